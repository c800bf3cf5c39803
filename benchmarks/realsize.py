"""Real-size check: generate_flax.py against diffusers' eager WanPipeline on one checkpoint.

It builds a random-weight Wan 2.1 T2V 1.3B checkpoint at its real size (the shipped
configs/Wan-AI/Wan2.1-T2V-1.3B-Diffusers transformer and VAE configs, 1.419 B + 126.9 M
parameters; a 1-layer UMT5 at the real width 4096 with the tiny tokenizer of
tools/make_tiny_checkpoint.py), written with ``save_pretrained`` (safetensors). ``--scale cpu``
shrinks it (2 narrow blocks, a narrow VAE and text encoder, 64x96x9) so CI proves the script
on a CPU.

Then, per run (float32 at a reduced frame count; with ``--bf16`` also bfloat16 at the full
length), it runs our script as a user runs it (``generate_flax.py --save_frames``, a
subprocess, ``JAX_PLATFORMS`` left to the machine) and, in this process, diffusers' eager
``WanPipeline`` (optionally ``torch.compile``d too) with the same prompt, negative prompt, seed,
CFG scale, UniPC scheduler and flow_shift. The prompts are read back from our JSON report, so
both sides get the same text.

Reported (a table, and ``<output_dir>/realsize.json``), each figure with its machine:
- frame parity: mean and max |ours - diffusers| in 0-255 levels, on the float32 frames in [0, 1]
  (ours: ``<stamp>.frames.safetensors``, lossless; diffusers: ``output_type="np"``);
- s/step: ours is the report's steady-state ``steady_s_per_step`` (after our warmup);
  diffusers' is the mean interval between ``callback_on_step_end`` stamps (the device
  synchronised in each) of a call made after a 2-step warmup call of the same shape;
- cold start: ours is the report's ``cold_start_s`` (text encode + placement + compiles +
  warmup); diffusers' load and first (warmup) call are listed as such;
- peak device memory: ours from the report's ``device_memory`` (JAX's allocator), diffusers'
  from ``torch.cuda.max_memory_allocated``; none on a CPU, which reports none.

float32 runs set ``JAX_DEFAULT_MATMUL_PRECISION=highest`` for ours and turn TF32 off in torch,
so both sides do float32 math on a GPU.

``--scale auto`` (the default) takes the real size where ours would run on an accelerator and
the CPU size where it would not (``JAX_PLATFORMS``, else JAX's default backend, asked in a
short subprocess so this process never holds the device): the real size's random checkpoint
and its two pipelines need more than a 24 GB CPU host has (the kernel's OOM killer ended it).

Examples:
    python benchmarks/realsize.py                                    # auto: real on a GPU/TPU
    python benchmarks/realsize.py --scale cpu                        # CI size, any machine
    JAX_PLATFORMS=cuda python benchmarks/realsize.py                 # 480x832x21 float32
    JAX_PLATFORMS=cuda python benchmarks/realsize.py --bf16 --torch_compile   # + bf16 x 81
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import importlib.metadata as md
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

# tools/ (the tiny checkpoints' tokenizer and atomic save_pretrained) is not a package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
from make_tiny_checkpoint import build_tokenizer
from tiny_checkpoint import write_pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "Wan-AI", "Wan2.1-T2V-1.3B-Diffusers")
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Scale:
    """A checkpoint size and its default video: ``transformer``/``vae`` override the shipped
    configs' entries; ``text`` is the UMT5 encoder's config; height/width in pixels, frames
    for the float32 parity run and ``full_frames`` for ``--bf16``."""

    transformer: dict
    vae: dict
    text: dict
    height: int
    width: int
    frames: int
    full_frames: int


SCALES = {
    # The shipped configs as they are; UMT5-XXL's width (d_model 4096, 64 heads x 64, FFN
    # 10240) in one layer: the real text_dim the transformer projects from.
    "real": Scale(transformer={}, vae={},
                  text=dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=1,
                            relative_attention_num_buckets=32,
                            relative_attention_max_distance=128),
                  height=480, width=832, frames=21, full_frames=81),
    # Everything the real one has (patch, qk norm, VAE stages and latent statistics), narrow.
    "cpu": Scale(transformer=dict(num_layers=2, num_attention_heads=2, attention_head_dim=12,
                                  ffn_dim=64, text_dim=32, rope_max_seq_len=32),
                 vae=dict(base_dim=8, num_res_blocks=1),
                 text=dict(d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=1,
                           relative_attention_num_buckets=8,
                           relative_attention_max_distance=32),
                 height=64, width=96, frames=9, full_frames=17),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", choices=("auto", *sorted(SCALES)), default="auto",
                   help="real: Wan 2.1 T2V 1.3B's size; cpu: shrunk for a CPU (CI); auto "
                        "(default): real on a GPU or TPU, cpu without one")
    p.add_argument("--checkpoint", default=None,
                   help="checkpoint folder, built if missing "
                        "(default: checkpoints/realsize-wan2.1-1.3b[-cpu])")
    p.add_argument("--force", action="store_true", help="rebuild the checkpoint")
    p.add_argument("--height", type=int, default=None, help="pixels (default: the scale's)")
    p.add_argument("--width", type=int, default=None, help="pixels (default: the scale's)")
    p.add_argument("--frames", type=int, default=None,
                   help="frames of the float32 parity run (default: the scale's reduced count)")
    p.add_argument("--bf16", action="store_true",
                   help="also a bfloat16 run at --full_frames")
    p.add_argument("--full_frames", type=int, default=None,
                   help="frames of the --bf16 run (default: the scale's full length)")
    p.add_argument("--no_float32", action="store_true",
                   help="with --bf16: skip the float32 parity run (time-boxed GPU checks)")
    p.add_argument("--steps", type=int, default=4, help="denoising steps")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--guidance_scale", type=float, default=5.0, help="CFG scale")
    p.add_argument("--flow_shift", type=float, default=3.0, help="UniPC flow_shift")
    p.add_argument("--attention", default="auto", help="our --attention")
    p.add_argument("--quantize", choices=("none", "int8", "fp8"), default="none",
                   help="ours' --quantize (W8A8, issue 54) in the --bf16 run; diffusers stays "
                        "bf16, so the parity columns are the 8 bits' difference")
    p.add_argument("--torch_compile", action="store_true",
                   help="a second baseline: pipe.transformer = torch.compile(pipe.transformer)")
    p.add_argument("--output_dir", default=os.path.join(ROOT, "outputs", "realsize"),
                   help="our runs' files and realsize.json")
    args = p.parse_args(argv)
    if args.no_float32 and not args.bf16:
        print("--no_float32: needs --bf16 (without it no run is left)", file=sys.stderr)
        raise SystemExit(2)
    if args.scale == "auto":
        platforms = os.environ.get("JAX_PLATFORMS", "")
        args.scale = pick_scale(platforms, None if platforms.strip() else jax_backend())
        print(f"--scale auto: {args.scale} (ours would run on "
              f"{'an accelerator' if args.scale == 'real' else 'the CPU'}; "
              f"--scale {'cpu' if args.scale == 'real' else 'real'} to override)", flush=True)
    scale = SCALES[args.scale]
    for name in ("height", "width", "frames", "full_frames"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(scale, name))
    if args.checkpoint is None:
        suffix = "" if args.scale == "real" else f"-{args.scale}"
        args.checkpoint = os.path.join(ROOT, "checkpoints", f"realsize-wan2.1-1.3b{suffix}")
    return args


def pick_scale(jax_platforms: str, backend: str | None) -> str:
    """The scale ``--scale auto`` means: "real" where ours runs on an accelerator, "cpu" where
    it runs on the CPU (the real size's random checkpoint and both pipelines need more host
    memory than a 24 GB CPU host has).

    Args:
        jax_platforms: ``$JAX_PLATFORMS`` ("" if unset); its first entry is the platform
            ours gets.
        backend: ``jax.default_backend()`` of this machine ("cpu", "gpu", "tpu"), used when
            ``jax_platforms`` is empty; None when it could not be asked.

    Returns:
        "real" or "cpu".
    """
    first = next((p.strip() for p in jax_platforms.split(",") if p.strip()), None)
    platform_name = first if first is not None else backend
    return "cpu" if platform_name in (None, "cpu") else "real"


def jax_backend() -> str | None:
    """``jax.default_backend()`` asked in a subprocess (this process must not hold a GPU's or
    TPU's memory while ours runs), without GPU preallocation; None if that fails."""
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    try:
        proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                              env=env, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.split()
    return lines[-1] if proc.returncode == 0 and lines else None


def build_pipeline(scale: Scale):
    """A random-weight ``WanPipeline`` of the shipped 1.3B configs with ``scale``'s
    overrides; torch's global generator seeded, so the same scale gives the same weights."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), feed_forward_proj="gated-gelu", pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, **scale.text)).eval()
    tcfg = dict(WanTransformer3DModel.load_config(CONFIG, subfolder="transformer"))
    transformer = WanTransformer3DModel.from_config({**tcfg, **scale.transformer}).eval()
    vcfg = dict(AutoencoderKLWan.load_config(CONFIG, subfolder="vae"))
    vae = AutoencoderKLWan.from_config({**vcfg, **scale.vae}).eval()
    # Wan 2.1's shipped scheduler config: UniPC in flow-prediction mode with flow sigmas.
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                       scheduler=scheduler, transformer=transformer)


def build_checkpoint(args) -> dict:
    """Build (or reuse) ``args.checkpoint``; returns its parameter counts and build time."""
    start = time.perf_counter()
    pipe, _ = write_pipeline(lambda: build_pipeline(SCALES[args.scale]), args.checkpoint,
                             force=args.force, prefix=".realsize-")
    out = dict(path=args.checkpoint, scale=args.scale, build_s=time.perf_counter() - start)
    if pipe is not None:
        out.update({f"{name}_params": sum(p.numel() for p in getattr(pipe, name).parameters())
                    for name in ("transformer", "vae", "text_encoder")})
        print(f"wrote {args.checkpoint}: transformer {out['transformer_params']:,}, VAE "
              f"{out['vae_params']:,}, text encoder {out['text_encoder_params']:,} parameters "
              f"in {out['build_s']:.0f} s", flush=True)
    return out


def run_ours(args, dtype: str, frames: int) -> tuple[np.ndarray, dict]:
    """``generate_flax.py`` as a user runs it, in a subprocess; returns ((F, H, W, 3) float32
    frames in [0, 1], its JSON report with ``process_wall_s`` added)."""
    from safetensors.numpy import load_file

    eight = dtype == "bfloat16" and args.quantize != "none"
    out = os.path.join(args.output_dir, f"ours-{dtype}-{frames}f"
                       + (f"-{args.quantize}" if eight else ""))
    os.makedirs(out, exist_ok=True)
    for old in glob.glob(os.path.join(out, "*")):  # one run's files per folder
        os.remove(old)
    env = dict(os.environ)
    if dtype == "float32":  # float32 dots on a GPU too (XLA's default there is TF32-like)
        env.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    cmd = [sys.executable, os.path.join(ROOT, "generate_flax.py"),
           "--model_id", args.checkpoint, "--dtype", dtype, "--height", str(args.height),
           "--width", str(args.width), "--frames", str(frames),
           "--num_inference_steps", str(args.steps), "--guidance_scale", str(args.guidance_scale),
           "--flow_shift", str(args.flow_shift), "--seed", str(args.seed),
           "--scheduler", "unipc", "--attention", args.attention, "--num_iterations", "1",
           "--save_frames", "--no_plots", "--output_dir", out,
           *(("--quantize", args.quantize) if eight else ())]
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"generate_flax.py exited {proc.returncode} ({dtype}, {frames} frames)")
    (report_path,) = glob.glob(os.path.join(out, "*.json"))
    (frames_path,) = glob.glob(os.path.join(out, "*.frames.safetensors"))
    with open(report_path) as f:
        report = json.load(f)
    report["process_wall_s"] = wall
    return load_file(frames_path)["frames"], report


def torch_device_label(device: str) -> str:
    """The machine torch ran on, e.g. "NVIDIA H200" or "CPU (AMD EPYC, 2 cores)"."""
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"CPU ({model}, {os.cpu_count()} cores)"


def load_diffusers(args, dtype: str, compiled: bool, device: str):
    """diffusers' ``WanPipeline`` from the checkpoint (the VAE in float32, as diffusers' Wan
    examples load it) with UniPC at ``args.flow_shift``, on ``device``."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    torch_dtype = getattr(torch, dtype)
    vae = AutoencoderKLWan.from_pretrained(args.checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(args.checkpoint, vae=vae, dtype=torch_dtype)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=args.flow_shift)
    pipe.set_progress_bar_config(disable=True)
    pipe.to(device)
    if compiled:
        pipe.transformer = torch.compile(pipe.transformer)
    return pipe


