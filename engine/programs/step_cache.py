"""Step caching on static schedules: DeepCache and MagCache as two ahead-of-time programs.

Both caches skip transformer work on some denoising steps, and both decide which steps from
the step index alone (DeepCache: a fixed pattern; MagCache: calibrated per-step magnitude
ratios), so the whole schedule is known on the host before the loop. That fits our
ahead-of-time design: a *full* program that runs every block and returns what the cache
keeps, and a *cached* program that takes it, with the choice made on the host per step. No
device-to-host sync is needed, and there is no third compile: the full program takes no
cache, and step 0 is always full, so the cached program always has one.

- **DeepCache** (as HunyuanVideo-1.5's official pipeline ships it; flags and defaults are the
  earlier TPU port's): a step is full when ``step < start``, ``step >= end`` or
  ``(step - start) % interval == 0``. A full step records the input (the block carry: hidden
  states, and HunyuanVideo-1.5's text stream) of block ``L - k`` (``k`` =
  ``--cache_recompute_blocks``); a cached step skips blocks ``0 .. L-k-1``, runs the last
  ``k`` blocks on the recorded input with the current step's timestep, then the output head.
- **MagCache** (Ma et al., 2025, "MagCache: Fast Video Generation with Magnitude-Aware
  Cache"; the semantics are diffusers 0.42.1's ``hooks/mag_cache.py``, whose code is the
  spec): a skipped step outputs the blocks' input plus the residual (last block output minus
  first block input) of the last full step; the output head then runs as usual.

Two-expert models (Wan 2.2 A14B): each expert is its own cache (``CacheSettings.expert_steps``;
MagCache as if diffusers' hook were attached to that expert alone, DeepCache with each
expert's first step full), and one full and one cached program serve both experts, the
weights and the guidance scale being arguments (``StepCache.add_experts``).

With CFG the cond and uncond passes are one batch-2 call, so one decision per step serves
both. diffusers keeps separate "cond" / "uncond" cache states, but with one ratio list both
states see the same step index, the same ratios and the same "a residual exists", so they
decide alike; the residual and recorded input stay per branch (the batch rows).

The schedule is fixed by the settings, not by the run's values: quality is traded for speed,
and nothing here measures quality on real weights (docs/features.md, "Step caching").

This module holds the compiled programs, the loop's runner and the reports; the settings and
schedules are ``step_cache_settings``, the flags ``step_cache_flags``, MagCache's ratio
lists ``mag_ratios``; the run's per-step decisions are ``step_plan.StepPlan``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from engine.programs import executables
from engine.programs.step import step_shardings
from engine.programs.step_cache_settings import CacheSettings
from engine.run.errors import GenerationError
from engine.weights.scan_layers import install_cached_blocks


def kept_specs(shapes, mesh) -> list:
    """A ``PartitionSpec`` per kept array: batch over "dp" and tokens over the other mesh axes
    that divide them (the residual stream is replicated over "tp" between blocks; what the
    cache keeps across steps need not be, and costs 1/(tp*sp) of the HBM this way)."""
    out = []
    for shape in shapes:
        batch = "dp" if shape[0] % mesh.shape["dp"] == 0 and mesh.shape["dp"] > 1 else None
        token = [a for a in ("tp", "sp") if mesh.shape[a] > 1]
        while token and shape[1] % math.prod(mesh.shape[a] for a in token):
            token.pop()
        out.append(P(batch, tuple(token) if len(token) > 1 else (token[0] if token else None),
                     *([None] * (len(shape) - 2))))
    return out


@dataclasses.dataclass
class StepCache:
    """The compiled full and cached step programs (weights bound); which step runs which is
    the run's ``step_plan.StepPlan`` (its ``cached``, from ``CacheSettings.schedule``).

    full: (latents, t, embeds) -> (noise prediction, kept tuple).
    cached: (latents, t, embeds, kept tuple) -> noise prediction.
    settings: the ``CacheSettings``; ``kept_bytes``: bytes of the kept arrays in all (their
    per-chip share is ``kept_bytes_per_chip``).
    programs: the unbound compiled (full, cached) programs, weights first; ``experts``: per
    expert (params, buffers, guidance-scale array or None), the weights a step binds
    (``add_experts`` sets a two-expert model's; one program pair serves both).
    """
    full: object
    cached: object | None
    settings: CacheSettings
    kept_shapes: list
    kept_bytes: int
    kept_bytes_per_chip: int
    compile_s: dict
    programs: tuple | None = None
    experts: list | None = None
    ensure: object = None

    def add_experts(self, placed: list, scale_arrays: list, ensure=None) -> None:
        """Bind a two-expert model's weights and guidance scales (``ExpertStep``'s), in
        ``EXPERT_NAMES`` order; ``ensure``: ``ExpertParking.ensure`` when the idle expert is
        parked (each call first makes its expert whole), else None."""
        self.experts = [(p["params"], p["buffers"], s)
                        for p, s in zip(placed, scale_arrays, strict=True)]
        self.ensure = ensure

    def runner(self, plan, calibrate: bool = False):
        """The model call of one loop over ``plan`` (a ``step_plan.StepPlan``: the run's, or
        the warmup's): each step full or cached, with its expert's weights, as the plan
        says."""
        return _Runner(self, plan, calibrate)

    def call(self, expert: int, latents, t, embeds, kept=None):
        """The full (``kept`` None) or cached program with ``expert``'s weights."""
        if not self.experts:
            return self.full(latents, t, embeds) if kept is None \
                else self.cached(latents, t, embeds, kept)
        if self.ensure is not None:
            self.ensure(expert)
        params, buffers, scale = self.experts[expert]
        embeds = {**embeds, "guidance_scale": scale}
        if kept is None:
            return self.programs[0](params, buffers, latents, t, embeds)
        return self.programs[1](params, buffers, latents, t, embeds, kept)


class _Runner:
    """One sampling loop's model call: ``at_step(i)`` runs step ``i`` as ``plan`` says (the
    full or the cached program, with ``plan.experts[i]``'s weights) and holds the kept arrays
    on the device between steps. ``kinds`` lists "full" / "cached" per call; with
    ``calibrate`` it collects MagCache's magnitude ratio per step and branch (None at each
    expert's first step)."""

    def __init__(self, cache: StepCache, plan, calibrate: bool):
        self.cache, self.plan = cache, plan
        self.kept, self.kinds, self.calibrate, self.ratios = None, [], calibrate, []
        self.kept_by = None  # the expert whose full step recorded ``kept``
        self.kept_bytes_by_device = None  # {device id: bytes}, read off the live arrays

    def at_step(self, i: int):
        return functools.partial(self._step, i)

    def _step(self, i: int, latents, t, embeds):
        cached, expert = self.plan.cached[i], self.plan.experts[i]
        self.kinds.append("cached" if cached else "full")
        if cached:
            if self.kept_by != expert:  # the plans never do this; a guard, not a path
                raise GenerationError(f"step {i}: a cached step of expert {expert} would "
                                      f"read what expert {self.kept_by} recorded")
            return self.cache.call(expert, latents, t, embeds, self.kept)
        previous, self.kept = self.kept, None  # let the old arrays go before the new ones land
        same = self.kept_by == expert
        out, self.kept = self.cache.call(expert, latents, t, embeds)
        self.kept_by = expert
        if self.kept_bytes_by_device is None:
            self.kept_bytes_by_device = {}
            for x in self.kept:
                for shard in x.addressable_shards:
                    d = shard.device.id
                    self.kept_bytes_by_device[d] = (self.kept_bytes_by_device.get(d, 0)
                                                    + shard.data.nbytes)
        if self.calibrate:
            self.ratios.append((expert, None if previous is None or not same else
                                magnitude_ratio(self.kept[0], previous[0])))
        return out

    def calibration(self) -> dict:
        """{"mag_ratios": cond per step, "mag_ratios_uncond": ...} (host floats), diffusers'
        calibration formula: mean over tokens of |r_t| / (|r_t-1| + 1e-8), 1.0 at step 0.
        For a two-expert model each holds one list per expert (``EXPERT_NAMES`` order), each
        starting at 1.0, as diffusers' hook on that expert alone measures it."""
        rows = [(k, np.ones(1) if r is None else np.asarray(r, np.float64))
                for k, r in self.ratios]
        width = max(len(r) for _, r in rows)
        per_expert = sorted({k for k, _ in rows})
        out = {}
        for branch, key in enumerate(("mag_ratios", "mag_ratios_uncond")[:min(width, 2)]):
            lists = [[round(float(np.broadcast_to(r, (width,))[branch]), 5)
                      for k, r in rows if k == e] for e in per_expert]
            out[key] = lists if self.cache.experts else lists[0]
        return out


def magnitude_ratio(current, previous):
    """Per batch row: mean over tokens of ||current|| / (||previous|| + 1e-8) over the last
    axis, in float32, as diffusers' ``MagCacheBlockHook._perform_calibration_step`` (which runs
    it per CFG branch). (B, N, D) x2 -> (B,) float32, on the device."""
    return _magnitude_ratio_fn()(current, previous)


@functools.cache
def _magnitude_ratio_fn():
    # Jitted once per process: a fresh jax.jit per calibration step would trace it every step.
    @jax.jit
    def ratio(c, p):
        cn = jnp.linalg.norm(c.astype(jnp.float32), axis=-1)
        pn = jnp.linalg.norm(p.astype(jnp.float32), axis=-1)
        return jnp.mean(cn / (pn + 1e-8), axis=1)

    return ratio


def step_functions(step_fn, blocks):
    """(full, cached) torch functions over the family's ``step_fn`` (params, buffers, latents,
    timestep, inputs) -> noise prediction: each sets the block list's mode for its trace."""

    def full(params, buffers, latents, timestep, inputs):
        blocks.mode, blocks.record = "full", None
        try:
            out = step_fn(params, buffers, latents, timestep, inputs)
            return out, tuple(blocks.record) if isinstance(blocks.record, tuple) \
                else (blocks.record,)
        finally:
            blocks.mode, blocks.record = "plain", None

    def cached(params, buffers, latents, timestep, inputs, kept):
        blocks.mode = "cached"
        blocks.kept = kept if blocks.kind == "deepcache" else kept[0]
        try:
            return step_fn(params, buffers, latents, timestep, inputs)
        finally:
            blocks.mode, blocks.kept = "plain", None

    return full, cached


def compile_cache_programs(placed: dict, mesh, step_fn, stack, settings: CacheSettings,
                           latents, timestep, inputs, *, lower_only: bool = False):
    """Install the cached block list on ``placed["module"]`` and AOT-compile the full and the
    cached program (``lower_only``: only lower them, for callers that compile themselves).

    Returns a ``StepCache`` whose calls bind ``placed``'s weights; with ``lower_only`` its
    ``full`` and ``cached`` are the ``jax.stages.Lowered`` programs.
    """
    blocks = install_cached_blocks(placed["module"]._model, stack, settings.kind,
                                   settings.recompute_blocks)
    full_fn, cached_fn = step_functions(step_fn, blocks)
    in_sh, out_sh = step_shardings(placed, mesh)
    full_view = interop.jax_view(full_fn)
    args = (placed["params"], placed["buffers"], latents, timestep, inputs)
    # The kept arrays' shapes come from tracing the full program once (abstractly).
    probe = jax.eval_shape(full_view, *args)
    shapes = [tuple(x.shape) for x in probe[1]]
    specs = kept_specs(shapes, mesh)
    kept_sh = tuple(NamedSharding(mesh, s) for s in specs)
    kept_abstract = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
                          for x, sh in zip(probe[1], kept_sh, strict=True))
    full_jit = jax.jit(full_view, in_shardings=in_sh, out_shardings=(out_sh, kept_sh))
    # keep_unused: MagCache's cached program reads no block weight, but they stay in HBM and
    # the dry run's per-chip figures must count them.
    cached_jit = jax.jit(interop.jax_view(cached_fn), in_shardings=(*in_sh, kept_sh),
                         out_shardings=out_sh, keep_unused=True)
    cached_args = (*args, kept_abstract)
    seconds, made = {}, {}
    for name, jitted, a in (("full", full_jit, args), ("cached", cached_jit, cached_args)):
        t0 = time.perf_counter()
        if lower_only:
            made[name] = jitted.lower(*a)
        else:  # from the executable cache when one is open and matches (no tracing then)
            made[name], _ = executables.compile_program(
                f"transformer_step_{name}", functools.partial(jitted.lower, *a), a,
                extra=[settings.kind, settings.recompute_blocks])
        seconds[name] = time.perf_counter() - t0
    full, cached = made["full"], made["cached"]
    nbytes = [math.prod(x.shape) * x.dtype.itemsize for x in probe[1]]
    per_chip = sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize
                   for x, sh in zip(probe[1], kept_sh, strict=True))
    params, buffers = placed["params"], placed["buffers"]
    programs = None
    if not lower_only:
        programs = full_c, cached_c = full, cached
        full = lambda lat, ts, inp: full_c(params, buffers, lat, ts, inp)  # noqa: E731
        cached = lambda lat, ts, inp, kept: cached_c(params, buffers, lat, ts, inp, kept)  # noqa
    return StepCache(full=full, cached=cached, settings=settings, kept_shapes=shapes,
                     kept_bytes=sum(nbytes), kept_bytes_per_chip=per_chip, compile_s=seconds,
                     programs=programs)


