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
from splash.mask import EDGE, EMPTY, MAX_EDGES, PARTIAL, Mask


@dataclasses.dataclass(frozen=True)
class InfoLayout:
    """Where things sit in the scalar-prefetch table (static, hashable).

    The table is int32 ``[q_offset, count[num_q_blocks], kv_block[num_q_blocks *
    num_kv_steps], tile_class[num_q_blocks * num_kv_steps * num_sub]]``: the global position
    of q's first row, per q block how many kv blocks it visits, the kv block of each visited
    step in increasing order (only the non-empty ones: a band plus an anchor far from it
    visits the two and nothing between), and the class of each sub-tile of each visited step
    (steps past a q block's count: ``EMPTY``). Without a mask (``num_kv_steps == 0``) it is
    ``[q_offset]`` alone.
    """

    num_q_blocks: int
    num_kv_steps: int = 0
    num_sub: int = 0

    @property
    def size(self) -> int:
        if not self.num_kv_steps:
            return 1
        steps = self.num_q_blocks * self.num_kv_steps
        return 1 + self.num_q_blocks + steps + steps * self.num_sub

    def _at(self, ref, index, which):
        """``ref[index]`` in the table row of mask ``which`` (None: the only row; the
        single-mask kernel's code stays as it was)."""
        return ref[index] if which is None else ref[which * self.size + index]

    def q_offset(self, ref, which=None):
        return self._at(ref, 0, which)

    def kv_block(self, ref, q_block, kv_step, which=None):
        """The kv block that q block ``q_block`` visits at ``kv_step``; past its count the
        last one again (an unchanged block index is not fetched again). ``which``: None, or
        the (traced) mask number of a ``HeadMasks`` table."""
        count = self._at(ref, 1 + q_block, which)
        step = jnp.minimum(kv_step, jnp.maximum(count - 1, 0))
        return self._at(ref, 1 + self.num_q_blocks + q_block * self.num_kv_steps + step, which)

    def tile_class(self, ref, q_block, kv_step, sub, which=None):
        base = 1 + self.num_q_blocks * (1 + self.num_kv_steps)
        return self._at(ref, base + (q_block * self.num_kv_steps + kv_step) * self.num_sub
                        + sub, which)


@dataclasses.dataclass(frozen=True, eq=False)
class MaskInfo:
    """A mask at one tiling: the layout and the table, one row per q shard.

    Attributes:
        layout: ``InfoLayout``.
        table: int32 (num_shards, layout.size); row s is for queries at positions
            ``q_offsets[s] + [0, q_len)``. For ``HeadMasks`` (``build_head_mask_info``):
            int32 (num_shards, num_masks, layout.size), mask m's rows at [:, m], all at one
            layout (the largest kv step count of the masks).
    """

    layout: InfoLayout
    table: np.ndarray

    @property
    def num_kv_steps(self) -> int:
        return self.layout.num_kv_steps

    def visited(self, shard: int = 0, mask: int = 0) -> np.ndarray:
        """(num_q_blocks, num_kv_steps) int32: the kv block each grid step of shard
        ``shard`` (and, for ``HeadMasks``, mask ``mask``) fetches, -1 for a step past its
        q block's count (a skip step: the block of the step before, no compute)."""
        lay = self.layout
        row = self.table[shard] if self.table.ndim == 2 else self.table[shard, mask]
        nq, steps = lay.num_q_blocks, lay.num_kv_steps
        count = row[1:1 + nq]
        blocks = row[1 + nq:1 + nq + nq * steps].reshape(nq, steps).copy()
        blocks[np.arange(steps)[None, :] >= count[:, None]] = -1
        return blocks


