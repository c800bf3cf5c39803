"""Rotary position embedding on the whole head_dim, without splitting it into lane pairs.

diffusers rotates q and k as complex pairs (``WanAttnProcessor``'s RoPE;
``diffusers.models.embeddings.apply_rotary_emb`` with ``use_real=True,
use_real_unbind_dim=-1``, which HunyuanVideo-1.5 uses)::

    x_real, x_imag = x.unflatten(-1, (-1, 2)).unbind(-1)
    x_rotated = stack([-x_imag, x_real], dim=-1).flatten(-2)
    out = x * cos + x_rotated * sin

Lowered to XLA, the pair split is strided lane slices and arrays with a size-2 minor
dimension, which TPU layout assignment stores as (2, 128) tiles: HBM copies several times the
size of q and k per block. ``apply_rope`` computes the same products on the whole head_dim:
``x * cos + rotate_pairs(x) * sin``, where ``rotate_pairs`` is ``x_rotated`` above. In
bfloat16 the swap is a matmul with a (D, D) signed permutation (one +-1 per column, so
exact), which XLA fuses with the products into one MXU fusion; in other dtypes it is two
lane rolls and a select (a float32 matmul would be rounded to bfloat16 by the TPU's default
matmul precision). Rolls and a select in bfloat16 were tried for Wan: XLA writes the rolled
slices out as passes of their own (benchmarks/dry_run_results.md, "A RoPE of our own for
Wan").

Exact for the tables both families use: each frequency repeated over its lane pair (the cos
and sin at lanes 2i and 2i + 1 equal), as ``get_1d_rotary_pos_embed(..., use_real=True,
repeat_interleave_real=True)`` builds them (``WanRotaryPosEmbed``,
``HunyuanVideo15RotaryPosEmbed``). The whole-lane products are then diffusers' pair products.

Users: ``families.wan_attention`` and ``families.hunyuan``'s ``KeyPaddingAttnProcessor``, each
applying it after the (B, S, H, D) -> (B, H, S, D) permute, so XLA fuses QK norm, permute and
rotation into one pass. Static estimates on v6e:2x4 (not measurements): Wan 2.1 14B 720p
2.982 -> 2.886 s/step, HunyuanVideo-1.5 720p x 121 3.314 -> 3.202 s/step.
"""

from __future__ import annotations

import torch


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """The pair rotation's partner: out[..., 2i] = -x[..., 2i + 1], out[..., 2i + 1] = x[..., 2i].

    Args:
        x: (..., D), D even, any float dtype.

    Returns:
        (..., D), x's dtype; exact (each lane is one lane of x, maybe negated), for finite
        x (in the bfloat16 path an inf lane makes its whole row NaN: 0 x inf).
    """
    lane = torch.arange(x.shape[-1], device=x.device)
    even = lane % 2 == 0
    if x.dtype == torch.bfloat16:
        # Column j of the permutation takes row j ^ 1, negated for even j: one MXU pass that
        # XLA fuses with the products below, where a lane shuffle is a pass of its own.
        partner = lane + 1 - 2 * (lane % 2)
        sign = torch.where(even, -1.0, 1.0).to(x.dtype)
        perm = (partner[:, None] == lane[None, :]).to(x.dtype) * sign[None, :]
        return x @ perm
    return torch.where(even, -torch.roll(x, -1, dims=-1), torch.roll(x, 1, dims=-1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' interleaved-pair rotary embedding without splitting the head_dim into pairs.

    Args:
        x: q or k, (..., D) with D = head_dim last ((B, H, S, D) in the processors), any
            float dtype.
        cos, sin: float32 tables with each frequency repeated over its lane pair,
            broadcastable to x ((1, 1, S, D) for Wan, (S, D) for HunyuanVideo-1.5).

    Returns:
        x's shape and dtype; the products are taken in the promoted dtype (float32 for
        bfloat16 x), as diffusers takes them.
    """
    return (x * cos + rotate_pairs(x) * sin).type_as(x)
