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
import tempfile
import time
import wave
from typing import NamedTuple

import jax
import numpy as np
import torch

from engine.files import plots as drawing
from engine.run import chips, clock, runtime
from engine.run.errors import GenerationError
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


# The sample rates ffmpeg's AAC encoder takes (``ffmpeg -h encoder=aac``, imageio-ffmpeg
# 0.8.1's ffmpeg 9.0.2); another rate would be resampled silently, so it is refused instead.
AAC_SAMPLE_RATES = (7350, 8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000, 64000,
                    88200, 96000)


class Audio(NamedTuple):
    """A waveform to mux beside a video: ``waveform`` (channels, samples) float in [-1, 1]
    (numpy, or anything ``np.asarray`` takes), 1 or 2 channels; ``sample_rate`` in Hz, one of
    ``AAC_SAMPLE_RATES``. Sample 0 plays with frame 0."""
    waveform: object
    sample_rate: int


def check_audio(audio: Audio) -> np.ndarray:
    """The waveform of ``audio`` as a C-contiguous float32 (channels, samples) array, checked
    before anything is written.

    Raises:
        GenerationError: one line naming the field, the value and the rule: not a
            (channels, samples) float array with 1 or 2 channels and at least one sample,
            a value that is not finite, or a sample rate that is not an int in
            ``AAC_SAMPLE_RATES``.
    """
    waveform, rate = audio
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) \
            or int(rate) not in AAC_SAMPLE_RATES:
        raise GenerationError(f"audio sample_rate={rate!r}: must be an int in Hz that AAC "
                              f"takes ({', '.join(map(str, AAC_SAMPLE_RATES))})")
    wave_ = np.asarray(waveform)
    if wave_.ndim != 2 or wave_.shape[0] not in (1, 2) or wave_.shape[1] < 1:
        raise GenerationError(f"audio waveform shape={wave_.shape}: must be (channels, "
                              "samples) with 1 or 2 channels and at least one sample")
    if not np.issubdtype(wave_.dtype, np.floating):
        raise GenerationError(f"audio waveform dtype={str(wave_.dtype)!r}: must be a float "
                              "array in [-1, 1]")
    wave_ = np.ascontiguousarray(wave_, np.float32)
    if not np.isfinite(wave_).all():
        raise GenerationError(f"audio waveform: {int((~np.isfinite(wave_)).sum())} value(s) "
                              "not finite (NaN or inf)")
    return wave_


def audio_fields(audio: Audio | None) -> dict:
    """The JSON report's fields of a video's audio: ``audio_sample_rate`` (Hz),
    ``audio_channels`` and ``audio_seconds`` (samples / rate); {} without audio."""
    if audio is None:
        return {}
    waveform = check_audio(audio)
    return dict(audio_sample_rate=int(audio.sample_rate), audio_channels=waveform.shape[0],
                audio_seconds=waveform.shape[1] / int(audio.sample_rate))


def write_wav(waveform: np.ndarray, sample_rate: int, path: str) -> None:
    """(channels, samples) float32 -> 16-bit PCM WAV (stdlib ``wave``). Values are clipped
    to [-1, 1] and scaled by 32767, rounded, as diffusers' ``encode_video`` does (it
    truncates; 0.42.1 ``utils/export_utils.py`` ``_write_audio``)."""
    pcm = np.round(np.clip(waveform, -1.0, 1.0) * 32767.0).astype("<i2")
    with wave.open(path, "wb") as f:
        f.setnchannels(waveform.shape[0])
        f.setsampwidth(2)
        f.setframerate(int(sample_rate))
        f.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # interleaved: (samples, ch)


def to_uint8(frames) -> np.ndarray:
    """(F, H, W, 3) float frames in [0, 1] -> uint8, as diffusers' ``export_to_video``
    converts them (0.42.1 ``utils/export_utils.py``: ``(frame * 255).astype(np.uint8)``,
    which truncates); uint8 frames are returned as they are."""
    frames = np.asarray(frames)
    return frames if frames.dtype == np.uint8 else (frames * 255).astype(np.uint8)


