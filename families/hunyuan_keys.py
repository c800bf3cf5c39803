"""HunyuanVideo-1.5's official (Tencent) transformer names -> diffusers' names: one table.

Ported (read, not copied) from huggingface/diffusers @ 9cc3601a3acdfdd0911ead713cb9e1eafc3a17de,
``scripts/convert_hunyuan_video1_5_to_diffusers.py``,
``convert_hyvideo15_transformer_to_diffusers``: the script that wrote the public
``hunyuanvideo-community/HunyuanVideo-1.5-*`` checkpoints from the original class
``HunyuanVideo_1_5_DiffusionTransformer`` (Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7,
hyvideo/models/transformers/hunyuanvideo_1_5_transformer.py). Every entry of that function is
here, by module (each official tensor is ``<module>.weight`` or ``<module>.bias`` and keeps its
suffix): linears, the patch-embedding Conv3d, LayerNorms, the q/k RMS norms and the
condition-type embedding.

Two entries are not renames:

* ``txt_in.individual_token_refiner.blocks.N.self_attn_qkv`` (one fused linear) is chunked
  into three equal row blocks, the refiner's ``to_q``, ``to_k``, ``to_v`` (``torch.chunk(W, 3,
  dim=0)``, the bias likewise);
* ``final_layer.adaLN_modulation.1`` becomes ``norm_out.linear`` with its two row halves
  exchanged (``swap_scale_shift``: the original computes (shift, scale), diffusers'
  ``AdaLayerNormContinuous`` (scale, shift)), weight and bias.

The script pops names in a fixed order and never checks what is left: an official tensor
outside its list (``guidance_in``, ``vector_in``, ``single_blocks``) would be dropped silently.
``diffusers_name`` and ``diffusers_modules`` return None for such a name, and the callers
refuse it (``tools/convert_hunyuan_sr.py``; ``families.hunyuan_lora`` via the engine). The
script's ``time_r_in`` entries (only ``if config.use_meanflow``) are unconditional here: the
caller's strict check against the model's own parameters refuses them where the config has no
MeanFlow embedder.

Used by ``families.hunyuan_lora`` (the ``nn.Linear`` rows: the only modules PEFT's
``all-linear`` adapts) and ``tools/convert_hunyuan_sr.py`` (every row).
"""

from __future__ import annotations

import re

import torch

# Row operations (see the module docstring); None is a rename.
SPLIT, SWAP = "split", "swap"
# Module kinds; only LINEAR rows take LoRA adapters.
LINEAR, CONV, NORM, EMBEDDING = "linear", "conv", "norm", "embedding"

_REFINER = "txt_in.individual_token_refiner.blocks.{i}"
_DREFINER = "context_embedder.token_refiner.refiner_blocks.{i}"

