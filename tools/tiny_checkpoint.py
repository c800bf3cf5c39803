"""What every tiny-checkpoint builder in tools/ shares: skip an existing build unless forced,
and write the pipeline with ``save_pretrained`` (safetensors) atomically."""

from __future__ import annotations

import os
import shutil
import tempfile


def write_pipeline(build, output: str, *, force: bool, prefix: str):
    """Build with ``build()`` and save it to ``output``; returns (pipeline or None, path).

    None means a checkpoint already was at ``output`` and ``force`` is off. The pipeline is
    written beside the target and renamed, so an interrupted build leaves no half checkpoint.
    """
    out = os.path.abspath(output)
    if os.path.exists(os.path.join(out, "model_index.json")) and not force:
        print(f"tiny checkpoint already at {out}")
        return None, out
    pipe = build()
    parent = os.path.dirname(out) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=prefix, dir=parent)
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        if os.path.exists(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return pipe, out
