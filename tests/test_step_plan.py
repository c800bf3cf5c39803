"""One per-step plan (issue 53, item 5; engine/programs/step_plan.py): the expert, the dense or
sparse program and the cache's full or cached decision of every step, built from the flags
as a run builds it (``engine.dry_run.fit.run_plan``, no model loaded), against values the
test computes on its own: the experts from diffusers' scheduler timesteps and the checkpoint's
``boundary_ratio``, the sparse steps from the published policy, DeepCache's pattern from its
rule, MagCache's decisions from diffusers' own ``MagCacheConfig`` ratios and its hook's rule.
"""

import json
import os

import diffusers
import pytest
import torch
from diffusers.hooks.mag_cache import MagCacheConfig

import generate_flax
from engine.dry_run import fit
from engine.files.checkpoint import CONFIGS_DIR
from engine.programs.step_plan import DENSE, StepPlan
from families import FAMILIES, detect_family

WAN21 = "Wan-AI/Wan2.1-T2V-14B-Diffusers"
A14B = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"


def _plan(model_id: str, steps: int, *flags: str) -> StepPlan:
    args = generate_flax.parse_args(["--model_id", model_id, "--dry_run", "--topology",
                                     "v6e:2x4", "--num_inference_steps", str(steps), *flags])
    config = generate_flax.validate_args(args)
    return fit.run_plan(config, FAMILIES[detect_family(model_id)])


def _experts(model_id: str, steps: int, flow_shift: float) -> list[int]:
    """Per step 0 while t >= boundary_ratio * num_train_timesteps, else 1 (diffusers'
    WanPipeline, 0.42.1 pipeline_wan.py), on diffusers' UniPC built from the checkpoint's
    scheduler config with the run's flow_shift."""
    root = os.path.join(CONFIGS_DIR, model_id)
    with open(os.path.join(root, "model_index.json")) as f:
        ratio = json.load(f)["boundary_ratio"]
    with open(os.path.join(root, "scheduler", "scheduler_config.json")) as f:
        cfg = json.load(f)
    sched = diffusers.UniPCMultistepScheduler.from_config(cfg, flow_shift=flow_shift)
    sched.set_timesteps(steps)
    boundary = ratio * sched.config.num_train_timesteps
    return [0 if float(t) >= boundary else 1 for t in sched.timesteps]


def test_one_expert_dense():
    plan = _plan(WAN21, 6)
    assert plan.experts == (0,) * 6 and plan.programs == (DENSE,) * 6
    assert plan.cached == (False,) * 6 and plan.cache == "none"
    assert plan.report() == dict(experts=[0] * 6, programs=[DENSE] * 6, caching=["full"] * 6,
                                 cache="none", sparse_steps=0, cached_steps=0)


@pytest.mark.parametrize("steps, start", [(40, 11), (20, 6)])  # 11 * 20 / 40 = 5.5: up to 6
def test_two_experts_sparse(steps, start):
    """Wan 2.2 A14B's published SVG policy (maxdiffusion's moderate: steps [11, 40) of 40
    sparse, s = 0.5 on the high-noise expert, 0.2 on the low-noise one) at its official
    flow_shift 12.0."""
    plan = _plan(A14B, steps, "--sparse", "svg")
    want = _experts(A14B, steps, 12.0)
    assert 0 < want.count(1) < steps  # the boundary falls inside the run
    assert list(plan.experts) == want
    density = {0: "svg0.5", 1: "svg0.2"}
    assert list(plan.programs) == [density[e] if start <= i < steps else DENSE
                                   for i, e in enumerate(want)]
    assert plan.cached == (False,) * steps
    assert plan.report()["sparse_steps"] == steps - start


def test_two_experts_deepcache():
    """DeepCache over two experts: full when step < start, step >= end or (step - start) %
    interval == 0, and at each expert's first step (it records its own input)."""
    plan = _plan(A14B, 40, "--cache", "deepcache", "--cache_start_step", "4",
                 "--cache_end_step", "36", "--cache_step_interval", "3")
    want = _experts(A14B, 40, 12.0)
    assert list(plan.experts) == want and plan.programs == (DENSE,) * 40
    first = {want.index(0), want.index(1)}
    assert [not (i < 4 or i >= 36 or (i - 4) % 3 == 0 or i in first)
            for i in range(40)] == list(plan.cached)
    assert plan.cache == "deepcache" and any(plan.cached)


def test_magcache_schedule():
    """MagCache on Wan 2.1 T2V 14B's shipped ratios (the cond entries of the MagCache authors'
    interleaved list) at 30 steps and diffusers' defaults: diffusers' ``MagCacheConfig``
    interpolates them, and its ``MagCacheHeadHook.new_forward`` rule (diffusers 0.42.1
    hooks/mag_cache.py, the ``# MagCache Logic`` block) decides each step, replayed here on
    its own tensors."""
    steps = 30
    plan = _plan(WAN21, steps, "--cache", "magcache")
    with open(os.path.join(CONFIGS_DIR, "mag_ratios.json")) as f:
        cond = json.load(f)["wan2.1-t2v-14b"]["published"][0::2]
    cfg = MagCacheConfig(num_inference_steps=steps, mag_ratios=cond)
    retention = int(cfg.retention_ratio * steps + 0.5)
    ratio, err, count, residual, want = 1.0, 0.0, 0, False, []
    for step in range(steps):
        skip = False
        if step >= retention:
            ratio = ratio * cfg.mag_ratios[step]
            count += 1
            err += abs(1.0 - ratio)
            skip = residual and bool(err <= cfg.threshold) and count <= cfg.max_skip_steps
            if not skip:
                ratio, err, count = 1.0, 0.0, 0
        residual = residual or not skip
        want.append(skip)
    assert isinstance(cfg.mag_ratios, torch.Tensor) and any(want)
    assert list(plan.cached) == want and plan.cache == "magcache"
    assert plan.experts == (0,) * steps and plan.programs == (DENSE,) * steps
    assert plan.report()["caching"] == ["cached" if c else "full" for c in want]


def test_warmup_runs_the_cached_program_after_a_full_step_of_its_expert():
    plan = StepPlan((0, 0, 0, 1, 1, 1), (DENSE,) * 6, (False, True, True, False, True, True),
                    "deepcache")
    warm, n = plan.warmup(2)
    assert n == 2 and warm.cached[:2] == (False, True) and warm.experts == plan.experts
    assert plan.warmup(3)[0].cached[:3] == (False, True, False)
    # The switch: step 2 may not be cached on what expert 0's step 1 kept.
    switch = StepPlan((0, 1, 1), (DENSE,) * 3, (False, False, True), "deepcache")
    warm, n = switch.warmup(1)
    assert n == 3 and warm.cached == (False, False, True)


def test_a_step_both_sparse_and_cached_is_refused():
    class Sparse:
        steps = (1, 3)

        def key(self, expert):
            return "svg0.3"

    class Cache:
        on, kind = True, "deepcache"

        def schedule(self, n):
            return (False, False, True, False)

    with pytest.raises(ValueError, match=r"steps \[2\] are both sparse and cached"):
        StepPlan.build([0] * 4, Sparse(), Cache())
    with pytest.raises(ValueError, match="3 experts, 2 programs"):
        StepPlan((0, 0, 0), (DENSE, DENSE))
