"""The denoising step's compiled model call, as the loop runs it: one program, or the step
cache's full and cached pair, bound to one expert's weights or chosen per step between a
two-expert model's (``engine.programs.experts.ExpertStep``)."""

from __future__ import annotations

from engine.programs import experts, sparse, step_cache
from engine.programs.step import compile_step
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
            ``ExpertStep``, or with ``config.sparse`` a ``sparse.PlannedStep`` (dense and
            sparse programs, per step); with a cache it runs the full program (the loop
            itself runs the
            cache's runner).

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
    if config.sparse is not None:  # dense and sparse programs, chosen per step by a plan
        sparse_programs = sparse.compile_sparse_programs(config, placed, mesh, fn, latents,
                                                         timestep, inputs, timings)
        parked = (experts.ExpertParking([placed, second], memory=second["parked"])
                  if second and second.get("parked") else None)
        return sparse.planned_step(config, pipe, placed, second, compiled, sparse_programs,
                                   inputs, parked), None
    if second:
        # transformer_2 placed parked (experts.place_second): the idle expert stays parked.
        parked = (experts.ExpertParking([placed, second], memory=second["parked"])
                  if second.get("parked") else None)
        step = experts.ExpertStep(
            compiled, [placed, second],
            (config.video.guidance_scale, config.video.guidance_scale_2), inputs,
            boundary_ratio=pipe.config.boundary_ratio,
            num_train_timesteps=pipe.scheduler.config.num_train_timesteps,
            timesteps=pipe.scheduler.timesteps, parking=parked)
        if cache is not None:
            split = (step.schedule.count(0), step.schedule.count(1))
            if split != settings.expert_steps or step.schedule != sorted(step.schedule):
                raise GenerationError(f"the experts' steps {step.schedule} differ from the "
                                      f"split {settings.expert_steps} the step cache was "
                                      "scheduled with")
            cache.add_experts([placed, second], step.scale_arrays,
                              parked.ensure if parked else None)
        return step, cache
    params, buffers = placed["params"], placed["buffers"]
    return (lambda lat, ts, inp: compiled(params, buffers, lat, ts, inp)), cache
