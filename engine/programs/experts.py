"""Two-expert denoising (Wan 2.2 A14B): one compiled step program, the expert chosen per step
on the host, the idle expert parked where both whole would not fit.

diffusers' ``WanPipeline`` (0.42.1, ``pipeline_wan.py:585-604``) runs a step whose timestep
``t >= boundary_ratio * num_train_timesteps`` with ``transformer`` (the high-noise expert) and
``guidance_scale``, every other step with ``transformer_2`` (the low-noise expert) and
``guidance_scale_2``. The timesteps are known before the loop, so the host knows each step's
expert. Both experts have the same config, so their placed weights have the same tree,
shapes, dtypes and (home) shardings; the step program takes the weights and the guidance
scale as arguments, so one executable serves both (``ExpertStep``). Each expert is streamed
from its own safetensors (``place_second``).

Expert parking (``--park_weights``, ``ExpertParking``): only one expert runs at a step, so
the idle one can be kept parked, every weight sharded over all devices
(``engine.weights.placement.parked_sharding``). ``transformer_2`` is placed parked; at the
boundary step the done expert is parked (local slices, no interconnect traffic) and the next
one gathered (one all-gather per weight), one weight at a time. A layout that replicates the
weights (Ulysses ``sp``) then holds one expert whole and 1/devices of the other: Wan 2.2
A14B at dp2 x sp4 on v6e-8 holds 26.67 + 3.33 GiB instead of 53.3. With ``--park_memory
pinned_host`` (``engine.weights.layout.idle_expert_memory``; "auto" picks it where it lets
the layout be Ulysses: A14B on v6e-8) the parked slices live in host memory instead, so the
idle expert holds no HBM; the swap then also moves each device's slice over the host link.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from engine.programs import parking
from engine.programs.denoise import set_timesteps
from engine.run import chips
from engine.run.errors import GenerationError, fail
from engine.weights import layout, placement, sharding

# diffusers' argument names, used in the report.
EXPERT_NAMES = ("transformer", "transformer_2")
# ``--park_weights auto`` parks the idle expert when the two experts whole would take more
# than this share of a device's usable HBM (leaving under 3.9 GiB of v6e's 31.25 for a
# 720p x 81 step's activations), on every chip. Below the v6e Ulysses share
# (``chips.ULYSSES_WEIGHT_FRACTION``), so a layout chosen for parking always parks.
PARK_EXPERT_FRACTION = 0.875


def park_idle_expert(mode: str, whole_bytes: int, parked_bytes: int,
                     capacity: int | None) -> bool:
    """Whether a two-expert model keeps its idle expert parked.

    Args:
        mode: ``--park_weights`` (``on``: always; ``off``: never; ``auto``: when the two
            experts whole exceed ``PARK_EXPERT_FRACTION`` of ``capacity``).
        whole_bytes / parked_bytes: one expert's weights per device, whole (its home
            shardings) and parked.
        capacity: usable HBM bytes per device, or None (CPU: ``auto`` never parks).

    Never parks when parking saves nothing (weights already sharded over every device).
    """
    if mode == "off" or parked_bytes >= whole_bytes:
        return False
    if mode == "on":
        return True
    return capacity is not None and 2 * whole_bytes > PARK_EXPERT_FRACTION * capacity


def expert_bytes(structs) -> tuple[int, int]:
    """(whole, parked) bytes per device of one expert's weights (``jax.Array``s or sharded
    ``ShapeDtypeStruct``s at their home shardings), the largest over devices."""
    structs = list(structs)
    parked = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placement.parked_sharding(a))
              for a in structs]
    return (sum(placement.shard_bytes(a) for a in structs),
            sum(placement.shard_bytes(a) for a in parked))


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
    fused into each slice as ``--lora`` is into the first expert's; placed parked (its
    ``parked`` the memory kind, "device" or "pinned_host") where ``park_idle_expert`` says
    so for the run's chip, in the memory ``layout.idle_expert_memory`` picks."""
    chip = chips.chip_for_device_kind(mesh.devices.flat[0].device_kind)
    capacity = chip and chip.usable_hbm_bytes

    def park(structs) -> str | None:
        whole, parked = expert_bytes(structs)
        if not park_idle_expert(config.run.park_weights, whole, parked, capacity):
            return None
        return layout.idle_expert_memory(config.run.park_memory, chip, whole, parked)

    return sharding.place_expert(config, family, pipe.transformer_2, "transformer_2", mesh,
                                 fallbacks, park=park)


def _hbm_bytes(arr) -> int:
    """Bytes one device holds of ``arr`` in its HBM (0 for an array in host memory)."""
    return 0 if placement.on_host(arr) else placement.shard_bytes(arr)


def _layout(placed: dict, homes: dict | None = None):
    """What the compiled program fixes of an expert's weights: tree, shapes, dtypes,
    shardings (``homes``' where given: a parked expert's are its home shardings)."""
    def entry(group, name, a):
        sh = a.sharding if homes is None else homes[(group, name)]
        return (a.shape, str(a.dtype), sh)

    return {group: {name: entry(group, name, a) for name, a in placed[group].items()}
            for group in ("params", "buffers")}


