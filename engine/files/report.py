"""What a run leaves behind: the timestamped mp4 (and optional lossless frames), the JSON
report, and the printed summary of compile, warmup and steady-state figures.

Every file is written under a temporary name and renamed, so a failed run leaves no partial
output.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import json
import logging
import os
import time

import jax
import numpy as np
import torch

from engine.files import plots as drawing
from engine.run import chips, runtime
from engine.run.runtime import to_host


def to_frames(pipe, video):
    """(1, 3, F, H, W) in [-1, 1] -> (F, H, W, 3) float32 in [0, 1], via diffusers'
    ``VideoProcessor.postprocess_video`` as ``WanPipeline`` does."""
    frames = pipe.video_processor.postprocess_video(torch.from_numpy(to_host(video)),
                                                    output_type="np")
    return frames[0]


def output_stem(output_dir: str) -> str:
    """A fresh ``YYYYMMDD_HHMMSS`` stem in ``output_dir`` (suffix _1, _2... on a clash)."""
    stem = time.strftime("%Y%m%d_%H%M%S")
    candidate, n = stem, 0
    while any(os.path.exists(os.path.join(output_dir, candidate + ext))
              for ext in (".mp4", ".json")):
        n += 1
        candidate = f"{stem}_{n}"
    return candidate


def atomic_write(path: str, write) -> None:
    """Call ``write(tmp_path)`` then rename onto ``path``; never leaves a partial file."""
    root, ext = os.path.splitext(path)
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(root)}.partial{ext}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def save_video(frames, path: str, fps: int) -> None:
    """Write (F, H, W, 3) [0, 1] frames as H.264 mp4 with imageio-ffmpeg, atomically."""
    from diffusers.utils import export_to_video

    atomic_write(path, lambda tmp: export_to_video(list(frames), tmp, fps=fps))


def save_frames(frames, path: str) -> None:
    """Write (F, H, W, 3) float32 frames in [0, 1] losslessly as safetensors ("frames")."""
    from safetensors.numpy import save_file

    atomic_write(path, lambda tmp: save_file(
        {"frames": np.ascontiguousarray(frames, np.float32)}, tmp))


def save_report(report: dict, path: str) -> None:
    """Write ``report`` as indented JSON, atomically."""

    def write(tmp):
        with open(tmp, "w") as f:
            json.dump(report, f, indent=2, sort_keys=False)
            f.write("\n")

    atomic_write(path, write)



def save_picture(draw, report: dict, path: str) -> list[str]:
    """``draw(report, tmp_path)`` (an ``engine.files.plots`` function) written atomically; a failure
    is a warning, never a failed run. Returns [path] when written, else []."""
    try:
        atomic_write(path, lambda tmp: draw(report, tmp))
        return [path]
    except Exception as e:  # noqa: BLE001 - a picture must never fail a finished run
        logging.getLogger("generate_flax").warning("could not draw %s: %s: %s",
                                                   os.path.basename(path), type(e).__name__, e)
        return []


def save_run(report: dict, output_dir: str, stem: str, *, plots: bool) -> list[str]:
    """Write ``<stem>.json`` and, with ``plots``, ``<stem>_timeline.png``; returns the paths."""
    written = []
    if plots:
        written += save_picture(drawing.timeline, report,
                                os.path.join(output_dir, f"{stem}_timeline.png"))
    path = os.path.join(output_dir, f"{stem}.json")
    save_report(report, path)
    return [*written, path]


def _mean(xs):
    return sum(xs) / len(xs)


def summarize(runs, timings: dict, flops_per_step: float | None, devices) -> dict:
    """Placement, compile, warmup and steady-state statistics and throughput, for the report.

    Every timed run is steady state: the programs were compiled ahead of time and run once
    by the warmup. ``cold_start_s`` is what a user waits before the first timed run starts:
    text encode + placement + compiles + warmup.
    """
    out = dict(timings)
    out["cold_start_s"] = sum(
        v for k, v in timings.items()
        if k in ("text_encode_s", "warmup_s") or (k.startswith(("compile_", "place_"))
                                                  and k.endswith("_s")))
    out["runs"] = runs
    totals = [r["total_s"] for r in runs]
    out.update(steady_mean_s=_mean(totals), steady_min_s=min(totals), steady_max_s=max(totals))
    if "vae_decode_s" in runs[0]:
        out["steady_vae_decode_s"] = _mean([r["vae_decode_s"] for r in runs])
    if "s_per_step" in runs[0]:
        s_step = _mean([r["s_per_step"] for r in runs])
        out["steady_s_per_step"] = s_step
        out["transformer_flops_per_step"] = flops_per_step
        out["achieved_tflops"] = flops_per_step / s_step / 1e12
        # MFU = analytic model-call FLOPs per step / s/step / (chips x bf16 peak per chip);
        # the scheduler and the VAE are excluded (nanoGPT's definition).
        out["mfu"] = chips.mfu(flops_per_step, s_step, devices)
    return out


def print_summary(s: dict, device_kind: str, n_devices: int) -> None:
    print(f"\n== Summary ({n_devices} x {device_kind}) ==")
    rows = [("text encode (CPU, once)", "text_encode_s"),
            ("place transformer weights", "place_transformer_s"),
            ("place VAE weights", "place_vae_s"),
            ("compile transformer step", "compile_transformer_s"),
            ("compile VAE decode", "compile_vae_s"),
            ("warmup", "warmup_s"),
            ("cold start (all of the above)", "cold_start_s")]
    for label, key in rows:
        if key in s:
            print(f"{label + ':':<32}{s[key]:8.2f} s")
    if "place_transformer_gbps" in s:
        print(f"{'  placement rate:':<32}{s['place_transformer_gbps']:8.2f} GB/s (host -> "
              "devices, transformer)")
    if "runs" not in s:
        return
    label = f"steady state, {len(s['runs'])} run(s):"
    print(f"{label:<32}{s['steady_mean_s']:8.2f} s mean (min {s['steady_min_s']:.2f}, "
          f"max {s['steady_max_s']:.2f})")
    if "steady_s_per_step" in s:
        print(f"{'  denoise:':<32}{s['steady_s_per_step']:8.3f} s/step")
    if "steady_vae_decode_s" in s:
        print(f"{'  VAE decode:':<32}{s['steady_vae_decode_s']:8.2f} s")
    if "achieved_tflops" in s:
        mfu = f", MFU {100 * s['mfu']:.1f}%" if s.get("mfu") is not None else ""
        print(f"{'  transformer throughput:':<32}{s['achieved_tflops']:8.3f} TFLOP/s{mfu}")


def versions() -> dict:
    out = {}
    for pkg in ("jax", "jaxlib", "libtpu", "torch", "torchax", "diffusers", "transformers"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def run_report(config, family, cfg, devices, mesh_shape, placed, fallbacks, *, summary,
               cache) -> dict:
    """The report's run-wide entries: mesh, devices, processes, cache, timings, fallbacks
    and, when the transformer ran, its tokens, layout and weights."""
    out = dict(
        mesh=dataclasses.asdict(mesh_shape),
        devices=dict(kind=devices[0].device_kind, count=len(devices),
                     platform=jax.default_backend()),
        processes=[dict(index=i, devices=[d.id for d in devices if d.process_index == i])
                   for i in range(jax.process_count())],
        compilation_cache=None if cache is None else dict(
            dir=config.run.compilation_cache_dir,
            **{k: v - cache[k] for k, v in runtime.CACHE_STATS.items()}),
        timings=summary, fallbacks=fallbacks.items, device_memory=device_memory(devices))
    if placed is not None:
        out.update(
            tokens=family.sizes.token_count(cfg, config.video.height, config.video.width,
                                      config.video.frames),
            layout=dict(replicate_row_parallel=config.layout.replicate_row_parallel,
                        fsdp=config.layout.fsdp, megatron_sp=config.layout.megatron_sp,
                        sequence_parallel=mesh_shape.sp > 1),
            sharding_rule_matches=placed["rule_counts"],
            # Streamed from the safetensors files: what this host (process 0) read, against
            # the weights' bytes; equal when one host's devices hold a whole replica.
            weights=dict(source="safetensors slices", param_bytes=placed["param_bytes"],
                         bytes_read_by_this_host=placed["bytes_read"]),
            loras=placed.get("loras", []), loras_2=placed.get("loras_2", []))
    return out


def device_memory(devices) -> dict | None:
    """This process's devices' allocator figures at the end of the run, in bytes: the
    largest ``peak_bytes_in_use`` and ``bytes_limit`` of one device (GPU and TPU runtimes
    report them); None where the runtime reports none (CPU)."""
    stats = [d.memory_stats() for d in devices if d.process_index == jax.process_index()]
    stats = [s for s in stats if s and "peak_bytes_in_use" in s]
    if not stats:
        return None
    return dict(peak_bytes_in_use=max(s["peak_bytes_in_use"] for s in stats),
                bytes_limit=max(s.get("bytes_limit", 0) for s in stats) or None,
                devices=len(stats))


def dry_run_command(config, devices, mesh_shape=None) -> str:
    """The ``--dry_run`` command that predicts this run's per-chip HBM without a TPU."""
    topology = chips.topology_name(devices) or "<chip>:<AxB>"
    flags = [f"--model_id {config.model.model_id}", f"--height {config.video.height}",
             f"--width {config.video.width}", f"--frames {config.video.frames}"]
    if mesh_shape is not None:
        flags += [f"--{k} {v}" for k, v in dataclasses.asdict(mesh_shape).items()]
    return f"python generate_flax.py {' '.join(flags)} --dry_run --topology {topology}"


