"""How far ``--quantize int8|fp8`` moves a video from the bf16 run, per family, in numbers.

RANDOM WEIGHTS: the tiny checkpoints (tools/) and the real-size random Wan 2.1 1.3B
(``benchmarks/realsize.py --quantize``) are not trained models, so these figures bound the
arithmetic, not the quality. The published quality of the same scheme (per-channel weights,
per-token activations, W8A8) is LightX2V's for its int8/fp8 Wan 2.1/2.2 checkpoints.

For each tiny checkpoint (Wan 2.1, Wan 2.2 two-expert, HunyuanVideo-1.5) it runs our
pipeline in-process on the CPU in bf16, then with each scheme, after 1 denoising step (the
frames decoded from one transformer step's latents) and after ``--steps``, and prints the
frames' relative L2 error and mean / max absolute difference in 0-255 levels against the
bf16 run. Results: benchmarks/quantize_results.md.

Usage::

    JAX_PLATFORMS=cpu python benchmarks/quantize.py            # about 10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import generate_flax  # noqa: E402
from engine.pipeline.generation import generate  # noqa: E402
from families import FAMILIES  # noqa: E402

CHECKPOINTS = {  # name: (builder, flags, (height, width))
    "wan2.1": ("make_tiny_checkpoint.py", (), (64, 96)),
    "wan2.2-a14b": ("make_tiny_checkpoint.py", ("--experts", "2", "--boundary_ratio", "0.875"),
                    (64, 128)),
    "hunyuanvideo-1.5": ("make_tiny_hunyuan_checkpoint.py", (), (48, 80)),
}


def build(name: str, folder: str) -> str:
    """The tiny checkpoint ``name`` written into ``folder``; returns its path."""
    tool, flags, _ = CHECKPOINTS[name]
    path = os.path.join(folder, name)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", tool), "--output", path,
                    *flags], check=True, capture_output=True)
    return path


def frames(path: str, shape: tuple, steps: int, scheme: str) -> np.ndarray:
    """Our (F, H, W, 3) float32 frames in [0, 1] of one bf16 run on every CPU device."""
    args = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", path, "--height", str(shape[0]), "--width", str(shape[1]),
        "--frames", "9", "--num_inference_steps", str(steps), "--num_iterations", "1",
        "--warmup_steps", "0", "--compilation_cache_dir", "none", "--quantize", scheme]))
    out, _ = generate(args, FAMILIES[args.model.family])
    return np.asarray(out, np.float64)


def compare(q: np.ndarray, ref: np.ndarray) -> dict:
    d = np.abs(q - ref)
    return dict(rel_l2=float(np.linalg.norm(q - ref) / np.linalg.norm(ref)),
                mean_levels=float(d.mean() * 255), max_levels=float(d.max() * 255))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=4, help="denoising steps of the full run")
    p.add_argument("--schemes", default="int8,fp8")
    args = p.parse_args(argv)
    print("| checkpoint | scheme | steps | rel. L2 | mean abs (levels) | max abs (levels) |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (_, _, shape) in CHECKPOINTS.items():
            path = build(name, tmp)
            for steps in (1, args.steps):
                ref = frames(path, shape, steps, "none")
                for scheme in args.schemes.split(","):
                    c = compare(frames(path, shape, steps, scheme), ref)
                    print(f"| {name} | {scheme} | {steps} | {c['rel_l2']:.4f} | "
                          f"{c['mean_levels']:.3f} | {c['max_levels']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
