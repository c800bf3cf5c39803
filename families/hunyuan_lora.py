"""HunyuanVideo-1.5 LoRA keys, official (Tencent) or diffusers/PEFT, as diffusers/PEFT keys.

diffusers 0.42.1 has no LoRA loader mixin for ``HunyuanVideo15Pipeline`` and no converter for
this model's original names (``HunyuanVideoLoraLoaderMixin`` and
``_convert_hunyuan_video_lora_to_diffusers`` are for HunyuanVideo 1.0: fused ``img_attn_qkv``,
single-stream blocks, ``time_text_embed``), so the table is here.

Two input formats, told apart key by key:

* **Official** (Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7): ``train.py --use_lora`` calls
  ``add_adapter(LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", bias="none"))``
  on the original ``HunyuanVideo_1_5_DiffusionTransformer`` and saves with that class's
  ``save_lora_adapter`` (hyvideo/models/transformers/hunyuanvideo_1_5_transformer.py):
  ``peft.get_peft_model_state_dict`` keys with no prefix
  (``double_blocks.0.img_attn_q.lora_A.weight``) in
  ``<checkpoint>/lora/default/pytorch_lora_weights.safetensors``, the ``LoraConfig`` as JSON
  under diffusers' ``lora_adapter_metadata`` (so ``lora_alpha / r`` = 2 reaches
  ``engine.weights.lora``). ``generate.py --lora_path`` loads it into that same class with
  ``transformer.load_lora_adapter(path, prefix=None)``. A ``transformer.``,
  ``base_model.model.`` or ``diffusion_model.`` prefix is accepted too.
* **diffusers/PEFT**: ``transformer.<diffusers module>.lora_A.weight`` (what diffusers'
  ``save_lora_adapter`` writes, ``load_lora_adapter``'s default prefix) or the unprefixed
  ``<diffusers module>.lora_A.weight`` (``load_lora_adapter(..., prefix=None)``); passed
  through with a ``transformer.`` prefix.

The module table is ``families.hunyuan_keys`` (ported from huggingface/diffusers @
9cc3601a3acdfdd0911ead713cb9e1eafc3a17de, ``scripts/convert_hunyuan_video1_5_to_diffusers.py``,
``convert_hyvideo15_transformer_to_diffusers``, the script that wrote the public diffusers
checkpoints; shared with ``tools/convert_hunyuan_sr.py``), restricted to its ``nn.Linear``
rows (the only modules ``all-linear`` adapts). Two entries are not renames, and the LoRA
follows the script's operation on the full weight ``W = W0 + s * B @ A``:

* ``txt_in.individual_token_refiner.blocks.N.self_attn_qkv`` is one fused linear that the
  script splits with ``torch.chunk(W, 3, dim=0)`` into the refiner's ``to_q``, ``to_k``,
  ``to_v``. Rows of ``B @ A`` are rows of ``B``: each of the three gets the shared ``A`` and
  its third of ``B``'s rows (and of ``lora_B.bias``).
* ``final_layer.adaLN_modulation.1`` becomes ``norm_out.linear`` through ``swap_scale_shift``
  (the two row halves exchanged: the original computes (shift, scale), diffusers' norm
  (scale, shift)): ``B``'s row halves (and ``lora_B.bias``'s) are exchanged, ``A`` kept.

A key in an official module outside the linear rows (``img_in``, a Conv3d; ``vector_in`` and
``guidance_in``, absent from 1.5) and any key that is not ``lora_A.weight``/``lora_B.weight``/
``lora_B.bias`` is returned unchanged: it then matches no transformer weight and
``engine.weights.lora.load`` refuses the file in one line naming it.
"""

from __future__ import annotations

import re

from families.hunyuan_keys import LINEAR, OFFICIAL_ROOTS, diffusers_modules, row_blocks

_PREFIX = re.compile(r"^(?:(?:base_model\.model|transformer|diffusion_model)\.)+")
_PART = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias)$")


def _official(module: str):
    """(diffusers modules, row operation) of an official linear module's name, or None."""
    found = diffusers_modules(module, kinds={LINEAR})
    return None if found is None else found[:2]


def _rows(tensor, part: str, op, count: int) -> list:
    """The ``count`` tensors the diffusers modules get from one official LoRA tensor.

    Raises:
        ValueError: a fused tensor whose rows do not split into ``count`` equal blocks.
    """
    if part == "lora_A.weight":  # (r, in): the input side is shared
        return [tensor] * count
    return row_blocks(tensor, op, count)  # lora_B (out, r) and its bias: rows as the weight's


def lora_state_dict(tensors: dict) -> dict:
    """Convert a HunyuanVideo-1.5 LoRA's keys to diffusers/PEFT keys.

    Args:
        tensors: {key: torch tensor} of the file, in the official format
            (``double_blocks.N.img_attn_q.lora_A.weight``, optionally prefixed), the diffusers
            format (``transformer.transformer_blocks.N.attn.to_q.lora_A.weight``) or the
            unprefixed diffusers format; lora_A (r, in), lora_B (out, r), lora_B.bias (out,).

    Returns:
        {``transformer.<diffusers module>.<part>``: tensor}; keys outside the table unchanged
        (the caller refuses them by name).

    Raises:
        ValueError: two keys for one diffusers tensor, or a fused tensor whose rows do not
            split as the conversion script splits the weight.
    """
    out: dict = {}
    for key, tensor in tensors.items():
        stripped = _PREFIX.sub("", key)
        m = _PART.match(stripped)
        if m is None:
            out.setdefault(key, tensor)
            continue
        module, part = m["module"], m["part"]
        if module.split(".")[0] not in OFFICIAL_ROOTS:  # diffusers/PEFT names
            new = {f"transformer.{module}.{part}": tensor}
        else:
            found = _official(module)
            if found is None:
                out.setdefault(key, tensor)
                continue
            targets, op = found
            try:
                pieces = _rows(tensor, part, op, len(targets))
            except ValueError as e:
                raise ValueError(f"{key}: {e}") from None
            new = {f"transformer.{t}.{part}": p for t, p in zip(targets, pieces, strict=True)}
        for name, value in new.items():
            if name in out:
                raise ValueError(f"{name} is given twice (official and diffusers keys "
                                 f"for one module; {key})")
            out[name] = value
    return out
