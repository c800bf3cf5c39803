"""The Pallas TPU kernel: online-softmax ("flash") attention in base 2 with a lazy shift,
and ``attention``, which fits the blocks, builds the mask's tables and calls it.

The kernel reads a mask only through ``splash.mask_info``: with a mask, the kv grid axis
walks each q block's list of kv blocks (scalar-prefetched) and each sub-tile's class picks
skip / unmasked / masked by ``Mask.tile_predicate``; without one, static ranges of kv blocks
carry the key-tail and segment-id classes. With ``HeadMasks`` the tables of every mask are
prefetched together with the per-(batch, head) ``mask_index``, and each (batch, head) reads
its mask's rows. docs/attention.md has the design notes (lazy
shift, transposed scores, software pipelining, block classes).

``describe_calls(hook)`` lets a caller see (and replace) every kernel call as it is traced:
the dry-run estimator records the grids and stubs the kernel out with it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from splash import blocks
from splash.blocks import NUM_LANES, NUM_SUBLANES, BlockSizes
from splash.mask import (
    EDGE,
    FULL,
    PARTIAL,
    REAL_SEGMENT_ID,
    HeadMasks,
    Mask,
    SegmentIds,
    as_segment_ids,
    check_mask_index,
)
from splash.mask_info import (
    InfoLayout,
    build_head_mask_info,
    build_mask_info,
    real_kv_blocks,
    static_kv_ranges,
)
from splash.options import AttentionOptions

# The Pallas call's name: what profiles and HLO dumps show (engine.dry_run.estimate finds the
# kernel's cycles by it). Family-neutral: the kernel serves every model family.
KERNEL_NAME = "exp2_splash_attention"
LOG2_E = math.log2(math.e)
# Start value of the running max. Finite (unlike the -inf used for masked scores) so that
# a row that has seen only masked keys computes 2^(-inf - floor) = 0 instead of
# 2^(-inf + inf) = NaN. Any valid score is far above it, so it never wins a max.
_M_FLOOR = -0.5 * float(np.finfo(np.float32).max)
# lax.dot_general dimension numbers: A @ B and A @ B^T.
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
# Lazy shift: 2^(s - m) for a stale m is accepted while a tile's column sum is <= 2^64.
_LAZY_LOG2_BOUND = 64
_LAZY_BOUND = float(2**_LAZY_LOG2_BOUND)
# Sub-tiles per grid step that are unrolled (more: a rolled loop, for compile time).
_UNROLL_MAX_TILES = 16


def expect_shape(what: str, shape, want) -> None:
    """Raise ``ValueError("<what>: expected <want>, got <shape>")`` unless they match (the
    kernel's reshapes and tiles, checked at trace time as JAX's splash kernel checks its
    own)."""
    if tuple(shape) != tuple(want):
        raise ValueError(f"{what}: expected shape {tuple(want)}, got {tuple(shape)}")


# ---------------------------------------------------------------------------------------
# The kernel body
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Step:
    """One (batch, head, q block, kv step) grid step: its refs, static sizes and the
    updates of the online softmax (see docs/attention.md).

    Refs: q (block_q, D) pre-scaled by scale*log2(e); k (block_kv, D); vt (D, block_kv);
    q_ids (1, block_q) and kv_ids (block_kv, 128) int32 or None; o (block_q, D); m (the
    shift, a stale running max), l (1, block_q) f32; acc (D, block_q) f32; bad (num_sub, 1,
    block_q) f32, 1.0 where sub-tile c rejected a column, -1.0 where it skipped it; p
    (block_kv_compute, block_q) in V's dtype, the probabilities of the sub-tile whose P V is
    pending. Rows of the last q block and keys of the last kv block past the arrays' ends
    hold unspecified values (NaN in interpret mode): garbage queries only touch their own
    columns and output rows (discarded on write); garbage keys are masked out of the scores
    and zeroed in V.
    """

    info_ref: object
    q_ref: object
    k_ref: object
    vt_ref: object
    q_ids_ref: object
    kv_ids_ref: object
    m_ref: object
    l_ref: object
    acc_ref: object
    bad_ref: object
    p_ref: object
    block_q: int
    block_kv_compute: int
    kv_len: int
    precision: object
    mask: Mask | HeadMasks | None
    kv_block: object = 0
    q_start: object = 0
    which: object = None  # HeadMasks: this (batch, head)'s mask number (traced int32)

    def keys_of(self, c):
        bkc = self.block_kv_compute
        return pl.ds(pl.multiple_of(c * bkc, bkc), bkc)

    def key_positions(self, c, shape, dim):
        block_kv = self.k_ref.shape[0]
        return self.kv_block * block_kv + c * self.block_kv_compute + lax.broadcasted_iota(
            jnp.int32, shape, dim)

    def scores(self, c, mask_kinds: tuple[str, ...]):
        """Masked S^T = K Q^T of sub-tile ``c``: (block_kv_compute, block_q), keys along
        sublanes. Kinds: "tail" (keys past kv_len), "segment" (ids), "mask" (the mask's
        tile predicate); "qsegment" masks columns later, not scores."""
        keys = self.keys_of(c)
        s = lax.dot_general(self.k_ref[keys, :], self.q_ref[...], _NT,
                            precision=self.precision, preferred_element_type=jnp.float32)
        expect_shape("scores", s.shape, (self.block_kv_compute, self.block_q))
        conditions = []
        if mask_kinds:
            k_pos = self.key_positions(c, s.shape, 0)
            if "tail" in mask_kinds:
                conditions.append(k_pos < self.kv_len)
            if "segment" in mask_kinds:
                conditions.append(self.kv_ids_ref[keys, :1] == self.q_ids_ref[...])
            if "mask" in mask_kinds:
                q_pos = self.q_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
                conditions.append(self.mask.tile_predicate(q_pos, k_pos))
        if conditions:
            s = jnp.where(functools.reduce(jnp.logical_and, conditions), s, -jnp.inf)
        return s

    def values(self, c, mask_kinds: tuple[str, ...]):
        """V^T of sub-tile ``c``: (head_dim, block_kv_compute)."""
        vt = self.vt_ref[:, self.keys_of(c)]
        if "tail" in mask_kinds:
            # Keys past kv_len are garbage: 0 * NaN would poison acc through P V.
            vt = jnp.where(self.key_positions(c, vt.shape, 1) < self.kv_len, vt,
                           jnp.zeros_like(vt))
        return vt

    def pv(self, vt, p):
        # acc^T += V^T P^T: (head_dim, block_q). Probabilities in V's dtype (bf16 x bf16
        # on the MXU for bf16 inputs), f32 accumulation.
        return lax.dot_general(vt, p.astype(vt.dtype), _NN, precision=self.precision,
                               preferred_element_type=jnp.float32)

    def init(self, real_blocks: int):
        self.l_ref[...] = jnp.zeros(self.l_ref.shape, jnp.float32)
        self.acc_ref[...] = jnp.zeros(self.acc_ref.shape, jnp.float32)
        if self.mask is not None:
            self.m_ref[...] = jnp.full(self.m_ref.shape, _M_FLOOR, jnp.float32)
            return
        # Start the shift at the max over the first 16 keys (masked like any tile), so the
        # first step is accepted by the fast path: any shift is exact, it only has to keep
        # 2^(x - m) finite (docs/attention.md).
        n0 = 2 * NUM_SUBLANES
        s0 = lax.dot_general(self.k_ref[:n0, :], self.q_ref[...], _NT,
                             precision=self.precision, preferred_element_type=jnp.float32)
        ok = lax.broadcasted_iota(jnp.int32, s0.shape, 0) < self.kv_len
        if self.q_ids_ref is not None and real_blocks:  # block 0 is all real
            ok = jnp.logical_and(ok, self.q_ids_ref[...] == REAL_SEGMENT_ID)
        elif self.q_ids_ref is not None:
            ok = jnp.logical_and(ok, self.kv_ids_ref[:n0, :1] == self.q_ids_ref[...])
        s0 = jnp.where(ok, s0, -jnp.inf)
        self.m_ref[...] = jnp.maximum(jnp.max(s0, axis=0, keepdims=True), _M_FLOOR)

    def exact_update(self, c, mask_kinds, cols):
        """The textbook flash update of sub-tile ``c`` for the columns ``cols`` only:
        m' = max(m, max s), rescale l and acc by 2^(m - m'), add the tile."""
        s = self.scores(c, mask_kinds)
        m_prev = self.m_ref[...]
        m_next = jnp.where(cols, jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True)), m_prev)
        p = jnp.exp2(s - m_next)
        alpha = jnp.exp2(m_prev - m_next)
        self.l_ref[...] = jnp.where(
            cols, alpha * self.l_ref[...] + jnp.sum(p, axis=0, keepdims=True), self.l_ref[...])
        self.acc_ref[...] = jnp.where(
            cols, alpha * self.acc_ref[...] + self.pv(self.values(c, mask_kinds), p),
            self.acc_ref[...])
        self.m_ref[...] = m_next

    def lazy_scores(self, c, mask_kinds, m):
        """Fast path, first half: p = 2^(s - m) with the stale shift m (no max pass),
        accepted per column when l_tile = sum(p) <= 2^_LAZY_LOG2_BOUND (so every p is
        finite). Accepted columns add l_tile to l; p goes to the scratch for P V. ``>``
        is False for NaN, so garbage query columns never count as rejected."""
        p = jnp.exp2(self.scores(c, mask_kinds) - m)
        l_tile = jnp.sum(p, axis=0, keepdims=True)
        bad = l_tile > _LAZY_BOUND
        if "qsegment" in mask_kinds:
            # All-real block: a query of another id attends none of its keys. Its column
            # is skipped (-1.0: neither added nor redone), whatever p holds there.
            skip = self.q_ids_ref[...] != REAL_SEGMENT_ID
            self.bad_ref[c] = jnp.where(skip, -1.0, bad.astype(jnp.float32))
            bad = jnp.logical_or(bad, skip)
        else:
            self.bad_ref[c] = bad.astype(jnp.float32)
        self.l_ref[...] = jnp.where(bad, self.l_ref[...], self.l_ref[...] + l_tile)
        self.p_ref[...] = p.astype(self.p_ref.dtype)

    def lazy_pv(self, c, mask_kinds):
        """Fast path, second half: acc += V^T P^T of sub-tile ``c`` for its accepted
        columns, from the scratch ``lazy_scores`` left (rejected: 1.0, skipped: -1.0)."""
        bad = self.bad_ref[c] != 0.0
        self.acc_ref[...] = jnp.where(
            bad, self.acc_ref[...],
            self.acc_ref[...] + self.pv(self.values(c, mask_kinds), self.p_ref[...]))

    def redo(self, c, mask_kinds):
        """The exact update of the columns sub-tile ``c`` rejected, if any (rare)."""
        cols = self.bad_ref[c] > 0.0
        pl.when(jnp.any(cols))(lambda: self.exact_update(c, mask_kinds, cols))

    def lazy_tiles(self, runs):
        """Sub-tiles ``runs`` = [(start, stop, mask_kinds), ...] (consecutive) with the
        stale shift, software pipelined: P V of tile c-1 is issued after the scores of
        tile c-1 and before those of tile c, from the bf16 scratch ``p_ref``, so the MXU
        never waits for the exp2 of the tile it just produced. Up to _UNROLL_MAX_TILES
        tiles are unrolled (one basic block: no loop-carried drain), more take a rolled
        loop (compile time). No branch until every tile is done; then the rejected
        columns of every tile are redone exactly (rare; order does not matter, since l
        and acc are sums under one shift)."""
        m = self.m_ref[...]
        tiles = [(c, mk) for start, stop, mk in runs for c in range(start, stop)]
        self.lazy_scores(*tiles[0], m)
        prev = tiles[0]
        for start, stop, mk in runs:
            lo = max(start, 1)
            if len(tiles) > _UNROLL_MAX_TILES and stop - lo > 1 and mk == prev[1]:

                def body(c, _, mk=mk):
                    self.lazy_pv(c - 1, mk)
                    self.lazy_scores(c, mk, m)

                lax.fori_loop(lo, stop, body, None)
            else:
                for c in range(lo, stop):
                    self.lazy_pv(*prev)
                    self.lazy_scores(c, mk, m)
                    prev = (c, mk)
            if stop - 1 >= lo:
                prev = (stop - 1, mk)
        self.lazy_pv(*prev)

        # Rare: columns a tile rejected (the max of a query jumped by about
        # _LAZY_LOG2_BOUND over its shift, or the init saw no valid key for it).
        @pl.when(jnp.any(self.bad_ref[: len(tiles)] > 0.0))
        def _redo():
            for start, stop, mk in runs:
                lax.fori_loop(start, stop, lambda c, _, mk=mk: self.redo(c, mk), None)

    def static_ranges(self, ranges):
        """Unmasked: one branch per static range of kv blocks (``static_kv_ranges``)."""
        if len(ranges) == 1:
            self.lazy_tiles(ranges[0][2])
            return
        num_kv_blocks = ranges[-1][1]
        for lo, hi, runs in ranges:
            if lo == 0:
                cond = self.kv_block < hi
            elif hi == num_kv_blocks:
                cond = self.kv_block >= lo
            else:
                cond = jnp.logical_and(self.kv_block >= lo, self.kv_block < hi)
            pl.when(cond)(functools.partial(self.lazy_tiles, runs))

    def tile_branches(self, segmented: bool) -> list:
        """[(class, mask number or None, step, mask kinds)]: the branches of a sub-tile,
        ``FULL`` unmasked, ``PARTIAL`` masked by the predicate and the key tail, ``EDGE + k``
        masked by the mask's k-th edge mask alone (``Mask.edge_masks``). With ``HeadMasks``
        those branches per mask, each a step whose ``mask`` is that mask, taken where
        ``which`` names it (``EMPTY``: no branch, skipped)."""
        base = ("segment",) if segmented else ()
        masked = base + ("mask", "tail")
        masks = self.mask.masks if isinstance(self.mask, HeadMasks) else (self.mask,)
        out = [(FULL, None, self, base)]
        for m, mask in enumerate(masks):
            m = m if isinstance(self.mask, HeadMasks) else None
            out.append((PARTIAL, m, dataclasses.replace(self, mask=mask), masked))
            # EDGE + k: the k-th edge mask alone, and no key tail (the host table gives the
            # tile that straddles kv_len PARTIAL).
            out += [(EDGE + k, m, dataclasses.replace(self, mask=edge), base + ("mask",))
                    for k, edge in enumerate(mask.edge_masks())]
        return out

    def masked_tiles(self, layout: InfoLayout, q_block, kv_step, segmented: bool):
        """With a mask: each sub-tile by its class, one at a time (no pipelining): skipped
        (``EMPTY``), unmasked (``FULL``) or masked by the predicate and the key tail
        (``PARTIAL``); the lazy update, then its exact redo."""

        def tile(c, _):
            cls = layout.tile_class(self.info_ref, q_block, kv_step, c, self.which)
            for kind, m, step, kinds in self.tile_branches(segmented):
                cond = cls == kind
                if m is not None:
                    cond = jnp.logical_and(cond, self.which == m)

                @pl.when(cond)
                def _tile(step=step, kinds=kinds):
                    step.lazy_scores(c, kinds, step.m_ref[...])
                    step.lazy_pv(c, kinds)
                    step.redo(c, kinds)

        lax.fori_loop(0, layout.num_sub, tile, None)

    def finish(self, o_ref):
        denom = self.l_ref[...]
        # A query with no valid key has l == 0 and acc == 0: return zeros, not NaN.
        inv = jnp.where(denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0)
        # Cast, then transpose: half the vregs through the transpose, same values.
        out = jnp.transpose((self.acc_ref[...] * inv).astype(o_ref.dtype))
        expect_shape("output tile", out.shape, o_ref.shape)
        o_ref[...] = out


def _splash_kernel(info_ref, q_ref, k_ref, vt_ref, q_ids_ref, kv_ids_ref, o_ref, m_ref, l_ref,
                   acc_ref, bad_ref, p_ref, *, block_q: int, block_kv: int,
                   block_kv_compute: int, kv_len: int, precision,
                   real_kv_blocks: int = 0, mask: Mask | HeadMasks | None = None,
                   layout: InfoLayout | None = None, which=None):
    """One (batch, head, q block, kv step) grid step (``_Step``).

    ``info_ref``: the scalar-prefetched int32 table of ``layout`` (``splash.mask_info``).
    ``mask``: None, or the mask whose ``tile_predicate`` masks ``PARTIAL`` sub-tiles, or
    ``HeadMasks`` whose mask number ``which`` (traced) this (batch, head) runs.
    ``real_kv_blocks`` (static, unmasked with segment ids): the first ``real_kv_blocks`` kv
    blocks hold only keys of id ``REAL_SEGMENT_ID``: those steps read no kv ids and only
    skip the query columns of other ids ("qsegment"). Later blocks compare ids per key.
    """
    expect_shape("q tile", q_ref.shape, (block_q, q_ref.shape[1]))
    expect_shape("k tile", k_ref.shape, (block_kv, q_ref.shape[1]))
    expect_shape("v^T tile", vt_ref.shape, (q_ref.shape[1], block_kv))
    q_block, kv_step = pl.program_id(2), pl.program_id(3)
    num_kv_steps = pl.num_programs(3)
    step = _Step(info_ref, q_ref, k_ref, vt_ref, q_ids_ref, kv_ids_ref, m_ref, l_ref, acc_ref,
                 bad_ref, p_ref, block_q, block_kv_compute, kv_len, precision, mask)
    if mask is None:
        step.kv_block = kv_step
    else:
        step.which = which
        step.q_start = layout.q_offset(info_ref, which) + q_block * block_q
        step.kv_block = layout.kv_block(info_ref, q_block, kv_step, which)
    pl.when(kv_step == 0)(functools.partial(step.init, real_kv_blocks))
    if mask is None:
        step.static_ranges(static_kv_ranges(
            kv_len, BlockSizes(block_q, block_kv, block_kv_compute), real_kv_blocks,
            q_ids_ref is not None))
    else:
        step.masked_tiles(layout, q_block, kv_step, q_ids_ref is not None)
    pl.when(kv_step == num_kv_steps - 1)(functools.partial(step.finish, o_ref))


def _per_head_kernel(info_ref, index_ref, *refs, heads: int, **kwargs):
    """``_splash_kernel`` with ``HeadMasks``: ``index_ref`` (int32 (batch * heads,),
    scalar-prefetched) names the mask of this (batch, head), whose table rows it reads."""
    which = index_ref[pl.program_id(0) * heads + pl.program_id(1)]
    return _splash_kernel(info_ref, *refs, which=which, **kwargs)


# ---------------------------------------------------------------------------------------
# Describing calls (the dry-run estimator's hook)
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One kernel call as traced: what ``describe_calls`` hands its hook.

    Attributes:
        grid: (batch, heads, q blocks, kv steps).
        q_len, kv_len: the sequence lengths the kernel runs (kv_len after ``valid_kv_len``).
        head_dim: int; dtype: the inputs' dtype name ("bfloat16").
        block_sizes: the fitted ``BlockSizes``.
        mask: the ``Mask`` applied, ``HeadMasks`` (one of its masks per (batch, head), by
            the call's ``mask_index``), or None.
        segment_ids: the call compares segment ids.
        real_kv_blocks: leading kv blocks declared all real (``real_keys_before``).
        out_shape: ``jax.ShapeDtypeStruct`` of the output (batch, heads, q_len, head_dim).
    """

    grid: tuple[int, int, int, int]
    q_len: int
    kv_len: int
    head_dim: int
    dtype: str
    block_sizes: BlockSizes
    mask: Mask | None
    segment_ids: bool
    real_kv_blocks: int
    out_shape: jax.ShapeDtypeStruct


