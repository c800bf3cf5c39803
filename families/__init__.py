"""Model families: everything that differs between Wan 2.1 and the next video model.

A family is one ``ModelFamily`` value (``families/base.py``) in its own module, registered in
``FAMILIES``. The engine (``engine/``) and ``generate_flax.py`` call only what this interface
names; nothing outside a family's module knows its pipeline class, text encoders, transformer
call, sharding rules or VAE. docs/architecture.md lists the steps to add one.

``detect_family(model_id)`` picks the family from ``model_index.json``'s ``_class_name`` (a
local folder, a config shipped under ``configs/``, or the Hub).
"""

from __future__ import annotations

import dataclasses
import inspect

from engine.files.checkpoint import read_model_index
from engine.run.errors import UsageError, fail
from families import helios, hunyuan, hunyuan_sr_stage, ltx2, ltx2_upscale, wan, wan_vace
from families.base import ModelFamily

__all__ = ["FAMILIES", "INPUT_NAMES", "OPTION_NAMES", "ModelFamily", "add_input_flags",
           "add_option_flags", "detect_family", "family_for_class", "resolve_inputs",
           "resolve_options"]

# Keys name a family, not a version: "wan" runs Wan 2.1 and 2.2, "hunyuanvideo" HunyuanVideo-1.5
# (they were "wan2.1" and "hunyuanvideo1.5"; staged intermediates never recorded the key).
# HunyuanVideo-1.5's SR stage and LTX-2's two-stage run (--sr 2x) are their own modules, which
# build on families.hunyuan and families.ltx2: joined here.
FAMILIES: dict[str, ModelFamily] = {
    "wan": wan.FAMILY,
    "hunyuanvideo": dataclasses.replace(hunyuan.FAMILY, upscale=hunyuan_sr_stage.UPSCALE),
    "ltx2": dataclasses.replace(ltx2.FAMILY, upscale=ltx2_upscale.UPSCALE),
    "wan_vace": wan_vace.FAMILY,  # WanVACEPipeline: built on families.wan
    "helios": helios.FAMILY}  # HeliosPipeline, HeliosPyramidPipeline: chunks
# Every family's other flags (``Flags.inputs``: conditioning inputs, list-valued settings).
INPUT_NAMES = tuple(dict.fromkeys(name for f in FAMILIES.values() for name in f.flags.inputs))
# Every family's own flags (``Flags.options`` and ``Flags.inputs``), for generate_flax.py's
# parser (they reach the run as ``config.video.options`` and ``config.video.inputs``).
OPTION_NAMES = tuple(name for f in FAMILIES.values() for name in f.flags.options) + INPUT_NAMES


def family_for_class(class_name: str | None, model_id: str) -> str:
    """The family key running pipeline ``class_name``.

    Raises:
        UsageError: no family runs it; the line lists the supported classes.
    """
    for key, family in FAMILIES.items():
        if class_name in family.checkpoint.pipeline_classes:
            return key
    supported = ", ".join(c for f in FAMILIES.values() for c in f.checkpoint.pipeline_classes)
    raise UsageError(f"--model_id={model_id!r}: pipeline class {class_name!r} is not supported "
                     f"(supported: {supported})")


def detect_family(model_id: str) -> str:
    """The family key of ``model_id``, from its ``model_index.json`` ``_class_name``.

    Raises:
        UsageError: the index cannot be read or names an unsupported pipeline.
    """
    return family_for_class(read_model_index(model_id).get("_class_name"), model_id)


