"""The largest frame count that fits a TPU slice, found with generate_flax.py's --dry_run.

Each probe is one ``generate_flax.py --dry_run`` subprocess (deviceless TPU compile on this
CPU host, no weights), judged by its exit code: 0 fits, 3 does not. Frame counts are of the
form 4n+1, and the transformer step's HBM grows with n, so a bisection over n finds the
largest count whose step fits. Probes skip the VAE (``--dry_run_skip_vae``): the
frame-chunked decode compiles one latent frame at a time, so its programs do not depend on the
frame count; ``--check_vae`` then runs one full dry run (transformer + VAE, with each stage's
resident bytes counted) at the answer, to confirm it.

Every figure is the compiler's memory accounting for that topology, not a TPU run.

Examples:
    python benchmarks/max_frames.py                         # 14B, 720p, v6e:2x4, defaults
    python benchmarks/max_frames.py --check_vae             # + one dry run with the VAE
    python benchmarks/max_frames.py --model_id Wan-AI/Wan2.1-T2V-1.3B-Diffusers \\
        --topology v5e:2x2 --height 480 --width 832 -- --flow_shift 3.0
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model_id", default="Wan-AI/Wan2.1-T2V-14B-Diffusers")
    p.add_argument("--topology", default="v6e:2x4")
    p.add_argument("--height", type=int, default=720)
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--min_frames", type=int, default=81,
                   help="a count believed to fit (checked first)")
    p.add_argument("--max_frames", type=int, default=401,
                   help="upper end of the search (4n+1)")
    p.add_argument("--check_vae", action="store_true",
                   help="confirm the answer with one dry run that includes the VAE decode")
    p.add_argument("extra", nargs="*", help="more generate_flax.py flags, after --")
    args = p.parse_args(argv)
    for flag in ("min_frames", "max_frames"):
        v = getattr(args, flag)
        if v < 1 or (v - 1) % 4:
            p.error(f"--{flag}={v}: expected a count of the form 4n+1, got {v}")
    if args.min_frames > args.max_frames:
        p.error(f"--min_frames={args.min_frames}: expected <= --max_frames={args.max_frames}")
    return args


def probe(args, frames: int, *, vae: bool) -> dict:
    """One dry run; returns its JSON report plus the exit code and wall seconds."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--dry_run",
               "--model_id", args.model_id, "--topology", args.topology,
               "--height", str(args.height), "--width", str(args.width),
               "--frames", str(frames), "--output_dir", out, *args.extra]
        if not vae:
            cmd.append("--dry_run_skip_vae")
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True,
                              env=dict(os.environ, JAX_PLATFORMS="cpu"))
        seconds = time.perf_counter() - t0
        if proc.returncode not in (0, 3):
            sys.exit(f"dry run at --frames {frames} failed (exit {proc.returncode}):\n"
                     + proc.stderr[-2000:])
        (path,) = glob.glob(os.path.join(out, "*_dry_run.json"))
        with open(path) as f:
            report = json.load(f)
    report["exit_code"], report["wall_s"] = proc.returncode, seconds
    step = report["per_chip"][0]
    print(f"frames {frames:4d} ({report['tokens']:7d} tokens): transformer step "
          f"{step['total_bytes'] / GIB:6.2f} GiB of {step['capacity_bytes'] / GIB:.2f} per chip"
          f" -> {'fits' if proc.returncode == 0 else 'does not fit'} ({seconds:.0f} s)",
          flush=True)
    return report


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"== Largest frame count: {args.model_id}, {args.height}x{args.width}, "
          f"{args.topology} (deviceless TPU compile on this CPU host) ==")
    lo, hi = (args.min_frames - 1) // 4, (args.max_frames - 1) // 4  # frames = 4n + 1
    if probe(args, 4 * lo + 1, vae=False)["exit_code"]:
        print(f"even --min_frames {args.min_frames} does not fit")
        return 3
    if not probe(args, 4 * hi + 1, vae=False)["exit_code"]:
        print(f"--max_frames {args.max_frames} fits; raise it to search further")
        return 0
    while hi - lo > 1:  # invariant: 4lo+1 fits, 4hi+1 does not
        mid = (lo + hi) // 2
        if probe(args, 4 * mid + 1, vae=False)["exit_code"]:
            hi = mid
        else:
            lo = mid
    best = 4 * lo + 1
    print(f"largest transformer-step fit: {best} frames ({4 * hi + 1} does not fit)")
    if args.check_vae:
        report = probe(args, best, vae=True)
        for r in report["per_chip"]:
            print(f"  {r['program']}: {r['total_bytes'] / GIB:.2f} GiB per chip "
                  f"({'fits' if r['fits'] else 'does not fit'})")
        print(f"with the VAE decode: {'fits' if report['fits'] else 'does not fit'}")
        return report["exit_code"]
    return 0


if __name__ == "__main__":
    sys.exit(main())