# {official module: (diffusers module(s), row operation, kind)}; "{i}" is a block index.
MODULES = {
    # 1. time_embed.timestep_embedder <- time_in
    "time_in.mlp.0": (("time_embed.timestep_embedder.linear_1",), None, LINEAR),
    "time_in.mlp.2": (("time_embed.timestep_embedder.linear_2",), None, LINEAR),
    # MeanFlow (use_meanflow) checkpoints only: the r-timestep embedder.
    "time_r_in.mlp.0": (("time_embed.timestep_embedder_r.linear_1",), None, LINEAR),
    "time_r_in.mlp.2": (("time_embed.timestep_embedder_r.linear_2",), None, LINEAR),
    # 2.-4. the text condition's timestep and pooled-text embedders, its input projection
    "txt_in.t_embedder.mlp.0": (
        ("context_embedder.time_text_embed.timestep_embedder.linear_1",), None, LINEAR),
    "txt_in.t_embedder.mlp.2": (
        ("context_embedder.time_text_embed.timestep_embedder.linear_2",), None, LINEAR),
    "txt_in.c_embedder.linear_1": (
        ("context_embedder.time_text_embed.text_embedder.linear_1",), None, LINEAR),
    "txt_in.c_embedder.linear_2": (
        ("context_embedder.time_text_embed.text_embedder.linear_2",), None, LINEAR),
    "txt_in.input_embedder": (("context_embedder.proj_in",), None, LINEAR),
    # 5. the token refiner's blocks
    f"{_REFINER}.norm1": ((f"{_DREFINER}.norm1",), None, NORM),
    f"{_REFINER}.self_attn_qkv": (
        tuple(f"{_DREFINER}.attn.{p}" for p in ("to_q", "to_k", "to_v")), SPLIT, LINEAR),
    f"{_REFINER}.self_attn_proj": ((f"{_DREFINER}.attn.to_out.0",), None, LINEAR),
    f"{_REFINER}.norm2": ((f"{_DREFINER}.norm2",), None, NORM),
    f"{_REFINER}.mlp.fc1": ((f"{_DREFINER}.ff.net.0.proj",), None, LINEAR),
    f"{_REFINER}.mlp.fc2": ((f"{_DREFINER}.ff.net.2",), None, LINEAR),
    f"{_REFINER}.adaLN_modulation.1": ((f"{_DREFINER}.norm_out.linear",), None, LINEAR),
    # 6. the ByT5 (glyph) projection
    "byt5_in.layernorm": (("context_embedder_2.norm",), None, NORM),
    "byt5_in.fc1": (("context_embedder_2.linear_1",), None, LINEAR),
    "byt5_in.fc2": (("context_embedder_2.linear_2",), None, LINEAR),
    "byt5_in.fc3": (("context_embedder_2.linear_3",), None, LINEAR),
    # 7. the SigLIP image projection: LayerNorm, Linear, GELU, Linear, LayerNorm
    "vision_in.proj.0": (("image_embedder.norm_in",), None, NORM),
    "vision_in.proj.1": (("image_embedder.linear_1",), None, LINEAR),
    "vision_in.proj.3": (("image_embedder.linear_2",), None, LINEAR),
    "vision_in.proj.4": (("image_embedder.norm_out",), None, NORM),
    # 8. the patch embedding (Conv3d); 9. the condition-type embedding (text, ByT5, image)
    "img_in.proj": (("x_embedder.proj",), None, CONV),
    "cond_type_embedding": (("cond_type_embed",), None, EMBEDDING),
    # 10. the dual-stream blocks (their norm2 LayerNorms have no affine weights)
    "double_blocks.{i}.img_mod.linear": (("transformer_blocks.{i}.norm1.linear",), None, LINEAR),
    "double_blocks.{i}.txt_mod.linear": (
        ("transformer_blocks.{i}.norm1_context.linear",), None, LINEAR),
    "double_blocks.{i}.img_attn_q": (("transformer_blocks.{i}.attn.to_q",), None, LINEAR),
    "double_blocks.{i}.img_attn_k": (("transformer_blocks.{i}.attn.to_k",), None, LINEAR),
    "double_blocks.{i}.img_attn_v": (("transformer_blocks.{i}.attn.to_v",), None, LINEAR),
    "double_blocks.{i}.img_attn_q_norm": (("transformer_blocks.{i}.attn.norm_q",), None, NORM),
    "double_blocks.{i}.img_attn_k_norm": (("transformer_blocks.{i}.attn.norm_k",), None, NORM),
    "double_blocks.{i}.img_attn_proj": (("transformer_blocks.{i}.attn.to_out.0",), None, LINEAR),
    "double_blocks.{i}.txt_attn_q": (("transformer_blocks.{i}.attn.add_q_proj",), None, LINEAR),
    "double_blocks.{i}.txt_attn_k": (("transformer_blocks.{i}.attn.add_k_proj",), None, LINEAR),
    "double_blocks.{i}.txt_attn_v": (("transformer_blocks.{i}.attn.add_v_proj",), None, LINEAR),
    "double_blocks.{i}.txt_attn_q_norm": (
        ("transformer_blocks.{i}.attn.norm_added_q",), None, NORM),
    "double_blocks.{i}.txt_attn_k_norm": (
        ("transformer_blocks.{i}.attn.norm_added_k",), None, NORM),
    "double_blocks.{i}.txt_attn_proj": (("transformer_blocks.{i}.attn.to_add_out",), None, LINEAR),
    "double_blocks.{i}.img_mlp.fc1": (("transformer_blocks.{i}.ff.net.0.proj",), None, LINEAR),
    "double_blocks.{i}.img_mlp.fc2": (("transformer_blocks.{i}.ff.net.2",), None, LINEAR),
    "double_blocks.{i}.txt_mlp.fc1": (
        ("transformer_blocks.{i}.ff_context.net.0.proj",), None, LINEAR),
    "double_blocks.{i}.txt_mlp.fc2": (("transformer_blocks.{i}.ff_context.net.2",), None, LINEAR),
    # 11. the final layer (its norm_final LayerNorm has no affine weights)
    "final_layer.linear": (("proj_out",), None, LINEAR),
    "final_layer.adaLN_modulation.1": (("norm_out.linear",), SWAP, LINEAR),
}

