"""Two-expert denoising (Wan 2.2 A14B): one compiled step program, the expert chosen per step
on the host.

diffusers' ``WanPipeline`` (0.42.1, ``pipeline_wan.py:585-604``) runs a step whose timestep
``t >= boundary_ratio * num_train_timesteps`` with ``transformer`` (the high-noise expert) and
``guidance_scale``, every other step with ``transformer_2`` (the low-noise expert) and
``guidance_scale_2``. The timesteps are known before the loop, so the host knows each step's
expert. Both experts have the same config, so their placed weights have the same tree,
shapes, dtypes and shardings; the step program takes the weights and the guidance scale as
arguments, so one executable serves both (``ExpertStep``). Both experts stay resident in HBM,
each streamed from its own safetensors (``place_second``).
"""

from __future__ import annotations

import jax
import numpy as np

from engine.programs.denoise import set_timesteps
from engine.run.errors import GenerationError, fail
from engine.weights import sharding

# diffusers' argument names, used in the report.
EXPERT_NAMES = ("transformer", "transformer_2")


def resolve_guidance_scale_2(given: float | None, defaults: dict) -> float | None:
    """``--guidance_scale_2``: the flag, else the two-expert checkpoint's default (None for a
    one-expert model).

    Raises:
        UsageError: the flag on a one-expert model.
    """
    if given is not None and "guidance_scale_2" not in defaults:
        fail("--guidance_scale_2", given, "needs a two-expert model (transformer_2 and "
             "boundary_ratio in model_index.json)")
    return defaults.get("guidance_scale_2") if given is None else given


def second_expert(pipe):
    """The pipeline's ``transformer_2`` when it switches experts (``boundary_ratio`` set),
    else None."""
    second = getattr(pipe, "transformer_2", None)
    ratio = getattr(getattr(pipe, "config", None), "boundary_ratio", None)
    return second if second is not None and ratio is not None else None


def expert_schedule(timesteps, boundary_ratio: float, num_train_timesteps: int) -> list[int]:
    """Per step, 0 (``transformer``) when ``t >= boundary_ratio * num_train_timesteps``,
    else 1 (``transformer_2``), as ``WanPipeline`` decides it."""
    boundary = boundary_ratio * num_train_timesteps
    return [0 if float(t) >= boundary else 1 for t in timesteps]


def expert_steps(model_index: dict, scheduler_config: dict | None, make_scheduler,
                 scheduler: str, flow_shift: float | None, num_steps: int,
                 sigmas=None) -> tuple[int, int] | None:
    """A two-expert checkpoint's (``transformer`` steps, ``transformer_2`` steps) for a run,
    from its scheduler's timesteps before any model loads (the step caches need the split at
    validation); None for a one-expert checkpoint.

    Args:
        model_index: the checkpoint's ``model_index.json`` (its ``boundary_ratio``).
        scheduler_config: its ``scheduler/scheduler_config.json``.
        make_scheduler: the family's ``(config, --scheduler, flow_shift) -> scheduler``.
        scheduler, flow_shift, num_steps: the run's resolved values.
        sigmas: the family's ``scheduler_sigmas`` (None: the scheduler's own spacing).

    Raises:
        UsageError: the high-noise steps do not come first (a scheduler whose timesteps do
            not descend: each expert's steps must be one run).
    """
    ratio = model_index.get("boundary_ratio")
    if ratio is None or scheduler_config is None or make_scheduler is None:
        return None
    sched = make_scheduler(scheduler_config, scheduler, flow_shift)
    set_timesteps(sched, num_steps, sigmas)
    which = expert_schedule(sched.timesteps, ratio, sched.config.num_train_timesteps)
    if which != sorted(which):
        fail("--scheduler", scheduler, "gives timesteps that do not descend: a step cache "
             "needs each expert's steps in one run")
    return which.count(0), which.count(1)


