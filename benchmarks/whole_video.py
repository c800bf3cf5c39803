"""The whole-video estimate of issue 64's Measure rows (``--dry_run --estimate``'s
``whole_video_seconds`` and its parts; benchmarks/whole_video.md).

ESTIMATES and HOST MEASUREMENTS, not timings of a video: the step, the decode and the
encoders on the mesh are libtpu's static model and the roofline for a described TPU slice;
the encoders on the host and the mp4 are measured on the host this runs on.

The shipped configs (``configs/``) carry no text or image encoder configs, so each row runs
on a temporary folder holding the shipped configs and the encoders' published configs from
``benchmarks/whole_video_configs/`` (UMT5-XXL; Qwen2.5-VL-7B's text model, ByT5-small and
SigLIP so400m-patch14-384; Gemma 3 12B). No weights: the dry run needs none.

Usage (one row per run: each is a whole dry run, minutes on a 2-core host):
    python benchmarks/whole_video.py --row wan|hunyuan|ltx2|ltx2_distilled[_v6e] [--output_dir DIR]
It prints the row's parts and writes the dry run's JSON to DIR (default
``outputs/whole_video``), with the wall time and the peak RSS of the dry run.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERLAY = os.path.join(ROOT, "benchmarks", "whole_video_configs")
HY = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v_step_distilled"
ROWS = {
    "ltx2": ("Lightricks/LTX-2", "tpu7x:2x2x1", [
        "--height", "512", "--width", "768", "--frames", "121", "--num_inference_steps", "40",
        "--stg_scale", "0", "--audio_stg_scale", "0", "--modality_scale", "1",
        "--audio_modality_scale", "1", "--audio_guidance_scale", "3"]),
    # issue 66's row: the distilled checkpoint's own recipe (8 steps of DISTILLED_SIGMA_VALUES,
    # no guidance: ltx2.checkpoint_defaults), with the dev checkpoint's encoder configs.
    "ltx2_distilled": ("rootonchair/LTX-2-19b-distilled", "tpu7x:2x2x1", [
        "--height", "512", "--width", "768", "--frames", "121"]),
    "ltx2_distilled_v6e": ("rootonchair/LTX-2-19b-distilled", "v6e:2x4", [
        "--height", "512", "--width", "768", "--frames", "121"]),
    "hunyuan": (HY, "v6e:2x4", ["--num_inference_steps", "8"]),
    "wan": ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "v6e:2x4", [
        "--height", "720", "--width", "1280", "--frames", "81", "--guidance_scale", "1",
        "--num_inference_steps", "4", "--scheduler", "euler"]),
}


def checkpoint(model: str, folder: str) -> str:
    """``folder``/<name>: the shipped configs of ``model`` with the encoders' configs on top
    (the folder's name is the checkpoint's, as the families read it)."""
    path = os.path.join(folder, os.path.basename(model))
    shutil.copytree(os.path.join(ROOT, "configs", model), path)
    # The distilled LTX-2 checkpoint shares the dev checkpoint's text encoder and connectors.
    overlay = model if os.path.isdir(os.path.join(OVERLAY, model)) else "Lightricks/LTX-2"
    shutil.copytree(os.path.join(OVERLAY, overlay), path, dirs_exist_ok=True)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", choices=sorted(ROWS), required=True)
    p.add_argument("--output_dir", default=os.path.join(ROOT, "outputs", "whole_video"))
    p.add_argument("--skip_vae", action="store_true",
                   help="--dry_run_skip_vae: no decode compiled (the 720p decode's compile "
                        "outran 25 min on the loaded 2-core host); the decode part is missing")
    args = p.parse_args()
    model, topology, flags = ROWS[args.row]
    out = os.path.join(args.output_dir, args.row)
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="whole_video_") as folder:
        cmd = [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id",
               checkpoint(model, folder), "--dry_run", "--estimate", "--topology", topology,
               "--dry_run_layers", "1", "--no_plots", "--output_dir", out, *flags,
               *(["--dry_run_skip_vae"] if args.skip_vae else [])]
        print(" ".join(cmd[1:]), flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"))
        wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    print(f"exit {proc.returncode}; wall {wall:.0f} s; peak RSS {rss:.2f} GiB")
    paths = sorted(glob.glob(os.path.join(out, "*_dry_run.json")))
    if proc.returncode not in (0, 3) or not paths:
        return 1
    report = json.load(open(paths[-1]))
    est = report["estimate"]
    est["benchmark"] = dict(wall_s=wall, peak_rss_gib=rss, row=args.row)
    with open(paths[-1], "w") as f:
        json.dump(report, f, indent=1)
    for name, part in est["whole_video_parts"].items() if "whole_video_parts" in est else ():
        print(f"{name:<22}{part['seconds']:9.3f} s  {part['kind']}")
    for e in est["text_encoders"]:
        print(f"  {e['folder']:<16}{e['cls']:<34}tokens {e['tokens']}  "
              f"{e['flops'] / 1e12:6.2f} TFLOP  mesh {e['mesh_s'] * 1e3:8.2f} ms  "
              f"host {e['host_s']:7.2f} s  ({'every video' if e['per_video'] else 'negative'})")
    for key, r in est["text_encode_host"]["rates"].items():
        print(f"  host rate at {key}: {r['flops_per_s'] / 1e9:.1f} GFLOP/s bf16 "
              f"({r['rows_measured']} rows, {r['calls']} calls, {r['host']})")
    print(f"whole video: {est['whole_video_seconds']} s (host encoders), "
          f"{est['whole_video_seconds_mesh_encoders']} s (mesh encoders); missing: "
          f"{est['whole_video_missing']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
