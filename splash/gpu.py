"""The NVIDIA GPU backend ("cudnn"): cuDNN flash attention through
``jax.nn.dot_product_attention(implementation="cudnn")`` for the calls cuDNN takes, the
query-chunked XLA attention (``splash.chunked``) for the rest. Which one a call gets is
``attention_implementation``, a pure function of static facts (tested without a GPU).

What cuDNN takes is JAX's own rule (``jax/_src/cudnn/fused_attention_stablehlo.py``,
``check_layout`` and ``check_is_flash_attention``, JAX 0.10): bf16 or fp16 inputs (fp8 is
not used here); head_dim a multiple of 8, at most 256 on compute capability >= 9.0 (Hopper)
and 128 before; masks only as sequence lengths (padding), causal, or a *left* window: JAX
raises for a right window without a causal mask, so our symmetric ``LocalMask`` cannot go
there. Its custom partitioning refuses a sharded sequence axis, so under a mesh we call it
inside ``shard_map`` on whole sequences.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from splash.options import ATTENTION_BACKENDS

CUDNN_DTYPES = ("bfloat16", "float16")
CUDNN_HEAD_DIM_MULTIPLE = 8
# Key masks a call can carry (``attention_implementation``'s ``key_mask``): none, padding
# known at trace time to be the tail (sequence parallelism's declared token padding), or a
# (batch, kv_len) bool array (a key-padding ``attn_mask``: padding anywhere).
KEY_MASKS = ("none", "tail", "data")
IMPLEMENTATIONS = ("cudnn", "xla_chunked", "splash", "stock_splash")


def cudnn_max_head_dim(device=None) -> int:
    """The largest head_dim cuDNN flash attention takes on ``device`` (default: the first
    local device): 256 from compute capability 9.0 (Hopper) on, else 128 (JAX's
    ``check_is_flash_attention``); 128 where the device reports no capability."""
    device = jax.local_devices()[0] if device is None else device
    capability = getattr(device, "compute_capability", None)
    try:
        major = int(str(capability).split(".")[0])
    except ValueError:
        return 128
    return 256 if major >= 9 else 128


def attention_implementation(backend: str, *, platform: str, dtype, head_dim: int, mask=None,
                             key_mask: str = "none", max_head_dim: int = 256) -> str:
    """Which implementation one SDPA call of ``backend`` runs (static facts only).

    Args:
        backend: an ``ATTENTION_BACKENDS`` name. Only "cudnn" has a choice; "xla" always
            runs "xla_chunked", the Splash kernels return themselves.
        platform: ``jax.default_backend()`` ("gpu", "tpu", "cpu"). Off "gpu" cuDNN does not
            exist, so "cudnn" runs "xla_chunked" (the run's prologue refuses
            ``--attention cudnn`` there; this keeps library calls and CPU tests working).
        dtype: q's dtype.
        head_dim: q's last axis.
        mask: ``None`` or the call's static ``splash.mask.Mask`` (e.g. ``LocalMask``).
        key_mask: one of ``KEY_MASKS``. All three go to cuDNN: "tail" as
            ``key_value_seq_lengths``, "data" after moving the real keys to the front
            (``cudnn_attention``; exact, keys are unordered for softmax).
        max_head_dim: ``cudnn_max_head_dim()`` of the device.

    Returns:
        "cudnn": bf16/fp16, head_dim % 8 == 0 and <= ``max_head_dim``, no static mask.
        "xla_chunked": any other "cudnn" call (float32, another head_dim, any ``Mask``:
        cuDNN's window is left-only and causal, ``LocalMask`` is symmetric).
        "xla_chunked" for "xla" too (bounded score memory on every platform).
        ``backend`` itself for "splash" and "stock_splash".

    Raises:
        ValueError: unknown ``backend`` or ``key_mask``.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend: expected one of {ATTENTION_BACKENDS}, got {backend!r}")
    if key_mask not in KEY_MASKS:
        raise ValueError(f"key_mask: expected one of {KEY_MASKS}, got {key_mask!r}")
    if backend != "cudnn":
        return "xla_chunked" if backend == "xla" else backend
    takes = (platform == "gpu" and jnp.dtype(dtype).name in CUDNN_DTYPES
             and head_dim % CUDNN_HEAD_DIM_MULTIPLE == 0 and head_dim <= max_head_dim
             and mask is None)
    return "cudnn" if takes else "xla_chunked"


def cudnn_attention(q, k, v, *, scale=None, key_mask=None, valid_kv_len: int | None = None,
                    implementation: str = "cudnn") -> jax.Array:
    """Softmax attention through ``jax.nn.dot_product_attention`` (cuDNN flash attention).

    Args:
        q: (batch, heads, q_len, head_dim), bf16 or fp16 for cuDNN.
        k, v: (batch, heads, kv_len, head_dim), q's dtype.
        scale: softmax scale; ``None`` means 1/sqrt(head_dim).
        key_mask: optional (batch, kv_len) bool, True = a real key, anywhere in the sequence.
            The real keys (and their values) are moved to the front by a stable sort and
            passed as ``key_value_seq_lengths``: softmax does not see key order, so this is
            exact, and costs one gather of K and V instead of a dense mask.
        valid_kv_len: static int: keys at positions >= it are padding (a tail). Not with
            ``key_mask``.
        implementation: "cudnn"; tests pass "xla" to run the same arguments on CPU.

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype. Every query is real (query lengths =
        q_len, as ``xla_attention`` with a key mask); a batch row with no real key gives
        zeros, as ``reference_attention``.

    Raises:
        ValueError: both ``key_mask`` and ``valid_kv_len``. cuDNN's own
            ``NotImplementedError``/``ValueError`` for a call it does not take.
    """
    if key_mask is not None and valid_kv_len is not None:
        raise ValueError("cudnn_attention: give key_mask or valid_kv_len, not both")
    b, _, q_len, _ = q.shape
    # jax.nn.dot_product_attention takes (batch, len, heads, head_dim).
    qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    lengths = None
    if key_mask is not None:
        order = jnp.argsort(~key_mask, axis=1, stable=True)[:, :, None, None]
        kt, vt = (jnp.take_along_axis(x, order, axis=1) for x in (kt, vt))
        lengths = jnp.sum(key_mask, axis=1, dtype=jnp.int32)
    elif valid_kv_len is not None:
        lengths = jnp.full((b,), valid_kv_len, jnp.int32)
    q_lengths = None if lengths is None else jnp.full((b,), q_len, jnp.int32)
    out = jax.nn.dot_product_attention(qt, kt, vt, scale=scale, query_seq_lengths=q_lengths,
                                       key_value_seq_lengths=lengths,
                                       implementation=implementation)
    if lengths is not None:
        out = jnp.where(lengths[:, None, None, None] > 0, out, 0)
    return jnp.swapaxes(out, 1, 2).astype(q.dtype)


def head_axes(mesh, heads: int):
    """The mesh axes heads are split over: ("tp", "sp") where they divide the heads (every
    device works), else "tp" (each "sp" device repeats its group's work)."""
    tp, sp = mesh.shape["tp"], mesh.shape["sp"]
    return ("tp", "sp") if sp > 1 and heads % (tp * sp) == 0 else "tp"


def sharded_cudnn_attention(q, k, v, *, mesh, scale=None, key_mask=None,
                            valid_kv_len: int | None = None,
                            implementation: str = "cudnn") -> jax.Array:
    """``cudnn_attention`` under ``jax.shard_map`` on a ("dp", "tp", "sp") mesh: batch over
    "dp", heads over ``head_axes``, whole sequences on every device (JAX's cuDNN
    partitioning refuses a sharded sequence; shard_map gathers it, as the heads layout of
    ``sharded_splash_attention``).

    Args:
        q, k, v, scale, key_mask, valid_kv_len, implementation: as ``cudnn_attention``, for
            the global arrays.
        mesh: ``jax.sharding.Mesh`` with axes "dp", "tp" and "sp".

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype, sharded P("dp", heads, None, None).

    Raises:
        ValueError: batch % dp or heads % tp is not 0.
    """
    b, h = q.shape[:2]
    if b % mesh.shape["dp"] or h % mesh.shape["tp"]:
        raise ValueError(f"sharded_cudnn_attention: q {tuple(q.shape)} does not split over "
                         f"dp={mesh.shape['dp']}, tp={mesh.shape['tp']}")
    spec = P("dp", head_axes(mesh, h), None, None)

    def local(q, k, v, key_mask):
        return cudnn_attention(q, k, v, scale=scale, key_mask=key_mask,
                               valid_kv_len=valid_kv_len, implementation=implementation)

    mask_spec = None if key_mask is None else P("dp", None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec, mask_spec),
                         out_specs=spec, check_vma=False)(q, k, v, key_mask)