def sub_tile_classes(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes, num_kv_blocks: int,
                     q_offset: int) -> np.ndarray:
    """(num_q_blocks, num_kv_blocks, num_sub) int8 classes of the sub-tiles of a fitted
    tiling: the mask's, with sub-tiles wholly past ``kv_len`` ``EMPTY`` and the one that
    straddles it ``PARTIAL`` unless ``EMPTY`` (it needs the tail mask, which ``FULL`` and
    ``EDGE + k`` tiles skip).

    Raises:
        ValueError: ``block_classes`` of the wrong shape, or a class code outside
            [EMPTY, EDGE + len(mask.edge_masks())), or more than ``MAX_EDGES`` edge masks."""
    bkc = bs.block_kv_compute
    num_sub = bs.block_kv // bkc
    classes = np.asarray(mask.block_classes(q_len, kv_len, bs.block_q, bkc, q_offset=q_offset),
                         np.int8)
    num_q_blocks, real_subs = -(-q_len // bs.block_q), -(-kv_len // bkc)
    if classes.shape != (num_q_blocks, real_subs):
        raise ValueError(f"{type(mask).__name__}.block_classes: expected shape "
                         f"{(num_q_blocks, real_subs)}, got {classes.shape}")
    edges = len(mask.edge_masks())
    if edges > MAX_EDGES or classes.min() < EMPTY or classes.max() >= EDGE + edges:
        raise ValueError(f"{type(mask).__name__}: expected at most {MAX_EDGES} edge masks and "
                         f"classes in [0, {EDGE + edges}), got {edges} edge masks, classes "
                         f"[{classes.min()}, {classes.max()}]")
    if kv_len % bkc:
        classes[:, -1] = np.where(classes[:, -1] == EMPTY, EMPTY, PARTIAL)
    padded = np.full((num_q_blocks, num_kv_blocks * num_sub), EMPTY, np.int8)
    padded[:, :real_subs] = classes
    return padded.reshape(num_q_blocks, num_kv_blocks, num_sub)


def build_mask_info(mask: Mask, q_len: int, kv_len: int, bs: BlockSizes,
                    q_offsets: tuple[int, ...] = (0,), *, min_kv_steps: int = 1) -> MaskInfo:
    """The kernel's table for ``mask`` at fitted blocks ``bs``, one row per q offset.

    Each q block visits exactly its non-empty kv blocks, in increasing order; the grid's kv
    axis is the largest such count over all q blocks and shards, and at least
    ``min_kv_steps`` (the steps past a q block's count are skips).
    """
    num_q_blocks, num_kv_blocks = -(-q_len // bs.block_q), -(-kv_len // bs.block_kv)
    num_sub = bs.block_kv // bs.block_kv_compute
    per_shard = [sub_tile_classes(mask, q_len, kv_len, bs, num_kv_blocks, off)
                 for off in q_offsets]
    busy = [[np.flatnonzero((c[i] != EMPTY).any(axis=1)) for i in range(num_q_blocks)]
            for c in per_shard]
    steps = max(min_kv_steps, max(len(b) for rows in busy for b in rows))
    layout = InfoLayout(num_q_blocks, steps, num_sub)
    table = np.zeros((len(q_offsets), layout.size), np.int32)
    for row, off, classes, rows in zip(table, q_offsets, per_shard, busy, strict=True):
        blocks = np.zeros((num_q_blocks, steps), np.int32)
        visited = np.full((num_q_blocks, steps, num_sub), EMPTY, np.int8)
        for i, b in enumerate(rows):
            blocks[i, :len(b)] = b
            blocks[i, len(b):] = b[-1] if len(b) else 0  # repeat: no new fetch
            visited[i, :len(b)] = classes[i, b]
        count = [len(b) for b in rows]
        row[:] = np.concatenate([[off], count, blocks.ravel(), visited.ravel()])
    return MaskInfo(layout, table)


def build_head_mask_info(masks: tuple[Mask, ...], q_len: int, kv_len: int, bs: BlockSizes,
                         q_offsets: tuple[int, ...] = (0,)) -> MaskInfo:
    """``build_mask_info`` of each of ``masks`` (a ``HeadMasks``' tuple) at one layout, the
    tables stacked along a mask axis: table (num_shards, num_masks, layout.size).

    The kv axis is the largest step count of the masks: a mask that needs fewer kv blocks
    for a q block pads with skip steps (the last block again: no new DMA; every sub-tile
    ``EMPTY``: no compute), as each mask does already for its own lighter q blocks.
    """
    infos = [build_mask_info(m, q_len, kv_len, bs, q_offsets) for m in masks]
    steps = max(info.num_kv_steps for info in infos)
    infos = [info if info.num_kv_steps == steps
             else build_mask_info(m, q_len, kv_len, bs, q_offsets, min_kv_steps=steps)
             for m, info in zip(masks, infos, strict=True)]
    return MaskInfo(infos[0].layout, np.stack([info.table for info in infos], axis=1))


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
