"""Where a diffusers checkpoint's files are: a local folder, the Hub cache, or the
architecture-only configs this project ships under ``configs/`` for dry runs."""

from __future__ import annotations

import json
import os
import re

from engine.run.errors import UsageError, first_line

# The project's top folder (this file is engine/files/checkpoint.py).
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS_DIR = os.path.join(PROJECT_ROOT, "configs")


def looks_local(model_id: str) -> bool:
    """A Hub id is exactly "org/name"; anything else (absolute, ./, ~, deeper) is a folder."""
    return os.path.exists(model_id) or not re.fullmatch(r"[\w.-]+/[\w.-]+", model_id)


def model_config_dir(model_id: str) -> str | None:
    """A folder holding the component configs for ``model_id``: the local folder, else the
    configs this project ships for public ids (``configs/``), else None."""
    for path in (model_id, os.path.join(CONFIGS_DIR, model_id)):
        if os.path.isfile(os.path.join(path, "model_index.json")):
            return path
    return None


def read_model_index(model_id: str) -> dict:
    """``model_index.json`` of a local folder, a shipped config, or (for other Hub ids) the
    Hub cache or the Hub itself.

    Raises:
        UsageError: it cannot be found or read.
    """
    folder = model_config_dir(model_id)
    if folder is not None:
        path = os.path.join(folder, "model_index.json")
    elif looks_local(model_id):
        raise UsageError(f"--model_id={model_id!r}: no model_index.json in that folder")
    else:
        from huggingface_hub import hf_hub_download

        try:
            path = hf_hub_download(model_id, "model_index.json")
        except Exception as e:  # offline, unknown repo, gated...
            raise UsageError(f"--model_id={model_id!r}: cannot read model_index.json from the "
                             f"Hub ({first_line(e, 200)})") from None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model_id={model_id!r}: unreadable model_index.json ({e})") \
            from None


def expert_count(model_index: dict) -> int:
    """Experts a checkpoint keeps resident: 2 when ``model_index.json`` names a
    ``transformer_2`` and sets ``boundary_ratio`` (Wan 2.2 A14B), else 1."""
    spec = model_index.get("transformer_2")
    two = (model_index.get("boundary_ratio") is not None and isinstance(spec, list)
           and all(spec))
    return 2 if two else 1


def read_component_config(model_id: str, subfolder: str, *, download: bool = False,
                          filename: str = "config.json") -> dict | None:
    """``<subfolder>/<filename>`` of a local folder or shipped config as a dict
    (``filename``: "scheduler_config.json" for a scheduler).

    Otherwise None, or with ``download`` the Hub's copy (from the local cache, or fetched).

    Raises:
        UsageError: ``download`` and the file cannot be found or read.
    """
    folder = model_config_dir(model_id)
    path = os.path.join(folder or model_id, subfolder, filename)
    if not os.path.isfile(path):
        if not download:
            return None
        try:
            if looks_local(model_id):
                raise FileNotFoundError(path)
            from huggingface_hub import hf_hub_download

            path = hf_hub_download(model_id, f"{subfolder}/{filename}")
        except Exception as e:
            raise UsageError(f"--model_id={model_id!r}: no {subfolder} config "
                             f"({first_line(e, 200)})") from None
    with open(path) as f:
        return json.load(f)


def component_folder(model_id: str, subfolder: str) -> str:
    """Local folder of a pipeline component: ``model_id/subfolder`` for a local checkpoint,
    else that part of the Hub snapshot (from the local cache, or downloaded)."""
    if looks_local(model_id):
        return os.path.join(model_id, subfolder)
    from huggingface_hub import snapshot_download

    return os.path.join(snapshot_download(model_id, allow_patterns=[f"{subfolder}/*"]),
                        subfolder)
