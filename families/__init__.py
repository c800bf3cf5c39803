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

from engine.files.checkpoint import read_model_index
from engine.run.errors import UsageError
from families import hunyuan, hunyuan_sr_stage, wan
from families.base import ModelFamily

__all__ = ["FAMILIES", "ModelFamily", "detect_family", "family_for_class"]

# Keys name a family, not a version: "wan" runs Wan 2.1 and 2.2, "hunyuanvideo" HunyuanVideo-1.5
# (they were "wan2.1" and "hunyuanvideo1.5"; staged intermediates never recorded the key).
# HunyuanVideo-1.5's SR stage is its own module, which builds on families.hunyuan: joined here.
FAMILIES: dict[str, ModelFamily] = {
    "wan": wan.FAMILY,
    "hunyuanvideo": dataclasses.replace(hunyuan.FAMILY, upscale=hunyuan_sr_stage.UPSCALE)}



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
