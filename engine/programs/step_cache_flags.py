"""The step-cache flags (``--cache`` and its DeepCache / MagCache options): their argparse
group, and their check and resolution into ``step_cache_settings.CacheSettings`` before any
model loads (one-line refusals, exit 2)."""

from __future__ import annotations

import logging
import math

from engine.files.checkpoint import read_component_config, read_model_index
from engine.programs import mag_ratios
from engine.programs.experts import expert_steps
from engine.programs.step_cache_settings import CacheSettings
from engine.run.errors import fail

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
        ratios, source = mag_ratios.resolve_ratios(
            v["mag_ratios"], v["cache_calibrate"], transformer_cfg, model_index,
            getattr(args, "image", None) is not None, expert_steps)
        return CacheSettings(
            "magcache", threshold=threshold, max_skip_steps=max_skip, retention_ratio=retention,
            mag_ratios=None if ratios is None
            else mag_ratios.interpolated(ratios, num_steps, expert_steps),
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
