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
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from engine.files.checkpoint import CONFIGS_DIR, read_component_config, read_model_index
from engine.programs import executables
from engine.programs.experts import EXPERT_NAMES, expert_steps
from engine.programs.step import step_shardings
from engine.run.errors import GenerationError, fail
from engine.weights.scan_layers import install_cached_blocks

MAG_RATIOS_FILE = os.path.join(CONFIGS_DIR, "mag_ratios.json")
KINDS = ("none", "deepcache", "magcache")
# DeepCache's flags and defaults as HunyuanVideo-1.5's port ships them
# (--enable_cache --cache_start_step 11 --cache_end_step 45 --cache_step_interval 4), and
# MagCache's as diffusers' MagCacheConfig.
DEFAULTS = dict(cache="none", cache_start_step=11, cache_end_step=45, cache_step_interval=4,
                cache_recompute_blocks=1, mag_threshold=0.06, mag_max_skip_steps=3,
                mag_retention_ratio=0.2, mag_ratios=None, cache_calibrate=False)
FLAGS = tuple(k for k in DEFAULTS if k != "cache") + ("enable_cache",)
# A LoRA run at this many steps or fewer is a few-step distill: a cache has little to skip.
FEW_STEPS = 8


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """The resolved step-cache settings (``kind`` "none" turns everything off).

    ``mag_ratios``: one ratio per step, already ``nearest_interp``-ed to the step count, as
    diffusers' ``MagCacheConfig.__post_init__`` does; for a two-expert model a pair of such
    tuples, each interpolated to the steps its expert runs. ``mag_ratios_source`` says where
    they came from (a built-in name, "--mag_ratios", a file, or None).

    ``expert_steps``: a two-expert model's (high-noise, low-noise) step counts, the
    ``transformer`` steps first (``engine.programs.experts.expert_steps``); None for one
    expert. With it each expert is its own cache: MagCache as if diffusers' hook were attached
    to that expert alone (its own step count, ratios, retention, accumulators, residual);
    DeepCache's flags keep their meaning over the global step index, and the first step of
    each expert is full (the recorded input is never the other expert's).
    """
    kind: str = "none"
    start: int = 11
    end: int = 45
    interval: int = 4
    recompute_blocks: int = 1
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple | None = None
    mag_ratios_source: str | None = None
    calibrate: bool = False
    expert_steps: tuple[int, int] | None = None

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def cached_share(self, num_layers: int) -> float:
        """A cached step's share of a full step's block work: k / L with DeepCache, none with
        MagCache (embeddings and the output head are outside the blocks)."""
        return self.recompute_blocks / num_layers if self.kind == "deepcache" else 0.0

    def spans(self, num_steps: int) -> list[tuple[int, int]]:
        """(first step, step count) per expert: one span for a one-expert model."""
        if self.expert_steps is None:
            return [(0, num_steps)]
        return [(0, self.expert_steps[0]), (self.expert_steps[0], self.expert_steps[1])]

    def expert_of_steps(self, num_steps: int) -> list[int]:
        """Per step, the index of the expert that runs it (all 0 for one expert)."""
        return [k for k, (_, n) in enumerate(self.spans(num_steps)) for _ in range(n)]

    def expert_ratios(self) -> list:
        """The per-step ratio tuple of each expert (one entry for one expert)."""
        if self.expert_steps is None:
            return [self.mag_ratios]
        return list(self.mag_ratios or (None, None))

    def schedule(self, num_steps: int) -> tuple[bool, ...]:
        """Per step, True when the step is cached (skips blocks)."""
        if self.kind == "deepcache":
            out = list(deepcache_schedule(num_steps, self.start, self.end, self.interval))
            for first, n in self.spans(num_steps):
                if n and self.expert_steps is not None:
                    out[first] = False  # each expert records its own input first
            return tuple(out)
        if self.kind == "magcache" and not self.calibrate:
            return tuple(skip for (_, n), ratios in zip(self.spans(num_steps),
                                                        self.expert_ratios(), strict=True)
                         for skip in magcache_schedule(n, ratios or (), self.threshold,
                                                       self.max_skip_steps,
                                                       self.retention_ratio))
        return (False,) * num_steps

    def report(self, num_steps: int) -> dict:
        """The JSON report's ``cache`` entry: the resolved settings and the schedule; for a
        two-expert model also ``experts``: per expert its steps, full and cached steps and
        its own settings (MagCache: its step count, retention steps and ratios)."""
        out = dict(kind=self.kind)
        if self.kind == "deepcache":
            out.update(start_step=self.start, end_step=self.end, step_interval=self.interval,
                       recompute_blocks=self.recompute_blocks)
        elif self.kind == "magcache":
            ratios = None if self.mag_ratios is None else (
                [list(r) for r in self.mag_ratios] if self.expert_steps else list(self.mag_ratios))
            out.update(threshold=self.threshold, max_skip_steps=self.max_skip_steps,
                       retention_ratio=self.retention_ratio, calibrate=self.calibrate,
                       mag_ratios=ratios, mag_ratios_source=self.mag_ratios_source)
        schedule = self.schedule(num_steps)
        out["cached_steps"] = [i for i, c in enumerate(schedule) if c]
        out["full_steps"] = len(schedule) - len(out["cached_steps"])
        if self.expert_steps is not None:
            out["experts"] = {name: self._expert_report(schedule, first, n, ratios)
                              for name, (first, n), ratios in zip(
                                  EXPERT_NAMES, self.spans(num_steps), self.expert_ratios(),
                                  strict=True)}
        return out

    def _expert_report(self, schedule, first: int, n: int, ratios) -> dict:
        cached = [i for i in range(first, first + n) if schedule[i]]
        out = dict(steps=list(range(first, first + n)), full_steps=n - len(cached),
                   cached_steps=cached)
        if self.kind == "magcache":
            out.update(num_inference_steps=n,
                       retention_steps=int(self.retention_ratio * n + 0.5),
                       mag_ratios=None if ratios is None else list(ratios))
        elif self.kind == "deepcache" and n:
            out["first_step_full"] = True
        return out


