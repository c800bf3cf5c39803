"""The kernel under ``jax.shard_map`` on a ("dp", "tp", "sp") mesh: head-parallel,
DeepSpeed-Ulysses (all-to-alls over "sp") or q-sequence-parallel, chosen from the shapes
(``sharded_attention``; the public ``sharded_splash_attention`` documents the layouts)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from splash import kernel
from splash.kernel import LOG2_E, check_shapes, expect_shape, fold_scale, softmax_scale
from splash.mask import SegmentIds, as_segment_ids, check_mask_index
from splash.options import SPLASH_KERNELS, AttentionOptions
from splash.stock import stock_splash_attention


def ulysses_to_heads(x, sp: int):
    """Inside ``shard_map``: (B, H, S/sp, D) -> (B, H/sp, S, D), by one all-to-all over "sp".

    The all-to-all runs on (sp, B, H/sp, S/sp, D), its chunks outermost: XLA's TPU all-to-all
    wants the split dimension major. With it there, the copy into that order fuses into the
    producer (Wan: the RoPE) and one copy merges the received shards. Splitting heads (axis
    1) and concatenating the sequence (axis 2) in place, as before, cost 2-3 more passes over
    each of q, k and v (Wan 14B 720p, dp2 x sp4 on v6e, one block's HLO from a deviceless
    compile: layout copies 6.2 -> about 3 GB)."""
    chunks = ulysses_receive(x, sp)  # (sp, B, H/sp, S/sp, D)
    _, b, h, s, d = chunks.shape
    return jnp.moveaxis(chunks, 0, 2).reshape(b, h, sp * s, d)


def ulysses_receive(x, sp: int):
    """Inside ``shard_map``: (B, H, S/sp, D) -> (sp, B, H/sp, S/sp, D), this device's head
    group of every sequence shard, shard c at index c (tokens [c S/sp, (c + 1) S/sp)): the
    all-to-all of ``ulysses_to_heads`` without the copy that merges the shards."""
    b, h, s, d = x.shape
    chunks = jnp.moveaxis(x.reshape(b, sp, h // sp, s, d), 1, 0)  # (sp, B, H/sp, S/sp, D)
    expect_shape("Ulysses chunks", chunks.shape, (sp, b, h // sp, s, d))
    # Axis 0 is the head group before and the sender, i.e. the sequence shard, after.
    return lax.all_to_all(chunks, "sp", split_axis=0, concat_axis=0, tiled=True)


def ulysses_to_tokens(x, sp: int):
    """Inside ``shard_map``: (B, H/sp, S, D) -> (B, H, S/sp, D), the inverse of
    ``ulysses_to_heads``, with the same chunks-outermost all-to-all."""
    b, h, s, d = x.shape
    return ulysses_send(jnp.moveaxis(x.reshape(b, h, sp, s // sp, d), 2, 0), sp)


def ulysses_send(chunks, sp: int):
    """Inside ``shard_map``: (sp, B, H/sp, S/sp, D) sequence chunks (``ulysses_receive``'s
    form) -> (B, H, S/sp, D): chunk c to sp device c, every head group back."""
    _, b, h, s, d = chunks.shape
    expect_shape("Ulysses chunks", chunks.shape, (sp, b, h, s, d))
    chunks = lax.all_to_all(chunks, "sp", split_axis=0, concat_axis=0, tiled=True)
    return jnp.moveaxis(chunks, 0, 1).reshape(b, sp * h, s, d)  # sender = head group


def _check(options: AttentionOptions, kernel_name: str, valid_kv_len) -> None:
    if kernel_name not in SPLASH_KERNELS:
        raise ValueError(f"kernel: expected one of {SPLASH_KERNELS}, got {kernel_name!r}")
    if kernel_name == "stock_splash" and not options.is_plain:
        raise ValueError("kernel='stock_splash': window_size and k_smoothing are ours only")
    if kernel_name == "stock_splash" and valid_kv_len is not None:
        raise ValueError("kernel='stock_splash': valid_kv_len is ours only")


def choose_layout(mesh, q_shape, kv_len: int) -> str:
    """"heads", "ulysses" or "q_sequence" for (B, H, Sq, D) queries on ``mesh``.

    Raises:
        ValueError: the mesh lacks an axis, or batch % dp or heads % tp is not 0, or neither
            heads % (tp*sp) nor q_len % sp is 0.
    """
    if [a for a in ("dp", "tp", "sp") if a not in mesh.shape]:
        raise ValueError(f"mesh: expected axes ('dp', 'tp', 'sp'), got {tuple(mesh.shape)}")
    dp, tp, sp = mesh.shape["dp"], mesh.shape["tp"], mesh.shape["sp"]
    batch, heads, q_len, _ = q_shape
    if batch % dp:
        raise ValueError(f"batch: expected a multiple of mesh axis dp={dp}, got {batch}")
    if heads % tp:
        raise ValueError(f"heads: expected a multiple of mesh axis tp={tp}, got {heads}")
    heads_split = heads % (tp * sp) == 0
    if sp == 1 or (heads_split and q_len % sp):
        return "heads"
    if heads_split and q_len == kv_len:
        return "ulysses"
    if q_len % sp == 0:
        return "q_sequence"
    raise ValueError(
        f"q_len: expected a multiple of mesh axis sp={sp} when heads "
        f"({heads}) are not divisible by tp*sp={tp * sp}, got {q_len}"
    )


def _specs(layout: str):
    """(q spec, kv spec, q ids spec, kv ids spec) of a layout."""
    if layout == "heads":
        return P("dp", ("tp", "sp"), None, None), P("dp", ("tp", "sp"), None, None), \
            P("dp", None), P("dp", None)
    if layout == "ulysses":  # the kernel sees whole sequences
        return P("dp", "tp", "sp", None), P("dp", "tp", "sp", None), P("dp", None), \
            P("dp", None)
    return P("dp", "tp", "sp", None), P("dp", "tp", None, None), P("dp", "sp"), P("dp", None)


def mask_index_spec(layout: str):
    """The ``HeadMasks`` index's (batch, heads) spec: the heads the kernel runs on each
    device. Ulysses' all-to-all hands sp device j head group j of its tp shard, which is
    block (t * sp + j) of ("tp", "sp"), as in the head-parallel layout."""
    return P("dp", "tp") if layout == "q_sequence" else P("dp", ("tp", "sp"))


def sharded_attention(q, k, v, *, mesh, options: AttentionOptions, scale=None,
                      segment_ids=None, interpret: bool = False, kernel_name: str = "splash",
                      real_keys_before: int = 0, valid_kv_len: int | None = None,
                      mask_index=None, around=None) -> jax.Array:
    """``kernel.attention`` (or the stock kernel) under ``jax.shard_map``; the public
    ``sharded_splash_attention`` documents the arguments, layouts and errors.

    ``around`` (``splash`` kernel, "heads" and "ulysses" layouts only: each device then holds
    whole sequences of its heads): ``(q, k, v, attend, q_scale) -> out`` runs per device on
    those whole sequences, given as (C, B, H', S/C, D) chunks, chunk outermost (Ulysses:
    the all-to-all's received shards, C = sp, unmerged; else C = 1), and returns out in
    the same form, which Ulysses' return all-to-all sends as it is;
    ``attend(q, k, v, mask, valid_kv_len, q_scaled=False)`` is the kernel call under
    ``mask`` on (B, H', S, D); ``q_scale`` is None, or under Ulysses the factor q already
    carries (``fold_scale`` before the all-to-all, where it fuses, as for a plain call). SVG's
    routing and token permutation run there (``splash.svg.sparse_attention``), so XLA never
    gathers the token-sharded arrays for them. ValueError for another layout."""
    check_shapes(q, k, v)
    _check(options, kernel_name, valid_kv_len)
    mask_index = check_mask_index(options.mask, mask_index, *q.shape[:2])
    layout = choose_layout(mesh, q.shape, k.shape[2])
    if around is not None and (layout not in ("heads", "ulysses") or kernel_name != "splash"):
        raise ValueError(f"around: expected the 'heads' or 'ulysses' layout of the splash "
                         f"kernel, got {layout!r} ({kernel_name})")
    sp = mesh.shape["sp"]
    q_spec, kv_spec, q_ids_spec, kv_ids_spec = _specs(layout)
    segment_ids = as_segment_ids(segment_ids)

    def local(q, k, v, seg, mask_index):
        q_shard, q_scale = None, None
        if layout == "q_sequence":  # masks use global query positions
            q_shard = (lax.axis_index("sp"), sp)
        if layout == "ulysses":
            # (B/dp, H/tp, S/sp, D) -> (B/dp, H/(tp*sp), S, D): send head group j to sp device j,
            # receive every device's sequence shard of our head group, in sequence order.
            if kernel_name == "splash":
                softmax = softmax_scale(q.shape[3], scale)
                q, q_scale = fold_scale(q, softmax), softmax * LOG2_E  # what q now carries
            if around is not None:  # the shards stay unmerged: around reads them in place
                q, k, v = (ulysses_receive(x, sp) for x in (q, k, v))
            else:
                q, k, v = (ulysses_to_heads(x, sp) for x in (q, k, v))
        if around is not None:
            def attend(q, k, v, mask, valid_kv_len=None, q_scaled=False):
                return kernel.attention(q, k, v, dataclasses.replace(options, mask=mask),
                                        scale=scale, interpret=interpret,
                                        valid_kv_len=valid_kv_len, q_scaled=q_scaled)

            if layout == "ulysses":
                return ulysses_send(around(q, k, v, attend, q_scale), sp)
            out = around(q[None], k[None], v[None], attend, None)[0]
        elif kernel_name == "stock_splash":
            out = stock_splash_attention(q, k, v, scale=scale, block_sizes=options.block_sizes,
                                         segment_ids=seg, interpret=interpret)
        else:
            out = kernel.attention(q, k, v, options, scale=scale, segment_ids=seg,
                                   interpret=interpret, q_shard=q_shard,
                                   real_keys_before=real_keys_before,
                                   valid_kv_len=valid_kv_len, q_scaled=layout == "ulysses",
                                   mask_index=mask_index)
        if layout == "ulysses":  # back to (B/dp, H/tp, S/sp, D)
            out = ulysses_to_tokens(out, sp)
        return out

    seg_spec = None if segment_ids is None else SegmentIds(q_ids_spec, kv_ids_spec)
    index_spec = None if mask_index is None else mask_index_spec(layout)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, seg_spec, index_spec),
        out_specs=q_spec,
        check_vma=False,  # pallas_call carries no varying-manual-axes annotations
    )(q, k, v, segment_ids, mask_index)
