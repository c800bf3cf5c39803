"""benchmarks/svg_estimate.py's host arithmetic (no deviceless compile): the tile counts it
reads from the kernel's table against a brute-force count over the dense mask, the exact
score density, the class cost split and the step / run combination on made-up inputs."""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import svg_estimate as se  # noqa: E402

from splash.blocks import BlockSizes, fit_block_sizes  # noqa: E402
from splash.svg import svg_mask  # noqa: E402


def brute_counts(mask, seq: int, bs: BlockSizes) -> dict:
    """Per (q block, kv block, sub-tile) from the dense (seq, seq) mask: visited kv blocks
    (any kept pair), FULL (all kept) and PARTIAL sub-tiles of visited blocks, and the grid's
    kv axis (the most visited blocks of any q block)."""
    bs = fit_block_sizes(bs, seq, seq)
    dense = np.asarray(mask.dense(seq, seq))
    nq, nkv = -(-seq // bs.block_q), -(-seq // bs.block_kv)
    nsub = bs.block_kv // bs.block_kv_compute
    visited, full, partial, most = 0, 0, 0, 0
    for i in range(nq):
        rows = dense[i * bs.block_q:(i + 1) * bs.block_q]
        blocks = 0
        for j in range(nkv):
            if not rows[:, j * bs.block_kv:(j + 1) * bs.block_kv].any():
                continue
            blocks += 1
            for c in range(nsub):
                lo = j * bs.block_kv + c * bs.block_kv_compute
                tile = rows[:, lo:lo + bs.block_kv_compute]
                if tile.size == 0 or not tile.any():
                    continue
                # The ragged last sub-tile is PARTIAL (it needs the key tail's mask).
                is_full = tile.all() and tile.shape[1] == bs.block_kv_compute
                full, partial = full + is_full, partial + (not is_full)
        visited, most = visited + blocks, max(most, blocks)
    return dict(q_blocks=nq, kv_blocks=nkv, visited=visited, full_subs=full,
                partial_subs=partial, grid_kv_steps=most)


@pytest.mark.parametrize("frames,frame_size,sparsity,blocks", [
    (7, 150, 0.3, (256, 256, 128)),   # N = 1,050: ragged last blocks
    (9, 128, 0.2, (384, 512, 128)),   # a narrow band: blocks between band and anchor skipped
    (5, 300, 0.5, (512, 256, 256)),   # one sub-tile per kv block
])
def test_tile_counts_match_the_dense_mask(frames, frame_size, sparsity, blocks):
    mask, seq, bs = svg_mask(sparsity, frames, frame_size), frames * frame_size, \
        BlockSizes(*blocks)
    counts = se.tile_counts(mask, seq, bs)
    want = brute_counts(mask, seq, bs)
    got = {k: getattr(counts, k) for k in want}
    # The brute force knows no edge classes: its PARTIAL is PARTIAL plus the edges.
    got["partial_subs"] += sum(counts.edge_subs)
    assert got == want
    assert len(counts.edge_subs) == 3 and sum(counts.edge_subs) > 0
    assert counts.visited < counts.q_blocks * counts.kv_blocks  # something is skipped
    assert counts.visited_density == want["visited"] / (want["q_blocks"] * want["kv_blocks"])


def test_score_density_is_the_dense_masks_mean():
    mask, seq = svg_mask(0.3, 7, 150), 1050
    assert se.score_density(mask, seq) == pytest.approx(float(np.asarray(
        mask.dense(seq, seq)).mean()), abs=1e-12)


def test_class_costs_split_made_up_profiles():
    # per q block 1000, step overhead 100, FULL 800 and PARTIAL 1200 per sub-tile, 2 subs:
    # a Q x K grid costs Q * (1000 + K * (100 + 2 * class cost)).
    def grid(q, k, sub):
        return q * (1000 + k * (100 + 2 * sub))

    profiles = {"full 2x2": grid(2, 2, 800), "full 2x3": grid(2, 3, 800),
                "empty 2x2": grid(2, 2, 0), "full 1x2": grid(1, 2, 800),
                "partial 1x2": grid(1, 2, 1200)}
    cost = se.class_costs(profiles, 2)
    assert cost.pop("edges") == []
    assert cost == pytest.approx(dict(per_q_block=1000, step=100, full=800, partial=1200))
    # Edge classes (one compare each): 900 and 950 per sub-tile, in edge order.
    edged = dict(profiles, **{"edge1 1x2": grid(1, 2, 950), "edge0 1x2": grid(1, 2, 900)})
    assert se.class_costs(edged, 2)["edges"] == pytest.approx([900, 950])
    # The mask's work from two smaller block_q (linear in block_q: 0.25 cycles per row per
    # sub-tile here, 1200 - 800 = 400 at 1600 rows), when the real one's profile is missing.
    reduced = {k: v for k, v in profiles.items() if k != "partial 1x2"}
    for rows in (600, 1000):
        reduced[f"full 1x2 q{rows}"] = grid(1, 2, 800)
        reduced[f"partial 1x2 q{rows}"] = grid(1, 2, 800 + 0.25 * rows)
    assert se.class_costs(reduced, 2, block_q=1600)["partial"] == pytest.approx(1200)
    counts = se.TileCounts(q_blocks=3, kv_blocks=10, num_sub=2, grid_kv_steps=4, visited=9,
                           full_subs=10, partial_subs=5)
    cycles = se.sparse_call_cycles(counts, cost, batch=2, heads=5)
    assert cycles == pytest.approx(10 * (3 * 1000 + 12 * 100 + 10 * 800 + 5 * 1200))
    counts = se.TileCounts(q_blocks=3, kv_blocks=10, num_sub=2, grid_kv_steps=4, visited=9,
                           full_subs=10, partial_subs=5, edge_subs=(4, 2))
    cycles = se.sparse_call_cycles(counts, dict(cost, edges=[900, 950]), batch=2, heads=5)
    assert cycles == pytest.approx(10 * (3 * 1000 + 12 * 100 + 10 * 800 + 5 * 1200 + 4 * 900
                                         + 2 * 950))


def test_step_and_run_combination_on_made_up_inputs():
    # 40 layers, self-attention 2.0 of a 3.0 s step: layer 0 keeps 0.05, 39 layers at 0.02
    # + 0.001 of extras: 3.0 - 1.95 + 39 * 0.021 = 1.869.
    step = se.sparse_step(3.0, 2.0, 0.02, 0.001, layers=40, dense_layers=1)
    assert step == pytest.approx(3.0 - 2.0 * 39 / 40 + 39 * 0.021)
    # Every layer dense at the dense call's cost and no extras: the dense step again.
    assert se.sparse_step(3.0, 2.0, 2.0 / 40, 0.0) == pytest.approx(3.0)
    assert se.average([3.0] * 10 + [1.5] * 40) == pytest.approx(1.8)
    plan = se.a14b_plan([0, 0, 0, 1, 1, 1], (2, 5), {0: 0.5, 1: 0.2})
    assert plan == [None, None, 0.5, 0.2, 0.2, None]
