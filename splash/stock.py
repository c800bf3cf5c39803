"""JAX's own Pallas splash kernel (``jax.experimental.pallas.ops.tpu.splash_attention``), the
trusted fallback for ours (``--attention stock_splash``), at any lengths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_kernel as stock,
)
from jax.experimental.pallas.ops.tpu.splash_attention import (
    splash_attention_mask as stock_mask,
)

from splash.blocks import BlockSizes, fit_block_sizes, round_up
from splash.kernel import check_shapes, softmax_scale
from splash.mask import SegmentIds, as_segment_ids


def stock_splash_attention(
    q, k, v, *, scale=None, block_sizes: BlockSizes | None = None, segment_ids=None,
    interpret: bool = False,
) -> jax.Array:
    """Softmax attention with JAX's own Pallas splash kernel (forward), any lengths.

    ``jax.experimental.pallas.ops.tpu.splash_attention`` with a full mask: the kernel
    JAX ships and tests, kept as the fallback for ours (``--attention stock_splash``). It
    needs lengths that its blocks divide, so q, k and v are zero-padded to whole blocks and
    the padded keys get a segment id no query has: they are masked exactly (never zero keys
    left in the softmax denominator). Padded query rows are sliced off.

    Args:
        q: (batch, heads, q_len, head_dim), float32 or bfloat16.
        k, v: (batch, heads, kv_len, head_dim), same dtype.
        scale: softmax scale; ``None`` means 1/sqrt(head_dim). Folded into q (the stock
            kernel does not scale).
        block_sizes: our ``BlockSizes``, fitted to the lengths as ``splash_attention`` fits
            them, then given to the stock kernel.
        segment_ids: ``None`` or ``SegmentIds``/(q_ids, kv_ids) as ``splash_attention``.
        interpret: Pallas interpret mode (CPU).

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype.
    """
    check_shapes(q, k, v)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    scale = softmax_scale(head_dim, scale)
    bs = fit_block_sizes(block_sizes or BlockSizes(), q_len, kv_len)
    q_pad, kv_pad = round_up(q_len, bs.block_q), round_up(kv_len, bs.block_kv)
    segment_ids = as_segment_ids(segment_ids)
    if segment_ids is None:
        segment_ids = SegmentIds(
            jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, kv_len), jnp.int32)
        )
    # Padded keys take an id below every query's, so no query attends them; padded query
    # rows repeat the last real row's id (their output is discarded).
    pad_id = jnp.min(segment_ids.q) - 1
    q_ids = jnp.pad(segment_ids.q, ((0, 0), (0, q_pad - q_len)), mode="edge")
    kv_ids = jnp.pad(segment_ids.kv, ((0, 0), (0, kv_pad - kv_len)), constant_values=0)
    kv_ids = jnp.where(jnp.arange(kv_pad) < kv_len, kv_ids, pad_id)
    qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, q_pad - q_len), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, kv_pad - kv_len), (0, 0))) for x in (k, v))
    mask = stock_mask.MultiHeadMask([stock_mask.FullMask((q_pad, kv_pad))] * heads)
    kernel = stock.make_splash_mha(
        mask,
        block_sizes=stock.BlockSizes(
            block_q=bs.block_q, block_kv=bs.block_kv, block_kv_compute=bs.block_kv_compute
        ),
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )

    def one(q, k, v, q_ids, kv_ids):  # (heads, len, head_dim) per batch element
        return kernel(q, k, v, segment_ids=stock.SegmentIds(q_ids, kv_ids))

    out = jax.vmap(one)(qs, k, v, q_ids, kv_ids)
    return out[:, :, :q_len].astype(q.dtype)