def place_second(config, family, pipe, mesh, fallbacks) -> dict:
    """Stream ``transformer_2``'s weights from its own safetensors into the same shardings as
    the first expert's (``engine.weights.sharding.place_expert``), with the ``--lora_2`` files
    fused into each slice as ``--lora`` is into the first expert's."""
    return sharding.place_expert(config, family, pipe.transformer_2, "transformer_2", mesh,
                                 fallbacks)


def _layout(placed: dict):
    """What the compiled program fixes of an expert's weights: tree, shapes, dtypes,
    shardings."""
    return jax.tree.map(lambda a: (a.shape, str(a.dtype), a.sharding),
                        (placed["params"], placed["buffers"]))


class ExpertStep:
    """The loop's model call for a two-expert model.

    ``engine.programs.denoise.denoise_step`` calls ``at_timestep(t)`` with each step's host timestep
    and runs the returned ``(latents, t, inputs) -> noise prediction``: the one compiled
    program with the chosen expert's weights and guidance scale as arguments.

    Args:
        compiled: the AOT-compiled step ``(params, buffers, latents, t, inputs)``.
        experts: the two placed experts (``sharding.place_transformer`` results).
        scales: (guidance_scale, guidance_scale_2).
        inputs: the placed model inputs; ``inputs["guidance_scale"]`` gives the (B,) layout
            each expert's scale is placed with.
        boundary_ratio, num_train_timesteps: diffusers' switch rule.
        timesteps: the run's scheduler timesteps (for the report's per-step experts).

    Raises:
        GenerationError: the experts' weights differ in tree, shape, dtype or sharding (one
            program could not serve both).
    """

    def __init__(self, compiled, experts: list, scales: tuple, inputs, *,
                 boundary_ratio: float, num_train_timesteps: int, timesteps):
        if _layout(experts[0]) != _layout(experts[1]):
            raise GenerationError("transformer and transformer_2 differ in their weights' "
                                  "tree, shapes, dtypes or shardings: one compiled step "
                                  "cannot serve both")
        self.compiled, self.experts, self.scales = compiled, experts, tuple(scales)
        self.boundary_ratio, self.num_train_timesteps = boundary_ratio, num_train_timesteps
        layout = inputs["guidance_scale"]
        self.scale_arrays = [jax.device_put(np.full(layout.shape, s, np.float32),
                                            layout.sharding) for s in self.scales]
        self.schedule = expert_schedule(timesteps, boundary_ratio, num_train_timesteps)

    def expert_for(self, t) -> int:
        return expert_schedule([t], self.boundary_ratio, self.num_train_timesteps)[0]

    def at_timestep(self, t):
        """The model call for host timestep ``t`` (a torch or Python number)."""
        k = self.expert_for(t)
        placed, scale = self.experts[k], self.scale_arrays[k]

        def call(latents, timestep, inputs):
            return self.compiled(placed["params"], placed["buffers"], latents, timestep,
                                 {**inputs, "guidance_scale": scale})

        return call

    def __call__(self, latents, timestep, inputs):
        raise TypeError("a two-expert step needs the host timestep: call at_timestep(t)")

    def report(self) -> dict:
        """The JSON report's ``experts`` entry: the rule, the scales, which step used which
        expert (0-based step indices) and the count per expert."""
        steps = {name: [i for i, k in enumerate(self.schedule) if k == j]
                 for j, name in enumerate(EXPERT_NAMES)}
        return dict(
            boundary_ratio=self.boundary_ratio,
            boundary_timestep=self.boundary_ratio * self.num_train_timesteps,
            rule="t >= boundary_timestep: transformer with guidance_scale; else "
                 "transformer_2 with guidance_scale_2 (diffusers' two-expert pipeline)",
            guidance_scale=self.scales[0], guidance_scale_2=self.scales[1],
            steps=steps, steps_per_expert={k: len(v) for k, v in steps.items()},
            compiled_programs=1)


def flops_per_step(step, flops_of_expert) -> float | None:
    """Mean analytic FLOPs per step with each step counted at its own expert's cost
    (``flops_of_expert(k)``); None for a one-expert step."""
    if not isinstance(step, ExpertStep):
        return None
    return sum(flops_of_expert(k) for k in step.schedule) / len(step.schedule)
