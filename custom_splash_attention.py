"""Attention for Wan 2.1 on JAX: a Pallas TPU flash-attention kernel and the SDPA override.

This module owns the route that every ``torch.nn.functional.scaled_dot_product_attention``
call of the diffusers Wan transformer takes once torchax runs it on JAX.

Public API:

* ``splash_attention(q, k, v, *, ...)``: Pallas TPU flash-attention forward kernel.
* ``sharded_splash_attention(q, k, v, *, mesh, ...)``: the same kernel under ``jax.shard_map``
  on a ("dp", "tp", "sp") mesh.
* ``BlockSizes``: the kernel's tile sizes; ``SegmentIds``: optional segment ids.
* ``reference_attention(...)``: float32 softmax attention, the numerical reference.
* ``xla_attention(q, k, v, *, scale=None)``: plain XLA softmax attention.
* ``install_sdpa_override(env, *, attention, ...)``: route torch SDPA in a torchax
  environment to ``attention`` ("xla" or "splash").
* ``default_attention_backend()``: "splash" on TPU, "xla" elsewhere.

Algorithm
---------
Online-softmax ("flash") attention after FlashAttention-2 (Dao 2023, arXiv:2307.08691) and
JAX's Pallas splash kernel (``jax/experimental/pallas/ops/tpu/splash_attention``): the keys
are visited in tiles; each query keeps a shift ``m``, a running denominator ``l`` and an
unnormalised output ``acc``; when the shift moves from ``m`` to ``m'`` the old ``l`` and
``acc`` are rescaled by ``2^(m - m')``; the output is ``acc / l``. Unlike textbook flash
attention the shift is a *stale* running maximum ("lazy rescale", see Design): any shift
shared by ``l`` and ``acc`` gives the same ``acc / l``, so it only has to keep
``2^(x - m)`` from overflowing.

The softmax runs in base 2. ``scale * log2(e)`` is folded into ``q`` once, outside the
kernel, so the kernel's scores are ``x = s * log2(e)`` for the true logits ``s`` and every
exponential is an ``exp2``. That is exact: ``2^(s log2 e) = e^s``, so
``2^(x_j - m) / sum_i 2^(x_i - m) = e^(s_j) / sum_i e^(s_i)`` for any shift ``m`` (the
max-shift cancels between numerator and denominator). It saves one multiply per score
(an ``exp`` is itself evaluated as ``2^(x log2 e)`` by base-2 exponential units), and the
single rounding of ``q * scale * log2(e)`` to q's dtype moves each query's scores by a
relative 2^-9 (bf16) at most; a shared component of that error is a per-row constant,
which softmax cancels.

Design
------
* Grid ``(batch, heads, q_blocks, kv_blocks)``; the first three are "parallel", the KV axis
  is the sequential ("arbitrary") reduction axis. Each step loads a ``(block_q, head_dim)``
  tile of Q and a ``(block_kv, head_dim)`` tile of K and V, and loops over the
  ``block_kv // block_kv_compute`` sub-tiles (11 at the defaults), unrolled up to
  ``_UNROLL_MAX_TILES`` into one branch-free basic block (a rolled loop beyond), so
  ``block_kv`` sets the DMA size and ``block_kv_compute`` the size of the live score tile.
  Each tile's ``P V`` is issued after the next tile's scores, from a bf16 P^T scratch
  (software pipelining), so the MXU does not wait for the exp2.
* Scores are computed transposed, ``S^T = K Q^T`` of shape ``(block_kv_compute, block_q)``:
  keys run along sublanes and queries along the 128 lanes, so the softmax max/sum
  reductions over keys are element-wise across vregs plus one 8-sublane reduce (no
  cross-lane XLU reductions), and the per-query statistics are ``(1, block_q)`` rows that
  broadcast over sublanes for free. The output accumulates as ``acc^T = V^T P^T`` of shape
  ``(head_dim, block_q)``; V is handed to the kernel pre-transposed as
  ``(batch, heads, head_dim, kv_len)`` (one cheap XLA transpose, O(S D), against the
  O(S^2 D) attention) so both matmuls are MXU-native (NT and NN). The last KV step
  transposes ``acc`` in VMEM and writes ``(block_q, head_dim)``, so no transpose of the
  output is needed outside.
* Lazy shift (issue #12 item 2). The textbook update needs the tile's max before its
  exp2, i.e. a max pass over the whole f32 score tile, which Mosaic spills to VMEM between
  passes (at 256 x 3328 the v6e loop was store-slot bound: 2,280 vector stores, 3,645
  loads and 836 exp2 in 2,239 bundles per sub-tile, MXU use 33%). Here a sub-tile computes
  ``p = 2^(x - m)`` with the shift ``m`` it already has, then ``l_tile = sum(p)``, and
  accepts the tile for every query column with ``l_tile <= 2^64`` (so every ``p <= 2^64``:
  finite in f32 and bf16, and ``l`` stays below 2^64 x keys): ``l += l_tile``,
  ``acc += V^T P^T``. No max, no alpha, no rescale of ``acc`` on this path, and the
  acceptance test is on ``l_tile``, which the sum already produces. Columns over the bound
  (``inf`` included) keep their state, are flagged per sub-tile in a
  (num_sub, 1, block_q) scratch, and are redone after the step's last ``P V`` under one
  ``pl.when`` with the exact update (``m' = max(m, max x)``, rescale by ``2^(m - m')``).
  The shift starts at the max of each query's first 16 keys (``_init``), so the redo
  runs only when a query's max jumps by about 64 (base 2; ~44 nats) over its shift (rare;
  or a query with no valid key among the first 16). ``>`` is False for NaN, so garbage
  query columns of a partial last q block never trigger it. The static profile barely
  charges the rare branch; benchmarks/kernel_cycles_results.md has the fast path's
  bundles. Exactness: as for any flash kernel,
  the result is ``sum 2^(x - m) v / sum 2^(x - m)`` for a per-query ``m`` shared by both
  sums; a stale ``m`` only makes the probabilities larger (never underflowing more than
  the exact shift would), and f32 and bf16 keep the same relative precision at any
  exponent.
* Sub-tile size. With the max pass gone, larger ``block_kv_compute`` amortises the
  per-sub-tile MXU fill/drain; 1536 overflows VMEM. On the 720p grid (23 q blocks x 25
  kv steps per head) ``BlockSizes(3328, 3072, 1024)`` comes to 17,363 cycles per grid step
  on v6e, 57.5% MXU use (the lazy shift alone at 256 keys: 45%; the textbook kernel: 33%),
  by libtpu's static profile through ``engine.dry_run.estimate.kernel_cost`` (an estimate, not a
  TPU measurement). The remaining v6e limit is the MXU result pops (one per bundle: S^T in
  f32 plus four passes of V^T P^T cap MXU use near 67% at head_dim 128) and the VMEM spill
  traffic of the f32 score tile between the pops and the exp2. Splitting the q block into
  lane chunks to keep it in registers made the loop latency bound instead (3-7x slower).
* Precision: bf16 Q/K/V feed the MXU as bf16 with f32 accumulation; the probabilities are
  cast to bf16 for ``P V`` (bf16 x bf16 -> f32), while ``m``, ``l`` and ``acc`` stay f32.
  f32 inputs use f32 matmuls at ``Precision.HIGHEST``. The output is cast to q.dtype.
* Any length, no padding copies: the grid is ``ceil(len / block)`` and Pallas hands the
  kernel partial last blocks whose out-of-range part holds unspecified values (NaN in
  interpret mode, which the tests exploit); out-of-range output rows are discarded on
  write. Out-of-range ("padded") keys are masked exactly, and only where they are: they
  never span more than the last KV block, whose sub-tiles wholly past ``kv_len`` are
  skipped statically and whose one straddling sub-tile gets an iota mask on the scores
  and zeroes V's garbage columns (``0 * NaN`` would poison ``acc``). Every other tile runs
  unmasked. Out-of-range queries only touch their own score columns and output rows.
  (A known port zero-padded K without a mask, which skews outputs by up to 3%.)
* Masked scores are set to ``-inf`` while the shift starts at a finite floor, so
  ``2^(-inf - m) = 0`` with no NaN, and a query whose keys are all masked ends with
  ``l = 0``; the final normalisation maps that row to zeros. (A query's first real key
  gives ``2^(x - floor) = inf``, which sends that tile to the exact redo.)
* ``segment_ids``: a query attends only to keys with the same id (per-batch int32 ids).
  ``real_keys_before=P`` classifies kv blocks statically (as the ``MaskInfo`` of JAX's
  splash kernel does): blocks wholly before P, whose keys the caller promises all have id
  ``REAL_SEGMENT_ID``, read no kv ids and mask no score; a query of another id is skipped
  there by a (1, block_q) column select, folded into the lazy shift's acceptance. Blocks
  from P on compare ids per key. The class is a branch on the kv grid index, never on
  data, so the static profile charges each class's code (issue #26).
* ``window_size=w``: local attention, query position ``i`` attends key position ``j`` iff
  ``|i - j| <= w`` (symmetric, positions in the unpadded sequences; intended for
  self-attention). The KV grid axis shrinks to the blocks that can intersect a q block's
  window (the index map slides it), and sub-tiles outside the window are skipped.
* ``k_smoothing``: K minus its mean over the real keys (per batch and head) before the
  kernel, the K smoothing of SageAttention (Zhang et al. 2024,
  arXiv:2410.02367). Each query's scores shift by the constant ``q . mean``, which softmax
  cancels exactly. With ``segment_ids`` the mean is over keys whose id some query has, so
  padding marked by its own id does not move it. The mean is rounded to K's dtype first,
  so that when a shared component dominates K the subtraction is (nearly) exact. Measured
  effect here (bf16, float64 reference, 3 seeds, shared offsets 0/8/64/512): no gain, RMS
  error 2.8e-4 without and 2.8-3.2e-4 with, max error within bf16 resolution either way.
  Scores are exact bf16 x bf16 products summed in f32, and the rounding of
  ``q * scale`` against a shared K component is a per-row constant that softmax cancels,
  so there is nothing for smoothing to remove; it pays off for kernels that quantise K
  (int8/fp8 scores). Off by default.

Block sizes
-----------
``BlockSizes()`` defaults to ``block_q=3328, block_kv=2816, block_kv_compute=256``, the
sizes a public Wan 2.1 port tuned on v6e for head_dim 128 at 75,600 tokens, for chips with
no entry of their own. ``DEFAULT_BLOCK_SIZES`` holds the per-generation defaults that
``generate_flax.py`` takes from the device kind (or the dry run's topology), chosen by the
static-profile sweep of ``benchmarks/kernel_cycles.py --sweep``. Sizes are upper
bounds: for a sequence of length ``n`` the kernel keeps the number of blocks
``ceil(n / block)`` and shrinks each block to the smallest aligned size that covers ``n``
(this shortens the ragged tail; at 75,600 tokens it reproduces 3328, 2816 and 3072
exactly), and short sequences clamp all blocks to the sequence rounded up to 128. At
3328/2816/256 Mosaic needs 8.9 MiB of scoped VMEM (bisected with deviceless v6e compiles);
the kernel requests a limit sized from the blocks (``_vmem_limit_bytes``), at most 100 MiB
and at most 3/4 of the chip's VMEM (48 MiB on tpu7x and v5p, which have 64 MiB).
3328/3072/1024 compiles deviceless for v5e, v6e and tpu7x (within that 48 MiB) at the
720p per-chip shape. With libtpu's static-profile flag set, the flag's own VMEM grows with
the grid beside the scoped request (~0.25 MiB per step at these blocks: with the 91 MiB
request a 1 x 8 grid needs 130.4 of 127.9 MiB), so profiles stay on small grids and request
less (``vmem_limit_bytes``).

Cross-attention
---------------
Wan's cross-attention has 75,600 queries against 512 text keys. The kernel handles it
(one KV block of 512, two 256-key sub-tiles, no masking), and it is the route used, by
compiler evidence: deviceless TPU compiles of Wan 14B cross-attention (B=2, 40 heads,
head_dim 128, bf16, mesh dp=2 x tp=4, ``tests/test_tpu_compile.py``) give per chip, on
both v5e and v6e:

=========  ============  ==================  ========================
path       temporaries   HBM bytes accessed  HLO flops
=========  ============  ==================  ========================
kernel     184.6 MiB     0.85 GB             2.01e11
XLA        1476.7 MiB    5.07 GB             2.01e11 (v6e 2.02e11)
=========  ============  ==================  ========================

XLA materialises the f32 ``(q_len, 512)`` scores of all 10 local heads in HBM (1477 MiB,
8x the output); the kernel keeps them in VMEM and reads 6x fewer bytes for the same
FLOPs. Its one temporary is ``q * scale * log2(e)``, which fuses into q's producer when
the whole transformer is jitted.

Sharding
--------
``sharded_splash_attention`` takes (B, H, S, D) arrays laid out as the Wan transformer
produces them: batch over mesh axis "dp" and heads over "tp" (Megatron column-parallel
QKV). With sequence parallelism ("sp" > 1) it runs head-parallel attention, heads over
("tp", "sp"), when ``heads % (tp * sp) == 0`` (XLA inserts the all-to-all from a
sequence-sharded layout); otherwise it shards q's sequence over "sp" and keeps the full K
and V on every device. Either way each device runs the unsharded kernel on its shard.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

ATTENTION_BACKENDS = ("xla", "splash", "stock_splash")
# The Pallas call's name: what profiles and HLO dumps show (engine.dry_run.estimate finds the
# kernel's cycles by it). Family-neutral: the kernel serves every model family.
KERNEL_NAME = "exp2_splash_attention"
# Kernels the Splash wrapper can run: ours, and JAX's own splash kernel as the trusted fallback.
SPLASH_KERNELS = ("splash", "stock_splash")

LOG2_E = math.log2(math.e)
NUM_LANES = 128
NUM_SUBLANES = 8
# Start value of the running max. Finite (unlike the -inf used for masked scores) so that
# a row that has seen only masked keys computes 2^(-inf - floor) = 0 instead of
# 2^(-inf + inf) = NaN. Any valid score is far above it, so it never wins a max.
_M_FLOOR = -0.5 * float(np.finfo(np.float32).max)
# lax.dot_general dimension numbers: A @ B and A @ B^T.
_NN = (((1,), (0,)), ((), ()))
# Lazy shift: 2^(s - m) for a stale m is accepted while a tile's column sum is <= 2^64.
_LAZY_LOG2_BOUND = 64
_LAZY_BOUND = float(2**_LAZY_LOG2_BOUND)
_NT = (((1,), (1,)), ((), ()))
# Sub-tiles per grid step that are unrolled (more: a rolled loop, for compile time).
_UNROLL_MAX_TILES = 16
# The segment id of real tokens where the SDPA override builds ids from a key-padding mask
# (padding: 0). ``real_keys_before`` promises that keys before it carry this id.
REAL_SEGMENT_ID = 1


def default_attention_backend() -> str:
    """Return "splash" when JAX's default backend is a TPU, else "xla"."""
    return "splash" if jax.default_backend() == "tpu" else "xla"