def call_diffusers(pipe, args, prompts: dict, frames: int, steps: int, output_type: str,
                   device: str):
    """One ``pipe(...)`` call; returns (output, [perf_counter at each step's end])."""
    stamps: list[float] = []

    def on_step_end(_pipe, _i, _t, kwargs):
        if device == "cuda":  # the step's kernels done, not just queued
            torch.cuda.synchronize()
        stamps.append(time.perf_counter())
        return kwargs

    with torch.no_grad():
        out = pipe(prompt=prompts["prompt"], negative_prompt=prompts["negative_prompt"],
                   height=args.height, width=args.width, num_frames=frames,
                   num_inference_steps=steps, guidance_scale=args.guidance_scale,
                   generator=torch.Generator("cpu").manual_seed(args.seed),
                   output_type=output_type, callback_on_step_end=on_step_end)
    return out, stamps


def run_diffusers(args, dtype: str, frames: int, prompts: dict,
                  compiled: bool) -> tuple[np.ndarray, dict]:
    """diffusers' pipeline: a 2-step warmup call (``output_type="latent"``), then the timed
    call. Returns ((F, H, W, 3) float32 frames in [0, 1], figures)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # float32 means float32 on both sides (TF32 would not)
        torch.backends.cuda.matmul.allow_tf32 = dtype != "float32"
        torch.backends.cudnn.allow_tf32 = dtype != "float32"
    start = time.perf_counter()
    pipe = load_diffusers(args, dtype, compiled, device)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    call_diffusers(pipe, args, prompts, frames, 2, "latent", device)
    first_call_s = time.perf_counter() - start
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out, stamps = call_diffusers(pipe, args, prompts, frames, args.steps, "np", device)
    figures = dict(
        baseline="torch.compile" if compiled else "eager", device=torch_device_label(device),
        load_s=load_s, first_call_s=first_call_s,
        # Intervals between step ends: the first step (and its one-off work) is left out.
        s_per_step=(stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else None,
        peak_bytes=torch.cuda.max_memory_allocated() if device == "cuda" else None)
    del pipe
    if device == "cuda":
        torch.cuda.empty_cache()
    return out.frames[0].astype(np.float32), figures


def parity(ours: np.ndarray, ref: np.ndarray) -> dict:
    """|ours - ref| in 0-255 levels (mean, max) of two (F, H, W, 3) [0, 1] videos, and the
    reference's std on [0, 1] (a flat video would make any parity meaningless)."""
    if ours.shape != ref.shape:
        raise SystemExit(f"frame shapes differ: ours {ours.shape}, diffusers {ref.shape}")
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64)) * 255
    return dict(mean_abs_levels=float(diff.mean()), max_abs_levels=float(diff.max()),
                reference_std=float(ref.std()))