# ---------------------------------------------------------------------------------------------
# Schedules (host only)
# ---------------------------------------------------------------------------------------------


def deepcache_schedule(num_steps: int, start: int, end: int, interval: int) -> tuple:
    """True for the cached steps: every step except ``[0, start)``, ``start + n * interval``
    and ``[end, num_steps)``. Defaults 11/45/4 over 50 steps: 25 full, 25 cached."""
    return tuple(not (i < start or i >= end or (i - start) % interval == 0)
                 for i in range(num_steps))


def nearest_interp(values, target_length: int) -> tuple:
    """diffusers' ``hooks.mag_cache.nearest_interp``: nearest-neighbour resampling of a ratio
    list to ``target_length`` entries (torch.round, i.e. round half to even, as there)."""
    n = len(values)
    if target_length == 1:
        return (float(values[-1]),)
    scale = (n - 1) / (target_length - 1)
    # numpy's round, like torch's, rounds half to even; Python's round does too.
    return tuple(float(values[round(i * scale)]) for i in range(target_length))


def magcache_schedule(num_steps: int, ratios, threshold: float, max_skip_steps: int,
                      retention_ratio: float) -> tuple:
    """True for the steps diffusers' ``MagCacheHeadHook`` skips, replayed on the host.

    From step ``int(retention_ratio * num_steps + 0.5)`` on, each step multiplies its ratio
    into an accumulated ratio and adds ``|1 - accumulated ratio|`` to an accumulated error;
    the step is skipped while that error is <= ``threshold``, the consecutive count is <=
    ``max_skip_steps`` and a residual exists (a full step ran before); otherwise it runs in
    full and the accumulators reset. Steps past the ratio list use ratio 1.0, as there.
    """
    retention_step = int(retention_ratio * num_steps + 0.5)
    acc_ratio, acc_err, acc_steps, has_residual = 1.0, 0.0, 0, False
    out = []
    for step in range(num_steps):
        skip = False
        if step >= retention_step:
            acc_ratio *= ratios[step] if step < len(ratios) else 1.0
            acc_steps += 1
            acc_err += abs(1.0 - acc_ratio)
            if has_residual and acc_err <= threshold and acc_steps <= max_skip_steps:
                skip = True
            else:
                acc_ratio, acc_err, acc_steps = 1.0, 0.0, 0
        has_residual = has_residual or not skip
        out.append(skip)
    return tuple(out)


