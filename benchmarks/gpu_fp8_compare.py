"""Two of our runs side by side: s/step, cold start, peak device memory, weight bytes and the
frame difference in 0-255 levels (``benchmarks/gpu_fp8.sh``'s last step).

Usage: ``python benchmarks/gpu_fp8_compare.py BASE_DIR OTHER_DIR [--xla_flags F]``, each DIR a
``generate_flax.py --save_frames`` output folder (one ``*.json`` report, one
``*.frames.safetensors``). Prints a Markdown table and one JSON line; exit 1 if either run
left no report.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import numpy as np

GIB = 2**30


def load_run(folder: str) -> tuple[dict | None, np.ndarray | None]:
    """(report, (F, H, W, 3) float32 frames in [0, 1]); None for what the run did not write."""
    from safetensors.numpy import load_file

    reports = glob.glob(os.path.join(folder, "*.json"))
    frames = glob.glob(os.path.join(folder, "*.frames.safetensors"))
    report = json.load(open(reports[0])) if reports else None
    return report, (load_file(frames[0])["frames"] if frames else None)


def figures(report: dict) -> dict:
    """The report's figures this table shows."""
    t, mem = report["timings"], report.get("device_memory") or {}
    return dict(device=f"{report['devices']['count']} x {report['devices']['kind']}",
                quantize=report["settings"].get("quantize", "none"),
                s_per_step=t.get("steady_s_per_step"), cold_start_s=t.get("cold_start_s"),
                peak_gib=(mem.get("peak_bytes_in_use") or 0) / GIB or None,
                quantized={k: v for k, v in (report.get("quantize") or {}).items()
                           if k != "names"} or None)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--xla_flags", default="", help="the other run's XLA_FLAGS, for the record")
    args = p.parse_args(argv)
    (base, base_frames), (other, other_frames) = load_run(args.base), load_run(args.other)
    if base is None or other is None:
        print(f"no report in {args.base if base is None else args.other}")
        return 1
    rows = [figures(base), figures(other)]
    diff = None
    if base_frames is not None and other_frames is not None:
        d = np.abs(other_frames.astype(np.float64) - base_frames.astype(np.float64)) * 255
        diff = dict(mean_abs_levels=float(d.mean()), max_abs_levels=float(d.max()))
    print(f"device: {rows[0]['device']}; other's XLA_FLAGS: '{args.xla_flags}'")
    print("| run | s/step | cold start s | peak device GiB |")
    print("|---|---|---|---|")
    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    for r in rows:
        print(f"| {r['quantize']} | {fmt(r['s_per_step'], '.3f')} | "
              f"{fmt(r['cold_start_s'], '.1f')} | {fmt(r['peak_gib'], '.2f')} |")
    if rows[0]["s_per_step"] and rows[1]["s_per_step"]:
        print(f"speedup (base / other s/step): {rows[0]['s_per_step'] / rows[1]['s_per_step']:.3f}")
    print(f"frames, other vs base: {diff}")
    print(json.dumps(dict(base=rows[0], other=rows[1], frames=diff, xla_flags=args.xla_flags)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
