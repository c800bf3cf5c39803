"""The denoising step's compiled model call, as the loop runs it: one program bound to one
expert's weights or chosen per step between a two-expert model's
(``engine.programs.experts.ExpertStep``); with a step cache or ``--sparse``, several programs
chosen per step by the run's ``step_plan.StepPlan`` (``step_plan.PlannedStep``)."""

from __future__ import annotations

from engine.programs import experts, sparse, step_cache
from engine.programs.step import compile_step
from engine.programs.step_plan import DENSE, PlannedStep, StepPlan
from engine.run.errors import GenerationError


def compile_transformer_step(config, stack, pipe, placed: dict, second: dict | None, mesh, fn,
                             latents, timestep, inputs, timings: dict, precompiled=None):
    """AOT-compile the step and bind its weights; returns (step, ``step_cache.StepCache`` or
    None).

    Args:
        config: the ``RunConfig`` (``step_cache``, the guidance scales).
        stack: the family's ``BlockStack`` (where a cache cuts the blocks).
        pipe: the diffusers pipeline (a two-expert model's ``boundary_ratio``, the scheduler
            with the run's timesteps set).
        placed / second: the placed ``transformer`` and, for a two-expert model,
            ``transformer_2`` (same tree, shapes and shardings), else None.
        fn: the family's torch step function; latents, timestep, inputs: placed examples.
        timings: receives ``compile_transformer_s`` (and ``compile_transformer_cached_s``).
        precompiled: (compiled, seconds) of ``compile_step`` for these arguments' signature,
            compiled ahead from shapes (``engine.pipeline.ahead``), or None; without a step
            cache it is used instead of compiling.

    Returns:
        step: ``(latents, t, inputs) -> noise prediction`` with the weights bound, an
            ``ExpertStep``, or with a cache or ``config.sparse`` a ``step_plan.PlannedStep``
            (the run's plan over its programs; with a cache its ``for_loop`` is the cache's
            runner, and its dense program the full program's noise prediction).

    Raises:
        GenerationError: the experts' split by the loaded scheduler differs from the one the
            cache's schedule was resolved with before loading.
    """
    cache, settings = None, config.step_cache
    if settings is not None and settings.on:
        cache = step_cache.compile_cache_programs(placed, mesh, fn, stack, settings, latents,
                                                  timestep, inputs)
        timings["compile_transformer_s"] = cache.compile_s["full"]
        timings["compile_transformer_cached_s"] = cache.compile_s["cached"]
        full = cache.programs[0]

        def compiled(*args):
            return full(*args)[0]
    elif precompiled is not None:
        compiled, timings["compile_transformer_s"] = precompiled
    else:
        compiled, timings["compile_transformer_s"] = compile_step(placed, mesh, fn, latents,
                                                                  timestep, inputs)
    programs = {DENSE: compiled}
    if config.sparse is not None:  # dense and sparse programs, chosen per step by the plan
        programs.update(sparse.compile_sparse_programs(config, placed, mesh, fn, latents,
                                                       timestep, inputs, timings))
    # transformer_2 placed parked (experts.place_second): the idle expert stays parked.
    parked = (experts.ExpertParking([placed, second], memory=second["parked"])
              if second and second.get("parked") else None)
    steps = {k: _bind(config, pipe, c, placed, second, inputs, parked)
             for k, c in programs.items()}
    if cache is None and len(steps) == 1:  # one program, no cache: nothing to plan
        return steps[DENSE], None
    expert_of_step = [0] * len(pipe.scheduler.timesteps)
    if second:
        expert_of_step = steps[DENSE].schedule
        if cache is not None:
            _check_split(expert_of_step, settings.expert_steps)
            cache.add_experts([placed, second], steps[DENSE].scale_arrays,
                              parked.ensure if parked else None)
    plan = StepPlan.build(expert_of_step, config.sparse, settings)
    return PlannedStep(steps, plan, pipe.scheduler.timesteps, config.sparse, cache), cache


def _bind(config, pipe, compiled, placed: dict, second: dict | None, inputs, parked):
    """``compiled`` as the loop calls it: ``(latents, t, inputs) -> noise prediction`` with
    ``placed``'s weights bound, or for two experts an ``experts.ExpertStep`` (one program,
    either expert's weights and guidance scale)."""
    if not second:
        params, buffers = placed["params"], placed["buffers"]
        return lambda lat, ts, inp: compiled(params, buffers, lat, ts, inp)
    return experts.ExpertStep(
        compiled, [placed, second],
        (config.video.guidance_scale, config.video.guidance_scale_2), inputs,
        boundary_ratio=pipe.config.boundary_ratio,
        num_train_timesteps=pipe.scheduler.config.num_train_timesteps,
        timesteps=pipe.scheduler.timesteps, parking=parked)


def _check_split(expert_of_step: list, split) -> None:
    """The loaded scheduler's experts per step against the split the step cache was
    scheduled with before loading (``CacheSettings.expert_steps``).

    Raises:
        GenerationError: they differ, or the high-noise steps do not come first."""
    if (expert_of_step.count(0), expert_of_step.count(1)) != split \
            or expert_of_step != sorted(expert_of_step):
        raise GenerationError(f"the experts' steps {expert_of_step} differ from the split "
                              f"{split} the step cache was scheduled with")
