"""The static estimate of a kernel call on the masked path (a ``Mask`` whose tiles the
kernel classifies from a host table): per-class profiles, combined with the call's own
tile counts. ESTIMATE ONLY, from libtpu's static profile; nothing is measured.

Why per class: on the masked path the kernel picks each sub-tile's work by a branch on its
class (EMPTY, FULL, PARTIAL) read from the scalar-prefetched table, and libtpu's static
profile charges almost nothing under a branch on data (a 1 x 2 grid of the masked kernel at
4736/2048/1024 on v6e profiles at 3,972 cycles, 34,278 with its work made visible;
``benchmarks/svg_results.md``). So each class is profiled with the class made static
(``InfoLayout.tile_class`` patched to return it, in the profiling process only): EMPTY (a
grid step's own overhead), FULL, and PARTIAL (the mask's predicate and the key tail). A
call's cycles = q blocks x per q block + grid steps x step overhead + FULL sub-tiles x FULL
+ PARTIAL sub-tiles x PARTIAL, the counts read from the kernel's host table
(``splash.mask_info.build_mask_info``). The data-dependent branch itself (a scalar compare
and jump per sub-tile) is not charged. Method and first figures: issue 53,
``benchmarks/svg_estimate.py`` (which uses this module). The profiles themselves are
``estimate.masked_cost`` (they need the profiling process).
"""

from __future__ import annotations

import dataclasses

from splash.blocks import BlockSizes, fit_block_sizes
from splash.mask import EDGE, EMPTY, FULL, PARTIAL
from splash.mask_info import build_mask_info

# (class name, static class, q blocks, kv blocks): the profiles ``class_costs`` reads
# (``class_profiles`` adds one "edge<k>" per edge mask of the mask).
CLASS_PROFILES = (("full", FULL, 2, 2), ("full", FULL, 2, 3), ("empty", EMPTY, 2, 2),
                  ("full", FULL, 1, 2), ("partial", PARTIAL, 1, 2))


def class_profiles(mask) -> tuple:
    """``CLASS_PROFILES`` and, per edge mask k of ``mask`` (``Mask.edge_masks``), ("edge<k>",
    EDGE + k, 1, 2): each edge class's work, taken from one q block as PARTIAL's."""
    return CLASS_PROFILES + tuple((f"edge{k}", EDGE + k, 1, 2)
                                  for k in range(len(mask.edge_masks())))


@dataclasses.dataclass(frozen=True)
class TileCounts:
    """One head's grid under a mask at fitted blocks, read from the kernel's host table.

    Attributes:
        q_blocks, kv_blocks, num_sub: the tiling (kv_blocks: of the dense grid).
        grid_kv_steps: the sparse grid's kv axis (the largest visit count).
        visited: (q block, kv block) steps with work, summed over q blocks.
        full_subs, partial_subs: visited sub-tiles of each class (the rest are skipped).
        edge_subs: visited sub-tiles of class ``EDGE + k``, per edge mask k.
    """

    q_blocks: int
    kv_blocks: int
    num_sub: int
    grid_kv_steps: int
    visited: int
    full_subs: int
    partial_subs: int
    edge_subs: tuple[int, ...] = ()

    @property
    def visited_density(self) -> float:
        """Visited tiles / all tiles of the dense grid."""
        return self.visited / (self.q_blocks * self.kv_blocks)

    @property
    def grid_density(self) -> float:
        """Grid steps of the sparse call / of the dense call."""
        return self.grid_kv_steps / self.kv_blocks

    @property
    def sub_tile_density(self) -> float:
        """Computed sub-tiles / all sub-tiles of the dense grid."""
        return (self.full_subs + self.partial_subs + sum(self.edge_subs)) / (
            self.q_blocks * self.kv_blocks * self.num_sub)


