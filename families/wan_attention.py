"""Wan's attention processor with a RoPE that XLA lowers without (2, 128)-tiled copies.

diffusers' ``WanAttnProcessor`` rotates q and k as complex pairs::

    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos

Even with ``engine.run.lowering`` (no scatters) that is, per q and k, two strided lane slices,
two interior pads and two fusions that XLA does not fuse into one another, with a size-2
minor dimension that TPU layout assignment stores as (2, 128) tiles: 4.3 GB of HBM traffic
per Wan 14B block (720p, dp2 x sp4, v6e; reading and writing q and k once is 0.8 GB).

``WanRopeAttnProcessor`` is diffusers' processor with two changes, both exact:

* the rotation is ``families.rope.apply_rope`` (shared with HunyuanVideo-1.5's processor):
  ``x * cos + rotate_pairs(x) * sin`` on the whole head_dim, where ``rotate_pairs`` swaps
  each (even, odd) lane pair and negates the new even lane. In bfloat16 the swap is a
  matmul with a (D, D) signed permutation (one +-1 per column, so exact), which XLA fuses
  with the rotation into one MXU fusion; in other dtypes it is two lane rolls and a select
  (a float32 matmul would be rounded to bfloat16 by the TPU's default matmul precision).
  Rolls and a select in bfloat16 were tried: XLA writes the rolled slices out as passes of
  their own.
* RoPE runs after the (B, S, H, D) -> (B, H, S, D) permute that SDPA needs, so XLA fuses the
  QK norm, the rotation and the permute into that one fusion (before it, the permute stays a
  copy of its own).

Static estimate, Wan 2.1 T2V 14B 720p x 81, ``v6e:2x4`` dp2 x sp4 (not a measurement):
2.982 -> 2.886 s/step; HBM bytes of one block 22.9 -> 17.7 GB
(benchmarks/dry_run_results.md, "A RoPE of our own for Wan").

Same values as diffusers' in float32 (a test): ``WanRotaryPosEmbed``'s tables repeat each
frequency over its pair (``repeat_interleave_real=True``), so the cos and sin at lanes 2i
and 2i + 1 are equal and the whole-lane products are diffusers' pair products.

``install(transformer)`` gives every block's self- and cross-attention this processor; the
family calls it on the transformers the engine builds (``wan.empty_transformer``, run under
torchax), never on a diffusers pipeline built elsewhere (the tests' eager references keep
diffusers' own).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from families.rope import apply_rope


class WanRopeAttnProcessor:
    """``diffusers.models.transformers.transformer_wan.WanAttnProcessor`` with ``apply_rope``
    in place of its pair-split RoPE, applied after the (B, S, H, D) -> (B, H, S, D) permute.

    The projections (diffusers' own helpers), QK norms, I2V image branch and output
    projection are diffusers' code path, in its order. The attention is what diffusers'
    ``dispatch_attention_fn`` runs with no backend set (its native backend: permute to
    (B, H, S, D), ``F.scaled_dot_product_attention``, permute back), written out so that
    RoPE runs on the permuted q and k: XLA then fuses the norm, the rotation, the
    permutation matmul and the permute into one pass over q (static estimate, see the module
    docstring of ``families.wan_attention`` and benchmarks/dry_run_results.md). Under torchax
    the engine's SDPA override is the backend; diffusers' other backends and its context
    parallelism are not used here.

    Call: (attn, hidden (B, S, dim), encoder_hidden_states (B, T, dim) or None, attention_mask,
    rotary_emb (cos, sin), each (1, S, 1, D), or None) -> (B, S, dim), hidden's dtype.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        # diffusers is imported where it is used, as the family modules import it.
        from diffusers.models.transformers.transformer_wan import (
            _get_added_kv_projections,
            _get_qkv_projections,
        )

        encoder_hidden_states_img = None
        if attn.add_k_proj is not None:
            # I2V: the first tokens are the image's; 512 is the text length diffusers hardcodes.
            image_context_length = encoder_hidden_states.shape[1] - 512
            encoder_hidden_states_img = encoder_hidden_states[:, :image_context_length]
            encoder_hidden_states = encoder_hidden_states[:, image_context_length:]
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)

        def heads(t):  # (B, S, H*D) -> (B, H, S, D), the layout SDPA takes
            return t.unflatten(2, (attn.heads, -1)).transpose(1, 2)

        query, key, value = heads(query), heads(key), heads(value)
        if rotary_emb is not None:
            cos, sin = (t.transpose(1, 2) for t in rotary_emb)  # (1, 1, S, D)
            query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)

        def attend(k, v, mask):  # -> (B, S, H*D) in q's dtype
            out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, dropout_p=0.0,
                                                 is_causal=False)
            return out.transpose(1, 2).flatten(2, 3).type_as(query)

        hidden_states_img = None
        if encoder_hidden_states_img is not None:
            key_img, value_img = _get_added_kv_projections(attn, encoder_hidden_states_img)
            hidden_states_img = attend(heads(attn.norm_added_k(key_img)), heads(value_img), None)
        hidden_states = attend(key, value, attention_mask)
        if hidden_states_img is not None:
            hidden_states = hidden_states + hidden_states_img
        return attn.to_out[1](attn.to_out[0](hidden_states))


def install(transformer: torch.nn.Module) -> None:
    """Give every block's self-attention (``attn1``) and cross-attention (``attn2``) of a
    ``WanTransformer3DModel`` a ``WanRopeAttnProcessor`` (cross-attention has no RoPE: the
    same path as diffusers', kept for one processor class per model)."""
    for block in transformer.blocks:
        block.attn1.set_processor(WanRopeAttnProcessor())
        block.attn2.set_processor(WanRopeAttnProcessor())
