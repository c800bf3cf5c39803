"""``--dry_run --estimate --sparse svg`` (issue 53) without a deviceless compile: the flags
(the dry run's refusal lifted), the kernel call the estimate records under SVG's mask, its
per-tile-class cycles against a brute-force count of the dense mask, and the run's average
over a step plan. The compiled estimate itself is a benchmark (benchmarks/svg_results.md)."""

import os
import sys

import jax
import jax.numpy as jnp
import pytest

import generate_flax
from custom_splash_attention import AttentionOptions, BlockSizes, splash_attention
from engine.dry_run import estimate, fit
from engine.programs.sparse import SparseSettings
from engine.programs.step_plan import StepPlan
from splash.svg import svg_mask

sys.path.insert(0, os.path.dirname(__file__))
from test_svg_estimate import brute_counts  # noqa: E402

WAN21 = "Wan-AI/Wan2.1-T2V-14B-Diffusers"


def _settings(densities=(0.3,), steps=(2, 8)):
    return SparseSettings(densities=densities, steps=steps, layers=(1, 40), num_frames=21,
                          frame_size=3600, source="test")


def test_average_over_the_plan():
    # 10 steps, [2, 8) sparse: 4 dense steps at 3.0 s and 6 sparse at 1.5 s.
    plan = StepPlan.build([0] * 10, _settings())
    assert plan.programs.count("svg0.3") == 6
    assert plan.average_seconds(3.0, {"svg0.3": 1.5}) == pytest.approx((4 * 3.0 + 6 * 1.5) / 10)
    # Two experts at their own densities: steps 0-4 high noise (s = 0.5), 5-9 low (0.2).
    two = StepPlan.build([0] * 5 + [1] * 5, _settings((0.5, 0.2)))
    got = two.average_seconds(3.0, {"svg0.5": 2.5, "svg0.2": 2.0})
    assert got == pytest.approx((2 * 3.0 + 3 * 2.5 + 3 * 2.0 + 2 * 3.0) / 10)
    with pytest.raises(KeyError):
        two.average_seconds(3.0, {"svg0.5": 2.5})


def test_sparse_estimate_fields():
    est = dict(seconds_per_step=3.0, sparse={"svg0.3": dict(seconds_per_step=1.5)})
    out = fit.sparse_estimate(est, StepPlan.build([0] * 10, _settings()))
    assert out["seconds_per_step"] == 3.0 and out["sparse_seconds_per_step"] == 1.5
    assert out["average_seconds_per_step"] == pytest.approx(2.1)
    assert out["sparse_plan"] == "4 dense + 6 sparse steps"
    est["sparse"]["svg0.2"] = dict(seconds_per_step=1.0)
    two = fit.sparse_estimate(est, StepPlan.build([0] * 5 + [1] * 5, _settings((0.3, 0.2))))
    assert two["sparse_seconds_per_step"] == {"svg0.3": 1.5, "svg0.2": 1.0}
    assert two["average_seconds_per_step"] == pytest.approx((4 * 3.0 + 3 * 1.5 + 3 * 1.0) / 10)


def test_dry_run_takes_sparse_svg():
    """The published Wan 2.1 T2V setting resolves under --dry_run (no refusal): 10 of 50
    steps and layer 0 dense, s = 0.3, 21 x 3,600 tokens at the default 720p x 81."""
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", WAN21, "--dry_run", "--estimate", "--topology", "v6e:2x4",
        "--sparse", "svg"]))
    s = config.sparse
    assert (s.densities, s.steps, s.layers) == ((0.3,), (10, 50), (1, 40))
    assert (s.num_frames, s.frame_size) == (21, 3600)


def test_aot_export_still_refused(capsys, tmp_path):
    assert generate_flax.cli(["--model_id", WAN21, "--dry_run", "--topology", "v6e:2x4",
                              "--sparse", "svg", "--aot_export", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--aot_export" in err, err


def test_recorded_band_call_and_its_cycles():
    """The stub records SVG's mask (window, anchor) on the traced call; its cycles are the
    per-class model over the sub-tiles of a brute-force count of the dense mask."""
    frames, frame_size, bs = 7, 150, BlockSizes(256, 256, 128)
    mask, seq = svg_mask(0.3, frames, frame_size), frames * frame_size
    x = jax.ShapeDtypeStruct((2, 3, seq, 64), jnp.bfloat16)
    calls = []
    with estimate.stub_attention_kernel(calls):
        jax.eval_shape(lambda q, k, v: splash_attention(
            q, k, v, options=AttentionOptions(block_sizes=bs, mask=mask)), x, x, x)
    (call,) = calls
    assert (call["band_window"], call["band_anchor"]) == (mask.window, frame_size)
    assert call["window_size"] is None and not call["segment_ids"]
    assert f"band{mask.window}+{frame_size}" in estimate._kernel_key(call)
    cost = dict(per_q_block=1000.0, step=100.0, full=800.0, partial=1200.0)
    want = brute_counts(mask, seq, bs)
    per_head = (want["q_blocks"] * (1000 + want["grid_kv_steps"] * 100)
                + want["full_subs"] * 800 + want["partial_subs"] * 1200)
    assert estimate.call_cycles(call, cost) == pytest.approx(2 * 3 * per_head)