# ---------------------------------------------------------------------------------------
# Block sizes and segment ids
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the splash kernel, in tokens.

    Attributes:
        block_q: queries per grid step; a multiple of 128 (queries run along the lanes
            of the transposed score tile).
        block_kv: keys per grid step (one DMA of K and V); a multiple of
            ``block_kv_compute``.
        block_kv_compute: keys per score tile inside a step; a multiple of 128 (keys
            index the lanes of the transposed V tile).

    The sizes are upper bounds; see ``splash_attention`` for how they are fitted to a
    sequence. Defaults come from a public v6e tuning of a Wan 2.1 port at head_dim 128
    and 75,600 tokens. With the lazy shift, v6e is faster at ``BlockSizes(3328, 3072, 1024)``
    (static-profile estimate at 720p: 57.5% MXU use against 52.3%) and v5e at these
    (96.4% against 86.2%); ``default_block_sizes`` picks per chip.

    Raises:
        BlockSizesError: (a ``ValueError``) a size is not a positive multiple of 128, or
            ``block_kv`` is not a multiple of ``block_kv_compute``; it names the field.
    """

    block_q: int = 3328
    block_kv: int = 2816
    block_kv_compute: int = 256

    def __post_init__(self):
        for name in ("block_q", "block_kv", "block_kv_compute"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BlockSizesError(name, "a positive int", value)
            if value % NUM_LANES:
                raise BlockSizesError(name, f"a multiple of {NUM_LANES}", value)
        if self.block_kv % self.block_kv_compute:
            raise BlockSizesError("block_kv", "a multiple of block_kv_compute="
                                  f"{self.block_kv_compute}", self.block_kv)


class BlockSizesError(ValueError):
    """A ``BlockSizes`` field breaks a rule: "BlockSizes.<field>: expected <rule>, got <value>".

    Attributes:
        field: the offending field's name ("block_q", "block_kv" or "block_kv_compute").
        expected: the rule, as a phrase ("a multiple of 128").
        value: the rejected value.
    """

    def __init__(self, field: str, expected: str, value):
        super().__init__(f"BlockSizes.{field}: expected {expected}, got {value!r}")
        self.field, self.expected, self.value = field, expected, value


# Default blocks per TPU generation (libtpu's topology prefix, as ``engine.run.chips`` names
# it), for head_dim 128. Chosen by ``benchmarks/kernel_cycles.py --sweep``: the fewest
# estimated cycles (libtpu 0.0.42.1's static profile, deviceless; not measured on a TPU) for
# Chosen on Wan's 720p self-attention (75,600 tokens, head_dim 128) by libtpu's static
# profile through ``benchmarks/kernel_cycles.py`` (estimates; benchmarks/kernel_cycles_results.md).
# v6e: 4864/2048/1024 (fitted 4736/2048/1024) takes 9.32 M cycles per head against 9.98 M at
# the earlier 3328/3072/1024 (-6.6%; maxdiffusion's 9472/1024/512 on our kernel: 9.45 M).
# v5e, MXU-bound already: the port's 3328/2816/256 (96.4% MXU use). tpu7x (libtpu 0.0.51, one
# TensorCore of 64 MiB VMEM): 3328/2048/1024 takes 9.13 M against 9.26-9.41 M for four other
# candidates; 3328/3072/1024 overflows VMEM under the profile flag. Other generations (v4,
# v5p) take ``BlockSizes()``.
DEFAULT_BLOCK_SIZES: dict[str, BlockSizes] = {
    "v5e": BlockSizes(3328, 2816, 256),
    "v6e": BlockSizes(4864, 2048, 1024),
    "tpu7x": BlockSizes(3328, 2048, 1024),
}


def default_block_sizes(chip: str | None = None) -> BlockSizes:
    """The default ``BlockSizes`` of a chip generation ("v5e", "v6e", "tpu7x", ...; None or
    an unlisted name: ``BlockSizes()``)."""
    return DEFAULT_BLOCK_SIZES.get(chip, BlockSizes())


@dataclasses.dataclass(frozen=True)
class LocalMask:
    """Local self-attention: query position ``i`` attends key position ``j`` iff
    ``|i - j| <= window_size`` (symmetric; positions in the unpadded q and kv sequences).

    The kernel shrinks its kv grid axis to the blocks a q block's window can reach (a
    scalar-prefetched index map), so skipped blocks are absent from the grid. As in JAX's
    splash kernel (``LocalMask``), a mask is a value, the same for every head.

    Raises:
        ValueError: ``window_size`` is not an int >= 0.
    """

    window_size: int

    def __post_init__(self):
        w = self.window_size
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 0:
            raise ValueError(f"window_size: expected None or an int >= 0, got {w!r}")
        object.__setattr__(self, "window_size", int(w))

    def dense(self, q_len: int, kv_len: int) -> jax.Array:
        """(q_len, kv_len) bool: True where the mask lets query i attend key j (the XLA and
        reference paths)."""
        return _band_mask(q_len, kv_len, self.window_size)


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How our kernel runs a model's attention: one frozen value, built once from the run's
    flags and passed down whole (the SDPA override, the sharded wrapper, the kernel).

    Attributes:
        block_sizes: the kernel's tiles (``BlockSizes``).
        k_smoothing: subtract K's mean over real keys first (exact for softmax; see the
            module docstring).
        mask: None (every key) or a mask value (``LocalMask``): applied to self-attention
            (q_len == kv_len) only; cross-attention always sees every key.
    """

    block_sizes: BlockSizes = BlockSizes()
    k_smoothing: bool = False
    mask: LocalMask | None = None

    @property
    def window_size(self) -> int | None:
        """The local window's half-width, or None without a ``LocalMask``."""
        return self.mask.window_size if isinstance(self.mask, LocalMask) else None

    @property
    def is_plain(self) -> bool:
        """No option beyond the blocks: what JAX's stock kernel can run."""
        return not self.k_smoothing and self.mask is None