class ExpertParking:
    """The two experts' weights, one whole and the other parked, swapped on demand.

    Args:
        experts: the two placed experts (dicts with ``params`` / ``buffers``, changed in
            place so every program bound to them sees the moved arrays); ``experts[0]``
            whole, ``experts[1]`` parked (as ``place_second`` places it).
        on_move: optional ``f()`` called while a weight's old and new copies are both live
            (tests sample the device bytes there).
        memory: where parked weights live: "device" (HBM) or "pinned_host" (host memory,
            ``--park_memory``).

    ``ensure(k)`` makes expert ``k`` whole: the other expert's weights are parked first
    (each a local slice of what the device holds), then ``k``'s gathered to their home
    shardings (one all-gather each), one weight at a time, so the HBM held at any moment is
    at most the steady state (one whole, one parked) plus one weight's parked slice.
    ``release()`` records that a decode parked everything (``parking.ParkingDecoder``).
    ``swaps``: one dict per swap (to, park_s, gather_s, gathered_bytes_per_device).
    """

    def __init__(self, experts: list, on_move=None, memory: str = "device"):
        self.experts, self.on_move, self.memory = experts, on_move, memory
        first = experts[0]
        mesh = next(iter(first["params"].values())).sharding.mesh
        self.homes = {**{("params", k): jax.sharding.NamedSharding(mesh, first["specs"][k])
                         for k in first["params"]},
                      **{("buffers", k): a.sharding for k, a in first["buffers"].items()}}
        self.whole: int | None = 0
        self.swaps: list[dict] = []
        for placed in experts:
            placed["expert_parking"] = self  # the decode's parking leaves the restore to us

    def release(self) -> None:
        self.whole = None

    def _put(self, k: int, home: bool) -> int:
        """Move expert ``k``'s weights home (``home``) or to parked; returns the bytes per
        device it gained."""
        gained = 0
        for group in ("params", "buffers"):
            arrays = self.experts[k][group]
            for name, arr in list(arrays.items()):
                target = self.homes[(group, name)] if home else placement.parked_sharding(
                    arr, self.memory)
                if target.is_equivalent_to(arr.sharding, arr.ndim):
                    continue
                before = _hbm_bytes(arr)
                arrays[name] = parking.move_array(arr, target, self.on_move)
                gained += _hbm_bytes(arrays[name]) - before
        return gained

    def ensure(self, k: int) -> None:
        """Make expert ``k`` whole and the other parked (nothing when it already is)."""
        if self.whole == k:
            return
        t0 = time.perf_counter()
        self._put(1 - k, home=False)
        t1 = time.perf_counter()
        gathered = self._put(k, home=True)
        self.whole = k
        self.swaps.append(dict(to=EXPERT_NAMES[k], park_s=t1 - t0,
                               gather_s=time.perf_counter() - t1,
                               gathered_bytes_per_device=gathered))

    def report(self) -> dict:
        return dict(idle_expert_parked=True, memory=self.memory, swaps=self.swaps)


class ExpertStep:
    """The loop's model call for a two-expert model.

    ``engine.programs.denoise.denoise_step`` calls ``at_timestep(t)`` with each step's host
    timestep (or a ``step_plan.PlannedStep`` calls ``for_expert(k)`` with the plan's expert)
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
        parking: an ``ExpertParking`` of ``experts`` when the idle one is kept parked (each
            step then first makes its expert whole), else None.

    Raises:
        GenerationError: the experts' weights differ in tree, shape, dtype or (home)
            sharding (one program could not serve both).
    """

    def __init__(self, compiled, experts: list, scales: tuple, inputs, *,
                 boundary_ratio: float, num_train_timesteps: int, timesteps, parking=None):
        homes = parking and parking.homes
        if _layout(experts[0], homes) != _layout(experts[1], homes):
            raise GenerationError("transformer and transformer_2 differ in their weights' "
                                  "tree, shapes, dtypes or shardings: one compiled step "
                                  "cannot serve both")
        self.compiled, self.experts, self.scales = compiled, experts, tuple(scales)
        self.parking = parking
        self.boundary_ratio, self.num_train_timesteps = boundary_ratio, num_train_timesteps
        layout = inputs["guidance_scale"]
        self.scale_arrays = [jax.device_put(np.full(layout.shape, s, np.float32),
                                            layout.sharding) for s in self.scales]
        self.schedule = expert_schedule(timesteps, boundary_ratio, num_train_timesteps)

    def expert_for(self, t) -> int:
        return expert_schedule([t], self.boundary_ratio, self.num_train_timesteps)[0]

    def at_timestep(self, t):
        """The model call for host timestep ``t`` (a torch or Python number)."""
        return self.for_expert(self.expert_for(t))

    def for_expert(self, k: int):
        """The model call with expert ``k``'s weights and guidance scale (a
        ``step_plan.StepPlan`` names the expert per step)."""
        if self.parking is not None:  # the boundary step: park the done expert, gather k
            self.parking.ensure(k)
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
            compiled_programs=1,
            parking=self.parking.report() if self.parking else dict(idle_expert_parked=False))


def flops_per_step(step, flops_of_expert) -> float | None:
    """Mean analytic FLOPs per step with each step counted at its own expert's cost
    (``flops_of_expert(k)``); None for a one-expert step."""
    if not isinstance(step, ExpertStep):
        return None
    return sum(flops_of_expert(k) for k in step.schedule) / len(step.schedule)