def flops_per_step(full_flops: float, config, cfg: dict) -> float:
    """Mean analytic FLOPs per step over the run's schedule: a cached step costs nothing in
    the blocks with MagCache and ``k / L`` of them with DeepCache (embeddings and the output
    head, < 0.1% at Wan sizes, are left out as in the families' counts)."""
    settings = config.step_cache
    if settings is None or not settings.on:
        return full_flops
    schedule = settings.schedule(config.video.num_inference_steps)
    cached = sum(schedule)
    share = settings.cached_share(cfg["num_layers"])
    return full_flops * (len(schedule) - cached + cached * share) / len(schedule)


def cache_report(cache: StepCache, runs: list, num_steps: int) -> dict:
    """The JSON report's ``cache`` entry (a run's, and with ``runs`` empty the dry run's):
    settings, ``cached_steps`` (0-based), what the cache keeps (shapes, bytes in all and per
    chip), and the calibration and per-device bytes of the last run."""
    out = cache.settings.report(num_steps)
    out.update(kept_shapes=[list(s) for s in cache.kept_shapes], kept_bytes=cache.kept_bytes,
               kept_bytes_per_chip=cache.kept_bytes_per_chip)
    if runs and "calibration" in runs[-1]:
        out["calibration"] = runs[-1]["calibration"]
    if runs and "kept_bytes_by_device" in runs[-1]:
        out["kept_bytes_by_device"] = runs[-1]["kept_bytes_by_device"]
    return out


def estimate_schedule(full_step_s: float, settings: CacheSettings, num_steps: int,
                      num_layers: int) -> dict:
    """The ``--estimate`` of a cached run: a cached step costs ``k / L`` of a full step's
    blocks with DeepCache and none of them with MagCache (the estimate models blocks only;
    MagCache's residual add, one read-modify-write of the residual stream, is ~1 ms per chip
    at 14B 720p and left out). Every figure is an ESTIMATE (see ``engine.dry_run.estimate``)."""
    schedule = settings.schedule(num_steps)
    cached = sum(schedule)
    cached_s = full_step_s * settings.cached_share(num_layers)
    total = (num_steps - cached) * full_step_s + cached * cached_s
    return dict(kind=settings.kind, full_steps=num_steps - cached, cached_steps=cached,
                full_step_s=full_step_s, cached_step_s=cached_s, denoise_s=total,
                denoise_s_without_cache=num_steps * full_step_s,
                speedup=num_steps * full_step_s / total if total else None)