def ours_figures(report: dict) -> dict:
    """The figures of our JSON report the table shows, with our machine."""
    d, t = report["devices"], report["timings"]
    memory = report.get("device_memory") or {}
    return dict(device=f"{d['count']} x {d['kind']} ({d['platform']})",
                s_per_step=t.get("steady_s_per_step"), cold_start_s=t.get("cold_start_s"),
                process_wall_s=report["process_wall_s"],
                peak_bytes=memory.get("peak_bytes_in_use"),
                attention=report["settings"]["attention"], mesh=report["mesh"],
                versions=report["versions"])


def run_all(args) -> list[dict]:
    """Every run: all of ours first (each a process that frees its device memory on exit),
    then diffusers' in this process, so neither side holds memory the other needs."""
    plan = ([] if args.no_float32 else [("float32", args.frames)]) \
        + ([("bfloat16", args.full_frames)] if args.bf16 else [])
    ours = {key: run_ours(args, *key) for key in plan}
    results = []
    for (dtype, frames), (our_frames, report) in ours.items():
        prompts = {k: report["settings"][k] for k in ("prompt", "negative_prompt")}
        for compiled in (False, True) if args.torch_compile else (False,):
            ref, theirs = run_diffusers(args, dtype, frames, prompts, compiled)
            results.append(dict(dtype=dtype, frames=frames, height=args.height,
                                quantize=report["settings"].get("quantize", "none"),
                                width=args.width, steps=args.steps, seed=args.seed,
                                guidance_scale=args.guidance_scale, flow_shift=args.flow_shift,
                                ours=ours_figures(report), diffusers=theirs,
                                parity=parity(our_frames, ref)))
    return results


