"""The kernel's tile sizes: ``BlockSizes``, the per-chip defaults, fitting blocks to a
sequence, and the scoped VMEM a set of blocks asks Mosaic for.

Fitting: sizes are upper bounds. For a sequence of length ``n`` the kernel keeps the number
of blocks ``ceil(n / block)`` and shrinks each block to the smallest aligned size that
covers ``n`` (``fit_block_sizes``); short sequences clamp every block to the sequence
rounded up to 128. See docs/attention.md ("Kernel design notes") for how the defaults were
chosen.
"""

from __future__ import annotations

import dataclasses

from jax.experimental.pallas import tpu as pltpu

NUM_LANES = 128
NUM_SUBLANES = 8


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

    The sizes are upper bounds (``fit_block_sizes``). ``BlockSizes()`` is (3328, 2816, 256),
    a public Wan 2.1 port's v6e tuning at head_dim 128 and 75,600 tokens, kept for chips
    with no entry of their own; it is also v5e's default. The per-chip defaults
    (``default_block_sizes``) are v6e (4864, 2048, 1024) and tpu7x (3328, 2048, 1024).

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


# Default blocks per TPU generation (libtpu's topology prefix, as ``engine.run.chips`` names
# it), for head_dim 128. Chosen on Wan's 720p self-attention (75,600 tokens) by the fewest
# estimated cycles in libtpu's static profile (deviceless; not measured on a TPU), through
# ``benchmarks/kernel_cycles.py --sweep`` (benchmarks/kernel_cycles_results.md).
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


# Default blocks of the sparse path (``--sparse svg``'s band-masked calls, their own step
# programs), head_dim 128. A band's two edges cross about block_q / block_kv_compute + 1
# masked sub-tiles per q block, and a masked sub-tile costs ~2.4x an unmasked one, so shorter
# q blocks pay off there although they cost 9-14% more per score in a dense call. Chosen on
# Wan 14B 720p x 81 at SVG's s = 0.3 by libtpu's static profile per tile class (deviceless;
# not measured): v6e 1664/2048/1024 gives a band call of 26.0 ms against 30.2 at the dense
# default (best of four sizes), tpu7x 2432/2048/1024 21.3 against 22.1 ms
# (benchmarks/svg_results.md). Other chips take their dense default.
SPARSE_BLOCK_SIZES: dict[str, BlockSizes] = {
    "v6e": BlockSizes(1664, 2048, 1024),
    "tpu7x": BlockSizes(2432, 2048, 1024),
}


def default_sparse_block_sizes(chip: str | None = None) -> BlockSizes:
    """The sparse path's default ``BlockSizes`` on ``chip`` (``SPARSE_BLOCK_SIZES``, else
    ``default_block_sizes(chip)``)."""
    return SPARSE_BLOCK_SIZES.get(chip, default_block_sizes(chip))


def round_up(x: int, multiple: int) -> int:
    """The smallest multiple of ``multiple`` >= ``x`` (ints)."""
    return -(-x // multiple) * multiple


def _fit_block(length: int, block: int, align: int) -> int:
    """Smallest multiple of ``align`` that covers ``length`` in ceil(length/block) blocks."""
    num_blocks = -(-length // block)
    return round_up(-(-length // num_blocks), align)


def fit_block_sizes(block_sizes: BlockSizes, q_len: int, kv_len: int) -> BlockSizes:
    """The blocks the kernel runs for (q_len, kv_len): same block count as ``block_sizes``,
    least padding, clamped to the sequences rounded up to 128."""
    block_q = _fit_block(q_len, block_sizes.block_q, NUM_LANES)
    block_kv_compute = min(block_sizes.block_kv_compute, round_up(kv_len, NUM_LANES))
    block_kv = _fit_block(kv_len, block_sizes.block_kv, block_kv_compute)
    return BlockSizes(block_q, block_kv, block_kv_compute)


def vmem_limit_bytes(bs: BlockSizes, head_dim: int, itemsize: int,
                     capacity: int | None = None, *, margin: int = 2) -> int:
    """Scoped VMEM to request from Mosaic: ``vmem_need_bytes`` x ``margin`` (2 for runs;
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
    limit = min(max(margin * vmem_need_bytes(bs, head_dim, itemsize), 32 << 20), 100 << 20)
    if capacity:
        limit = min(limit, capacity * 3 // 4)
    return int(limit)


def vmem_need_bytes(bs: BlockSizes, head_dim: int, itemsize: int) -> int:
    """An upper estimate of the kernel's VMEM need, bytes (1.5-2x Mosaic's actual need)."""
    d = round_up(head_dim, NUM_LANES)
    buffers = 2 * itemsize * d * (2 * bs.block_q + 2 * bs.block_kv)  # Q, O, K, V^T x2
    ids = 2 * 4 * NUM_LANES * (NUM_SUBLANES + bs.block_kv)  # segment ids x2
    num_sub = bs.block_kv // bs.block_kv_compute
    # acc^T, its transpose, m, l, the per-sub-tile rejection flags
    scratch = 4 * bs.block_q * (2 * d + (2 + num_sub) * NUM_SUBLANES)
    tiles = 2 * 4 * bs.block_kv_compute * bs.block_q  # f32 scores and probabilities
    tiles += itemsize * bs.block_kv_compute * bs.block_q  # P^T scratch of the pending P V
    return buffers + ids + scratch + tiles


def vmem_capacity_bytes() -> int | None:
    """VMEM per TensorCore of the chip being compiled for, or None off TPU.

    Pallas reads the chip from the abstract mesh under ``shard_map`` (so a deviceless
    compile for a topology sees that topology's chip), else from the default device.
    """
    try:
        return pltpu.get_tpu_info().vmem_capacity_bytes
    except (ValueError, RuntimeError, NotImplementedError):  # CPU, interpret mode, unknown
        return None
