"""Step caching on CPU: the wall time of a cached step against a full step, in one process.

Builds a small random Wan checkpoint (more blocks than the test one, so the blocks and not the
per-call overhead dominate a step), then runs ``generate_flax.generate`` three times in this
process: without a cache, with DeepCache (the seed's schedule scaled to the step count) and with
MagCache (ratios of 1.0, so it skips as often as its settings allow). Every step is timed
after a ``block_until_ready`` (the runs with a cache time each step; see
``engine.programs.denoise.denoise``). It prints each run's denoise seconds, its full and cached step
means, and the ratios cached / full and denoise(cache) / denoise(none).

These are CPU figures on this host (JAX's CPU backend, float32, one device): they show that a
cached step does the work the schedule says, not what a TPU would take. Step seconds include
the scheduler step (eager diffusers UniPC through torchax), which a cache does not shorten.

    python benchmarks/step_cache.py                       # 8 blocks, 64x96x17, 20 steps
    python benchmarks/step_cache.py --layers 12 --steps 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from engine.pipeline import generate
from families import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head_dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--iterations", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    folder = os.path.join(tempfile.mkdtemp(prefix="step-cache-bench-"), "ckpt")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_checkpoint.py"),
                    "--output", folder, "--layers", str(args.layers), "--heads",
                    str(args.heads), "--head_dim", str(args.head_dim), "--ffn_dim",
                    str(4 * args.heads * args.head_dim)], check=True, capture_output=True)
    import jax

    import generate_flax

    start = max(1, args.steps // 5)
    runs = {
        "none": [],
        "deepcache": ["--cache", "deepcache", "--cache_start_step", str(start),
                      "--cache_end_step", str(args.steps - 2), "--cache_step_interval", "4"],
        "magcache": ["--cache", "magcache", "--mag_ratios", json.dumps([1.0] * args.steps)],
    }
    results = {}
    for name, flags in runs.items():
        config = generate_flax.validate_args(generate_flax.parse_args([
            "--model_id", folder, "--dtype", "float32", "--height", "64", "--width", "96",
            "--frames", "17", "--num_inference_steps", str(args.steps), "--attention", "xla",
            "--num_iterations", str(args.iterations), "--compilation_cache_dir", "none",
            "--output_dir", tempfile.mkdtemp(), *flags]))
        _, report = generate(config, FAMILIES[config.model.family], devices=jax.devices()[:1])
        run = report["timings"]["runs"][-1]  # the last timed run: steady state
        results[name] = run
        if name == "none":
            print(f"{name:<10} denoise {run['denoise_s']:.3f} s ({run['s_per_step']:.4f} s/step)")
            continue
        ratio = run["cached_step_s"] / run["full_step_s"]
        print(f"{name:<10} denoise {run['denoise_s']:.3f} s: {run['full_steps']} full x "
              f"{run['full_step_s']:.4f} s, {run['cached_steps']} cached x "
              f"{run['cached_step_s']:.4f} s; cached/full {ratio:.3f}; denoise vs none "
              f"{run['denoise_s'] / results['none']['denoise_s']:.3f}")
    print(f"(CPU, {jax.devices()[0].device_kind}, float32, {args.layers} blocks, "
          f"{args.heads}x{args.head_dim} heads, 64x96x17, {args.steps} steps: not TPU figures)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