def load_builtin_ratios() -> dict:
    with open(MAG_RATIOS_FILE) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def per_step_ratios(entry: dict) -> list[float]:
    """One ratio per step from a shipped entry: the cond entries of an interleaved list,
    with step 0's 1.0 put back where the source leaves it out (``first_step_omitted``: the
    MagCache authors' Wan 2.2 script prepends ``[1.0, 1.0]`` itself)."""
    published = entry["published"]
    cond = list(published[0::2]) if entry["layout"].startswith("interleaved") else published
    return [1.0, *cond] if entry.get("first_step_omitted") else cond


def builtin_for_checkpoint(transformer_cfg: dict | None, model_index: dict,
                           image: bool = False) -> str | None:
    """The name of the shipped ratio list whose ``match`` fits this checkpoint (and whose
    ``image``, when the entry names one, equals whether ``--image`` is given), or None."""
    if not transformer_cfg:
        return None
    for name, entry in load_builtin_ratios().items():
        if all(transformer_cfg.get(k) == v for k, v in entry["match"].items()) and all(
                model_index.get(k) in (v, None) if v is None else model_index.get(k) == v
                for k, v in entry.get("model_index", {}).items()) and \
                entry.get("image", image) == image:
            return name
    return None


# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def add_cache_flags(g) -> None:
    """The step-cache flags (argparse group ``g``)."""
    d = DEFAULTS
    g.add_argument("--cache", choices=KINDS, default=None,
                   help="step caching on a static schedule: deepcache (skip all but the last "
                        "blocks on cached steps) or magcache (skip every block, reuse the last "
                        "residual); trades quality for speed; two-expert models cache each "
                        "expert on its own (default none)")
    g.add_argument("--enable_cache", action="store_true",
                   help="the earlier port's alias for --cache deepcache")
    g.add_argument("--cache_start_step", type=int, default=None,
                   help=f"DeepCache: steps before this are full (default {d['cache_start_step']})")
    g.add_argument("--cache_end_step", type=int, default=None,
                   help=f"DeepCache: steps from this on are full (default {d['cache_end_step']})")
    g.add_argument("--cache_step_interval", type=int, default=None,
                   help="DeepCache: every this-many steps from the start is full (default "
                        f"{d['cache_step_interval']})")
    g.add_argument("--cache_recompute_blocks", type=int, default=None,
                   help="DeepCache: trailing blocks a cached step recomputes (default "
                        f"{d['cache_recompute_blocks']})")
    g.add_argument("--mag_threshold", type=float, default=None,
                   help=f"MagCache: accumulated-error threshold (default {d['mag_threshold']}, "
                        "diffusers')")
    g.add_argument("--mag_max_skip_steps", type=int, default=None,
                   help="MagCache: most consecutive skipped steps (default "
                        f"{d['mag_max_skip_steps']})")
    g.add_argument("--mag_retention_ratio", type=float, default=None,
                   help="MagCache: fraction of first steps never skipped, per expert (default "
                        f"{d['mag_retention_ratio']})")
    g.add_argument("--mag_ratios", default=None,
                   help="MagCache: a JSON list of per-step ratios; for a two-expert model a "
                        "JSON list of two lists (high-noise, low-noise) or one list over all "
                        "steps, split at the switch; a built-in name from "
                        "configs/mag_ratios.json; or a JSON file holding any of these or a "
                        "--cache_calibrate report (default: the checkpoint's, if shipped)")
    g.add_argument("--cache_calibrate", action="store_true",
                   help="MagCache: run every step in full and write the measured ratios (one "
                        "list per expert) into the JSON report, ready for --mag_ratios")


