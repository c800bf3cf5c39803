"""Query-chunked XLA attention: exact float32-softmax attention whose score memory is bounded
by looping over query chunks (``chunked_attention``), and the chunk size from the device's
free memory (``score_budget_bytes``, ``chunk_rows``).

It is the "xla" backend (the CPU default), the Splash wrappers' fallback, and the GPU
backend's path for what cuDNN does not take (float32, a head_dim cuDNN rejects,
``LocalMask`` and other ``Mask`` values): plain ``xla_attention`` materialises
every (q_len, kv_len) score at once (Wan 14B at 720p: ~228 GB per chip), one chunk of rows
needs ``batch * heads * chunk * kv_len * 4`` bytes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

# Scores of one chunk where the device reports no free memory (CPU): at most 256 MiB.
DEFAULT_SCORE_BYTES = 256 << 20
# The share of free device memory one chunk's scores may take. XLA keeps a few buffers of
# the score's size live at once (scores, their exponentials, the fusion's temporaries), and
# the rest of the step (activations, the other stream) needs room too: 1/8 leaves both.
FREE_MEMORY_FRACTION = 1 / 8
# Chunks above this many rows are rounded down to a multiple of it: whole MMA tiles.
ROW_ALIGN = 128


def score_budget_bytes(device=None) -> int:
    """Bytes one query chunk's float32 scores may take on ``device`` (default: the first
    local device): ``FREE_MEMORY_FRACTION`` of ``bytes_limit - bytes_in_use`` from
    ``device.memory_stats()`` where the device reports them (GPU, TPU), else
    ``DEFAULT_SCORE_BYTES``. Read at trace time: the chunk is a static shape.

    Returns:
        int >= 1.
    """
    device = jax.local_devices()[0] if device is None else device
    try:
        stats = device.memory_stats()
    except (AttributeError, NotImplementedError, RuntimeError):  # backends without stats
        stats = None
    if not stats or "bytes_limit" not in stats:
        return DEFAULT_SCORE_BYTES
    free = int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    return max(1, int(free * FREE_MEMORY_FRACTION))


def chunk_rows(batch: int, heads: int, q_len: int, kv_len: int, budget_bytes: int) -> int:
    """Query rows per chunk so that one chunk's float32 scores, ``batch * heads * rows *
    kv_len * 4`` bytes, fit ``budget_bytes``: at least 1 (a single row may exceed the
    budget: nothing smaller exists) and at most ``q_len``; above ``ROW_ALIGN`` rounded down
    to a multiple of it.

    Raises:
        ValueError: a size < 1.
    """
    for name, value in (("batch", batch), ("heads", heads), ("q_len", q_len),
                        ("kv_len", kv_len), ("budget_bytes", budget_bytes)):
        if value < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
    rows = budget_bytes // (batch * heads * kv_len * 4)
    if rows > ROW_ALIGN:
        rows -= rows % ROW_ALIGN
    return max(1, min(q_len, rows))


def _chunk(q, k, v, q_start, *, scale: float, key_mask, static_mask):
    """Attention of the query rows ``q`` (B, H, C, D) starting at global position ``q_start``
    to every key: float32 scores and softmax, (B, H, C, D) float32 out (zeros for a row with
    no allowed key, as ``reference_attention``)."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision=lax.Precision.HIGHEST,
                   preferred_element_type=jnp.float32) * scale
    valid = None
    if key_mask is not None:
        valid = key_mask[:, None, None, :]
    if static_mask is not None:
        # The mask's own predicate on this chunk's positions: no (q_len, kv_len) array.
        q_pos = q_start + jnp.arange(q.shape[2], dtype=jnp.int32)[:, None]
        kv_pos = jnp.arange(k.shape[2], dtype=jnp.int32)[None, :]
        band = jnp.broadcast_to(static_mask.tile_predicate(q_pos, kv_pos), s.shape[2:])
        valid = band[None, None] if valid is None else valid & band[None, None]
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # an all-masked row: exp(-inf) = 0, no NaN
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bhkd->bhqd", p, v, precision=lax.Precision.HIGHEST)
    return jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)


def chunked_attention(q, k, v, *, scale=None, key_mask=None, static_mask=None,
                      chunk: int | None = None) -> jax.Array:
    """Softmax attention in float32, over query chunks of ``chunk`` rows (``lax.map``), each
    chunk attending every key: equal to ``reference_attention`` with the same masks, with
    peak score memory ``batch * heads * chunk * kv_len * 4`` bytes instead of q_len rows.

    Under ``jax.jit`` with sharded inputs (batch over "dp", heads over "tp") XLA partitions
    it by itself, as ``xla_attention``.

    Args:
        q: (batch, heads, q_len, head_dim), any float dtype.
        k, v: (batch, heads, kv_len, head_dim), q's dtype.
        scale: softmax scale; ``None`` means 1/sqrt(head_dim), as torch SDPA.
        key_mask: optional (batch, kv_len) bool, True = a real key, for every query.
        static_mask: ``None`` or a ``splash.mask.Mask`` (e.g. ``LocalMask``), evaluated
            through its ``tile_predicate`` on each chunk's global positions.
        chunk: query rows per chunk; ``None``: ``chunk_rows`` of ``score_budget_bytes()``.
            Values above q_len run one chunk. The last chunk is zero-padded (its extra rows
            are computed and dropped).

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype; a row with no allowed key is zeros.

    Raises:
        ValueError: ``chunk`` < 1, or k/v shapes disagree with q.
    """
    b, h, q_len, d = q.shape
    kv_len = k.shape[2]
    if k.shape != (b, h, kv_len, d) or v.shape != k.shape:
        raise ValueError(f"k, v: expected (batch, heads, kv_len, head_dim) matching q "
                         f"{tuple(q.shape)}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if chunk is None:
        chunk = chunk_rows(b, h, q_len, kv_len, score_budget_bytes())
    if chunk < 1:
        raise ValueError(f"chunk: expected an int >= 1, got {chunk!r}")
    chunk = min(int(chunk), q_len)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)  # once, not per chunk
    qf = q.astype(jnp.float32)
    run = functools.partial(_chunk, k=kf, v=vf, scale=scale, key_mask=key_mask,
                            static_mask=static_mask)
    if chunk == q_len:
        return run(qf, q_start=0).astype(q.dtype)
    n = -(-q_len // chunk)
    qf = jnp.pad(qf, ((0, 0), (0, 0), (0, n * chunk - q_len), (0, 0)))
    chunks = jnp.moveaxis(qf.reshape(b, h, n, chunk, d), 2, 0)  # (n, B, H, C, D)
    starts = jnp.arange(n, dtype=jnp.int32) * chunk
    out = lax.map(lambda xs: run(xs[0], q_start=xs[1]), (chunks, starts))  # (n, B, H, C, D)
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, d)[:, :, :q_len]
    return out.astype(q.dtype)
