"""What every tiny-checkpoint builder in tools/ shares: skip an existing build unless forced,
and write the pipeline with ``save_pretrained`` (safetensors) atomically."""

from __future__ import annotations

import os
import shutil
import tempfile


def write_atomically(save, output: str, *, force: bool, prefix: str, marker: str) -> bool:
    """Call ``save(folder)`` on a fresh folder beside ``output`` and rename it to ``output``,
    so an interrupted build leaves no half-written tree. Returns False (nothing written) when
    ``output/marker`` exists and ``force`` is off."""
    out = os.path.abspath(output)
    if os.path.exists(os.path.join(out, marker)) and not force:
        return False
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        save(tmp)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return True


def write_pipeline(build, output: str, *, force: bool, prefix: str):
    """Build with ``build()`` and save it to ``output``; returns (pipeline or None, path).

    None means a checkpoint already was at ``output`` and ``force`` is off. Written with
    ``write_atomically``.
    """
    out = os.path.abspath(output)
    built = []

    def save(folder):
        built.append(build())
        built[0].save_pretrained(folder, safe_serialization=True)

    if not write_atomically(save, out, force=force, prefix=prefix, marker="model_index.json"):
        print(f"tiny checkpoint already at {out}")
        return None, out
    return built[0], out
