"""Attention for the video transformers (Wan 2.1/2.2, HunyuanVideo-1.5) on JAX: our Pallas TPU
flash-attention kernel ("exp2 Splash") and the torch SDPA override that routes every
``torch.nn.functional.scaled_dot_product_attention`` call of a diffusers transformer to it
once torchax runs the model on JAX.

This module is the public face; the implementation is the ``splash`` package (one module
per concern: blocks, masks, mask info, kernel, sharding, stock fallback, references, SDPA
state). Public API:

* ``splash_attention(q, k, v, *, options, ...)``: the kernel (forward).
* ``sharded_splash_attention(q, k, v, *, mesh, options, ...)``: the same under
  ``jax.shard_map`` on a ("dp", "tp", "sp") mesh (heads, Ulysses or q-sequence layout).
* ``AttentionOptions`` (blocks, K smoothing, mask); ``BlockSizes``, ``default_block_sizes``,
  ``DEFAULT_BLOCK_SIZES``; masks ``LocalMask`` (and the ``Mask`` protocol for new ones),
  ``HeadMasks`` (one of a few masks per (batch, head), picked by a data index);
  ``SegmentIds``.
* ``install_sdpa_override(env, *, attention, ...)``: route torch SDPA in a torchax
  environment to "xla", "splash", "stock_splash" or "cudnn"; ``default_attention_backend()``;
  ``forced_attention``, ``pad_self_attention_keys``, ``real_keys_before``,
  ``mark_self_attention``: trace-time declarations the override reads.
* ``reference_attention`` (float32), ``xla_attention`` (the whole score matrix at once: for
  benchmarks and small calls; the "xla" backend runs ``chunked_attention``),
  ``stock_splash_attention`` (JAX's kernel), ``kernel_self_check``.
* The NVIDIA GPU backend "cudnn": ``attention_implementation`` (which path a call takes),
  ``cudnn_attention``, ``sharded_cudnn_attention``, and the query-chunked XLA attention
  ``chunked_attention`` with its chunk size (``chunk_rows``, ``score_budget_bytes``).

Design notes (algorithm, lazy shift, block sizes, masks, cross-attention, sharding):
docs/attention.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import torch

from splash import svg as _svg
from splash.blocks import (
    DEFAULT_BLOCK_SIZES,
    NUM_LANES,
    NUM_SUBLANES,
    BlockSizes,
    BlockSizesError,
    default_block_sizes,
    default_sparse_block_sizes,
)
from splash.blocks import fit_block_sizes as _fit_block_sizes  # noqa: F401 (tests, benchmarks)
from splash.blocks import round_up as _round_up  # noqa: F401
from splash.blocks import vmem_capacity_bytes as _vmem_capacity_bytes  # noqa: F401
from splash.blocks import vmem_limit_bytes as _vmem_limit_bytes  # noqa: F401
from splash.blocks import vmem_need_bytes as _vmem_need_bytes  # noqa: F401
from splash.chunked import chunk_rows, chunked_attention, score_budget_bytes
from splash.gpu import (
    attention_implementation,
    cudnn_attention,
    cudnn_max_head_dim,
    sharded_cudnn_attention,
)
from splash.kernel import (
    KERNEL_NAME,
    LOG2_E,
    KernelCall,
    _splash_kernel,  # noqa: F401 (tests spy on the kernel body)
    describe_calls,
)
from splash.kernel import attention as _kernel_attention
from splash.kernel import check_shapes as _check_shapes  # noqa: F401
from splash.kernel import fold_scale as _fold_scale  # noqa: F401
from splash.kernel import smooth_keys as _smooth_keys
from splash.mask import (
    EMPTY,
    FULL,
    MAX_HEAD_MASKS,
    PARTIAL,
    REAL_SEGMENT_ID,
    HeadMasks,
    LocalMask,
    Mask,
    SegmentIds,
)
from splash.mask import as_segment_ids as _as_segment_ids  # noqa: F401
from splash.mask import band_mask as _band_mask  # noqa: F401
from splash.options import ATTENTION_BACKENDS, SPLASH_KERNELS, AttentionOptions
from splash.reference import (
    SELF_CHECK_BLOCKS,
    SELF_CHECK_SHAPE,
    SELF_CHECK_TOLERANCE,
    reference_attention,
    xla_attention,
)
from splash.reference import kernel_self_check as _kernel_self_check
from splash.sdpa import IN_SELF_ATTENTION as _IN_SELF_ATTENTION  # noqa: F401 (tests)
from splash.sdpa import (
    KeyPadding,
    forced_attention,
    forced_backend,
    key_padding_mask,
    mark_self_attention,
    pad_self_attention_keys,
    real_keys_before,
    unpad_self_attention_keys,
)
from splash.sdpa import declared_tail as _declared_tail
from splash.sdpa import key_segment_ids as _key_segment_ids
from splash.sdpa import real_keys as _real_keys
from splash.sharded import choose_layout as _choose_layout
from splash.sharded import sharded_attention as _sharded_attention
from splash.sharded import ulysses_to_heads as _ulysses_to_heads  # noqa: F401
from splash.sharded import ulysses_to_tokens as _ulysses_to_tokens  # noqa: F401
from splash.stock import stock_splash_attention

__all__ = [
    "ATTENTION_BACKENDS", "DEFAULT_BLOCK_SIZES", "EMPTY", "FULL", "KERNEL_NAME", "LOG2_E",
    "MAX_HEAD_MASKS", "HeadMasks", "NUM_LANES", "NUM_SUBLANES", "PARTIAL", "REAL_SEGMENT_ID",
    "SELF_CHECK_BLOCKS",
    "SELF_CHECK_SHAPE", "SELF_CHECK_TOLERANCE", "SPLASH_KERNELS", "AttentionOptions",
    "BlockSizes", "BlockSizesError", "KernelCall", "KeyPadding", "LocalMask", "Mask",
    "SegmentIds", "attention_implementation", "chunk_rows", "chunked_attention",
    "cudnn_attention", "cudnn_max_head_dim", "default_attention_backend",
    "default_block_sizes", "default_sparse_block_sizes", "describe_calls",
    "score_budget_bytes", "sharded_cudnn_attention",
    "forced_attention", "install_sdpa_override", "kernel_self_check", "key_padding_mask",
    "mark_self_attention", "pad_self_attention_keys", "real_keys_before",
    "reference_attention", "sharded_splash_attention", "splash_attention",
    "stock_splash_attention", "unpad_self_attention_keys", "xla_attention",
]


def default_attention_backend(platform: str | None = None) -> str:
    """The backend ``--attention auto`` means on ``platform`` (default:
    ``jax.default_backend()``): "splash" on "tpu", "cudnn" on "gpu" (CUDA), else "xla"."""
    platform = jax.default_backend() if platform is None else platform
    return {"tpu": "splash", "gpu": "cudnn"}.get(platform, "xla")


def _options(options: AttentionOptions | None) -> AttentionOptions:
    """``options``, or ``AttentionOptions()`` for ``None``."""
    return AttentionOptions() if options is None else options


def splash_attention(q, k, v, *, options: AttentionOptions | None = None, scale=None,
                     segment_ids=None, interpret: bool = False,
                     vmem_limit_bytes: int | None = None, real_keys_before: int = 0,
                     valid_kv_len: int | None = None, mask_index=None) -> jax.Array:
    """Softmax attention with the Pallas TPU flash kernel (forward only).

    Args:
        q: (batch, heads, q_len, head_dim), float32 or bfloat16.
        k, v: (batch, heads, kv_len, head_dim), same dtype as q.
        options: ``AttentionOptions``, the only door for the kernel's options; ``None``
            means ``AttentionOptions()`` (default blocks, no K smoothing, every key). Its
            fields:

            * ``block_sizes``: tile sizes (``BlockSizes``). Each size is an upper bound: the
              kernel keeps ``ceil(len / block)`` blocks and shrinks them to the smallest
              multiple of 128 (``block_kv``: of ``block_kv_compute``) that covers the
              sequence, so padding stays small and short sequences get short blocks.
            * ``mask``: ``None`` for full attention, else a mask value, e.g. ``LocalMask(w)``
              (query ``i`` attends key ``j`` iff ``|i - j| <= w``; ``LocalMask`` raises
              ``ValueError`` unless ``w`` is an int >= 0), or ``HeadMasks((m0, m1, ...))``:
              each (batch, head) runs the mask ``mask_index`` names.
            * ``k_smoothing``: subtract the mean of K over real keys (per batch and head)
              first; exact for softmax (docs/attention.md has its measured bf16 effect).
        scale: softmax scale; ``None`` means 1/sqrt(head_dim), as torch SDPA.
        segment_ids: ``None``, a ``SegmentIds(q, kv)`` or a pair ``(q_ids, kv_ids)`` of
            int32 arrays (batch, q_len) and (batch, kv_len); a query attends only to keys
            with an equal id. A query with no such key returns zeros.
        interpret: run the kernel in Pallas interpret mode (CPU tests).
        vmem_limit_bytes: scoped VMEM to request from Mosaic, bytes; ``None`` sizes it from
            the blocks and the chip (``splash.blocks.vmem_limit_bytes``). libtpu's
            static-profile flag adds VMEM buffers of its own, so ``engine.dry_run.estimate``
            profiles ask for less.
        real_keys_before: static block classification for ``segment_ids``: the caller
            promises that every key at a position < ``real_keys_before`` has segment id
            ``REAL_SEGMENT_ID`` (1), in every batch row (as the SDPA override's ids from a
            key-padding mask whose padding lies at or after that position). kv blocks wholly
            below it skip the per-key id load and compare (a query then attends all of
            their keys iff its id is 1); blocks that can hold other ids keep the exact
            compare. 0 (default): every block compares. A broken promise is not detected
            (ids are data) and gives wrong results. Ignored with a mask in ``options``.
        valid_kv_len: static int in [1, kv_len], or None (every key): keys at positions
            >= ``valid_kv_len`` are padding. The result equals attention over
            ``k[:, :, :valid_kv_len]`` and ``v[...]`` without copying them: the grid covers
            only the valid keys and the last block masks its tail by position, as for any
            length the blocks do not divide (no segment ids, no per-block id compare).
            Sequence parallelism's tail padding of the token axis uses it.
        mask_index: with ``HeadMasks`` in ``options.mask`` (required there, else ``None``):
            an integer array (batch, heads), ``m`` = ``options.mask.masks[m]`` for that
            (batch, head); values outside [0, len(masks)) are clipped. Data: a jitted
            caller may change it without a recompile. The kernel visits, per (batch, head),
            only the kv blocks its mask needs; the grid's kv axis is the largest count of
            the masks, the others' extra steps are skips (no DMA, no compute).

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype.

    Raises:
        ValueError: shapes disagree, ``valid_kv_len`` is out of range, ``segment_ids``
            has the wrong form or shape, or ``mask_index`` is missing, misshaped,
            not integer, or given without ``HeadMasks``.
    """
    return _kernel_attention(q, k, v, _options(options), scale=scale,
                             segment_ids=segment_ids, interpret=interpret,
                             vmem_limit_bytes=vmem_limit_bytes,
                             real_keys_before=real_keys_before, valid_kv_len=valid_kv_len,
                             mask_index=mask_index)


def sharded_splash_attention(q, k, v, *, mesh, options: AttentionOptions | None = None,
                             scale=None, segment_ids=None, interpret: bool = False,
                             kernel: str = "splash", real_keys_before: int = 0,
                             valid_kv_len: int | None = None, mask_index=None) -> jax.Array:
    """``splash_attention`` under ``jax.shard_map`` on a ("dp", "tp", "sp") mesh.

    Batch is sharded over "dp" and heads over "tp" (the Megatron layout the projections leave).
    The "sp" axis is used in one of three ways, chosen from the shapes:

    * ``sp == 1``, or q_len % sp != 0 with heads % (tp*sp) == 0: head-parallel. Heads go over
      ("tp", "sp"), every device holds whole sequences. Layout P("dp", ("tp", "sp"), None,
      None) in and out.
    * Self-attention (q_len == kv_len), heads % (tp*sp) == 0 and q_len % sp == 0, sp > 1:
      sequence-sharded in and out, P("dp", "tp", "sp", None), as the sequence-parallel
      residual stream leaves q, k and v. Inside, one all-to-all over "sp" per tensor trades the
      sequence shard for a head shard (DeepSpeed-Ulysses, Jacobs et al. 2023,
      arXiv:2309.14509), the kernel attends whole sequences for H/(tp*sp) heads, and one
      all-to-all trades back: 4 all-to-alls, each moving 1/sp of a tensor per device.
    * Otherwise (cross-attention, or heads % (tp*sp) != 0): q's sequence over "sp", K and V
      (and kv segment ids) whole on every "sp" device, so each device attends its query rows
      to all keys with no communication. Layout P("dp", "tp", "sp", None) for q and the output.

    Axes of size 1 are fine.

    Args:
        q, k, v, options, scale, segment_ids, interpret: as ``splash_attention``, for the
            global arrays.
        mesh: ``jax.sharding.Mesh`` with axis names "dp", "tp" and "sp".
        kernel: "splash" (ours) or "stock_splash" (``stock_splash_attention``, JAX's kernel;
            plain ``options`` only: no mask, no K smoothing).
        real_keys_before: as ``splash_attention``, a global key position. Every layout hands
            the kernel the whole key sequence (heads and Ulysses: all keys of its heads;
            q-sequence: full K and V), so the position needs no translation per shard.
            Ignored by "stock_splash".
        valid_kv_len: as ``splash_attention``, a global key position (no translation, for
            the same reason); "splash" only.
        mask_index: as ``splash_attention``, the global (batch, heads) array ("splash"
            only). It is sharded as q's batch and heads: P("dp", ("tp", "sp")) for the
            head-parallel and Ulysses layouts (a device's heads after the all-to-all),
            P("dp", "tp") for the q-sequence layout.

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype, sharded as described.

    Raises:
        ValueError: the mesh lacks an axis, or batch % dp or heads % tp is not 0, or neither
            heads % (tp*sp) nor q_len % sp is 0; ``mask_index`` as ``splash_attention``.
    """
    return _sharded_attention(q, k, v, mesh=mesh, options=_options(options),
                              scale=scale, segment_ids=segment_ids, interpret=interpret,
                              kernel_name=kernel, real_keys_before=real_keys_before,
                              valid_kv_len=valid_kv_len, mask_index=mask_index)


def kernel_self_check(kernel: str, *, interpret: bool = False, attention_fn=None) -> dict:
    """``splash.reference.kernel_self_check``, whose "splash" kernel is this module's
    ``splash_attention`` (looked up at call time, so a replaced one is what gets checked).

    Args:
        kernel, interpret: as ``splash.reference.kernel_self_check``.
        attention_fn: optional replacement ``f(q, k, v, *, block_sizes, interpret)``.

    Returns:
        dict(backend, shape, dtype, max_abs_error, tolerance, passed, seconds).
    """
    if attention_fn is None and kernel == "splash":
        def attention_fn(q, k, v, *, block_sizes, interpret):
            return splash_attention(q, k, v, options=AttentionOptions(block_sizes=block_sizes),
                                    interpret=interpret)
    return _kernel_self_check(kernel, interpret=interpret, attention_fn=attention_fn)


def _sdpa(
    query,
    key,
    value,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    env,
    attention,
    options: AttentionOptions,
    routing: dict,
):
    """torch SDPA signature; runs on the JAX arrays behind torchax tensors."""
    if dropout_p != 0.0:
        raise ValueError(
            f"scaled_dot_product_attention: expected dropout_p=0.0 for inference, got {dropout_p}"
        )
    if enable_gqa:
        raise ValueError("scaled_dot_product_attention: enable_gqa=True is not supported")
    forced = forced_backend()
    attention = forced or attention
    q, k, v = env.t2j_iso((query, key, value))
    mask = env.t2j_iso(attn_mask) if attn_mask is not None else None
    # Tail padding alone, into our kernel without a window: masked by length in the kernel
    # (``valid_kv_len``) instead of by segment ids; XLA (a fallback) masks ``real``.
    tail = None
    if attention in ("splash", "cudnn") and forced is None and mask is None and not is_causal \
            and options.mask is None:
        tail = _declared_tail(k)
    real, mask, before = _real_keys(q, k, mask)
    segment_ids = None if real is None or tail is not None else _key_segment_ids(q, k, real)
    # The mask and K smoothing are the model's self-attention options: not for the forced
    # (VAE) scopes, and the mask not for cross-attention (q_len != kv_len).
    options = dataclasses.replace(
        options, k_smoothing=options.k_smoothing and forced is None,
        mask=options.mask if forced is None and q.shape[2] == k.shape[2] else None)
    if mask is not None or is_causal:
        # Masks the kernels were not built for take the exact reference path.
        if real is not None:
            mask = mask & real[:, None, None, :]
        if options.mask is not None:
            mask = mask & options.mask.dense(q.shape[2], k.shape[2])
        out = reference_attention(q, k, v, scale=scale, mask=mask, is_causal=is_causal)
    elif attention == "xla":
        if options.k_smoothing:  # exact for softmax; so that the flag means the same everywhere
            k = _smooth_keys(k, segment_ids)
        out = _chunked_route(q, k, v, options, routing["mesh"], scale=scale, real=real)
    elif attention == "cudnn":
        if options.k_smoothing:  # as for "xla"
            k = _smooth_keys(k, None if real is None else _key_segment_ids(q, k, real))
        out = _cudnn_route(q, k, v, options, routing, scale=scale, real=real, tail=tail)
    elif attention == "splash" and forced is None and _svg.active_scope() is not None \
            and q.shape[2] == k.shape[2]:
        out = _svg_route(q, k, v, options, routing, scale=scale, real=real, tail=tail)
    elif attention in SPLASH_KERNELS:
        out = _splash_route(q, k, v, attention, options, routing, scale=scale, real=real,
                            segment_ids=segment_ids, before=before, tail=tail)
    else:
        raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {attention!r}")
    return env.j2t_iso(out)


def _splash_route(q, k, v, attention: str, options: AttentionOptions, routing: dict, *, scale,
                  real, segment_ids, before: int, tail):
    """A Splash kernel's call for ``_sdpa``: unsharded without a mesh, the sharded wrapper
    with one, XLA (reported through ``routing["on_fallback"]``) when the wrapper cannot
    split the call. Looks the entries up in this module, so tests may replace them."""
    mesh = routing["mesh"]
    if mesh is None:
        if attention == "stock_splash":
            out = stock_splash_attention(q, k, v, scale=scale,
                                         block_sizes=options.block_sizes,
                                         segment_ids=segment_ids,
                                         interpret=routing["interpret"])
        else:
            out = splash_attention(q, k, v, options=options, scale=scale,
                                   segment_ids=segment_ids, interpret=routing["interpret"],
                                   real_keys_before=before, valid_kv_len=tail)
    elif q.shape[0] % mesh.shape["dp"] or q.shape[1] % mesh.shape["tp"]:
        # The wrapper cannot split this call: XLA, which GSPMD partitions as it likes,
        # instead of failing; reported, never silent.
        if routing["on_fallback"] is not None:
            routing["on_fallback"](
                "attention_to_xla",
                f"{attention} wrapper cannot split q {tuple(q.shape)} over dp="
                f"{mesh.shape['dp']}, tp={mesh.shape['tp']}: chunked XLA attention instead",
            )
        out = _chunked_route(q, k, v, options, mesh, scale=scale, real=real)
    else:
        out = sharded_splash_attention(
            q, k, v, mesh=mesh, options=options, scale=scale, segment_ids=segment_ids,
            interpret=routing["interpret"], kernel=attention,
            real_keys_before=before if attention == "splash" else 0, valid_kv_len=tail)
    return out


def _svg_route(q, k, v, options: AttentionOptions, routing: dict, *, scale, real, tail):
    """A self-attention call under ``splash.svg.sparse_scope``: SVG's routing, the temporal
    heads permuted, one ``_splash_route`` call with the scope's mask (``sparse_attention``).
    Sequence parallelism's declared tail padding (``tail``: the real token count) stays in
    place: its keys are left out (``valid_kv_len``), its rows are computed and read by no
    real token. Raises ValueError for any other key mask (SVG's band has no place for one)
    or a real token count other than the scope's grid."""
    scope, mesh = _svg.active_scope(), routing["mesh"]
    grid = scope.num_frames * scope.frame_size
    if (real is not None and tail is None) or (tail or q.shape[2]) != grid:
        raise ValueError(f"sparse attention: expected {grid} real tokens (the scope's grid) "
                         f"and no key mask but sequence parallelism's tail padding, got "
                         f"{tail or q.shape[2]} of {q.shape[2]} tokens"
                         f"{' and a key mask' if real is not None and tail is None else ''}")
    if scope.block_sizes is not None:  # the band calls' own blocks (SPARSE_BLOCK_SIZES)
        options = dataclasses.replace(options, block_sizes=BlockSizes(*scope.block_sizes))
    if mesh is not None and q.shape[0] % mesh.shape["dp"] == 0 and q.shape[1] % mesh.shape[
            "tp"] == 0 and _choose_layout(mesh, q.shape, k.shape[2]) in ("heads", "ulysses"):
        # Routing and permutation per device, on the whole sequences the layout gives each
        # device: on the token-sharded global arrays XLA gathered them (Wan 14B 720p,
        # v6e:2x4: 2.3 GB of all-gathers and 19.6 ms per layer, the step 2.750 s, estimated)
        return _sharded_attention(
            q, k, v, mesh=mesh, options=options, scale=scale, interpret=routing["interpret"],
            around=lambda q, k, v, attend, q_scale: _svg.sparse_attention(
                q, k, v, scope, attend, scale=scale, q_scale=q_scale))

    def attend(q, k, v, mask, valid_kv_len=None):
        return _splash_route(q, k, v, "splash", dataclasses.replace(options, mask=mask),
                             routing, scale=scale, real=None, segment_ids=None, before=0,
                             tail=valid_kv_len)

    return _svg.sparse_attention(q, k, v, scope, attend, scale=scale)


def _cudnn_route(q, k, v, options: AttentionOptions, routing: dict, *, scale, real, tail):
    """The "cudnn" backend's call for ``_sdpa``: cuDNN where ``attention_implementation``
    says it takes the call (under ``shard_map`` with a mesh), else the query-chunked XLA
    attention, which XLA partitions by itself under a mesh, as "xla". A mesh that cannot
    split the call sends it to the chunked path too, reported through
    ``routing["on_fallback"]``."""
    key_mask = "none" if real is None else "tail" if tail is not None else "data"
    impl = attention_implementation("cudnn", platform=jax.default_backend(), dtype=q.dtype,
                                    head_dim=q.shape[3], mask=options.mask, key_mask=key_mask,
                                    max_head_dim=cudnn_max_head_dim())
    mesh = routing["mesh"]
    b, h = q.shape[:2]
    if impl == "cudnn" and mesh is not None and (b % mesh.shape["dp"] or h % mesh.shape["tp"]):
        if routing["on_fallback"] is not None:
            routing["on_fallback"](
                "attention_to_xla",
                f"cudnn wrapper cannot split q {tuple(q.shape)} over dp={mesh.shape['dp']}, "
                f"tp={mesh.shape['tp']}: chunked XLA attention instead")
        impl = "xla_chunked"
    if impl == "cudnn":
        # A declared tail is a length; any other key mask moves the real keys first.
        kw = dict(scale=scale, key_mask=None if tail is not None else real, valid_kv_len=tail)
        if mesh is None:
            return cudnn_attention(q, k, v, **kw)
        return sharded_cudnn_attention(q, k, v, mesh=mesh, **kw)
    return _chunked_route(q, k, v, options, mesh, scale=scale, real=real)


def _chunked_route(q, k, v, options: AttentionOptions, mesh, *, scale, real):
    """The query-chunked XLA attention (``chunked_attention``) for ``_sdpa``: the "xla"
    backend, the Splash wrappers' and cuDNN's fallback. Plain ``xla_attention`` would hold
    every (q_len, kv_len) score at once (a tiny Wan checkpoint at 480 x 832 x 81 asked for
    68.7 GB on CPU); one chunk's scores fit ``score_budget_bytes()``. Without a mesh, or
    when batch % dp or heads % tp is not 0, the chunk is sized for the whole batch and
    heads; otherwise for one device's B/dp x H/tp (XLA partitions the call by itself)."""
    b, h = q.shape[:2]
    shards = 1 if mesh is None or b % mesh.shape["dp"] or h % mesh.shape["tp"] \
        else mesh.shape["dp"] * mesh.shape["tp"]
    chunk = chunk_rows(max(1, b * h // shards), 1, q.shape[2], k.shape[2],
                       score_budget_bytes())
    return chunked_attention(q, k, v, scale=scale, key_mask=real, static_mask=options.mask,
                             chunk=chunk)


def install_sdpa_override(
    env,
    *,
    attention: str,
    mesh=None,
    options: AttentionOptions | None = None,
    interpret: bool = False,
    on_fallback=None,
) -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` in ``env`` to JAX.

    A boolean key-padding ``attn_mask`` (``key_padding_mask``: one row of allowed keys for
    every query, as HunyuanVideo-1.5's text padding) becomes segment ids (real = 1,
    padding = 0) for the kernels, or a (batch, kv_len) key mask for the chunked XLA
    attention: no dense (batch, 1, q_len, kv_len) mask is built. Calls with other masks or
    ``is_causal=True`` take ``reference_attention`` (exact) whatever ``attention`` says; the
    rest take ``attention``.

    Args:
        env: a ``torchax.tensor.Environment`` (``torchax.default_env()``).
        attention: "xla" (``chunked_attention``: exact float32 softmax over query chunks,
            bounded score memory), "splash" (``splash_attention``, or
            ``sharded_splash_attention`` when ``mesh`` is given), "stock_splash" (the same
            with ``stock_splash_attention``, JAX's kernel) or "cudnn" (per call, as
            ``attention_implementation`` decides: ``cudnn_attention``, under ``shard_map``
            with a mesh, or ``chunked_attention``).
        mesh: optional ``jax.sharding.Mesh`` with axes ("dp", "tp", "sp") for the sharded
            kernel wrapper.
        options: ``AttentionOptions`` (``None``: ``AttentionOptions()``). K smoothing
            subtracts the mean of K before the kernel (see ``splash_attention``); exact for
            softmax, so XLA applies it too. The mask (e.g. ``LocalMask``: query ``i``
            attends key ``j`` iff ``|i - j| <= w``, positions in the flattened token order)
            applies to every
            self-attention call (q_len == kv_len; not in ``forced_attention`` scopes),
            through the kernel's grid or, for "xla", its predicate per chunk. Neither with
            "stock_splash".
        interpret: run the Pallas kernel in interpret mode (CPU).
        on_fallback: optional ``f(kind, detail)`` told when a call the wrapper cannot split
            goes to the chunked XLA attention instead.

    Raises:
        ValueError: unknown ``attention``, or ``HeadMasks`` in ``options.mask`` (torch SDPA
            carries no per-call ``mask_index``; call ``splash_attention`` with one).
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {attention!r}")
    options = _options(options)
    if isinstance(options.mask, HeadMasks):
        raise ValueError("options.mask: expected None or a Mask for the SDPA override (it "
                         "passes no mask_index), got HeadMasks")
    if attention == "stock_splash" and not options.is_plain:
        raise ValueError("attention='stock_splash': window_size and k_smoothing are ours only")
    routing = dict(mesh=mesh, interpret=interpret, on_fallback=on_fallback)
    env.override_op_definition(
        torch.nn.functional.scaled_dot_product_attention,
        functools.partial(_sdpa, env=env, attention=attention, options=options,
                          routing=routing),
    )