def save_video(frames, path: str, fps: int, audio: Audio | None = None) -> None:
    """Write (F, H, W, 3) frames, float in [0, 1] or uint8 (``to_uint8``), as H.264 mp4 with
    imageio-ffmpeg, atomically, with the writer and settings of diffusers'
    ``export_to_video`` (0.42.1 ``utils/export_utils.py``: quality 5, macro block 16), so the
    bytes are the ones it writes.

    With ``audio`` (``Audio``: checked by ``check_audio`` before anything is written), its
    waveform goes through a temporary 16-bit WAV (``write_wav``: clipped to [-1, 1]) into an
    AAC track muxed beside the video; both start at t=0. Neither is cut: a waveform longer or
    shorter than F / fps keeps its length, and the mp4 lasts as long as the longer (ffmpeg
    without ``-shortest``, as diffusers' ``encode_video`` writes the whole waveform), so the
    track is the saved waveform (a model that makes sound for the video makes it as long).

    Raises:
        GenerationError: a bad ``audio`` (``check_audio``), nothing written.
    """
    # Deferred, as diffusers' own export is: imageio alone costs 0.25 s of import time.
    import imageio

    waveform = None if audio is None else check_audio(audio)
    pixels = to_uint8(frames)

    def write(tmp):
        with tempfile.TemporaryDirectory() as folder:
            sound = {}
            if waveform is not None:
                wav = os.path.join(folder, "audio.wav")
                write_wav(waveform, audio.sample_rate, wav)
                # Log level "error": the stdlib's WAV header names no channel layout, and
                # ffmpeg warns on every run that it guessed it (unambiguous for 1 or 2).
                sound = dict(audio_path=wav, audio_codec="aac", ffmpeg_log_level="error")
            with imageio.get_writer(tmp, fps=fps, quality=5.0, bitrate=None,
                                    macro_block_size=16, **sound) as writer:
                for frame in pixels:
                    writer.append_data(frame)

    atomic_write(path, write)


def save_frames(frames, path: str, audio: Audio | None = None) -> None:
    """Write (F, H, W, 3) float32 frames in [0, 1] losslessly as safetensors ("frames") and,
    with ``audio``, its waveform as "audio": float32 (channels, samples), not clipped (the
    sample rate goes in the JSON report, ``audio_fields``).

    Raises:
        GenerationError: a bad ``audio`` (``check_audio``), nothing written.
    """
    from safetensors.numpy import save_file

    tensors = {"frames": np.ascontiguousarray(frames, np.float32)}
    if audio is not None:
        tensors["audio"] = check_audio(audio)
    atomic_write(path, lambda tmp: save_file(tensors, tmp))


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


def print_summary(s: dict, device_kind: str, n_devices: int, quantized: str | None = None
                  ) -> None:
    """Print the run's summary from its report's timings ``s``; ``quantized``: the
    ``--quantize`` line (``engine.weights.quantize.summary_line``), if any."""
    print(f"\n== Summary ({n_devices} x {device_kind}) ==")
    if quantized:
        print(f"{'8-bit (--quantize):':<32}{quantized}")
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
    if "overlap_wall_s" in s:  # the compile ran beside read, encode and place
        longer = max(s["overlap_load_chain_s"], s["overlap_compile_chain_s"])
        print(f"{'compile while loading:':<32}{s['overlap_wall_s']:8.2f} s wall = "
              f"{s['overlap_wall_s'] / max(longer, 1e-9):.2f} x the longer chain (load "
              f"{s['overlap_load_chain_s']:.2f} s, compile {s['overlap_compile_chain_s']:.2f} s)")
    if "programs_compiled" in s:
        print(f"{'programs compiled / loaded:':<32}{s['programs_compiled']:5d} / "
              f"{s['programs_loaded']} (executable cache)")
    if "time_to_first_video" in s:
        print_first_video(s["time_to_first_video"])
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


# The time-to-first-video split's phases, in the order a run does them, with their labels.
FIRST_VIDEO_PHASES = (("imports_s", "imports"), ("checkpoint_check_s", "checkpoint check"),
                      ("prologue_s", "runtime, mesh, kernel check"), ("read_s", "read"),
                      ("text_encode_s", "text (and image) encode"), ("place_s", "place"),
                      ("compile_wait_s", "compile wait (overlapped)"),
                      ("trace_lower_s", "trace + lower"), ("compile_s", "compile"),
                      ("executable_load_s", "executable load"), ("warmup_s", "warmup"),
                      ("denoise_s", "denoise"), ("decode_s", "decode"), ("write_s", "write"),
                      ("other_s", "other (untimed)"))