_CALL_HOOK: contextvars.ContextVar = contextvars.ContextVar("splash_call_hook", default=None)


@contextlib.contextmanager
def describe_calls(hook):
    """Within: every kernel call traced is first described to ``hook(call, inputs)``.

    Args:
        hook: ``f(call: KernelCall, inputs: tuple) -> jax.Array | None``; ``inputs`` are the
            kernel's array operands (q scaled, k, v^T (batch, heads, head_dim, kv_len),
            q ids (batch, 1, q_len) or None, kv ids (batch, kv_len, 128) or None, the
            ``HeadMasks`` index int32 (batch, heads) or None). A
            returned array (of ``call.out_shape``) replaces the kernel's output, and no
            Pallas kernel is built; None lets the kernel run.

    Trace-time state (a ``ContextVar``): it applies to what is traced inside the block.
    """
    token = _CALL_HOOK.set(hook)
    try:
        yield
    finally:
        _CALL_HOOK.reset(token)


# ---------------------------------------------------------------------------------------
# Building the call
# ---------------------------------------------------------------------------------------


def check_shapes(q, k, v) -> None:
    """Raise ``ValueError`` unless q is (B, H, Sq, D) and k, v are (B, H, Skv, D)."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"q, k, v: expected rank-4 (batch, heads, len, head_dim) arrays, "
            f"got shapes {q.shape}, {k.shape}, {v.shape}"
        )
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {k.shape}, got {v.shape}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k: expected (batch, heads, kv_len, head_dim) = "
            f"({q.shape[0]}, {q.shape[1]}, kv_len, {q.shape[3]}), got {k.shape}"
        )


def softmax_scale(head_dim: int, scale) -> float:
    """``scale``, or 1/sqrt(head_dim) for None (torch SDPA's default)."""
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def fold_scale(q, scale: float):
    """q * scale * log2(e), rounded once to q's dtype: the kernel's scores are base-2 logits.
    Under jit the multiply fuses into q's producer."""
    return (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)


def attendable_keys(segment_ids: SegmentIds) -> jax.Array:
    """(batch, kv_len) bool: the key's segment id occurs among the query ids."""

    def one(q_ids, kv_ids):
        sorted_q = jnp.sort(q_ids)
        idx = jnp.clip(jnp.searchsorted(sorted_q, kv_ids), 0, sorted_q.shape[0] - 1)
        return sorted_q[idx] == kv_ids

    return jax.vmap(one)(segment_ids.q, segment_ids.kv)


def smooth_keys(k, segment_ids: SegmentIds | None):
    """K minus its per-(batch, head) mean over real (attendable) keys, in K's dtype.

    Any constant vector would be exact for softmax; rounding the mean to K's dtype keeps
    ``k - mean`` exact (Sterbenz) wherever the shared component dominates K.
    """
    kf = k.astype(jnp.float32)
    if segment_ids is None:
        mean = jnp.mean(kf, axis=2, keepdims=True)
    else:
        w = attendable_keys(segment_ids).astype(jnp.float32)  # (B, S)
        total = jnp.einsum("bs,bhsd->bhd", w, kf, precision=lax.Precision.HIGHEST)
        count = jnp.maximum(jnp.sum(w, axis=1), 1.0)[:, None, None]
        mean = (total / count)[:, :, None, :]
    mean = mean.astype(k.dtype).astype(jnp.float32)
    return (kf - mean).astype(k.dtype)


def _checked_lengths(q, k, segment_ids, valid_kv_len, real_keys_before) -> int:
    """The kv length the kernel runs (``valid_kv_len`` or k's); raises on bad arguments."""
    batch, _, q_len, _ = q.shape
    kv_len = k.shape[2]
    if segment_ids is not None and (
        segment_ids.q.shape != (batch, q_len) or segment_ids.kv.shape != (batch, kv_len)
    ):
        raise ValueError(
            f"segment_ids: expected shapes {(batch, q_len)} and {(batch, kv_len)}, got "
            f"{segment_ids.q.shape} and {segment_ids.kv.shape}"
        )
    if int(real_keys_before) != real_keys_before or real_keys_before < 0:
        raise ValueError(f"real_keys_before: expected an int >= 0, got {real_keys_before!r}")
    if valid_kv_len is None:
        return kv_len
    if int(valid_kv_len) != valid_kv_len or not 1 <= valid_kv_len <= kv_len:
        raise ValueError(f"valid_kv_len: expected an int in [1, {kv_len}], "
                         f"got {valid_kv_len!r}")
    # From here on the keys end at valid_kv_len: blocks, grid and the tail mask; the arrays
    # stay as they are (their rows past it are never read, or masked).
    return int(valid_kv_len)


def _prefetch(mask, q_len, kv_len, bs, q_shard) -> tuple[jax.Array, InfoLayout]:
    """(the scalar-prefetch table for this call, its layout). ``q_shard`` = (index, count):
    q is shard ``index`` (traced) of ``count`` equal shards of the global sequence; every
    shard's table is built and the index picks one."""
    index, count = q_shard if q_shard is not None else (0, 1)
    offsets = tuple(s * q_len for s in range(count))
    num_q_blocks = -(-q_len // bs.block_q)
    rows = 1
    if mask is None:
        layout, table = InfoLayout(num_q_blocks), np.asarray(offsets, np.int32)[:, None]
    elif isinstance(mask, HeadMasks):  # every mask's rows, one after another
        info = build_head_mask_info(mask.masks, q_len, kv_len, bs, offsets)
        layout, table, rows = info.layout, info.table.reshape(count, -1), len(mask)
    else:
        info = build_mask_info(mask, q_len, kv_len, bs, offsets)
        layout, table = info.layout, info.table
    expect_shape("scalar-prefetch table", table.shape, (count, rows * layout.size))
    if count == 1:
        return jnp.asarray(table[0]), layout
    return jnp.asarray(table)[index], layout


def _specs(bs, head_dim, layout, mask, segmented, real_blocks, num_kv_blocks,
           heads: int) -> list:
    """BlockSpecs of (q, k, v^T, q ids, kv ids): kv blocks by step, or by the mask's table
    (``HeadMasks``: the rows of mask ``index[b * heads + h]``). Index maps take the grid
    indices and the scalar-prefetch refs (table[, index])."""
    bq, bkv = bs.block_q, bs.block_kv

    def kv_index(b, h, i, j, refs):
        if mask is None:
            return j
        which = refs[1][b * heads + h] if isinstance(mask, HeadMasks) else None
        return layout.kv_block(refs[0], i, j, which)

    specs = [
        pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, j, *refs: (b, h, i, 0)),
        pl.BlockSpec((None, None, bkv, head_dim),
                     lambda b, h, i, j, *refs: (b, h, kv_index(b, h, i, j, refs), 0)),
        pl.BlockSpec((None, None, head_dim, bkv),
                     lambda b, h, i, j, *refs: (b, h, 0, kv_index(b, h, i, j, refs))),
    ]
    if not segmented:
        return specs + [None, None]
    # All-real blocks read no kv ids: their steps keep the buffer of the first block that
    # may hold other ids (an unchanged block index is not fetched again), so kv ids cost no
    # DMA there either.
    first_mixed = min(real_blocks, num_kv_blocks - 1)

    def kv_ids_index(b, h, i, j, *refs):
        if real_blocks:
            return b, jnp.maximum(j, first_mixed), 0
        return b, kv_index(b, h, i, j, refs), 0

    return specs + [pl.BlockSpec((None, 1, bq), lambda b, h, i, j, *refs: (b, 0, i)),
                    pl.BlockSpec((None, bkv, NUM_LANES), kv_ids_index)]


def _segment_operands(segment_ids, batch, q_len, kv_len):
    """q ids as a lane row (batch, 1, q_len), kv ids broadcast over lanes (batch, kv_len,
    128): the layouts that broadcast against the (keys, queries) score tile without
    relayout."""
    if segment_ids is None:
        return None, None
    q_ids = segment_ids.q[:, None, :]
    expect_shape("q ids", q_ids.shape, (batch, 1, q_len))
    kv_ids = jnp.broadcast_to(segment_ids.kv[:, :, None], (batch, kv_len, NUM_LANES))
    return q_ids, kv_ids


def attention(q, k, v, options: AttentionOptions, *, scale=None, segment_ids=None,
              interpret: bool = False, q_shard=None, vmem_limit_bytes: int | None = None,
              real_keys_before: int = 0, valid_kv_len: int | None = None,
              q_scaled: bool = False, mask_index=None) -> jax.Array:
    """Softmax attention with our kernel (forward); ``splash_attention`` of the public face
    documents the arguments and their errors.

    Args:
        q: (batch, heads, q_len, head_dim) float32 or bfloat16; k, v: (batch, heads, kv_len,
            head_dim), cast to q's dtype.
        options: ``AttentionOptions`` (the only door: no shorthand keywords here).
        q_shard: None, or (index, count): q is shard ``index`` (int or traced int32) of
            ``count`` equal shards of the global query sequence, for the mask's positions.
        q_scaled: q is already ``fold_scale(q, scale)`` (the Ulysses layout scales q before
            its all-to-all, where the multiply fuses into q's producer).
        mask_index: with ``HeadMasks`` in ``options.mask``: int (batch, heads), which mask
            each (batch, head) runs (``splash.mask.check_mask_index``); else None.

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype.
    """
    check_shapes(q, k, v)
    batch, heads, q_len, head_dim = q.shape
    mask_index = check_mask_index(options.mask, mask_index, batch, heads)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    segment_ids = as_segment_ids(segment_ids)
    kv_len = _checked_lengths(q, k, segment_ids, valid_kv_len, real_keys_before)
    scale = softmax_scale(head_dim, scale)
    bs = blocks.fit_block_sizes(options.block_sizes, q_len, kv_len)
    real_blocks = 0  # leading kv blocks whose keys all have id REAL_SEGMENT_ID
    if segment_ids is not None and options.mask is None:
        real_blocks = real_kv_blocks(real_keys_before, kv_len, bs.block_kv)
    if options.k_smoothing:
        k = smooth_keys(k, segment_ids)
    # Fold scale*log2(e) into q once: the kernel's scores are base-2 logits. No padding:
    # partial last blocks are read with unspecified padding (masked or discarded in the
    # kernel), which saves HBM copies of q, k and v and a slice of the output.
    qs = q if q_scaled else fold_scale(q, scale)
    vt = jnp.swapaxes(v, 2, 3)  # (batch, heads, head_dim, kv_len): MXU-native P V
    expect_shape("v^T", vt.shape, (batch, heads, head_dim, k.shape[2]))
    q_ids, kv_ids = _segment_operands(segment_ids, batch, q_len, k.shape[2])
    info, layout = _prefetch(options.mask, q_len, kv_len, bs, q_shard)
    num_kv_blocks = -(-kv_len // bs.block_kv)
    steps = num_kv_blocks if options.mask is None else layout.num_kv_steps
    call = KernelCall(grid=(batch, heads, -(-q_len // bs.block_q), steps), q_len=q_len,
                      kv_len=kv_len, head_dim=head_dim, dtype=jnp.dtype(q.dtype).name,
                      block_sizes=bs, mask=options.mask, segment_ids=segment_ids is not None,
                      real_kv_blocks=real_blocks,
                      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype))
    hook = _CALL_HOOK.get()
    out = None if hook is None else hook(call, (qs, k, vt, q_ids, kv_ids, mask_index))
    if out is not None:
        return out
    return _pallas_call(call, layout, info, (qs, k, vt, q_ids, kv_ids), interpret=interpret,
                        vmem_limit_bytes=vmem_limit_bytes, mask_index=mask_index)


def _pallas_call(call: KernelCall, layout: InfoLayout, info, inputs, *, interpret: bool,
                 vmem_limit_bytes: int | None, mask_index=None) -> jax.Array:
    """The ``pallas_call`` of ``call`` over ``inputs`` (``attention``'s operands); with
    ``HeadMasks``, ``mask_index`` (int32 (batch, heads)) is a second scalar prefetch."""
    bs, (batch, heads, num_q_blocks, num_kv_steps) = call.block_sizes, call.grid
    bq, bkv, head_dim = bs.block_q, bs.block_kv, call.head_dim
    dtype = call.out_shape.dtype
    body, prefetch = _splash_kernel, (info,)
    if mask_index is not None:
        body = functools.partial(_per_head_kernel, heads=heads)
        prefetch = (info, mask_index.reshape(batch * heads))
    kernel = functools.partial(
        body, block_q=bq, block_kv=bkv, block_kv_compute=bs.block_kv_compute,
        kv_len=call.kv_len, precision=lax.Precision.HIGHEST if dtype == jnp.float32 else None,
        real_kv_blocks=call.real_kv_blocks, mask=call.mask,
        layout=None if call.mask is None else layout)
    itemsize = jnp.dtype(dtype).itemsize
    q_pad = num_q_blocks * bq
    cost = pl.CostEstimate(
        flops=4 * batch * heads * q_pad * num_kv_steps * bkv * head_dim,
        transcendentals=batch * heads * q_pad * num_kv_steps * bkv,
        bytes_accessed=itemsize * batch * heads * head_dim
        * (2 * q_pad + 2 * num_q_blocks * num_kv_steps * bkv),
    )
    if vmem_limit_bytes is None:
        vmem_limit_bytes = blocks.vmem_limit_bytes(bs, head_dim, itemsize,
                                                   blocks.vmem_capacity_bytes())
    return pl.pallas_call(
        kernel,
        out_shape=call.out_shape,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch),
            grid=call.grid,
            in_specs=_specs(bs, head_dim, layout, call.mask, call.segment_ids,
                            call.real_kv_blocks, -(-call.kv_len // bkv), heads),
            out_specs=pl.BlockSpec((None, None, bq, head_dim),
                                   lambda b, h, i, j, *refs: (b, h, i, 0)),
            scratch_shapes=[
                pltpu.VMEM((1, bq), jnp.float32),  # shift m (base 2, stale running max)
                pltpu.VMEM((1, bq), jnp.float32),  # running denominator l
                pltpu.VMEM((head_dim, bq), jnp.float32),  # acc^T
                # 1.0: sub-tile c rejected the column (lazy shift)
                pltpu.VMEM((bkv // bs.block_kv_compute, 1, bq), jnp.float32),
                pltpu.VMEM((bs.block_kv_compute, bq), dtype),  # P^T of the pending P V
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=vmem_limit_bytes,
        ),
        cost_estimate=cost,
        interpret=interpret,
        name=KERNEL_NAME,
    )(*prefetch, *inputs)
