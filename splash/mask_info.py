"""From a mask to what the kernel reads: per q block the kv blocks to visit, and per
(q block, kv step, sub-tile) a class, ``EMPTY`` (skipped), ``PARTIAL`` (scores masked by the
mask's ``tile_predicate`` and by the key tail) or ``FULL`` (no mask), in one int32 table
that the kernel gets as scalar prefetch (SMEM).

Without a mask the kernel runs every kv block and its classes are static: the key tail
(keys past ``kv_len`` in the last block) and the segment-id classes (``real_keys_before``)
depend only on lengths and blocks, so ``static_kv_ranges`` hands them to the kernel as
Python ranges, branches on the kv grid index that the static profile charges per class.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from splash.blocks import BlockSizes
from splash.mask import EMPTY, PARTIAL, Mask


@dataclasses.dataclass(frozen=True)
class InfoLayout:
    """Where things sit in the scalar-prefetch table (static, hashable).

    The table is int32 ``[q_offset, first_kv_block[num_q_blocks], kv_blocks[num_q_blocks],
    tile_class[num_q_blocks * num_kv_steps * num_sub]]``: the global position of q's first
    row, per q block the first kv block it visits and how many (a contiguous range), and the
    class of each sub-tile of each visited step (steps past a q block's range: ``EMPTY``).
    Without a mask (``num_kv_steps == 0``) it is ``[q_offset]`` alone.
    """

    num_q_blocks: int
    num_kv_steps: int = 0
    num_sub: int = 0

    @property
    def size(self) -> int:
        if not self.num_kv_steps:
            return 1
        return 1 + 2 * self.num_q_blocks + self.num_q_blocks * self.num_kv_steps * self.num_sub

    def q_offset(self, ref):
        return ref[0]

    def kv_block(self, ref, q_block, kv_step):
        """The kv block that q block ``q_block`` visits at ``kv_step``; past its range the
        last one again (an unchanged block index is not fetched again)."""
        count = ref[1 + self.num_q_blocks + q_block]
        return ref[1 + q_block] + jnp.minimum(kv_step, jnp.maximum(count - 1, 0))

    def tile_class(self, ref, q_block, kv_step, sub):
        base = 1 + 2 * self.num_q_blocks
        return ref[base + (q_block * self.num_kv_steps + kv_step) * self.num_sub + sub]


@dataclasses.dataclass(frozen=True, eq=False)
class MaskInfo:
    """A mask at one tiling: the layout and the table, one row per q shard.

    Attributes:
        layout: ``InfoLayout``.
        table: int32 (num_shards, layout.size); row s is for queries at positions
            ``q_offsets[s] + [0, q_len)``.
    """

    layout: InfoLayout
    table: np.ndarray

    @property
    def num_kv_steps(self) -> int:
        return self.layout.num_kv_steps


def sub_tile_classes(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes, num_kv_blocks: int,
                     q_offset: int) -> np.ndarray:
    """(num_q_blocks, num_kv_blocks, num_sub) int8 classes of the sub-tiles of a fitted
    tiling: the mask's, with sub-tiles wholly past ``kv_len`` ``EMPTY`` and the one that
    straddles it at least ``PARTIAL`` (it needs the tail mask)."""
    bkc = bs.block_kv_compute
    num_sub = bs.block_kv // bkc
    classes = np.asarray(mask.block_classes(q_len, kv_len, bs.block_q, bkc, q_offset=q_offset),
                         np.int8)
    num_q_blocks, real_subs = -(-q_len // bs.block_q), -(-kv_len // bkc)
    if classes.shape != (num_q_blocks, real_subs):
        raise ValueError(f"{type(mask).__name__}.block_classes: expected shape "
                         f"{(num_q_blocks, real_subs)}, got {classes.shape}")
    if kv_len % bkc:
        classes[:, -1] = np.minimum(classes[:, -1], PARTIAL)
    padded = np.full((num_q_blocks, num_kv_blocks * num_sub), EMPTY, np.int8)
    padded[:, :real_subs] = classes
    return padded.reshape(num_q_blocks, num_kv_blocks, num_sub)


def build_mask_info(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes,
                    q_offsets: tuple[int, ...] = (0,)) -> MaskInfo:
    """The kernel's table for ``mask`` at fitted blocks ``bs``, one row per q offset.

    Each q block visits the kv blocks from its first to its last non-empty one; the grid's
    kv axis is the longest such range over all q blocks and shards (at least 1).
    """
    num_q_blocks, num_kv_blocks = -(-q_len // bs.block_q), -(-kv_len // bs.block_kv)
    num_sub = bs.block_kv // bs.block_kv_compute
    per_shard = [sub_tile_classes(mask, q_len, kv_len, bs, num_kv_blocks, off)
                 for off in q_offsets]
    ranges = []
    for classes in per_shard:
        busy = (classes != EMPTY).any(axis=2)  # (num_q_blocks, num_kv_blocks)
        first = np.where(busy.any(axis=1), busy.argmax(axis=1), 0)
        last = np.where(busy.any(axis=1), num_kv_blocks - 1 - busy[:, ::-1].argmax(axis=1), -1)
        ranges.append((first, last - first + 1))
    steps = max(1, max(int(count.max()) for _, count in ranges))
    layout = InfoLayout(num_q_blocks, steps, num_sub)
    table = np.zeros((len(q_offsets), layout.size), np.int32)
    for row, off, classes, (first, count) in zip(table, q_offsets, per_shard, ranges, strict=True):
        visited = np.full((num_q_blocks, steps, num_sub), EMPTY, np.int8)
        for i in range(num_q_blocks):
            visited[i, :count[i]] = classes[i, first[i]:first[i] + count[i]]
        row[:] = np.concatenate([[off], first, count, visited.ravel()])
    return MaskInfo(layout, table)


def real_kv_blocks(real_keys_before: int, kv_len: int, block_kv: int) -> int:
    """Leading kv blocks whose keys all have id ``REAL_SEGMENT_ID``, from the caller's
    promise that every key before ``real_keys_before`` has it (all blocks when it covers
    ``kv_len``: the ragged last block's keys past ``kv_len`` are masked by position)."""
    num_kv_blocks = -(-kv_len // block_kv)
    return num_kv_blocks if real_keys_before >= kv_len else int(real_keys_before) // block_kv


def static_kv_ranges(kv_len: int, bs: BlockSizes, real_blocks: int,
                     segmented: bool) -> list[tuple[int, int, list]]:
    """The unmasked kernel's static block classes: ``[(lo, hi, runs)]``, kv blocks
    ``[lo, hi)`` sharing ``runs = [(sub_start, sub_stop, mask_kinds), ...]``.

    Mask kinds: "qsegment" (all-real blocks, ``real_blocks`` of them: a query of another id
    skips the block; no kv ids read), "segment" (compare ids per key), "tail" (the ragged
    last block's one sub-tile that straddles ``kv_len``; its sub-tiles wholly past it are
    left out of the runs). Each range is one branch on the kv grid index, never on data.
    """
    num_kv_blocks = -(-kv_len // bs.block_kv)
    num_sub = bs.block_kv // bs.block_kv_compute
    base = ("segment",) if segmented else ()
    tail = kv_len - (num_kv_blocks - 1) * bs.block_kv  # real keys in the last block
    full, part = divmod(tail, bs.block_kv_compute)
    real_masks = ("qsegment",) if real_blocks else base
    body_end = num_kv_blocks if tail == bs.block_kv else num_kv_blocks - 1
    fast_end = min(real_blocks, body_end)
    ranges = [(0, fast_end, [(0, num_sub, real_masks)]),
              (fast_end, body_end, [(0, num_sub, base)])]
    if tail != bs.block_kv:
        kinds = real_masks if real_blocks >= num_kv_blocks else base
        runs = [(0, full, kinds)] if full else []
        if part:
            runs.append((full, full + 1, kinds + ("tail",)))
        ranges.append((num_kv_blocks - 1, num_kv_blocks, runs))
    return [r for r in ranges if r[1] > r[0]]