def time_to_first_video(timings: dict, runs: list, *, imports_s: float | None = None,
                        checkpoint_check_s: float | None = None, write_s: float | None = None,
                        total_s: float | None = None) -> dict:
    """The wait until the first video exists, split into phases (``FIRST_VIDEO_PHASES``).

    Args:
        timings: a ``Generation``'s (or a served job's) ``timings``, seconds per stage:
            prologue_s, read_s, text_encode_s, image_encode_s, place_*_s, trace_lower_s
            (tracing and lowering every program compiled), xla_compile_s,
            executable_load_s (programs loaded from the executable cache), warmup_s; a key
            that is absent counts as a phase that did not run (0 s, or left out).
        runs: the timed runs before the first video was written, each with its denoise_s
            and vae_decode_s (seconds).
        imports_s: seconds from the process start to the end of the entry point's imports
            (``clock``); checkpoint_check_s: ``engine.files.integrity``'s seconds; write_s:
            seconds writing the first video's files.
            With ``--overlap_compile`` (``overlap_*_s``, ``engine.pipeline.ahead``), the
            thread's lower / compile / load seconds ran beside read, encode and place: they
            leave those phases, and ``compile_wait_s`` (building the shapes and waiting for
            the thread, on the main thread) takes their place.
        total_s: seconds from the process start to the first video written; with it,
            ``other_s`` is what no phase timed (placing the model inputs, Python between
            stages). Without it, ``total_s`` is the sum of the phases.

    Returns:
        {phase: seconds} in ``FIRST_VIDEO_PHASES`` order (phases given as None left out),
        and ``total_s``.
    """
    t = timings
    split = dict(
        imports_s=imports_s, checkpoint_check_s=checkpoint_check_s,
        prologue_s=t.get("prologue_s"), read_s=t.get("read_s"),
        text_encode_s=t.get("text_encode_s", 0.0) + t.get("image_encode_s", 0.0),
        place_s=sum(v for k, v in t.items() if k.startswith("place_") and k.endswith("_s")),
        trace_lower_s=t.get("trace_lower_s"), compile_s=t.get("xla_compile_s"),
        executable_load_s=t.get("executable_load_s"), warmup_s=t.get("warmup_s", 0.0),
        compile_wait_s=0.0,
        denoise_s=sum(r.get("denoise_s", 0.0) for r in runs),
        decode_s=sum(r.get("vae_decode_s", 0.0) for r in runs), write_s=write_s)
    if "overlap_wall_s" in t:  # the overlapped thread's share is not on the main thread's path
        for phase, key in (("trace_lower_s", "overlap_lower_s"),
                           ("compile_s", "overlap_xla_compile_s"),
                           ("executable_load_s", "overlap_load_s")):
            split[phase] = max((split[phase] or 0.0) - t.get(key, 0.0), 0.0)
        split["compile_wait_s"] = t.get("overlap_build_s", 0.0) + t.get("overlap_wait_s", 0.0)
    out = {k: float(split[k]) for k, _ in FIRST_VIDEO_PHASES if split.get(k) is not None}
    if total_s is None:
        return dict(out, total_s=sum(out.values()))
    return dict(out, other_s=max(total_s - sum(out.values()), 0.0), total_s=float(total_s))


def first_video(report: dict, write_s: float | None = None,
                done_at: float | None = None) -> dict:
    """``time_to_first_video`` of the run's ``report``, measured from the process start when
    the entry point marked its imports (``clock.mark_imports_done``). ``write_s``: the first
    video's uint8, encode and mux seconds; ``done_at``: the ``time.time()`` its file was in
    place (both from the writer thread: ``engine.files.videos.write_video``), or None."""
    videos = report.get("videos")
    runs = videos[0]["runs"] if videos else report["timings"].get("runs", [])
    imported = clock.imports_done_at()
    start = clock.process_start_time() if imported is not None else None
    total = None if start is None or done_at is None else done_at - start
    return time_to_first_video(
        report["timings"], runs, imports_s=None if start is None else imported - start,
        checkpoint_check_s=(report.get("checkpoint_check") or {}).get("seconds"),
        write_s=write_s, total_s=total)


def print_first_video(split: dict) -> None:
    """Print the time-to-first-video split, one phase a line."""
    print(f"{'time to first video:':<32}{split['total_s']:8.2f} s")
    for key, label in FIRST_VIDEO_PHASES:
        if key in split:
            print(f"{'  ' + label + ':':<32}{split[key]:8.2f} s")


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
                                            config.video.frames, config.model.model_id),
            layout=dict(replicate_row_parallel=config.layout.replicate_row_parallel,
                        fsdp=config.layout.fsdp, megatron_sp=config.layout.megatron_sp,
                        sequence_parallel=mesh_shape.sp > 1),
            sharding_rule_matches=placed["rule_counts"],
            # Streamed from the safetensors files: what this host (process 0) read, against
            # the weights' bytes; equal when one host's devices hold a whole replica.
            weights=dict(source="safetensors slices", param_bytes=placed["param_bytes"],
                         bytes_read_by_this_host=placed["bytes_read"]),
            loras=placed.get("loras", []), loras_2=placed.get("loras_2", []),
            quantize=placed.get("quantize"))
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
