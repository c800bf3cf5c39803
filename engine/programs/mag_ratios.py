"""MagCache's magnitude ratios: the shipped lists (``configs/mag_ratios.json``), the
checkpoint each fits, and ``--mag_ratios`` (a JSON list, a built-in name, a file or a
``--cache_calibrate`` report) resolved and interpolated to the run's steps, per expert for a
two-expert model, as diffusers' ``MagCacheConfig`` does.
"""

from __future__ import annotations

import json
import math
import os

from engine.files.checkpoint import CONFIGS_DIR
from engine.programs.step_cache_settings import nearest_interp
from engine.run.errors import fail

MAG_RATIOS_FILE = os.path.join(CONFIGS_DIR, "mag_ratios.json")


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



def interpolated(ratios, num_steps: int, expert_steps) -> tuple:
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



def resolve_ratios(text, calibrate: bool, transformer_cfg, model_index, image: bool,
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