def add_option_flags(group) -> None:
    """Every family's own flags (``Flags.options``) into ``group``, default None (the
    family's default, which the help gives), and ``--sigmas`` (a family whose
    ``Scheduling.named_sigmas`` is set; ``engine.run.config.resolve_sigmas`` checks it)."""
    for family in FAMILIES.values():
        for name, (default, text) in family.flags.options.items():
            group.add_argument(f"--{name}", type=float, default=None,
                               help=f"{text} ({family.name} only; default {default})")
    group.add_argument("--sigmas", default=None, metavar="S1,S2,...|distilled",
                       help="LTX-2 only: the sigmas before the scheduler's shift (diffusers' "
                            "sigmas), decreasing, in (0, 1], or 'distilled' (diffusers' "
                            "DISTILLED_SIGMA_VALUES); the step count is their count (default: "
                            "the checkpoint's recipe)")
    add_input_flags(group)


def resolve_options(args, key: str) -> dict | None:
    """The flags ``args`` gives for family ``key``: its own options (given, else the
    checkpoint's default, ``Flags.checkpoint_defaults``, else the family's; None when it has
    none). Sets ``args.scan_layers`` when not given (the family's
    default, else True) and ``args.overlap_compile`` when "auto" (the family's default, else
    "auto").

    Raises:
        UsageError: another family's option, or a flag the family refuses
            (``Flags.refused``), in one line.
    """
    family = FAMILIES[key]
    for other in FAMILIES.values():
        for name in other.flags.options:  # inputs: resolve_inputs
            if name not in family.flags.options and getattr(args, name) is not None:
                fail(f"--{name}", getattr(args, name), f"is a {other.name} flag; --model_id "
                     f"is a {family.name} checkpoint")
    # Engine flags whose unset value ("chosen for you") a family may decide.
    for flag, unset, default in (("scan_layers", None, True), ("overlap_compile", "auto", None)):
        if getattr(args, flag) == unset:
            setattr(args, flag, family.flags.defaults.get(flag, default if unset is None
                                                          else unset))
    for flag, allowed, why in family.flags.refused:
        if getattr(args, flag, allowed) != allowed:
            fail(f"--{flag}", getattr(args, flag), why)
    if not family.flags.options:
        return None
    checkpoint = family.flags.checkpoint_defaults(args.model_id)
    return {name: checkpoint.get(name, default) if getattr(args, name) is None
            else getattr(args, name) for name, (default, _) in family.flags.options.items()}


def add_input_flags(group) -> None:
    """Every family's other flags (``Flags.inputs``) into ``group``, once per name, default
    None; the help names the families that take each."""
    for name in INPUT_NAMES:
        users = [f for f in FAMILIES.values() if name in f.flags.inputs]
        spec = dict(users[0].flags.inputs[name])
        takers = ", ".join(f.name for f in users)
        spec["help"] = f"{spec.get('help', '')} ({takers} only)".strip()
        group.add_argument(f"--{name}", default=None, **{k: v for k, v in spec.items()
                                                          if k != "default"})


def resolve_inputs(args, key: str, values: dict) -> tuple[dict | None, dict]:
    """Family ``key``'s other flags from ``args``, checked by its ``Flags.check_inputs``.

    Returns:
        (inputs, values): {name: resolved value} of the family's inputs (None when it declares
        none), and the resolved family flags ``values`` as the check left them.

    Raises:
        UsageError: a flag the family does not take (one line, naming the families that do),
            or the family's own check's line.
    """
    family = FAMILIES[key]
    for name in INPUT_NAMES:
        given = getattr(args, name, None)
        if name not in family.flags.inputs and given not in (None, []):
            takers = ", ".join(f.name for f in FAMILIES.values() if name in f.flags.inputs)
            fail(f"--{name}", given, f"is a {takers} flag; --model_id is a {family.name} "
                 "checkpoint")
    if not family.flags.inputs:
        return None, values
    inputs = {name: getattr(args, name, None) for name in family.flags.inputs}
    if family.flags.check_inputs is None:
        return inputs, values
    check = family.flags.check_inputs
    # A check that reads other flags (--frames given or not, --stage) takes ``args``.
    extra = {"args": args} if "args" in inspect.signature(check).parameters else {}
    return check(inputs, dict(values), args.model_id, **extra)