# The original class's top-level submodules (HunyuanVideo_1_5_DiffusionTransformer.__init__):
# a name under one of them is an official name.
OFFICIAL_ROOTS = frozenset({
    "img_in", "vision_in", "txt_in", "byt5_in", "time_in", "time_r_in", "vector_in",
    "guidance_in", "double_blocks", "single_blocks", "final_layer", "cond_type_embedding"})

PARAMS = ("weight", "bias")

_TABLE = tuple(
    (re.compile("^" + re.escape(official).replace(r"\{i\}", r"(?P<i>\d+)") + "$"), targets, op,
     kind)
    for official, (targets, op, kind) in MODULES.items())


def diffusers_modules(module: str, kinds=None):
    """(diffusers module names, row operation, kind) of an official module name, or None.

    ``module`` e.g. ``double_blocks.3.img_attn_q``; ``kinds`` (a set of kinds) restricts the
    rows searched (``{LINEAR}`` for LoRA). None: not in the table (the caller refuses it).
    """
    for pattern, targets, op, kind in _TABLE:
        if kinds is not None and kind not in kinds:
            continue
        m = pattern.match(module)
        if m:
            index = m.groupdict().get("i")
            return tuple(t.format(i=index) for t in targets), op, kind
    return None


def diffusers_name(key: str):
    """(diffusers tensor names, row operation) of an official state-dict key, or None.

    ``key`` is ``<official module>.weight`` or ``<official module>.bias``, e.g.
    ``final_layer.adaLN_modulation.1.bias`` -> ((``norm_out.linear.bias``,), "swap").
    None: another suffix or a module outside the table.
    """
    module, _, param = key.rpartition(".")
    found = diffusers_modules(module) if param in PARAMS else None
    if found is None:
        return None
    targets, op, _ = found
    return tuple(f"{t}.{param}" for t in targets), op


def row_blocks(tensor: torch.Tensor, op, count: int) -> list:
    """The ``count`` tensors the diffusers modules get from one official tensor's rows (dim 0):
    the tensor itself for a rename, ``count`` equal row blocks for "split", the row halves
    exchanged for "swap". Works on weights (out, in), biases (out,) and LoRA ``lora_B``
    (out, r) alike: all three are row-indexed by the module's outputs; and on meta tensors
    (``row_shapes``).

    Raises:
        ValueError: rows that do not split into ``count`` equal blocks (or two halves).
    """
    if op in (SPLIT, SWAP):
        blocks = count if op == SPLIT else 2
        if tensor.ndim == 0 or tensor.shape[0] % blocks:
            raise ValueError(f"shape {tuple(tensor.shape)}: rows do not split into "
                             + (f"{count} equal blocks" if op == SPLIT else "two halves"))
    if op == SPLIT:
        return list(tensor.chunk(count, dim=0))
    if op == SWAP:
        shift, scale = tensor.chunk(2, dim=0)
        return [torch.cat([scale, shift], dim=0)]
    return [tensor]


def row_shapes(shape: tuple, op, count: int) -> list:
    """The shapes ``row_blocks`` gives for a tensor of ``shape``, without its data (a meta
    tensor).

    Raises:
        ValueError: as ``row_blocks``.
    """
    return [tuple(t.shape) for t in row_blocks(torch.empty(shape, device="meta"), op, count)]