def resolve_cache_flags(args, *, num_steps: int, num_layers: int | None,
                        transformer_cfg: dict | None, model_index: dict,
                        expert_steps: tuple[int, int] | None = None) -> CacheSettings:
    """Check the cache flags (before any model loads) and resolve the ``CacheSettings``.

    Args:
        args: the parsed flags (``argparse.Namespace``); the cache flags are None when unset.
        num_steps: the resolved ``--num_inference_steps``.
        num_layers: the transformer's block count (bounds ``--cache_recompute_blocks``), or
            None when its config is not readable here.
        transformer_cfg / model_index: the checkpoint's configs, to choose shipped ratios.
        expert_steps: a two-expert model's (high-noise, low-noise) step counts, else None.

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    kind = args.cache
    if args.enable_cache:
        if kind not in (None, "deepcache"):
            fail("--enable_cache", True, f"is the alias of --cache deepcache; --cache {kind} "
                 "contradicts it")
        kind = "deepcache"
    kind = kind or "none"
    given = {k: getattr(args, k) for k in DEFAULTS if k != "cache"}
    given = {k: v for k, v in given.items() if v is not None and v is not False}
    deep = ("cache_start_step", "cache_end_step", "cache_step_interval", "cache_recompute_blocks")
    owner = {k: "deepcache" if k in deep else "magcache" for k in given}
    for flag, needs in owner.items():
        if kind != needs:
            fail(f"--{flag}", given[flag], f"needs --cache {needs}")
    v = {**DEFAULTS, **given}
    if kind == "deepcache":
        return _deepcache_settings(v, num_steps, num_layers, expert_steps)
    if kind == "magcache":
        threshold, max_skip = v["mag_threshold"], v["mag_max_skip_steps"]
        retention = v["mag_retention_ratio"]
        if not (math.isfinite(threshold) and threshold >= 0):
            fail("--mag_threshold", threshold, "must be a finite number >= 0")
        if max_skip < 1:
            fail("--mag_max_skip_steps", max_skip, "must be >= 1")
        if not 0 <= retention <= 1:
            fail("--mag_retention_ratio", retention, "must be in [0, 1]")
        ratios, source = _resolve_ratios(v["mag_ratios"], v["cache_calibrate"], transformer_cfg,
                                         model_index, getattr(args, "image", None) is not None,
                                         expert_steps)
        return CacheSettings(
            "magcache", threshold=threshold, max_skip_steps=max_skip, retention_ratio=retention,
            mag_ratios=None if ratios is None else _interpolated(ratios, num_steps, expert_steps),
            mag_ratios_source=source, calibrate=v["cache_calibrate"], expert_steps=expert_steps)
    return CacheSettings()


def _deepcache_settings(v: dict, num_steps: int, num_layers, expert_steps) -> CacheSettings:
    start, end, interval = v["cache_start_step"], v["cache_end_step"], v["cache_step_interval"]
    k = v["cache_recompute_blocks"]
    if not 0 <= start < num_steps:
        fail("--cache_start_step", start, f"must satisfy 0 <= start < --num_inference_steps "
             f"({num_steps}); a smoke test with few steps needs a smaller start")
    if not start <= end <= num_steps:
        fail("--cache_end_step", end, f"must satisfy --cache_start_step ({start}) <= end <= "
             f"--num_inference_steps ({num_steps})")
    if interval < 1:
        fail("--cache_step_interval", interval, "must be >= 1")
    if k < 1 or (num_layers is not None and k >= num_layers):
        bound = f" and < the transformer's {num_layers} blocks" if num_layers else ""
        fail("--cache_recompute_blocks", k, f"must be >= 1{bound}")
    return CacheSettings("deepcache", start=start, end=end, interval=interval,
                         recompute_blocks=k, expert_steps=expert_steps)


def _interpolated(ratios, num_steps: int, expert_steps) -> tuple:
    """The resolved ratios as ``CacheSettings.mag_ratios``: one list interpolated to the step
    count; for two experts a list per expert, each interpolated to its own step count (one
    list over all steps is interpolated to the step count first, then split at the switch)."""
    if expert_steps is None:
        return nearest_interp(ratios, num_steps)
    if not isinstance(ratios[0], list):
        whole = nearest_interp(ratios, num_steps)
        ratios = [list(whole[:expert_steps[0]]), list(whole[expert_steps[0]:])]
    return tuple(nearest_interp(r, n) if n else () for r, n in zip(ratios, expert_steps,
                                                                  strict=True))


def validate_cache_flags(args, num_steps: int, *, make_scheduler=None, scheduler: str = "",
                         flow_shift: float | None = None, sigmas=None) -> CacheSettings:
    """--cache and its flags against the step count and the checkpoint's block count; for
    a two-expert checkpoint the expert split comes from its scheduler
    (``experts.expert_steps`` with the family's ``make_scheduler``, the run's ``--scheduler``
    and flow_shift), so the whole schedule is known before any model loads."""
    cfg = read_component_config(args.model_id, "transformer")
    index = read_model_index(args.model_id)
    split = None
    if (args.cache or args.enable_cache) and index.get("boundary_ratio") is not None:
        split = expert_steps(index, read_component_config(
            args.model_id, "scheduler", filename="scheduler_config.json"), make_scheduler,
            scheduler, flow_shift, num_steps, sigmas)
    settings = resolve_cache_flags(args, num_steps=num_steps,
                                   num_layers=(cfg or {}).get("num_layers"), transformer_cfg=cfg,
                                   model_index=index, expert_steps=split)
    loras = [f for f in ("lora", "lora_2") if getattr(args, f, None)]
    if settings.on and loras and num_steps <= FEW_STEPS:
        logging.getLogger("generate_flax").warning(
            "--cache %s with --%s at %d steps: a few-step LoRA leaves a step cache little to "
            "skip (allowed, but expect no speed-up)", settings.kind, loras[0], num_steps)
    return settings


def _resolve_ratios(text, calibrate: bool, transformer_cfg, model_index, image: bool,
                    expert_steps):
    """(ratios, source): a list of floats, or for a two-expert model a list of two lists or
    one list over all steps; None with ``calibrate`` and no ratios."""
    builtin = load_builtin_ratios()
    if text is None:
        if calibrate:
            return None, None
        name = builtin_for_checkpoint(transformer_cfg, model_index, image)
        if name is None:
            fail("--cache", "magcache", "no calibrated ratios are known for this checkpoint "
                 f"(shipped: {', '.join(builtin)}); give --mag_ratios, or measure them with "
                 "--cache_calibrate")
        return per_step_ratios(builtin[name]), name
    if text in builtin:
        ratios, source = per_step_ratios(builtin[text]), text
    elif os.path.isfile(text):
        ratios, source = _ratios_from_file(text), text
    else:
        try:
            ratios, source = json.loads(text), "--mag_ratios"
        except ValueError:
            ratios, source = None, "--mag_ratios"
    two = expert_steps is not None
    if _is_ratio_list(ratios) or (two and isinstance(ratios, list) and len(ratios) == 2
                                  and all(_is_ratio_list(r) for r in ratios)):
        return ([[float(x) for x in r] for r in ratios] if not _is_ratio_list(ratios)
                else [float(r) for r in ratios]), source
    if not two and isinstance(ratios, list) and len(ratios) == 2 and all(
            _is_ratio_list(r) for r in ratios):
        fail("--mag_ratios", text, "is a list per expert; this checkpoint has one expert: give "
             "one list")
    fail("--mag_ratios", text, "must be a JSON list of positive numbers"
         + (", or a list of two such lists (high-noise, low-noise)" if two else "")
         + f", a built-in name ({', '.join(builtin)}), or a JSON file holding one of these "
         "or a --cache_calibrate report")


def _is_ratio_list(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r) and r > 0
        for r in x)


def _ratios_from_file(path: str):
    """The ratios a JSON file holds: a list (or a list per expert), ``{"mag_ratios": ...}``,
    or a run's report, whose ``cache.calibration.mag_ratios`` ``--cache_calibrate`` wrote.
    None when it holds none of these (the caller refuses it in one line)."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        fail("--mag_ratios", path, "is not a readable JSON file")
    if isinstance(data, dict):
        data = data.get("cache", data)
        data = data.get("calibration", data) if isinstance(data, dict) else data
        data = data.get("mag_ratios") if isinstance(data, dict) else data
    return data


