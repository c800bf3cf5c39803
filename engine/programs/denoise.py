"""The benchmark protocol: the denoising loop, a short warmup, timed steady-state runs and an
optional profiler trace of one step.

Every program is compiled ahead of time (AOT) before any of this runs, so compile time is
reported apart; the warmup then runs each program once, and every timed run after it is
steady state. Every timing blocks on the device result (``block_until_ready``), never on
dispatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torchax
from tqdm import tqdm

from engine.files import stream_writer
from engine.run.errors import GenerationError
from engine.run.runtime import is_writer, to_host


@dataclasses.dataclass(frozen=True)
class Programs:
    """What a run executes; a part is None when its stage does not run (staged mode).

    step: compiled model call ``(latents, t, embeds) -> noise prediction`` (weights bound),
        or an object whose ``at_timestep(host t)`` returns one
        (``engine.programs.experts.ExpertStep``: a two-expert model's weights chosen per step,
        one compiled program; ``engine.programs.step_plan.PlannedStep``: dense and sparse
        programs, the expert and cached or full, chosen per step by its ``StepPlan``).
    scheduler_config: the diffusers scheduler's config; a fresh scheduler is built from it
        per run (its ``_class_name`` names the class).
    sigmas: optional ``f(num_inference_steps) -> sigmas`` for ``set_timesteps`` (the
        family's ``scheduler_sigmas``); None, or returning None, keeps the scheduler's own.
    embeds: the placed prompt embeddings pytree the step takes.
    timesteps_sharding: where the (1,) timestep arrays go (replicated).
    vae_decode: latents -> (1, 3, F, H, W) float32 video in [-1, 1] (a ``ChunkedDecoder``).
    cache: ``engine.programs.step_cache.StepCache`` (full and cached programs) with step
        caching on; ``step`` is then a ``step_plan.PlannedStep`` whose plan says which steps
        are cached (the reports read the cache's settings and kept arrays here).
    finish: ``(final latents, embeds) -> latents`` after the loop, before the decode and
        before a staged denoise saves them (the family's ``finish_latents``: TI2V-5B
        image-to-video puts the image's latents back on frame 0).
    upscale: ``Upscale``: a second denoising stage on a larger grid run after ``finish``
        (``--sr``), or None; the decode then takes its latents.
    first_step: the index of the first sampled timestep in the ``num_inference_steps``
        schedule, the scheduler's begin index (the family's ``Scheduling.first_step``:
        video-to-video's strength cut); the loop runs the timesteps from there.
    chunks: a family's chunk loop (``families.base.ModelFamily.chunks``: Helios), or None;
        when set it runs in place of the denoising loop and the decode (``run_chunks``).
    """

    step: Callable | None = None
    scheduler_config: Any = None
    sigmas: Callable | None = None
    embeds: Any = None
    timesteps_sharding: Any = None
    vae_decode: Callable | None = None
    cache: Any = None
    finish: Callable | None = None
    upscale: Any = None
    first_step: int = 0
    chunks: Any = None


@dataclasses.dataclass(frozen=True)
class Upscale:
    """The upscale stage as the loop runs it (``engine.pipeline.upscale`` builds it).

    programs: its ``Programs`` (step, scheduler config, sigmas, timesteps' sharding; its
        model inputs come from ``hand_off``).
    num_inference_steps: its steps.
    hand_off: ``f(first stage's final latents) -> (initial latents, model inputs)``.
    next_video: ``f(config, embeds) -> Upscale`` for another video (its seed and prompt).
    for_shape: ``f(config, embeds, lr_latents, timings) -> (Upscale, example final latents)``
        compiled for another first-stage shape (``config``) on the same placed weights (the
        server's buckets).
    size: (width, height) of the stage's video, pixels.
    """

    programs: Programs
    num_inference_steps: int
    hand_off: Callable
    next_video: Callable
    for_shape: Callable | None = None
    size: tuple | None = None


def timestep_array(t):
    """A scheduler timestep as a (1,) numpy array: int32 for integer timesteps (JAX runs
    without x64), float32 otherwise; the transformers cast it to float themselves."""
    a = t.reshape(1).numpy()
    return a.astype(np.int32 if a.dtype.kind in "iu" else np.float32)


def set_timesteps(scheduler, num_inference_steps: int, sigmas=None) -> None:
    """``scheduler.set_timesteps`` as the family's pipeline calls it: with the sigmas
    ``sigmas(num_inference_steps)`` gives (HunyuanVideo-1.5), else by step count (Wan)."""
    values = None if sigmas is None else sigmas(num_inference_steps)
    if values is None:
        scheduler.set_timesteps(num_inference_steps)
    else:
        scheduler.set_timesteps(sigmas=values)


def run_sigmas(config, family):
    """The run's ``sigmas`` callable for ``set_timesteps``: ``--sigmas``' values
    (``config.video.sigmas``, as many as the steps) when given, else the family's
    ``scheduler.sigmas``."""
    given = config.video.sigmas
    return family.scheduler.sigmas if given is None else (lambda n: list(given))


def new_scheduler(scheduler_config, num_inference_steps: int, timesteps_sharding,
                  sigmas=None):
    """A fresh scheduler of the config's class with its timesteps set (see
    ``set_timesteps``), and [(torch t, (1,) jax.Array t)]."""
    import diffusers
    scheduler = getattr(diffusers, scheduler_config["_class_name"]).from_config(scheduler_config)
    set_timesteps(scheduler, num_inference_steps, sigmas)
    timesteps = [(t, jax.device_put(timestep_array(t), timesteps_sharding))
                 for t in scheduler.timesteps]
    return scheduler, timesteps


def denoise_step(step, scheduler, latents, t_torch, t, embeds, index: int | None = None):
    """One denoising step: the compiled model call, then diffusers' scheduler step run eagerly
    on JAX arrays through torchax (its float32 math is exactly upstream's). Returns the next
    float32 latents as a ``jax.Array`` (not yet synchronised).

    ``index``: the step's index in the loop; a planned call (``at_step``) runs what its
    ``step_plan.StepPlan`` says for that step. Without it (the profiler) or for a
    two-expert ``ExpertStep``, the call is found by the host timestep (``at_timestep``)."""
    env = torchax.default_env()
    if index is not None and hasattr(step, "at_step"):  # the plan's step ``index``
        step = step.at_step(index)
    elif hasattr(step, "at_timestep"):  # the expert of this timestep (or its plan step)
        step = step.at_timestep(t_torch)
    noise_pred = step(latents, t, embeds)
    with env:
        out = scheduler.step(env.j2t_iso(noise_pred), t_torch, env.j2t_iso(latents),
                             return_dict=False)[0]
    return env.t2j_iso(out)


def denoise(step, scheduler, latents, timesteps, embeds, *, desc: str, step_times=None,
            on_step=None, begin: int = 0):
    """Run the sampling loop: one compiled model call plus one scheduler step per timestep.

    Latents stay float32 between steps, as in diffusers' pipelines.

    Args:
        step: compiled model call (weights bound) latents, t, embeds -> noise prediction,
            or a call with ``at_step(i)`` (a ``step_plan.PlannedStep``'s ``for_loop``: the
            program, expert and cache decision of step ``i`` from the run's plan) or
            ``at_timestep(t)`` (``experts.ExpertStep``).
        scheduler: a fresh scheduler with timesteps set.
        latents: (1, C, F', H', W') float32 ``jax.Array``.
        timesteps: [(torch timestep, (1,) ``jax.Array``)], ``scheduler.timesteps`` in order
            (a prefix of them for the warmup).
        step_times: optional list; each step's seconds are appended, which synchronises
            after every step (the timed runs do: the timeline shows each step, and step
            caching times full and cached steps apart; the host's dispatch of the next step
            then no longer overlaps the device's work, a few ms per step).
        on_step: optional ``f(steps done)`` after each step (a server's progress); with
            ``step_times`` the step is then finished on the device.
        begin: the index of ``timesteps[0]`` in the scheduler's schedule (its begin index;
            ``Programs.first_step``).

    Returns:
        final latents, float32 ``jax.Array`` (not yet synchronised).
    """
    scheduler.set_begin_index(begin)
    for i, (t_torch, t) in enumerate(tqdm(timesteps, desc=desc, leave=False)):
        t0 = time.perf_counter()
        latents = denoise_step(step, scheduler, latents, t_torch, t, embeds, index=i)
        if step_times is not None:
            latents.block_until_ready()
            step_times.append(time.perf_counter() - t0)
        if on_step is not None:
            on_step(i + 1)
    return latents


def check_finite(x, stage: str) -> None:
    if not bool(to_host(jnp.isfinite(x).all())):
        raise GenerationError(f"{stage} produced NaN or Inf values; no video was written")


def decode(vae_decode, latents):
    """VAE-decode final latents; returns the (1, 3, F, H, W) float32 video in [-1, 1]."""
    video = vae_decode(latents)
    video.block_until_ready()
    return video


def _fresh_loop(programs: Programs, num_inference_steps: int, limit: int | None = None):
    """(scheduler, timesteps) for one sampling loop, built before its clock starts: the
    schedule from ``programs.first_step`` (its first ``limit`` steps, for the warmup)."""
    scheduler, timesteps = new_scheduler(programs.scheduler_config, num_inference_steps,
                                         programs.timesteps_sharding, programs.sigmas)
    timesteps = timesteps[programs.first_step:]
    return scheduler, timesteps[:limit] if limit is not None else timesteps


def _model_call(step, warmup_steps: int | None = None):
    """(the model call one sampling loop runs, its step count or None for all): the step
    program itself, or a planned step's ``for_loop`` over the run's plan (with
    ``warmup_steps``, over its warmup plan, ``StepPlan.warmup``)."""
    if not hasattr(step, "for_loop"):
        return step, warmup_steps
    limit = None
    if warmup_steps is not None:
        step, limit = step.for_warmup(warmup_steps)
    return step.for_loop(), limit


def _denoise_now(programs: Programs, loop, latents0, *, desc: str, call=None,
                 step_times=None, on_step=None):
    scheduler, timesteps = loop
    latents = denoise(call or programs.step, scheduler, latents0, timesteps, programs.embeds,
                      desc=desc, step_times=step_times, on_step=on_step,
                      begin=programs.first_step)
    if programs.finish is not None:
        latents = programs.finish(latents, programs.embeds)
    latents.block_until_ready()
    return latents


def _upscale_now(upscale: Upscale, latents, *, desc: str, limit: int | None = None,
                 step_times=None):
    """The upscale stage from the first stage's final latents: the hand-off, then its loop
    (its first ``limit`` steps only, for the warmup). Returns its final latents."""
    latents0, inputs = upscale.hand_off(latents)
    programs = dataclasses.replace(upscale.programs, embeds=inputs)
    loop = _fresh_loop(programs, upscale.num_inference_steps, limit)
    return _denoise_now(programs, loop, latents0, desc=desc, step_times=step_times)


def warmup(programs: Programs, latents0, *, warmup_steps: int,
           num_inference_steps: int) -> dict:
    """Run every compiled program once, so the timed runs measure steady state.

    Both programs are compiled ahead of time, so the warmup needs no whole generation:
    ``warmup_steps`` denoising steps (UniPC's first-order step 0 and its predictor-corrector
    step 1 cover every eager scheduler op) and one VAE decode of their latents. At 720p on
    v6e-8 a whole-generation warmup would cost ~4 min per run.

    Returns:
        {} when ``warmup_steps`` is 0, else dict(warmup_s, warmup_denoise_s, warmup_steps,
        warmup_vae_decode_s), keys present for the stages that ran.
    """
    if warmup_steps == 0:
        return {}
    out, t0, latents = {}, time.perf_counter(), latents0
    if programs.chunks is not None:  # each of its programs once
        programs.chunks.warmup(programs)
        out["warmup_s"] = time.perf_counter() - t0
        print(f"warmup: {out['warmup_s']:.2f} s (every chunk program once)")
        return out
    if programs.step is not None:  # a planned step: each of its programs (and cached) once
        call, limit = _model_call(programs.step, warmup_steps)
        loop = _fresh_loop(programs, num_inference_steps, limit=limit)
        latents = _denoise_now(programs, loop, latents0, desc="warmup", call=call)
        out.update(warmup_denoise_s=time.perf_counter() - t0, warmup_steps=len(loop[1]))
    if programs.upscale is not None:  # its hand-off and step, on the warmup's latents
        t1 = time.perf_counter()
        latents = _upscale_now(programs.upscale, latents, desc="warmup (upscale)",
                               limit=warmup_steps)
        out["warmup_upscale_s"] = time.perf_counter() - t1
    if programs.vae_decode is not None:
        t1 = time.perf_counter()
        decode(programs.vae_decode, latents)
        out["warmup_vae_decode_s"] = time.perf_counter() - t1
    out["warmup_s"] = time.perf_counter() - t0
    print(f"warmup: {out['warmup_s']:.2f} s"
          + (f" ({out['warmup_steps']} denoising steps" if "warmup_steps" in out else " (")
          + ("; VAE decode)" if programs.vae_decode is not None else ")"))
    return out


def run_chunks(programs: Programs, label: str, on_step=None, on_chunk=None, sink=None):
    """One timed generation by the family's chunk loop (``programs.chunks``): (run entry,
    latents, video). The entry has denoise_s (every chunk: steps and decodes), s_per_step
    (over every transformer call), total_s and the loop's own info: chunks, frames_made,
    frames_decoded, first_chunk_s, chunk_seconds, transformer_calls.

    ``sink``: an ``engine.files.stream_writer.ChunkSink`` (or None) that gets each chunk's
    frames as it is decoded, before ``on_chunk``; its errors propagate (one line)."""
    if sink is not None:
        on_chunk = functools.partial(_to_sink, sink, on_chunk)
    t0 = time.perf_counter()
    latents, video, info = programs.chunks.run(programs, on_step=on_step, on_chunk=on_chunk)
    seconds = time.perf_counter() - t0
    run = dict(denoise_s=seconds, s_per_step=seconds / max(info["transformer_calls"], 1),
               total_s=seconds, **info)
    print(f"{label}: {seconds:.2f} s ({info['chunks']} chunks, {info['frames_made']} frames, "
          f"first chunk {info['first_chunk_s']:.2f} s)")
    check_finite(video, "the chunk loop (transformer, scheduler, VAE decode)")
    return run, latents, video


def _to_sink(sink, on_chunk, index: int, frames, last: bool) -> None:
    sink.on_chunk(frames)
    if on_chunk is not None:
        on_chunk(index, frames, last)


def run_benchmark(programs: Programs, latents0, *, num_iterations: int,
                  num_inference_steps: int, desc: str = "", on_step=None, on_chunk=None):
    """``num_iterations`` timed generations of the stages ``programs`` holds (after
    ``warmup``); returns (latents, video or None, runs). ``on_step(steps done)`` is called
    after each denoising step (see ``denoise``); ``on_chunk(index, frames, last)`` as each
    chunk is decoded, with a chunk loop (``run_chunks``); the first run's chunks also go to
    the sink installed by ``engine.files.stream_writer.streaming`` (a server job's or a CLI
    run's streamed mp4; every run makes the same frames, so one run's are the video).

    ``programs.step`` runs the denoising loop from ``latents0``; ``programs.vae_decode``
    decodes its result (or ``latents0`` when there is no step).
    """
    runs, latents, video = [], latents0, None
    for i in range(num_iterations):
        label = f"{desc}run {i + 1}/{num_iterations}"
        if programs.chunks is not None:
            sink = stream_writer.chunk_sink() if i == 0 else None
            run, latents, video = run_chunks(programs, label, on_step, on_chunk, sink)
            runs.append(run)
            continue
        run, latents, t0 = {}, latents0, time.perf_counter()
        if programs.step is not None:
            loop = _fresh_loop(programs, num_inference_steps)
            cache = programs.cache
            call, _ = _model_call(programs.step)
            step_times = []
            t0 = time.perf_counter()
            latents = _denoise_now(programs, loop, latents0, desc=label, call=call,
                                   step_times=step_times, on_step=on_step)
            run["denoise_s"] = time.perf_counter() - t0
            run["s_per_step"] = run["denoise_s"] / (num_inference_steps - programs.first_step)
            run["step_seconds"] = step_times
            if cache is not None:
                run.update(_cache_step_times(call.kinds, step_times),
                           kept_bytes_by_device=call.kept_bytes_by_device)
                if cache.settings.calibrate:
                    run["calibration"] = call.calibration()
            check_finite(latents, "denoising (transformer + scheduler)")
        if programs.upscale is not None:
            run.update(_timed_upscale(programs.upscale, latents, label))
            latents = run.pop("latents")
        if programs.vae_decode is not None:
            t1 = time.perf_counter()
            video = decode(programs.vae_decode, latents)
            run["vae_decode_s"] = time.perf_counter() - t1
            run.update(getattr(programs.vae_decode, "last", None) or {})  # --park_weights
        run["total_s"] = time.perf_counter() - t0
        runs.append(run)
        parts = []
        if "denoise_s" in run:
            parts.append(f"denoise {run['denoise_s']:.2f} s, {run['s_per_step']:.3f} s/step")
        if run.get("cached_steps"):
            parts.append(f"{run['full_steps']} full steps {run['full_step_s']:.3f} s, "
                         f"{run['cached_steps']} cached {run['cached_step_s']:.3f} s")
        if "upscale_s" in run:
            parts.append(f"upscale {run['upscale_s']:.2f} s, {run['upscale_steps']} steps")
        if "vae_decode_s" in run:
            parts.append(f"VAE decode {run['vae_decode_s']:.2f} s")
        print(f"{label}: {run['total_s']:.2f} s ({'; '.join(parts)})")
    if video is not None:
        check_finite(video, "VAE decode")
    return latents, video, runs


def _timed_upscale(upscale: Upscale, latents, label: str) -> dict:
    """One timed upscale stage: {"latents": its final latents, "upscale_s" (hand-off and
    steps), "upscale_steps", "upscale_step_seconds"}."""
    step_times, t0 = [], time.perf_counter()
    latents = _upscale_now(upscale, latents, desc=f"{label} (upscale)", step_times=step_times)
    check_finite(latents, "the upscale stage (transformer + scheduler)")
    return dict(latents=latents, upscale_s=time.perf_counter() - t0,
                upscale_steps=upscale.num_inference_steps, upscale_step_seconds=step_times)


def _cache_step_times(kinds: list, seconds: list) -> dict:
    """Full and cached steps timed apart (each synchronised; scheduler step included)."""
    out = dict(step_kinds=kinds)
    for kind in ("full", "cached"):
        times = [s for k, s in zip(kinds, seconds, strict=True) if k == kind]
        out[f"{kind}_steps"] = len(times)
        out[f"{kind}_step_s"] = sum(times) / len(times) if times else None
    return out


def profile_step(profile_dir: str, programs: Programs, latents0, *,
                 num_inference_steps: int) -> dict:
    """Capture a ``jax.profiler`` trace of one steady-state denoising step.

    Called after the timed runs, so every program is compiled and warm. Step 0 runs untraced
    because UniPC's first step is its first-order special case; the traced step is step 1 (the
    predictor-corrector step every later step repeats), or step 0 when there is only one. The
    trace is an XSpace ``*.xplane.pb`` for TensorBoard's profile plugin / XProf plus a
    ``perfetto_trace.json.gz`` for ui.perfetto.dev, under ``profile_dir/plugins/profile/<run>/``.

    Returns dict(dir, files (paths relative to ``profile_dir``), traced_step, seconds).
    """
    p = programs
    scheduler, steps = new_scheduler(p.scheduler_config, num_inference_steps,
                                     p.timesteps_sharding, p.sigmas)
    scheduler.set_begin_index(p.first_step)
    steps = steps[p.first_step:][:2]
    latents = latents0
    if len(steps) == 2:
        latents = denoise_step(p.step, scheduler, latents, *steps[0], p.embeds)
        latents.block_until_ready()
    before = set(_files_under(profile_dir))
    # Every process runs the step (it is one SPMD program); process 0 traces it.
    tracing = jax.profiler.trace(profile_dir, create_perfetto_trace=True) if is_writer() \
        else contextlib.nullcontext()
    with tracing:
        with jax.profiler.StepTraceAnnotation("denoising_step", step_num=len(steps) - 1):
            t0 = time.perf_counter()
            latents = denoise_step(p.step, scheduler, latents, *steps[-1], p.embeds)
            latents.block_until_ready()
            seconds = time.perf_counter() - t0
    files = sorted(set(_files_under(profile_dir)) - before)
    return dict(dir=os.path.abspath(profile_dir), files=files, traced_step=len(steps) - 1,
                seconds=seconds)


def _files_under(root: str) -> list[str]:
    return [os.path.relpath(os.path.join(d, f), root)
            for d, _, names in os.walk(root) for f in names]


def profile(config, programs, latents0) -> dict:
    """``--profile_dir``: trace one steady-state step (``profile_step``) and say where."""
    out = profile_step(config.run.profile_dir, programs, latents0,
                       num_inference_steps=config.video.num_inference_steps)
    print(f"profile of denoising step {out['traced_step']} ({out['seconds']:.3f} s traced) in "
          f"{config.run.profile_dir}: open with TensorBoard/XProf, or perfetto_trace.json.gz in "
          "ui.perfetto.dev")
    return out