def attention_options(options: AttentionOptions | None = None, *,
                      block_sizes: BlockSizes | None = None, window_size: int | None = None,
                      k_smoothing: bool = False) -> AttentionOptions:
    """``options``, or the value the shorthand keywords describe (``window_size`` becomes a
    ``LocalMask``). The public entries accept either, never both.

    Raises:
        ValueError: both ``options`` and a shorthand; a bad ``window_size``.
    """
    shorthand = block_sizes is not None or window_size is not None or k_smoothing
    if options is not None:
        if shorthand:
            raise ValueError("options: expected either options or block_sizes/window_size/"
                             "k_smoothing, got both")
        return options
    return AttentionOptions(block_sizes=block_sizes or BlockSizes(), k_smoothing=k_smoothing,
                            mask=None if window_size is None else LocalMask(window_size))


class SegmentIds(NamedTuple):
    """Segment ids: a query attends only to keys with the same id.

    Attributes:
        q: int32 (batch, q_len).
        kv: int32 (batch, kv_len).
    """

    q: jax.Array
    kv: jax.Array


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _fit_block(length: int, block: int, align: int) -> int:
    """Smallest multiple of ``align`` that covers ``length`` in ceil(length/block) blocks."""
    num_blocks = -(-length // block)
    return _round_up(-(-length // num_blocks), align)


def _fit_block_sizes(block_sizes: BlockSizes, q_len: int, kv_len: int) -> BlockSizes:
    """Fit block sizes to the sequences: same block count, least padding, clamped."""
    block_q = _fit_block(q_len, block_sizes.block_q, NUM_LANES)
    block_kv_compute = min(block_sizes.block_kv_compute, _round_up(kv_len, NUM_LANES))
    block_kv = _fit_block(kv_len, block_sizes.block_kv, block_kv_compute)
    return BlockSizes(block_q, block_kv, block_kv_compute)


def _vmem_limit_bytes(bs: BlockSizes, head_dim: int, itemsize: int,
                      capacity: int | None = None, *, margin: int = 2) -> int:
    """Scoped VMEM to request from Mosaic: ``_vmem_need_bytes`` x ``margin`` (2 for runs;
    ``engine.dry_run.estimate`` profiles take 1, leaving room for the profile flag's buffers).

    Mosaic's actual need, bisected with deviceless v6e compiles at head_dim 128 and bf16,
    is 8.9 MiB at the default blocks (3328, 2816, 256), 15.3 MiB at (3328, 3072, 512) and
    18.7 MiB at (6656, 2816, 256); this estimate is 1.5-2x those. The request is floored at
    32 MiB (v6e's default scoped limit; v5e's is 16 MiB) and capped at 100 MiB, below the
    128 MiB of VMEM on v5e and v6e, and at 3/4 of ``capacity`` (the chip's VMEM per core,
    bytes; ``None`` when unknown): v7x and v5p have 64 MiB, under the 91 MiB that
    (3328, 3072, 1024) asks for. A deviceless compile does not refuse a limit above the
    chip's VMEM, so the cap is ours; the quarter left is XLA's own headroom, a guess. At
    (3328, 3072, 1024) a deviceless tpu7x compile at 20,000 tokens fails at 16 MiB and
    passes at 32 MiB, within the 48 MiB cap.
    """
    limit = min(max(margin * _vmem_need_bytes(bs, head_dim, itemsize), 32 << 20), 100 << 20)
    if capacity:
        limit = min(limit, capacity * 3 // 4)
    return int(limit)


def _vmem_need_bytes(bs: BlockSizes, head_dim: int, itemsize: int) -> int:
    """An upper estimate of the kernel's VMEM need, bytes (1.5-2x Mosaic's actual need)."""
    d = _round_up(head_dim, NUM_LANES)
    buffers = 2 * itemsize * d * (2 * bs.block_q + 2 * bs.block_kv)  # Q, O, K, V^T x2
    ids = 2 * 4 * NUM_LANES * (NUM_SUBLANES + bs.block_kv)  # segment ids x2
    num_sub = bs.block_kv // bs.block_kv_compute
    # acc^T, its transpose, m, l, the per-sub-tile rejection flags
    scratch = 4 * bs.block_q * (2 * d + (2 + num_sub) * NUM_SUBLANES)
    tiles = 2 * 4 * bs.block_kv_compute * bs.block_q  # f32 scores and probabilities
    tiles += itemsize * bs.block_kv_compute * bs.block_q  # P^T scratch of the pending P V
    return buffers + ids + scratch + tiles


def _vmem_capacity_bytes() -> int | None:
    """VMEM per TensorCore of the chip being compiled for, or None off TPU.

    Pallas reads the chip from the abstract mesh under ``shard_map`` (so a deviceless
    compile for a topology sees that topology's chip), else from the default device.
    """
    try:
        return pltpu.get_tpu_info().vmem_capacity_bytes
    except (ValueError, RuntimeError, NotImplementedError):  # CPU, interpret mode, unknown
        return None


# ---------------------------------------------------------------------------------------
# The Pallas kernel
# ---------------------------------------------------------------------------------------


def _splash_kernel(
    # Scalar prefetch
    q_offset_ref,
    # Inputs
    q_ref,
    k_ref,
    vt_ref,
    q_ids_ref,
    kv_ids_ref,
    # Outputs
    o_ref,
    # Scratch
    m_ref,
    l_ref,
    acc_ref,
    bad_ref,
    p_ref,
    *,
    block_q: int,
    block_kv: int,
    block_kv_compute: int,
    kv_len: int,
    num_kv_blocks: int,
    window_size: int | None,
    precision,
    real_kv_blocks: int = 0,
):
    """One (batch, head, q block, kv step) grid step; see the module docstring.

    Refs: q (block_q, D) pre-scaled by scale*log2(e); k (block_kv, D); vt (D, block_kv);
    q_ids (1, block_q) and kv_ids (block_kv, 128) int32 or None; o (block_q, D);
    m (the shift, a stale running max), l (1, block_q) f32; acc (D, block_q) f32; bad
    (num_sub, 1, block_q) f32, 1.0 where sub-tile c rejected a column (lazy shift, see the
    module docstring); p (block_kv_compute, block_q) in V's dtype, the probabilities of
    the sub-tile whose P V is pending. Rows of the last q block and keys of the last kv
    block that lie past the arrays' ends hold unspecified values (Pallas pads partial
    blocks with garbage, NaN in interpret mode): garbage queries only touch their own
    score columns and output rows, which Pallas discards on write; garbage keys are
    masked out of the scores and zeroed in V.

    ``real_kv_blocks`` (static, with segment ids): the first ``real_kv_blocks`` kv blocks
    hold only keys of id ``REAL_SEGMENT_ID``, so there a query attends every key iff its
    own id is ``REAL_SEGMENT_ID``: those steps read no kv ids and mask no score, they only
    skip the other query columns (mask kind "qsegment": a (1, block_q) select on l and acc,
    folded into the lazy shift's per-column acceptance). Later blocks compare ids per key.
    """
    q_block, kv_step = pl.program_id(2), pl.program_id(3)
    num_kv_steps = pl.num_programs(3)
    num_sub = block_kv // block_kv_compute
    base_masks = ("segment",) if q_ids_ref is not None else ()

    q_start = q_offset_ref[0] + q_block * block_q  # global position of the first query
    if window_size is None:
        kv_block = kv_step
    else:
        kv_block = _window_kv_block(
            q_start, kv_step, block_q, block_kv, num_kv_blocks, num_kv_steps, window_size
        )

    def keys_of(c):
        return pl.ds(pl.multiple_of(c * block_kv_compute, block_kv_compute), block_kv_compute)

    def key_positions(c, shape, dim):
        return kv_block * block_kv + c * block_kv_compute + lax.broadcasted_iota(
            jnp.int32, shape, dim
        )

    def scores(c, mask_kinds: tuple[str, ...]):
        """Masked S^T = K Q^T of sub-tile ``c``: (block_kv_compute, block_q), keys along
        sublanes."""
        keys = keys_of(c)
        s = lax.dot_general(
            k_ref[keys, :], q_ref[...], _NT, precision=precision, preferred_element_type=jnp.float32
        )
        if mask_kinds:
            k_pos = key_positions(c, s.shape, 0)
            conditions = []
            if "tail" in mask_kinds:
                conditions.append(k_pos < kv_len)
            if "segment" in mask_kinds:
                conditions.append(kv_ids_ref[keys, :1] == q_ids_ref[...])
            if "window" in mask_kinds:
                q_pos = q_start + lax.broadcasted_iota(jnp.int32, s.shape, 1)
                conditions.append(jnp.abs(q_pos - k_pos) <= window_size)
            if conditions:  # "qsegment" masks columns later, not scores
                s = jnp.where(functools.reduce(jnp.logical_and, conditions), s, -jnp.inf)
        return s

    def values(c, mask_kinds: tuple[str, ...]):
        """V^T of sub-tile ``c``: (head_dim, block_kv_compute)."""
        vt = vt_ref[:, keys_of(c)]
        if "tail" in mask_kinds:
            # Keys past kv_len are garbage: 0 * NaN would poison acc through P V.
            vt = jnp.where(key_positions(c, vt.shape, 1) < kv_len, vt, jnp.zeros_like(vt))
        return vt

    def pv(vt, p):
        # acc^T += V^T P^T: (head_dim, block_q). Probabilities in V's dtype (bf16 x bf16
        # on the MXU for bf16 inputs), f32 accumulation.
        return lax.dot_general(
            vt, p.astype(vt.dtype), _NN, precision=precision, preferred_element_type=jnp.float32
        )

    @pl.when(kv_step == 0)
    def _init():
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if window_size is None:
            # Start the shift at the max over the first 16 keys (masked like any tile),
            # so the first step is accepted by the fast path: any shift is exact, it
            # only has to keep 2^(x - m) finite (see the module docstring).
            n0 = 2 * NUM_SUBLANES
            s0 = lax.dot_general(
                k_ref[:n0, :], q_ref[...], _NT, precision=precision,
                preferred_element_type=jnp.float32,
            )
            ok = lax.broadcasted_iota(jnp.int32, s0.shape, 0) < kv_len
            if q_ids_ref is not None and real_kv_blocks:  # block 0 is all real
                ok = jnp.logical_and(ok, q_ids_ref[...] == REAL_SEGMENT_ID)
            elif q_ids_ref is not None:
                ok = jnp.logical_and(ok, kv_ids_ref[:n0, :1] == q_ids_ref[...])
            s0 = jnp.where(ok, s0, -jnp.inf)
            m_ref[...] = jnp.maximum(jnp.max(s0, axis=0, keepdims=True), _M_FLOOR)
        else:
            m_ref[...] = jnp.full(m_ref.shape, _M_FLOOR, jnp.float32)

    def exact_update(c, mask_kinds, cols):
        """The textbook flash update of sub-tile ``c`` for the columns ``cols`` only:
        m' = max(m, max s), rescale l and acc by 2^(m - m'), add the tile."""
        s = scores(c, mask_kinds)
        m_prev = m_ref[...]
        m_next = jnp.where(cols, jnp.maximum(m_prev, jnp.max(s, axis=0, keepdims=True)), m_prev)
        p = jnp.exp2(s - m_next)
        alpha = jnp.exp2(m_prev - m_next)
        l_ref[...] = jnp.where(cols, alpha * l_ref[...] + jnp.sum(p, axis=0, keepdims=True),
                               l_ref[...])
        acc_ref[...] = jnp.where(
            cols, alpha * acc_ref[...] + pv(values(c, mask_kinds), p), acc_ref[...]
        )
        m_ref[...] = m_next

    def lazy_scores(c, mask_kinds, m):
        """Fast path, first half: p = 2^(s - m) with the stale shift m (no max pass),
        accepted per column when l_tile = sum(p) <= 2^_LAZY_LOG2_BOUND (so every p is
        finite). Accepted columns add l_tile to l; p goes to the scratch for P V. ``>``
        is False for NaN, so garbage query columns never count as rejected."""
        p = jnp.exp2(scores(c, mask_kinds) - m)
        l_tile = jnp.sum(p, axis=0, keepdims=True)
        bad = l_tile > _LAZY_BOUND
        if "qsegment" in mask_kinds:
            # All-real block: a query of another id attends none of its keys. Its column
            # is skipped (-1.0: neither added nor redone), whatever p holds there.
            skip = q_ids_ref[...] != REAL_SEGMENT_ID
            bad_ref[c] = jnp.where(skip, -1.0, bad.astype(jnp.float32))
            bad = jnp.logical_or(bad, skip)
        else:
            bad_ref[c] = bad.astype(jnp.float32)
        l_ref[...] = jnp.where(bad, l_ref[...], l_ref[...] + l_tile)
        p_ref[...] = p.astype(p_ref.dtype)

    def lazy_pv(c, mask_kinds):
        """Fast path, second half: acc += V^T P^T of sub-tile ``c`` for its accepted
        columns, from the scratch ``lazy_scores`` left (rejected: 1.0, skipped: -1.0)."""
        bad = bad_ref[c] != 0.0
        acc_ref[...] = jnp.where(
            bad, acc_ref[...], acc_ref[...] + pv(values(c, mask_kinds), p_ref[...])
        )

    def lazy_tiles(runs):
        """Sub-tiles ``runs`` = [(start, stop, mask_kinds), ...] (consecutive) with the
        stale shift, software pipelined: P V of tile c-1 is issued after the scores of
        tile c-1 and before those of tile c, from the bf16 scratch ``p_ref``, so the MXU
        never waits for the exp2 of the tile it just produced. Up to _UNROLL_MAX_TILES
        tiles are unrolled (one basic block: no loop-carried drain), more take a rolled
        loop (compile time). No branch until every tile is done; then the rejected
        columns of every tile are redone exactly (rare; order does not matter, since l
        and acc are sums under one shift)."""
        m = m_ref[...]
        tiles = [(c, mk) for start, stop, mk in runs for c in range(start, stop)]
        lazy_scores(*tiles[0], m)
        prev = tiles[0]
        for start, stop, mk in runs:
            lo = max(start, 1)
            if len(tiles) > _UNROLL_MAX_TILES and stop - lo > 1 and mk == prev[1]:

                def body(c, _, mk=mk):
                    lazy_pv(c - 1, mk)
                    lazy_scores(c, mk, m)

                lax.fori_loop(lo, stop, body, None)
            else:
                for c in range(lo, stop):
                    lazy_pv(*prev)
                    lazy_scores(c, mk, m)
                    prev = (c, mk)
            if stop - 1 >= lo:
                prev = (stop - 1, mk)
        lazy_pv(*prev)

        # Rare: columns a tile rejected (the max of a query jumped by about
        # _LAZY_LOG2_BOUND over its shift, or the init saw no valid key for it).
        @pl.when(jnp.any(bad_ref[: len(tiles)] > 0.0))
        def _redo():
            for start, stop, mk in runs:

                def redo(c, _, mk=mk):
                    cols = bad_ref[c] > 0.0
                    pl.when(jnp.any(cols))(lambda: exact_update(c, mk, cols))

                lax.fori_loop(start, stop, redo, None)

    if window_size is None:
        tail = kv_len - (num_kv_blocks - 1) * block_kv  # real keys in the last block
        full, part = divmod(tail, block_kv_compute)
        # Static block classes, as ranges [lo, hi) of kv blocks: all-real blocks (no id
        # compare), blocks that may hold other ids (exact compare), and the ragged last
        # block, whose sub-tiles wholly past kv_len are skipped statically and whose one
        # straddling sub-tile pays for a tail mask. Each class is one branch on the kv
        # grid index (never on data), so the profile charges each class's code.
        real_masks = ("qsegment",) if real_kv_blocks else base_masks
        body_end = num_kv_blocks if tail == block_kv else num_kv_blocks - 1
        fast_end = min(real_kv_blocks, body_end)
        ranges = [(0, fast_end, [(0, num_sub, real_masks)]),
                  (fast_end, body_end, [(0, num_sub, base_masks)])]
        if tail != block_kv:
            mk = real_masks if real_kv_blocks >= num_kv_blocks else base_masks
            runs = [(0, full, mk)] if full else []
            if part:
                runs.append((full, full + 1, mk + ("tail",)))
            ranges.append((num_kv_blocks - 1, num_kv_blocks, runs))
        ranges = [r for r in ranges if r[1] > r[0]]
        if len(ranges) == 1:
            lazy_tiles(ranges[0][2])
        for lo, hi, runs in ranges if len(ranges) > 1 else ():
            if lo == 0:
                cond = kv_block < hi
            elif hi == num_kv_blocks:
                cond = kv_block >= lo
            else:
                cond = jnp.logical_and(kv_block >= lo, kv_block < hi)
            pl.when(cond)(functools.partial(lazy_tiles, runs))
    else:
        masks = base_masks + ("window", "tail")

        def windowed(c, _):
            k_lo = kv_block * block_kv + c * block_kv_compute
            k_hi = k_lo + block_kv_compute - 1
            overlaps = (
                (k_lo <= q_start + block_q - 1 + window_size)
                & (k_hi >= q_start - window_size)
                & (k_lo < kv_len)
            )

            @pl.when(overlaps)
            def _tile():
                # One tile at a time (no pipelining): lazy update, then its exact redo.
                lazy_scores(c, masks, m_ref[...])
                lazy_pv(c, masks)
                cols = bad_ref[c] > 0.0
                pl.when(jnp.any(cols))(lambda: exact_update(c, masks, cols))

        lax.fori_loop(0, num_sub, windowed, None)

    @pl.when(kv_step == num_kv_steps - 1)
    def _finish():
        denom = l_ref[...]
        # A query with no valid key has l == 0 and acc == 0: return zeros, not NaN.
        inv = jnp.where(denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0)
        # Cast, then transpose: half the vregs through the transpose, same values.
        o_ref[...] = jnp.transpose((acc_ref[...] * inv).astype(o_ref.dtype))


def _window_kv_block(q_start, kv_step, block_q, block_kv, num_kv_blocks, num_kv_steps, window_size):
    """KV block visited at ``kv_step`` by the q block starting at ``q_start`` (window)."""
    first = jnp.maximum(q_start - window_size, 0) // block_kv
    return jnp.minimum(first, num_kv_blocks - num_kv_steps) + kv_step


def _as_segment_ids(segment_ids) -> SegmentIds | None:
    if segment_ids is None:
        return None
    if not isinstance(segment_ids, (tuple, list)) or len(segment_ids) != 2:
        raise ValueError(f"segment_ids: expected a pair (q_ids, kv_ids), got {segment_ids!r}")
    return SegmentIds(
        jnp.asarray(segment_ids[0], jnp.int32), jnp.asarray(segment_ids[1], jnp.int32)
    )


def _attendable_keys(segment_ids: SegmentIds) -> jax.Array:
    """(batch, kv_len) bool: the key's segment id occurs among the query ids."""

    def one(q_ids, kv_ids):
        sorted_q = jnp.sort(q_ids)
        idx = jnp.clip(jnp.searchsorted(sorted_q, kv_ids), 0, sorted_q.shape[0] - 1)
        return sorted_q[idx] == kv_ids

    return jax.vmap(one)(segment_ids.q, segment_ids.kv)


def _smooth_keys(k, segment_ids: SegmentIds | None):
    """K minus its per-(batch, head) mean over real (attendable) keys, in K's dtype.

    Any constant vector would be exact for softmax; rounding the mean to K's dtype keeps
    ``k - mean`` exact (Sterbenz) wherever the shared component dominates K.
    """
    kf = k.astype(jnp.float32)
    if segment_ids is None:
        mean = jnp.mean(kf, axis=2, keepdims=True)
    else:
        w = _attendable_keys(segment_ids).astype(jnp.float32)  # (B, S)
        total = jnp.einsum("bs,bhsd->bhd", w, kf, precision=lax.Precision.HIGHEST)
        count = jnp.maximum(jnp.sum(w, axis=1), 1.0)[:, None, None]
        mean = (total / count)[:, :, None, :]
    mean = mean.astype(k.dtype).astype(jnp.float32)
    return (kf - mean).astype(k.dtype)


def _check_shapes(q, k, v):
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


def splash_attention(
    q,
    k,
    v,
    *,
    options: AttentionOptions | None = None,
    scale=None,
    segment_ids=None,
    interpret: bool = False,
    vmem_limit_bytes: int | None = None,
    real_keys_before: int = 0,
    valid_kv_len: int | None = None,
    **shorthand,
) -> jax.Array:
    """Softmax attention with the Pallas TPU flash kernel (forward only).

    Args:
        q: (batch, heads, q_len, head_dim), float32 or bfloat16.
        k, v: (batch, heads, kv_len, head_dim), same dtype as q.
        options: ``AttentionOptions`` (blocks, K smoothing, mask); or give its parts as the
            shorthand keywords ``block_sizes``, ``window_size``, ``k_smoothing`` below
            (``attention_options``), never both.
        scale: softmax scale; ``None`` means 1/sqrt(head_dim), as torch SDPA.
        block_sizes: tile sizes (``BlockSizes``); ``None`` means ``BlockSizes()``. Each
            size is an upper bound: the kernel keeps ``ceil(len / block)`` blocks and
            shrinks them to the smallest multiple of 128 (``block_kv``: of
            ``block_kv_compute``) that covers the sequence, so padding stays small and
            short sequences get short blocks.
        window_size: ``None`` for full attention, else an int ``w >= 0``: query position
            ``i`` attends key position ``j`` iff ``|i - j| <= w`` (symmetric; positions in
            the unpadded q and kv sequences; meant for self-attention).
        k_smoothing: subtract the mean of K over real keys (per batch and head) first;
            exact for softmax (see the module docstring for its measured bf16 effect).
        segment_ids: ``None``, a ``SegmentIds(q, kv)`` or a pair ``(q_ids, kv_ids)`` of
            int32 arrays (batch, q_len) and (batch, kv_len); a query attends only to keys
            with an equal id. A query with no such key returns zeros.
        interpret: run the kernel in Pallas interpret mode (CPU tests).
        vmem_limit_bytes: scoped VMEM to request from Mosaic, bytes; ``None`` sizes it from
            the blocks and the chip (``_vmem_limit_bytes``). libtpu's static-profile flag
            adds VMEM buffers of its own, so ``engine.dry_run.estimate`` profiles ask for less.
        real_keys_before: static block classification for ``segment_ids``: the caller
            promises that every key at a position < ``real_keys_before`` has segment id
            ``REAL_SEGMENT_ID`` (1), in every batch row (as the SDPA override's ids from a
            key-padding mask whose padding lies at or after that position). kv blocks wholly
            below it skip the per-key id load and compare (a query then attends all of
            their keys iff its id is 1); blocks that can hold other ids keep the exact
            compare. 0 (default): every block compares. A broken promise is not detected
            (ids are data) and gives wrong results. Ignored with ``window_size``.
        valid_kv_len: static int in [1, kv_len], or None (every key): keys at positions
            >= ``valid_kv_len`` are padding. The result equals attention over
            ``k[:, :, :valid_kv_len]`` and ``v[...]`` without copying them: the grid covers
            only the valid keys and the last block masks its tail by position, as for any
            length the blocks do not divide (no segment ids, no per-block id compare).
            Sequence parallelism's tail padding of the token axis uses it.

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype.

    Raises:
        ValueError: shapes disagree, ``window_size`` is negative, ``valid_kv_len`` is out of
            range, or ``segment_ids`` has the wrong form or shape.
    """
    options = attention_options(options, **shorthand)
    return _splash_attention(q, k, v, options, scale=scale, segment_ids=segment_ids,
                             interpret=interpret, vmem_limit_bytes=vmem_limit_bytes,
                             real_keys_before=real_keys_before, valid_kv_len=valid_kv_len)


def _scale(head_dim: int, scale) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def _fold_scale(q, scale: float):
    """q * scale * log2(e), rounded once to q's dtype: the kernel's scores are base-2 logits.
    Under jit the multiply fuses into q's producer."""
    return (q.astype(jnp.float32) * (scale * LOG2_E)).astype(q.dtype)


def _splash_attention(
    q,
    k,
    v,
    options: AttentionOptions,
    *,
    scale=None,
    segment_ids=None,
    interpret: bool = False,
    q_offset=None,
    vmem_limit_bytes: int | None = None,
    real_keys_before: int = 0,
    valid_kv_len: int | None = None,
    q_scaled: bool = False,
) -> jax.Array:
    """``splash_attention`` with ``q_offset``: the global position of q's first row.

    ``q_offset`` (int or traced int32 scalar, default 0) shifts query positions for the
    window mask, for q shards of a longer sequence (``sharded_splash_attention``).

    ``q_scaled``: q is already ``_fold_scale(q, scale)``. The Ulysses layout scales q before
    its all-to-all, where the multiply fuses into q's producer (Wan: the RoPE) instead of
    costing a pass of its own after it.
    """
    _check_shapes(q, k, v)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    if k.dtype != q.dtype or v.dtype != q.dtype:
        k, v = k.astype(q.dtype), v.astype(q.dtype)
    window_size = options.window_size
    segment_ids = _as_segment_ids(segment_ids)
    if segment_ids is not None and (
        segment_ids.q.shape != (batch, q_len) or segment_ids.kv.shape != (batch, kv_len)
    ):
        raise ValueError(
            f"segment_ids: expected shapes {(batch, q_len)} and "
            f"{(batch, kv_len)}, got {segment_ids.q.shape} and "
            f"{segment_ids.kv.shape}"
        )
    if valid_kv_len is not None:
        if int(valid_kv_len) != valid_kv_len or not 1 <= valid_kv_len <= kv_len:
            raise ValueError(f"valid_kv_len: expected an int in [1, {kv_len}], "
                             f"got {valid_kv_len!r}")
        # From here on the keys end at valid_kv_len: blocks, grid and the tail mask; the
        # arrays stay as they are (their rows past it are never read, or masked).
        kv_len = int(valid_kv_len)
    scale = _scale(head_dim, scale)
    bs = _fit_block_sizes(options.block_sizes, q_len, kv_len)
    bq, bkv = bs.block_q, bs.block_kv
    q_pad, kv_pad = _round_up(q_len, bq), _round_up(kv_len, bkv)
    num_q_blocks, num_kv_blocks = q_pad // bq, kv_pad // bkv
    num_kv_steps = num_kv_blocks
    if window_size is not None:
        num_kv_steps = min(num_kv_blocks, -(-(bq + 2 * window_size) // bkv) + 1)
    if int(real_keys_before) != real_keys_before or real_keys_before < 0:
        raise ValueError(f"real_keys_before: expected an int >= 0, got {real_keys_before!r}")
    real_kv_blocks = 0  # leading kv blocks whose keys all have id REAL_SEGMENT_ID
    if segment_ids is not None and window_size is None:
        real_kv_blocks = (num_kv_blocks if real_keys_before >= kv_len
                          else int(real_keys_before) // bkv)

    if options.k_smoothing:
        k = _smooth_keys(k, segment_ids)
    # Fold scale*log2(e) into q once: the kernel's scores are base-2 logits. Under jit
    # this multiply fuses into q's producer. No padding: partial last blocks are read
    # with unspecified padding (masked or discarded in the kernel), which saves HBM
    # copies of q, k and v and a slice of the output.
    qs = q if q_scaled else _fold_scale(q, scale)
    vt = jnp.swapaxes(v, 2, 3)  # (batch, heads, head_dim, kv_len): MXU-native P V
    # Scalar-prefetched into SMEM: the window's index map and mask read it.
    q_offset = jnp.reshape(jnp.asarray(0 if q_offset is None else q_offset, jnp.int32), (1,))

    def kv_index(i, j, q_offset_ref):
        if window_size is None:
            return j
        return _window_kv_block(
            q_offset_ref[0] + i * bq, j, bq, bkv, num_kv_blocks, num_kv_steps, window_size
        )

    in_specs = [
        pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, j, off: (b, h, i, 0)),
        pl.BlockSpec(
            (None, None, bkv, head_dim), lambda b, h, i, j, off: (b, h, kv_index(i, j, off), 0)
        ),
        pl.BlockSpec(
            (None, None, head_dim, bkv), lambda b, h, i, j, off: (b, h, 0, kv_index(i, j, off))
        ),
    ]
    if segment_ids is None:
        q_ids = kv_ids = None
        in_specs += [None, None]
    else:
        # q ids as a lane row (1, q), kv ids broadcast over lanes (kv, 128): the layouts
        # that broadcast against the (keys, queries) score tile without relayout.
        q_ids = segment_ids.q[:, None, :]
        kv_ids = jnp.broadcast_to(segment_ids.kv[:, :, None],
                                  (batch, segment_ids.kv.shape[1], NUM_LANES))
        # All-real blocks read no kv ids: their steps keep the buffer of the first block
        # that may hold other ids (an unchanged block index is not fetched again), so kv
        # ids cost no DMA there either.
        first_mixed = min(real_kv_blocks, num_kv_blocks - 1)

        def kv_ids_index(b, h, i, j, off):
            if real_kv_blocks:
                return b, jnp.maximum(j, first_mixed), 0
            return b, kv_index(i, j, off), 0

        in_specs += [
            pl.BlockSpec((None, 1, bq), lambda b, h, i, j, off: (b, 0, i)),
            pl.BlockSpec((None, bkv, NUM_LANES), kv_ids_index),
        ]
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _splash_kernel,
        block_q=bq,
        block_kv=bkv,
        block_kv_compute=bs.block_kv_compute,
        kv_len=kv_len,
        num_kv_blocks=num_kv_blocks,
        window_size=window_size,
        precision=precision,
        real_kv_blocks=real_kv_blocks,
    )
    itemsize = jnp.dtype(q.dtype).itemsize
    cost = pl.CostEstimate(
        flops=4 * batch * heads * q_pad * num_kv_steps * bkv * head_dim,
        transcendentals=batch * heads * q_pad * num_kv_steps * bkv,
        bytes_accessed=itemsize
        * batch
        * heads
        * head_dim
        * (2 * q_pad + 2 * num_q_blocks * num_kv_steps * bkv),
    )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((batch, heads, q_len, head_dim), q.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(batch, heads, num_q_blocks, num_kv_steps),
            in_specs=in_specs,
            out_specs=pl.BlockSpec(
                (None, None, bq, head_dim), lambda b, h, i, j, off: (b, h, i, 0)
            ),
            scratch_shapes=[
                pltpu.VMEM((1, bq), jnp.float32),  # shift m (base 2, stale running max)
                pltpu.VMEM((1, bq), jnp.float32),  # running denominator l
                pltpu.VMEM((head_dim, bq), jnp.float32),  # acc^T
                # 1.0: sub-tile c rejected the column (lazy shift)
                pltpu.VMEM((bkv // bs.block_kv_compute, 1, bq), jnp.float32),
                pltpu.VMEM((bs.block_kv_compute, bq), q.dtype),  # P^T of the pending P V
            ],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=(_vmem_limit_bytes(bs, head_dim, itemsize, _vmem_capacity_bytes())
                              if vmem_limit_bytes is None else vmem_limit_bytes),
        ),
        cost_estimate=cost,
        interpret=interpret,
        name=KERNEL_NAME,
    )(q_offset, qs, k, vt, q_ids, kv_ids)
    return out


# ---------------------------------------------------------------------------------------
# Sharded wrapper
# ---------------------------------------------------------------------------------------


def _ulysses_to_heads(x, sp: int):
    """Inside ``shard_map``: (B, H, S/sp, D) -> (B, H/sp, S, D), by one all-to-all over "sp".

    The all-to-all runs on (sp, B, H/sp, S/sp, D), its chunks outermost: XLA's TPU all-to-all
    wants the split dimension major. With it there, the copy into that order fuses into the
    producer (Wan: the RoPE) and one copy merges the received shards. Splitting heads (axis
    1) and concatenating the sequence (axis 2) in place, as before, cost 2-3 more passes over
    each of q, k and v (Wan 14B 720p, dp2 x sp4 on v6e, one block's HLO from a deviceless
    compile: layout copies 6.2 -> about 3 GB)."""
    b, h, s, d = x.shape
    chunks = jnp.moveaxis(x.reshape(b, sp, h // sp, s, d), 1, 0)  # (sp, B, H/sp, S/sp, D)
    chunks = lax.all_to_all(chunks, "sp", split_axis=0, concat_axis=0, tiled=True)
    # Axis 0 is now the sender, i.e. the sequence shard: (B, H/sp, sp, S/sp, D).
    return jnp.moveaxis(chunks, 0, 2).reshape(b, h // sp, sp * s, d)


def _ulysses_to_tokens(x, sp: int):
    """Inside ``shard_map``: (B, H/sp, S, D) -> (B, H, S/sp, D), the inverse of
    ``_ulysses_to_heads``, with the same chunks-outermost all-to-all."""
    b, h, s, d = x.shape
    chunks = jnp.moveaxis(x.reshape(b, h, sp, s // sp, d), 2, 0)  # (sp, B, H/sp, S/sp, D)
    chunks = lax.all_to_all(chunks, "sp", split_axis=0, concat_axis=0, tiled=True)
    return jnp.moveaxis(chunks, 0, 1).reshape(b, sp * h, s // sp, d)  # sender = head group


def sharded_splash_attention(
    q,
    k,
    v,
    *,
    mesh,
    options: AttentionOptions | None = None,
    scale=None,
    segment_ids=None,
    interpret: bool = False,
    kernel: str = "splash",
    real_keys_before: int = 0,
    valid_kv_len: int | None = None,
    **shorthand,
) -> jax.Array:
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
        q, k, v, options (or its shorthands), scale, segment_ids, interpret: as
            ``splash_attention``, for the global arrays.
        mesh: ``jax.sharding.Mesh`` with axis names "dp", "tp" and "sp".
        kernel: "splash" (ours) or "stock_splash" (``stock_splash_attention``, JAX's kernel;
            no ``window_size`` or ``k_smoothing``).
        real_keys_before: as ``splash_attention``, a global key position. Every layout hands
            the kernel the whole key sequence (heads and Ulysses: all keys of its heads;
            q-sequence: full K and V), so the position needs no translation per shard.
            Ignored by "stock_splash".
        valid_kv_len: as ``splash_attention``, a global key position (no translation, for
            the same reason); "splash" only.

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype, sharded as described.

    Raises:
        ValueError: the mesh lacks an axis, or batch % dp or heads % tp is not 0, or neither
            heads % (tp*sp) nor q_len % sp is 0.
    """
    options = attention_options(options, **shorthand)
    _check_shapes(q, k, v)
    if kernel not in SPLASH_KERNELS:
        raise ValueError(f"kernel: expected one of {SPLASH_KERNELS}, got {kernel!r}")
    if kernel == "stock_splash" and not options.is_plain:
        raise ValueError("kernel='stock_splash': window_size and k_smoothing are ours only")
    if kernel == "stock_splash" and valid_kv_len is not None:
        raise ValueError("kernel='stock_splash': valid_kv_len is ours only")
    missing = [a for a in ("dp", "tp", "sp") if a not in mesh.shape]
    if missing:
        raise ValueError(f"mesh: expected axes ('dp', 'tp', 'sp'), got {tuple(mesh.shape)}")
    dp, tp, sp = mesh.shape["dp"], mesh.shape["tp"], mesh.shape["sp"]
    batch, heads, q_len, _ = q.shape
    kv_len = k.shape[2]
    if batch % dp:
        raise ValueError(f"batch: expected a multiple of mesh axis dp={dp}, got {batch}")
    if heads % tp:
        raise ValueError(f"heads: expected a multiple of mesh axis tp={tp}, got {heads}")
    heads_split = heads % (tp * sp) == 0
    if sp == 1 or (heads_split and q_len % sp):
        layout = "heads"
    elif heads_split and q_len == kv_len:
        layout = "ulysses"
    elif q_len % sp == 0:
        layout = "q_sequence"
    else:
        raise ValueError(
            f"q_len: expected a multiple of mesh axis sp={sp} when heads "
            f"({heads}) are not divisible by tp*sp={tp * sp}, got {q_len}"
        )
    if layout == "heads":
        q_spec = kv_spec = P("dp", ("tp", "sp"), None, None)
        q_ids_spec = kv_ids_spec = P("dp", None)
    elif layout == "ulysses":
        q_spec = kv_spec = P("dp", "tp", "sp", None)
        q_ids_spec = kv_ids_spec = P("dp", None)  # the kernel sees whole sequences
    else:
        q_spec, kv_spec = P("dp", "tp", "sp", None), P("dp", "tp", None, None)
        q_ids_spec, kv_ids_spec = P("dp", "sp"), P("dp", None)
    segment_ids = _as_segment_ids(segment_ids)

    def local(q, k, v, seg):
        offset = 0
        if layout == "q_sequence":  # window masks use global query positions
            offset = lax.axis_index("sp") * (q_len // sp)
        if layout == "ulysses":
            # (B/dp, H/tp, S/sp, D) -> (B/dp, H/(tp*sp), S, D): send head group j to sp device j,
            # receive every device's sequence shard of our head group, in sequence order.
            if kernel == "splash":
                q = _fold_scale(q, _scale(q.shape[3], scale))
            q, k, v = (_ulysses_to_heads(x, sp) for x in (q, k, v))
        if kernel == "stock_splash":
            out = stock_splash_attention(
                q, k, v, scale=scale, block_sizes=options.block_sizes, segment_ids=seg,
                interpret=interpret,
            )
        else:
            out = _splash_attention(q, k, v, options, scale=scale, segment_ids=seg,
                                    interpret=interpret, q_offset=offset,
                                    real_keys_before=real_keys_before,
                                    valid_kv_len=valid_kv_len, q_scaled=layout == "ulysses")
        if layout == "ulysses":  # back to (B/dp, H/tp, S/sp, D)
            out = _ulysses_to_tokens(out, sp)
        return out

    seg_spec = None if segment_ids is None else SegmentIds(q_ids_spec, kv_ids_spec)
    return jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, seg_spec),
        out_specs=q_spec,
        check_vma=False,  # pallas_call carries no varying-manual-axes annotations
    )(q, k, v, segment_ids)


# ---------------------------------------------------------------------------------------
# JAX's stock splash kernel, the trusted fallback
# ---------------------------------------------------------------------------------------


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
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as stock,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as stock_mask,
    )

    _check_shapes(q, k, v)
    batch, heads, q_len, head_dim = q.shape
    kv_len = k.shape[2]
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    scale = _scale(head_dim, scale)
    bs = _fit_block_sizes(block_sizes or BlockSizes(), q_len, kv_len)
    q_pad, kv_pad = _round_up(q_len, bs.block_q), _round_up(kv_len, bs.block_kv)
    segment_ids = _as_segment_ids(segment_ids)
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


# ---------------------------------------------------------------------------------------
# Self-check: is this kernel right on this device?
# ---------------------------------------------------------------------------------------

# The interpret-mode tests' bf16 tolerance (tests/test_splash_attention.py): ~3 bf16
# roundings of O(1) values; a masking or rescale bug is O(0.1).
SELF_CHECK_TOLERANCE = 1e-2
# Small enough to run in well under a second on a TPU, big enough to cover several q and
# kv blocks, several sub-tiles per kv block and a ragged tail (600 = 2 * 256 + 88).
SELF_CHECK_SHAPE = (1, 2, 600, 128)
SELF_CHECK_BLOCKS = BlockSizes(block_q=256, block_kv=256, block_kv_compute=128)


def kernel_self_check(kernel: str, *, interpret: bool = False, attention_fn=None) -> dict:
    """Run a Splash kernel on the default device against the float32 reference.

    A bf16 problem of ``SELF_CHECK_SHAPE`` (batch, heads, length, head_dim) with a ragged
    tail, blocks ``SELF_CHECK_BLOCKS``, against ``reference_attention`` on the same
    bf16-rounded inputs. It passes when every element satisfies
    ``|out - ref| <= tol + tol * |ref|`` with ``tol = SELF_CHECK_TOLERANCE``.

    Args:
        kernel: "splash" or "stock_splash".
        interpret: Pallas interpret mode (off TPU).
        attention_fn: optional replacement ``f(q, k, v, *, block_sizes, interpret)`` (tests
            inject a wrong kernel here).

    Returns:
        dict(backend, shape, dtype, max_abs_error, tolerance, passed, seconds).
    """
    import time

    if attention_fn is None:
        attention_fn = stock_splash_attention if kernel == "stock_splash" else splash_attention
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


# ---------------------------------------------------------------------------------------
# References and the torch SDPA override
# ---------------------------------------------------------------------------------------


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
        static_mask: ``None``, or a mask value (``LocalMask``): the kernel's mask, applied
            as its dense (q_len, kv_len) bool form (for small or reference runs).

    Returns:
        (batch, heads, q_len, head_dim) in q.dtype.
    """
    mask = None
    if segment_ids is not None:
        ids = _as_segment_ids(segment_ids)
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


def _band_mask(q_len: int, kv_len: int, window_size: int) -> jax.Array:
    """(q_len, kv_len) bool: ``|i - j| <= window_size``, the kernel's local window."""
    i = jnp.arange(q_len)[:, None]
    return jnp.abs(i - jnp.arange(kv_len)[None, :]) <= window_size


# Backend forced for a scope (``forced_attention``): the Wan VAE's attention always takes XLA.
_FORCED_ATTENTION: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "forced_attention", default=None
)


@contextlib.contextmanager
def forced_attention(attention: str):
    """Route every SDPA call traced inside this block to ``attention``, whatever
    ``install_sdpa_override`` chose.

    The Wan VAE's mid-block attention is batch 1, one head, head_dim 384, float32: nothing
    a flash kernel helps with (one tiny head), and a shape our Mosaic kernel was never tuned
    or tested for. Its programs are traced under ``forced_attention("xla")``.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {attention!r}")
    token = _FORCED_ATTENTION.set(attention)
    try:
        yield
    finally:
        _FORCED_ATTENTION.reset(token)


class KeyPadding(NamedTuple):
    """Self-attention keys at positions >= ``valid_len`` of a ``padded_len`` sequence are
    padding (``pad_self_attention_keys``)."""

    padded_len: int
    valid_len: int


_KEY_PADDING: contextvars.ContextVar[KeyPadding | None] = contextvars.ContextVar(
    "key_padding", default=None
)
_IN_SELF_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "in_self_attention", default=False
)


_REAL_KEYS_BEFORE: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "real_keys_before", default=None
)


@contextlib.contextmanager
def real_keys_before(position: int):
    """Declare, for the SDPA calls traced inside, that a key-padding ``attn_mask`` can only
    mask keys at positions >= ``position`` (a static fact of the family's token layout,
    e.g. HunyuanVideo-1.5's joint attention: [video tokens, text tokens], padding only in
    the text). The Splash kernel then skips the segment-id compare in kv blocks wholly
    before it (``splash_attention(real_keys_before=...)``). A mask that breaks the promise
    gives wrong results; nothing checks it at run time."""
    token = _REAL_KEYS_BEFORE.set(int(position))
    try:
        yield
    finally:
        _REAL_KEYS_BEFORE.reset(token)


def pad_self_attention_keys(padded_len: int, valid_len: int) -> contextvars.Token:
    """Declare, until ``unpad_self_attention_keys(token)``, that the token axis of the
    sequences being traced was zero-padded from ``valid_len`` to ``padded_len``.

    Self-attention calls (inside a module ``mark_self_attention`` marked) whose key length
    is ``padded_len`` then give real tokens segment id 1 and padding id 0: the kernels mask
    the padded keys exactly (never zero keys left in the softmax denominator), and padded
    query rows attend only padding, so they stay finite. Used by sequence parallelism to run
    token counts the "sp" axis does not divide. Trace-time state: set and reset around the
    traced blocks, not inside the compiled program.
    """
    return _KEY_PADDING.set(KeyPadding(padded_len, valid_len))


def unpad_self_attention_keys(token: contextvars.Token) -> None:
    _KEY_PADDING.reset(token)


def mark_self_attention(module) -> list:
    """Hooks that flag SDPA calls traced inside ``module`` as self-attention (keys are the
    video tokens themselves), for ``pad_self_attention_keys``. Returns the hook handles."""
    tokens = []

    def enter(_module, _args):
        tokens.append(_IN_SELF_ATTENTION.set(True))

    def leave(_module, _args, _output):
        _IN_SELF_ATTENTION.reset(tokens.pop())

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


def key_padding_mask(mask, q, k):
    """The (batch, kv_len) bool of real keys when ``mask`` is a boolean key-padding mask,
    else None.

    A key-padding mask is a boolean SDPA ``attn_mask`` of shape (batch or 1, 1 or heads, 1,
    kv_len): one row of allowed keys broadcast over every query, as diffusers'
    ``Attention.prepare_attention_mask`` leaves a (batch, 1, 1, kv_len) mask (repeated over
    heads) and as the HunyuanVideo-1.5 family passes its text padding. Such a mask must be
    the same for every head; the heads are combined with AND.
    """
    batch, heads, _, _ = q.shape
    kv_len = k.shape[2]
    if (mask is None or mask.dtype != jnp.bool_ or mask.ndim != 4 or mask.shape[2] != 1
            or mask.shape[3] != kv_len or mask.shape[0] not in (1, batch)
            or mask.shape[1] not in (1, heads)):
        return None
    return jnp.broadcast_to(jnp.all(mask[:, :, 0, :], axis=1), (batch, kv_len))


def _active_padding(k) -> KeyPadding | None:
    """The ``pad_self_attention_keys`` declaration that applies to this call (a self-attention
    call whose keys hold the padded tokens, with some padding), else None."""
    pad = _KEY_PADDING.get()
    if (pad is None or not _IN_SELF_ATTENTION.get() or k.shape[2] < pad.padded_len
            or pad.valid_len >= pad.padded_len):
        return None
    return pad


def _declared_padding(q, k):
    """(batch, kv_len) bool, False at the keys ``pad_self_attention_keys`` declared padding
    (self-attention calls only; the video tokens come first in the key sequence), else
    None."""
    pad = _active_padding(k)
    if pad is None:
        return None
    pos = jnp.arange(k.shape[2])
    real = (pos < pad.valid_len) | (pos >= pad.padded_len)
    return jnp.broadcast_to(real, (q.shape[0], k.shape[2]))


def _declared_tail(k) -> int | None:
    """``valid_len`` when declared padding applies to this call and is the key sequence's tail
    (the keys are the padded tokens alone), else None."""
    pad = _active_padding(k)
    return pad.valid_len if pad is not None and k.shape[2] == pad.padded_len else None


def _real_keys(q, k, mask):
    """(real keys (batch, kv_len) bool or None, the mask left for the reference path,
    the static position before which every key is real: 0 when unknown).

    A key-padding ``mask`` is consumed (its padding may sit anywhere unless
    ``real_keys_before`` declared where); declared sequence-parallel padding, which starts
    at its ``valid_len``, is added."""
    kv_len = k.shape[2]
    real = key_padding_mask(mask, q, k)
    before = kv_len
    if real is not None:
        mask = None
        declared_before = _REAL_KEYS_BEFORE.get()
        before = 0 if declared_before is None else min(declared_before, kv_len)
    declared = _declared_padding(q, k)
    if declared is not None:
        real = declared if real is None else real & declared
        before = min(before, _KEY_PADDING.get().valid_len)
    return real, mask, before


def _key_segment_ids(q, k, real) -> SegmentIds:
    """Segment ids for the kernels from real keys: real = 1, padding = 0.

    In self-attention (q_len == kv_len, the same tokens) a query gets its own key's id, so a
    padded query attends only padding (its own key among them) and stays finite; no real
    token reads it. Otherwise every query is real (id 1)."""
    kv_ids = real.astype(jnp.int32)
    if q.shape[2] == k.shape[2]:
        return SegmentIds(kv_ids, kv_ids)
    return SegmentIds(jnp.ones((q.shape[0], q.shape[2]), jnp.int32), kv_ids)


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
    forced = _FORCED_ATTENTION.get()
    attention = forced or attention
    q, k, v = env.t2j_iso((query, key, value))
    mask = env.t2j_iso(attn_mask) if attn_mask is not None else None
    # Tail padding alone, into our kernel without a window: masked by length in the kernel
    # (``valid_kv_len``) instead of by segment ids; XLA (a fallback) masks ``real``.
    tail = None
    if attention == "splash" and forced is None and mask is None and not is_causal \
            and options.window_size is None:
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
        out = xla_attention(q, k, v, scale=scale, key_mask=real, static_mask=options.mask)
    elif attention in SPLASH_KERNELS:
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
                    f"{mesh.shape['dp']}, tp={mesh.shape['tp']}: XLA attention instead",
                )
            out = xla_attention(q, k, v, scale=scale, key_mask=real, static_mask=options.mask)
        else:
            out = sharded_splash_attention(
                q, k, v, mesh=mesh, options=options, scale=scale, segment_ids=segment_ids,
                interpret=routing["interpret"], kernel=attention,
                real_keys_before=before if attention == "splash" else 0, valid_kv_len=tail)
    else:
        raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {attention!r}")
    return env.j2t_iso(out)


def install_sdpa_override(
    env,
    *,
    attention: str,
    mesh=None,
    options: AttentionOptions | None = None,
    interpret: bool = False,
    on_fallback=None,
    **shorthand,
) -> None:
    """Route ``torch.nn.functional.scaled_dot_product_attention`` in ``env`` to JAX.

    A boolean key-padding ``attn_mask`` (``key_padding_mask``: one row of allowed keys for
    every query, as HunyuanVideo-1.5's text padding) becomes segment ids (real = 1,
    padding = 0) for the kernels, or a (batch, 1, 1, kv_len) mask for XLA: no dense
    (batch, 1, q_len, kv_len) mask is built. Calls with other masks or ``is_causal=True``
    take ``reference_attention`` (exact) whatever ``attention`` says; the rest take
    ``attention``.

    Args:
        env: a ``torchax.tensor.Environment`` (``torchax.default_env()``).
        attention: "xla" (``xla_attention``), "splash" (``splash_attention``, or
            ``sharded_splash_attention`` when ``mesh`` is given) or "stock_splash" (the same
            with ``stock_splash_attention``, JAX's kernel).
        mesh: optional ``jax.sharding.Mesh`` with axes ("dp", "tp", "sp") for the sharded
            kernel wrapper.
        options: ``AttentionOptions``, or its shorthands ``block_sizes``, ``window_size``,
            ``k_smoothing`` (``attention_options``). K smoothing subtracts the mean of K
            before the kernel (see ``splash_attention``); exact for softmax, so XLA applies
            it too. The mask (``LocalMask``: query ``i`` attends key ``j`` iff
            ``|i - j| <= w``, positions in the flattened token order) applies to every
            self-attention call (q_len == kv_len; not in ``forced_attention`` scopes),
            through the kernel's grid or, for "xla", its dense form. Neither with
            "stock_splash".
        interpret: run the Pallas kernel in interpret mode (CPU).
        on_fallback: optional ``f(kind, detail)`` told when a call the wrapper cannot split
            goes to XLA instead.

    Raises:
        ValueError: unknown ``attention``.
    """
    import torch

    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention: expected one of {ATTENTION_BACKENDS}, got {attention!r}")
    options = attention_options(options, **shorthand)
    if attention == "stock_splash" and not options.is_plain:
        raise ValueError("attention='stock_splash': window_size and k_smoothing are ours only")
    routing = dict(mesh=mesh, interpret=interpret, on_fallback=on_fallback)
    env.override_op_definition(
        torch.nn.functional.scaled_dot_product_attention,
        functools.partial(_sdpa, env=env, attention=attention, options=options,
                          routing=routing),
    )