# ``Device.platform`` of JAX's GPU backends (CUDA and ROCm devices both say "gpu").
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def oom_hint(config, devices, mesh_shape) -> str:
    """What a device out-of-memory error adds (``runtime.hardware_errors``), by the devices'
    platform. On a GPU: ``gpu_oom_hint``. Elsewhere (TPU, and CPU where the tests run): the
    ``--dry_run`` command, and at tp 1 with sp (Ulysses: every chip holds the whole
    transformer, the v6e default where the weights leave room) the flags that split the
    weights instead."""
    if devices[0].platform in GPU_PLATFORMS:
        return gpu_oom_hint(config, devices, mesh_shape)
    hint = "predict it without a TPU: " + dry_run_command(config, devices, mesh_shape)
    if mesh_shape.tp == 1 and mesh_shape.sp % 2 == 0:
        hint += (f"; at --tp 1 every chip holds the whole transformer, --tp 2 "
                 f"--sp {mesh_shape.sp // 2} splits it")
    return hint


def gpu_oom_hint(config, devices, mesh_shape) -> str:
    """The GPU advice. The dry run compiles for TPUs and cannot predict a GPU's memory, so it
    names what shrinks the activations (fewer --frames, a smaller --height/--width), more GPUs
    with --sp (the sequence, and so the activations, split across them), and cuDNN flash
    attention when another backend ran (XLA attention materialises the tokens x tokens
    scores: 144 GiB asked at 480x832x81 on an H200, see benchmarks/realsize_results.md)."""
    v = config.video
    hint = (f"the dry run models TPUs only; on {devices[0].device_kind} use fewer --frames "
            f"(now {v.frames}) or a smaller --height/--width (now {v.height}x{v.width}), or "
            f"more GPUs with --sp (now {mesh_shape.sp})")
    if config.kernel.attention not in ("auto", "cudnn"):
        hint += (f", or --attention cudnn (flash attention) instead of --attention "
                 f"{config.kernel.attention}")
    return hint