def _fmt(x, spec: str, scale: float = 1.0) -> str:
    return "n/a" if x is None else format(x / scale, spec)


def print_table(results: list[dict]) -> None:
    """One row per (run, diffusers baseline), the machines named above the rows."""
    for r in results[:1]:
        print(f"\nours on {r['ours']['device']}, attention {r['ours']['attention']}; "
              f"diffusers on {r['diffusers']['device']}")
    print("| run | diffusers | ours s/step | diffusers s/step | mean abs diff (levels) | "
          "max abs diff | ours cold start s | peak GiB ours / diffusers |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        o, d, p = r["ours"], r["diffusers"], r["parity"]
        q = "" if r.get("quantize", "none") == "none" else f" --quantize {r['quantize']}"
        print(f"| {r['dtype']}{q}, {r['height']}x{r['width']}x{r['frames']}, {r['steps']} steps "
              f"| {d['baseline']} | {_fmt(o['s_per_step'], '.3f')} "
              f"| {_fmt(d['s_per_step'], '.3f')} | {p['mean_abs_levels']:.4f} "
              f"| {p['max_abs_levels']:.4f} | {_fmt(o['cold_start_s'], '.1f')} "
              f"| {_fmt(o['peak_bytes'], '.2f', GIB)} / {_fmt(d['peak_bytes'], '.2f', GIB)} |")
    mismatch = [r for r in results if r["ours"]["device"].endswith("(cpu)")
                and not r["diffusers"]["device"].startswith("CPU")]
    if mismatch:
        print("WARNING: ours ran on the CPU while diffusers had a GPU: set JAX_PLATFORMS=cuda "
              "(and install requirements-gpu.txt)")


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    checkpoint = build_checkpoint(args)
    results = run_all(args)
    print_table(results)
    path = os.path.join(args.output_dir, "realsize.json")
    with open(path, "w") as f:
        json.dump(dict(date=time.strftime("%Y-%m-%d"), checkpoint=checkpoint,
                       host=dict(python=platform.python_version(), **{
                           pkg: md.version(pkg) for pkg in ("torch", "diffusers", "transformers",
                                                            "jax", "jaxlib")}),
                       results=results), f, indent=2)
        f.write("\n")
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
