"""References: float32 softmax attention (``reference_attention``, the numerical reference of
every other path), plain XLA attention (``xla_attention``), and ``kernel_self_check``, which
runs a Splash kernel on the default device against the reference."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from splash.blocks import BlockSizes
from splash.gpu import cudnn_attention
from splash.kernel import attention as kernel_attention
from splash.mask import as_segment_ids
from splash.options import AttentionOptions
from splash.stock import stock_splash_attention


def reference_attention(q, k, v, *, scale=None, mask=None, is_causal=False):
    """Float32 softmax attention, the numerical reference for every other path.

    Args:
        q: (batch, heads, q_len, head_dim), any float dtype.
        k, v: (batch, heads, kv_len, head_dim).
        scale: softmax scale; ``None`` means 1/sqrt(head_dim), as torch SDPA.
        mask: optional boolean (True = attend) or additive float mask broadcastable to
            (batch, heads, q_len, kv_len), with torch SDPA's semantics.
        is_causal: apply a lower-triangular mask aligned at the top-left, as torch SDPA.

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype. A query row with no valid key gives
        zeros instead of torch's NaN.
    """
    head_dim = q.shape[-1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    s = (
        jnp.einsum(
            "bhqd,bhkd->bhqk",
            q.astype(jnp.float32),
            k.astype(jnp.float32),
            precision=lax.Precision.HIGHEST,
        )
        * scale
    )
    valid = jnp.ones(s.shape, dtype=bool)
    if mask is not None:
        if mask.dtype == jnp.bool_:
            valid = valid & mask
        else:
            s = s + mask.astype(jnp.float32)
    if is_causal:
        q_len, kv_len = s.shape[-2:]
        valid = valid & jnp.tril(jnp.ones((q_len, kv_len), dtype=bool))
    s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    o = jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)
    return o.astype(q.dtype)


def xla_attention(q, k, v, *, scale=None, segment_ids=None, key_mask=None, static_mask=None):
    """Softmax attention through ``jax.nn.dot_product_attention`` (XLA).

    Under ``jax.jit`` with sharded inputs XLA partitions it by itself, so it needs no
    mesh.

    Args:
        q: (batch, heads, q_len, head_dim); k, v: (batch, heads, kv_len, head_dim).
        scale: softmax scale; ``None`` means 1/sqrt(head_dim).
        segment_ids: optional ``SegmentIds``: a query attends only keys of its own id (a
            dense (batch, 1, q_len, kv_len) mask: for small or debugging runs).
        key_mask: optional (batch, kv_len) bool, True = a real key; every query attends only
            those (broadcast as (batch, 1, 1, kv_len): no dense mask). Not with
            ``segment_ids``.
        static_mask: ``None``, or a mask value (a ``Mask``, e.g. ``LocalMask``): the
            kernel's mask, applied as its dense (q_len, kv_len) bool form (for small or
            reference runs).

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype.
    """
    mask = None
    if segment_ids is not None:
        ids = as_segment_ids(segment_ids)
        mask = ids.q[:, None, :, None] == ids.kv[:, None, None, :]
    elif key_mask is not None:
        mask = key_mask[:, None, None, :]
    if static_mask is not None:
        band = static_mask.dense(q.shape[2], k.shape[2])[None, None]
        mask = band if mask is None else mask & band
    # jax.nn.dot_product_attention takes (batch, len, heads, head_dim).
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    out = jax.nn.dot_product_attention(qt, kt, vt, scale=scale, mask=mask)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


# The interpret-mode tests' bf16 tolerance (tests/test_splash_attention.py): ~3 bf16
# roundings of O(1) values; a masking or rescale bug is O(0.1).
SELF_CHECK_TOLERANCE = 1e-2
# Small enough to run in well under a second on a TPU, big enough to cover several q and
# kv blocks, several sub-tiles per kv block and a ragged tail (600 = 2 * 256 + 88).
SELF_CHECK_SHAPE = (1, 2, 600, 128)
SELF_CHECK_BLOCKS = BlockSizes(block_q=256, block_kv=256, block_kv_compute=128)


def _ours(q, k, v, *, block_sizes: BlockSizes, interpret: bool):
    """Our kernel with ``block_sizes``, as ``kernel_self_check`` calls a kernel."""
    return kernel_attention(q, k, v, AttentionOptions(block_sizes=block_sizes),
                            interpret=interpret)


def _cudnn(q, k, v, *, block_sizes: BlockSizes, interpret: bool):
    """cuDNN flash attention, as ``kernel_self_check`` calls a kernel (no blocks to set)."""
    del block_sizes, interpret
    return cudnn_attention(q, k, v)


def kernel_self_check(kernel: str, *, interpret: bool = False, attention_fn=None) -> dict:
    """Run a Splash kernel (or cuDNN) on the default device against the float32 reference.

    A bf16 problem of ``SELF_CHECK_SHAPE`` (batch, heads, length, head_dim) with a ragged
    tail, blocks ``SELF_CHECK_BLOCKS``, against ``reference_attention`` on the same
    bf16-rounded inputs. It passes when every element satisfies
    ``|out - ref| <= tol + tol * |ref|`` with ``tol = SELF_CHECK_TOLERANCE``.

    Args:
        kernel: "splash", "stock_splash" or "cudnn" (``cudnn_attention``: needs a GPU).
        interpret: Pallas interpret mode (off TPU).
        attention_fn: optional replacement ``f(q, k, v, *, block_sizes, interpret)`` (tests
            inject a wrong kernel here).

    Returns:
        dict(backend, shape, dtype, max_abs_error, tolerance, passed, seconds).
    """
    if attention_fn is None:
        attention_fn = {"stock_splash": stock_splash_attention, "cudnn": _cudnn}.get(kernel,
                                                                                     _ours)
    b, h, n, d = SELF_CHECK_SHAPE
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.random.normal(key, (b, h, n, d), jnp.float32).astype(jnp.bfloat16)
               for key in keys)
    t0 = time.perf_counter()
    out = attention_fn(q, k, v, block_sizes=SELF_CHECK_BLOCKS, interpret=interpret)
    out = np.asarray(jnp.asarray(out, jnp.float32))
    seconds = time.perf_counter() - t0
    f32 = (x.astype(jnp.float32) for x in (q, k, v))  # the very bf16 values, in float32
    ref = np.asarray(reference_attention(*f32))
    err = np.abs(out - ref)
    tol = SELF_CHECK_TOLERANCE
    passed = bool(np.all(np.isfinite(out)) and np.all(err <= tol + tol * np.abs(ref)))
    return dict(backend=kernel, shape=list(SELF_CHECK_SHAPE), dtype="bfloat16",
                max_abs_error=float(np.max(err)) if np.all(np.isfinite(out)) else float("nan"),
                tolerance=tol, passed=passed, seconds=seconds)
