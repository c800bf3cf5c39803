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

The module table is ported from huggingface/diffusers @ 9cc3601a3acdfdd0911ead713cb9e1eafc3a17de,
``scripts/convert_hunyuan_video1_5_to_diffusers.py``, ``convert_hyvideo15_transformer_to_diffusers``
(the script that wrote the public diffusers checkpoints), restricted to its ``nn.Linear``
modules (the only ones ``all-linear`` adapts). Two entries are not renames, and the LoRA
follows the script's operation on the full weight ``W = W0 + s * B @ A``:

* ``txt_in.individual_token_refiner.blocks.N.self_attn_qkv`` is one fused linear that the
  script splits with ``torch.chunk(W, 3, dim=0)`` into the refiner's ``to_q``, ``to_k``,
  ``to_v``. Rows of ``B @ A`` are rows of ``B``: each of the three gets the shared ``A`` and
  its third of ``B``'s rows (and of ``lora_B.bias``).
* ``final_layer.adaLN_modulation.1`` becomes ``norm_out.linear`` through ``swap_scale_shift``
  (the two row halves exchanged: the original computes (shift, scale), diffusers' norm
  (scale, shift)): ``B``'s row halves (and ``lora_B.bias``'s) are exchanged, ``A`` kept.

A key in an official module outside the table (``img_in``, a Conv3d; ``vector_in`` and
``guidance_in``, absent from 1.5) and any key that is not ``lora_A.weight``/``lora_B.weight``/
``lora_B.bias`` is returned unchanged: it then matches no transformer weight and
``engine.weights.lora.load`` refuses the file in one line naming it.
"""

from __future__ import annotations

import re

import torch

# {official module: (diffusers module(s), row operation)}; "{i}" is a block index.
# None: a rename. "split": a fused linear chunked into equal row blocks, one per target.
# "swap": the row halves exchanged (swap_scale_shift).
MODULES = {
    "time_in.mlp.0": (("time_embed.timestep_embedder.linear_1",), None),
    "time_in.mlp.2": (("time_embed.timestep_embedder.linear_2",), None),
    # MeanFlow (use_meanflow) checkpoints only.
    "time_r_in.mlp.0": (("time_embed.timestep_embedder_r.linear_1",), None),
    "time_r_in.mlp.2": (("time_embed.timestep_embedder_r.linear_2",), None),
    "txt_in.t_embedder.mlp.0": (
        ("context_embedder.time_text_embed.timestep_embedder.linear_1",), None),
    "txt_in.t_embedder.mlp.2": (
        ("context_embedder.time_text_embed.timestep_embedder.linear_2",), None),
    "txt_in.c_embedder.linear_1": (
        ("context_embedder.time_text_embed.text_embedder.linear_1",), None),
    "txt_in.c_embedder.linear_2": (
        ("context_embedder.time_text_embed.text_embedder.linear_2",), None),
    "txt_in.input_embedder": (("context_embedder.proj_in",), None),
    "txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv": (tuple(
        f"context_embedder.token_refiner.refiner_blocks.{{i}}.attn.{p}"
        for p in ("to_q", "to_k", "to_v")), "split"),
    "txt_in.individual_token_refiner.blocks.{i}.self_attn_proj": (
        ("context_embedder.token_refiner.refiner_blocks.{i}.attn.to_out.0",), None),
    "txt_in.individual_token_refiner.blocks.{i}.mlp.fc1": (
        ("context_embedder.token_refiner.refiner_blocks.{i}.ff.net.0.proj",), None),
    "txt_in.individual_token_refiner.blocks.{i}.mlp.fc2": (
        ("context_embedder.token_refiner.refiner_blocks.{i}.ff.net.2",), None),
    "txt_in.individual_token_refiner.blocks.{i}.adaLN_modulation.1": (
        ("context_embedder.token_refiner.refiner_blocks.{i}.norm_out.linear",), None),
    "byt5_in.fc1": (("context_embedder_2.linear_1",), None),
    "byt5_in.fc2": (("context_embedder_2.linear_2",), None),
    "byt5_in.fc3": (("context_embedder_2.linear_3",), None),
    "vision_in.proj.1": (("image_embedder.linear_1",), None),
    "vision_in.proj.3": (("image_embedder.linear_2",), None),
    "double_blocks.{i}.img_mod.linear": (("transformer_blocks.{i}.norm1.linear",), None),
    "double_blocks.{i}.txt_mod.linear": (("transformer_blocks.{i}.norm1_context.linear",), None),
    "double_blocks.{i}.img_attn_q": (("transformer_blocks.{i}.attn.to_q",), None),
    "double_blocks.{i}.img_attn_k": (("transformer_blocks.{i}.attn.to_k",), None),
    "double_blocks.{i}.img_attn_v": (("transformer_blocks.{i}.attn.to_v",), None),
    "double_blocks.{i}.img_attn_proj": (("transformer_blocks.{i}.attn.to_out.0",), None),
    "double_blocks.{i}.txt_attn_q": (("transformer_blocks.{i}.attn.add_q_proj",), None),
    "double_blocks.{i}.txt_attn_k": (("transformer_blocks.{i}.attn.add_k_proj",), None),
    "double_blocks.{i}.txt_attn_v": (("transformer_blocks.{i}.attn.add_v_proj",), None),
    "double_blocks.{i}.txt_attn_proj": (("transformer_blocks.{i}.attn.to_add_out",), None),
    "double_blocks.{i}.img_mlp.fc1": (("transformer_blocks.{i}.ff.net.0.proj",), None),
    "double_blocks.{i}.img_mlp.fc2": (("transformer_blocks.{i}.ff.net.2",), None),
    "double_blocks.{i}.txt_mlp.fc1": (("transformer_blocks.{i}.ff_context.net.0.proj",), None),
    "double_blocks.{i}.txt_mlp.fc2": (("transformer_blocks.{i}.ff_context.net.2",), None),
    "final_layer.linear": (("proj_out",), None),
    "final_layer.adaLN_modulation.1": (("norm_out.linear",), "swap"),
}

# The original class's top-level submodules (HunyuanVideo_1_5_DiffusionTransformer.__init__):
# a key under one of them is in the official format.
OFFICIAL_ROOTS = frozenset({
    "img_in", "vision_in", "txt_in", "byt5_in", "time_in", "time_r_in", "vector_in",
    "guidance_in", "double_blocks", "single_blocks", "final_layer", "cond_type_embedding"})

_PREFIX = re.compile(r"^(?:(?:base_model\.model|transformer|diffusion_model)\.)+")
_PART = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_B\.bias)$")
_TABLE = tuple(
    (re.compile("^" + re.escape(official).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), targets, op)
    for official, (targets, op) in MODULES.items())


def _official(module: str):
    """(diffusers modules, row operation) of an official module name, or None."""
    for pattern, targets, op in _TABLE:
        m = pattern.match(module)
        if m:
            index = m.groupdict().get("i")
            return tuple(t.format(i=index) for t in targets), op
    return None


def _rows(tensor, part: str, op, count: int) -> list:
    """The ``count`` tensors the diffusers modules get from one official LoRA tensor.

    Raises:
        ValueError: a fused tensor whose rows do not split into ``count`` equal blocks.
    """
    if part == "lora_A.weight":  # (r, in): the input side is shared
        return [tensor] * count
    if op == "split":
        if tensor.shape[0] % count:
            raise ValueError(f"{tensor.shape[0]} rows do not split into {count} equal blocks")
        return list(tensor.chunk(count, dim=0))
    if op == "swap":
        if tensor.shape[0] % 2:
            raise ValueError(f"{tensor.shape[0]} rows do not split into two halves")
        shift, scale = tensor.chunk(2, dim=0)
        return [torch.cat([scale, shift], dim=0)]
    return [tensor]


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