def tile_counts(mask, q_len: int, bs: BlockSizes, kv_len: int | None = None) -> TileCounts:
    """``TileCounts`` of ``mask`` on a ``q_len`` x ``kv_len`` (default ``q_len``) call at
    ``bs`` (fitted here as the kernel fits them), from ``build_mask_info``'s table."""
    kv_len = q_len if kv_len is None else kv_len
    fitted = fit_block_sizes(bs, q_len, kv_len)
    info = build_mask_info(mask, q_len, kv_len, fitted)
    lay, row = info.layout, info.table[0]
    nq, steps, num_sub = lay.num_q_blocks, lay.num_kv_steps, lay.num_sub
    count = row[1:1 + nq]
    base = 1 + nq * (1 + steps)
    classes = row[base:base + nq * steps * num_sub].reshape(nq, steps, num_sub)
    return TileCounts(q_blocks=nq, kv_blocks=-(-kv_len // fitted.block_kv), num_sub=num_sub,
                      grid_kv_steps=steps, visited=int(count.sum()),
                      full_subs=int((classes == FULL).sum()),
                      partial_subs=int((classes == PARTIAL).sum()),
                      edge_subs=tuple(int((classes == EDGE + k).sum())
                                      for k in range(len(mask.edge_masks()))))


def sparse_call_cycles(counts: TileCounts, cost: dict, *, batch: int, heads: int) -> float:
    """Estimated cycles of one masked call (grid (batch, heads, q_blocks, grid_kv_steps)):
    per q block ``cost["per_q_block"]``, per grid step ``cost["step"]`` (a skip step's
    overhead, paid by every step), per visited sub-tile ``cost["full"]``,
    ``cost["partial"]`` or ``cost["edges"][k]`` by its class (an edge class at PARTIAL's
    cost where ``cost`` has no "edges": an upper bound, the edge branch does less)."""
    edges = cost.get("edges") or [cost["partial"]] * len(counts.edge_subs)
    per_head = (counts.q_blocks * cost["per_q_block"]
                + counts.q_blocks * counts.grid_kv_steps * cost["step"]
                + counts.full_subs * cost["full"] + counts.partial_subs * cost["partial"]
                + sum(n * c for n, c in zip(counts.edge_subs, edges, strict=True)))
    return batch * heads * per_head


def class_costs(profiles: dict, num_sub: int, block_q: int | None = None) -> dict:
    """Cost model of the masked path from its static-class profiles (cycles of grids of Q
    q blocks x K kv blocks, keyed "<class> QxK": "full 2x2", "full 2x3", "empty 2x2",
    "full 1x2", "partial 1x2").

    FULL's two 2 x K grids split into a per-step slope and a per-q-block rest, as
    ``estimate.grid_cost`` does; EMPTY (a step with every sub-tile skipped) shares that rest
    (init and finish do not depend on the class). PARTIAL is FULL plus the mask's work,
    taken from one q block: libtpu's profile of the masked sub-tile on two q blocks of
    4,736 rows outgrew 8 GB of host memory, and on one q block the same grids differ by
    that work alone. Where that profile overflowed VMEM under the profile flag (tpu7x), the
    mask's work is taken from the same pair of grids at two smaller block_q ("full 1x2
    q<rows>", "partial 1x2 q<rows>") and extrapolated linearly to ``block_q`` (elementwise
    work on the (block_kv_compute, block_q) score tile). Returns cycles: per_q_block, step
    (EMPTY's per step: the overhead of any grid step), full and partial (per computed
    sub-tile, above the step's), and edges (per edge class k, from "edge<k> 1x2" as PARTIAL's,
    [] without those profiles)."""
    full_step = (profiles["full 2x3"] - profiles["full 2x2"]) / 2
    per_q_block = profiles["full 2x2"] / 2 - 2 * full_step
    step = (profiles["empty 2x2"] / 2 - per_q_block) / 2
    full = (full_step - step) / num_sub
    edges = sorted({k.split()[0] for k in profiles if k.startswith("edge")},
                   key=lambda name: int(name[4:]))
    return dict(per_q_block=per_q_block, step=step, full=full,
                partial=full + _mask_work(profiles, "partial", num_sub, block_q),
                edges=[full + _mask_work(profiles, e, num_sub, block_q) for e in edges])


def _mask_work(profiles: dict, name: str, num_sub: int, block_q: int | None) -> float:
    """Cycles a sub-tile of class ``name`` ("partial", "edge<k>") adds to a FULL one: from
    "<name> 1x2" against "full 1x2", or extrapolated in block_q from the "... q<rows>" pairs
    (``class_costs``)."""
    if f"{name} 1x2" in profiles:
        return (profiles[f"{name} 1x2"] - profiles["full 1x2"]) / (2 * num_sub)
    rows = sorted(int(k.split(" q")[1]) for k in profiles if k.startswith(f"{name} 1x2 q"))
    lo, hi = rows[0], rows[-1]
    work = {r: (profiles[f"{name} 1x2 q{r}"] - profiles[f"full 1x2 q{r}"]) / (2 * num_sub)
            for r in (lo, hi)}
    return work[lo] + (block_q - lo) * (work[hi] - work[lo]) / (hi - lo)