# ---------------------------------------------------------------------------------------------
# The two programs and the host-side loop
# ---------------------------------------------------------------------------------------------


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
    """The compiled full and cached step programs (weights bound) and the schedule.

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

    def schedule(self, num_steps: int) -> tuple:
        return self.settings.schedule(num_steps)

    def add_experts(self, placed: list, scale_arrays: list, ensure=None) -> None:
        """Bind a two-expert model's weights and guidance scales (``ExpertStep``'s), in
        ``EXPERT_NAMES`` order; ``ensure``: ``ExpertParking.ensure`` when the idle expert is
        parked (each call first makes its expert whole), else None."""
        self.experts = [(p["params"], p["buffers"], s)
                        for p, s in zip(placed, scale_arrays, strict=True)]
        self.ensure = ensure

    def warmup_schedule(self, steps: int, num_steps: int) -> tuple:
        """The warmup runs each program at least once: full, then cached (when the real
        schedule caches any step), alternating, for ``steps`` steps and until a cached step
        ran; a cached step only where the step before ran the same expert (the warmup runs
        the first steps of the real loop, each with its expert's weights)."""
        if self.cached is None or not any(self.schedule(num_steps)):
            return (False,) * steps
        which = self._experts(num_steps)
        out = []
        for i in range(num_steps):
            if len(out) >= steps and any(out):
                break
            out.append(bool(out) and not out[-1] and which[i] == which[i - 1])
        return tuple(out)

    def _experts(self, num_steps: int) -> list[int]:
        """Per step of the loop (or a prefix of it), the expert whose weights it runs."""
        n = self.settings.expert_steps
        if not self.experts or not n:
            return [0] * num_steps
        return self.settings.expert_of_steps(sum(n))[:num_steps]

    def runner(self, schedule: tuple, calibrate: bool = False):
        """The model call of one loop over ``schedule`` (the run's, or the warmup's prefix):
        each step with its expert's weights."""
        return _Runner(self, schedule, calibrate, self._experts(len(schedule)))

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
    """One sampling loop's model call: picks the program per step from the schedule (and the
    expert from ``experts``, one index per step) and holds the kept arrays on the device
    between steps. ``kinds`` lists "full" / "cached" per call; with ``calibrate`` it collects
    MagCache's magnitude ratio per step and branch (None at each expert's first step)."""

    def __init__(self, cache: StepCache, schedule: tuple, calibrate: bool, experts: list):
        self.cache, self.schedule, self.index, self.experts = cache, schedule, 0, experts
        self.kept, self.kinds, self.calibrate, self.ratios = None, [], calibrate, []
        self.kept_by = None  # the expert whose full step recorded ``kept``
        self.kept_bytes_by_device = None  # {device id: bytes}, read off the live arrays

    def __call__(self, latents, t, embeds):
        i, cached = self.index, self.schedule[self.index]
        expert = self.experts[i]
        self.index += 1
        self.kinds.append("cached" if cached else "full")
        if cached:
            if self.kept_by != expert:  # the schedules never do this; a guard, not a path
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
