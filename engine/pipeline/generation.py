"""One run of ``generate_flax.py``, stage by stage: ``Generation`` holds what each stage
hands the next, and ``generate`` runs them all.

The stages, in order: the prologue (``engine.pipeline.prologue.start``), ``load``,
``encode`` (text and image encoders on the CPU, then freed), ``compile`` (place the weights
and inputs, route SDPA to the kernel, compile the step and the VAE decode ahead of time),
``warm_up``, ``time_videos`` (the timed generations, each video written as it is done) and
``finish`` (the report). ``--stage encode`` stops after ``encode`` with ``save_encoded``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

from engine.files import embeddings_cache, staging, stream_writer
from engine.files import report as reporting
from engine.pipeline import ahead as aheads
from engine.pipeline import prologue as prologues
from engine.pipeline import text_device
from engine.pipeline.stages import (
    encode,
    encode_image,
    for_video,
    install_attention,
    next_video,
    prepare_programs,
    program_settings,
)
from engine.programs import denoise, executables, experts, step_cache, step_plan
from engine.run import runtime
from engine.run.config import RunConfig
from engine.run.mesh import make_mesh
from engine.weights.sharding import Fallbacks


class Generation:
    """The state of one run between its stages (see the module docstring for the order).

    Attributes, as the stages fill them: ``start`` (the ``Prologue``), ``config`` (its
    config), ``pipe``, ``embeds`` (one {name: tensor} per video), ``programs``,
    ``latents0``, ``timings`` (seconds per stage), ``report`` (the JSON report's content).
    """

    def __init__(self, config: RunConfig, family, devices=None):
        """The prologue: staged intermediates read and checked (``--stage denoise`` /
        ``decode``), then ``prologue.start``. Raises what those raise."""
        t0 = time.perf_counter()
        config, self.staged = staging.read_intermediates(config, family)
        self.start = prologues.start(config, family, devices)
        self.config, self.family = self.start.config, family
        self.video_list = self.config.run.videos or (None,)
        self.pipe = self.programs = self.latents0 = self.placed = self.frames = None
        self.mesh = self.fallbacks = self.ahead = self.stats_before = self.overlap_began = None
        self.embeds: list = []
        self.runs: list = []
        # Per video done: its timed runs and the seconds of its frames to the host
        # (``run_videos``); with ``began`` (its prompt's encode) the report's stages.
        self.video_parts: list = []
        self.began = time.time()
        self.timings: dict = {"prologue_s": time.perf_counter() - t0}
        self.cache = self.cached = None
        s = self.start
        self.report: dict = dict(stage=self.config.run.stage, settings={
            **self.config.settings(), "attention": s.attention,
            **dataclasses.asdict(s.mesh_shape)}, versions=reporting.versions())
        if self.config.run.stage in ("all", "denoise"):  # the stages that call attention
            self.report["kernel_self_check"] = s.self_check

    def load(self) -> None:
        """The diffusers pipeline, with the transformer's weights on the meta device. With
        the prompt-embedding cache on and every video's embeddings in it (and no --image,
        whose encoder loads with the text encoder's), the text encoders are not loaded.
        With ``--overlap_compile`` on, the programs start compiling from shapes first."""
        self.start_compile()
        self.cache = embeddings_cache.open_cache(self.config, self.family)
        skip = ()
        if self.cache is not None:
            self.cached = [self.cache.load_video(for_video(self.config, v))
                           for v in self.video_list]
            if not self.family.image.wanted(self.config) and all(
                    e is not None for e in self.cached):
                skip = embeddings_cache.encoder_components(self.family)
        self.pipe, self.timings["read_s"] = self.start.load(skip)
        if self.cache is not None:
            self.report["embeddings_cache"] = dict(dir=self.cache.directory,
                                                   text_encoder_loaded=not skip)

    def encode(self) -> None:
        """Every video's prompt embeddings (and the image conditioning) on the CPU (or, with
        ``--text_encoder_device mesh``, the encoders' forwards on the mesh:
        ``engine.pipeline.text_device``), the encoders freed after; a staged denoise takes
        its staged embeddings instead."""
        stage = self.config.run.stage
        self.began = time.time()  # every video's prompt enters the run here
        self.embeds = self.staged if stage == "denoise" else [None] * len(self.video_list)
        if stage not in ("all", "encode"):
            return
        # --text_encoder_device mesh: the encoders' forwards on the mesh until finish
        encoders = text_device.start(self.pipe, self.family, self.config, self.mesh, self.report)
        self.embeds, self.timings["text_encode_s"], hits = encode(
            self.pipe, self.config, self.family, self.video_list, self.cached, self.cache)
        if self.cache is not None:
            self.report["embeddings_cache"]["videos"] = [
                dict(video=0 if v is None else v.label, hit=h)
                for v, h in zip(self.video_list, hits, strict=True)]
        if self.family.image.wanted(self.config):
            self.embeds, self.timings["image_encode_s"] = encode_image(
                self.pipe, self.config, self.family, self.embeds, self.start.devices)
        text_device.finish(encoders)

    def save_encoded(self) -> dict:
        """``--stage encode``: each video's embeddings into ``--work_dir``; the report."""
        for video, video_embeds in zip(self.video_list, self.embeds, strict=True):
            staging.save_run_embeddings(for_video(self.config, video), video_embeds, video)
        return dict(self.report, timings=self.timings, videos=[
            dataclasses.asdict(v) for v in self.config.run.videos])

    def start_compile(self) -> None:
        """The mesh, and with ``--overlap_compile`` on (``ahead.wanted``) the attention
        routed and the step and the VAE decode compiling from shapes on a thread
        (``engine.pipeline.ahead``) while the checkpoint is read, the prompts encoded and
        the weights placed; ``compile`` joins it."""
        s = self.start
        self.mesh, self.fallbacks = make_mesh(s.mesh_shape, s.devices), Fallbacks()
        self.stats_before = executables.stats_snapshot()
        if self.config.upscale is not None or not aheads.wanted(  # --sr: decode's shape later
                self.config.run.overlap_compile, self.config.run.stage, s.devices):
            return
        self.overlap_began = time.perf_counter()
        config = for_video(self.config, self.video_list[0])
        install_attention(config.kernel, self.mesh, s.attention, self.fallbacks)
        self.ahead = aheads.start(config, self.family, self.mesh,
                                  lambda parts: program_settings(config, parts), self.fallbacks,
                                  decode=self.config.run.stage == "all")

    def compile(self) -> None:
        """Place the weights and the first video's inputs on the mesh, route torch SDPA to
        the attention backend, and compile the step and the VAE decode ahead of time (or
        join the compile ``start_compile`` began)."""
        s = self.start
        if self.mesh is None:
            self.start_compile()
        self.oom_hint = reporting.oom_hint(self.config, s.devices, s.mesh_shape)
        self.programs, self.latents0, self.placed = prepare_programs(
            for_video(self.config, self.video_list[0]), self.family, self.pipe, self.mesh,
            self.embeds[0], self.staged[0], s.attention, self.fallbacks, self.oom_hint,
            self.timings, self.ahead)
        if self.ahead is not None:
            self.timings.update(self.ahead.timings(self.overlap_began))
        self.count_programs()

    def count_programs(self) -> None:
        """The programs compiled and loaded since ``start_compile``, and their seconds, into
        the timings and the report (again after the warmup: a loaded program that fails its
        first call is recompiled there, ``executables.Checked``)."""
        done = executables.stats_since(self.stats_before)
        self.timings.update(trace_lower_s=done["lower_s"], xla_compile_s=done["compile_s"],
                            executable_load_s=done["load_s"],
                            programs_compiled=done["compiled"], programs_loaded=done["loaded"])
        self.report["executable_cache"] = dict(
            dir=self.config.run.executable_cache_dir, programs_compiled=done["compiled"],
            programs_loaded=done["loaded"])

    def warm_up(self) -> None:
        """Run every compiled program once, so the timed runs are steady state."""
        with runtime.hardware_errors("running the warmup", self.oom_hint):
            self.timings.update(denoise.warmup(
                self.programs, self.latents0, warmup_steps=self.config.run.warmup_steps,
                num_inference_steps=self.config.video.num_inference_steps))
        self.count_programs()

    def time_videos(self, on_video: Callable | None = None, on_chunk: Callable | None = None,
                    stream: Callable | None = None):
        """The timed generations of every video; returns the last video's frames
        ((F, H, W, 3) float32 in [0, 1]) or None (``--stage denoise``). ``on_video(video,
        frames)`` writes each video as it is done and returns its file names;
        ``on_chunk(video, index, frames, last)`` gets each chunk of a chunked family
        (Helios) as it is decoded (``engine.programs.denoise.run_chunks``); ``stream(video)
        -> ChunkSink or None``: the sink a chunked family's video streams to (``run_videos``)."""
        self.frames, self.runs, self.programs, self.latents0 = run_videos(
            self.config, self.family, self.pipe, self.mesh, self.programs, self.latents0,
            (self.video_list, self.embeds, self.staged), self.oom_hint, on_video, self.report,
            self.video_parts, on_chunk, stream)
        return self.frames

    def finish(self) -> dict:
        """The profile (``--profile_dir``) and the report: settings, mesh, timings,
        steady-state statistics, fallbacks, compilation cache."""
        config, s, programs = self.config, self.start, self.programs
        if config.run.profile_dir is not None:
            self.report["profile"] = denoise.profile(config, programs, self.latents0)
        self.report["park_weights"] = getattr(programs.vae_decode, "decision", None)
        entries, flops, cfg = step_report(config, self.family, self.pipe, programs, self.runs)
        self.report.update(entries)
        summary = reporting.summarize(self.runs, self.timings, flops, s.devices)
        self.report.update(reporting.run_report(
            config, self.family, cfg, s.devices, s.mesh_shape, self.placed, self.fallbacks,
            summary=summary, cache=s.cache_before))
        return self.report


def generate(config: RunConfig, family, devices=None, on_video=None,
             on_chunk=None) -> tuple[Any, dict]:
    """Run the stages ``config.run.stage`` selects; returns (frames or None, report).

    ``all`` runs everything in memory; ``encode`` / ``denoise`` / ``decode`` each load only
    their own component and read/write intermediates in ``config.run.work_dir``. ``devices``
    (default: all of ``jax.devices()``) lets tests build smaller meshes. With many videos
    (``config.run.videos``: --prompts_file / --seeds) everything is placed and compiled once
    and ``on_video(video, frames)`` is called as each video is done. ``on_chunk(video,
    index, frames, last)``: each chunk of a chunked family (Helios) as it is decoded, frames
    (F, H, W, 3) float32 in [0, 1] (video None without --prompts_file / --seeds).

    frames: (F, H, W, 3) float32 in [0, 1] (``all`` and ``decode``; the last video's). report:
    the JSON report's content without output file names.
    """
    run = Generation(config, family, devices)
    run.load()
    run.encode()
    if run.config.run.stage == "encode":
        return None, run.save_encoded()
    run.compile()
    run.warm_up()
    frames = run.time_videos(on_video, on_chunk)
    return (None if run.config.run.stage == "denoise" else frames), run.finish()


def run_videos(config, family, pipe, mesh, programs, latents0, per_video, oom_hint: str,
               on_video, report: dict, parts: list | None = None, on_chunk=None, stream=None):
    """The timed generations of every video (one without --prompts_file / --seeds), on the
    programs placed and compiled once; returns (the last video's frames or None, every
    timed run, the last video's programs and initial latents). ``per_video``: (videos,
    their embeddings, their staged intermediates). ``parts`` gets one {"runs", "to_frames_s"
    (seconds: device -> host and [0, 1] frames)} per video done, for its report stages.

    An interrupt between videos keeps the finished ones: ``report["interrupted"]`` is set
    and ``report["videos"]`` lists what is done, each with the files ``on_video`` wrote.
    With a chunk loop (``programs.chunks``) and ``stream``, each video's chunks go to
    ``stream(video)`` (``engine.files.stream_writer.ChunkSink``, or None) as they are
    decoded; ``on_video`` closes it, and a failure or an interrupt aborts it (no file).
    """
    runs, done, frames, before = [], [], None, dict(runtime.CACHE_STATS)
    try:
        for video, video_embeds, video_staged in zip(*per_video, strict=True):
            if video is not None and video.index > 0:  # video 0's were placed with the step
                programs, latents0 = next_video(for_video(config, video), family, pipe, mesh,
                                                programs, video_embeds, video_staged)
            sink = stream(video) if stream and programs.chunks is not None else None
            try:
                with runtime.hardware_errors("running the timed generations", oom_hint), \
                        stream_writer.streaming(sink):
                    latents, decoded, video_runs = denoise.run_benchmark(
                        programs, latents0, num_iterations=config.run.num_iterations,
                        num_inference_steps=config.video.num_inference_steps,
                        desc="" if video is None else f"video {video.label}: ",
                        on_chunk=on_chunk and functools.partial(on_chunk, video))
            except BaseException:
                if sink is not None:
                    sink.abort()
                raise
            runs += video_runs
            if config.run.stage == "denoise":  # each video's latents as soon as they are done
                staging.save_run_latents(for_video(config, video), latents, video)
            host_began = time.perf_counter()
            if decoded is not None:
                frames = reporting.to_frames(pipe, decoded)
            if parts is not None:
                parts.append(dict(runs=video_runs,
                                  to_frames_s=time.perf_counter() - host_began))
            if video is not None:
                done.append(dict(dataclasses.asdict(video), runs=video_runs,
                                 files=on_video(video, frames) if on_video and decoded is
                                 not None else [],
                                 compilation_cache=runtime.cache_events_since(before)))
            before = dict(runtime.CACHE_STATS)
    except KeyboardInterrupt:
        if not config.run.videos:
            raise
        report["interrupted"] = True
    if config.run.videos:
        report["videos"] = done
    return frames, runs, programs, latents0


def step_report(config, family, pipe, programs, runs) -> tuple[dict, float | None, dict]:
    """The step's part of the report: ({"cache": the step cache's entry, "experts": the two
    experts' entry}, when they apply; analytic FLOPs per step or None; the transformer's
    config or None)."""
    out = {}
    if programs.cache is not None:
        out["cache"] = step_cache.cache_report(programs.cache, runs,
                                                config.video.num_inference_steps)
    cfg = dict(pipe.transformer.config) if pipe.transformer is not None else None
    step = programs.step
    if isinstance(step, step_plan.PlannedStep):  # its plan (and the experts' entry)
        out.update(step.report())
        step = step.expert_step
    flops = None if step is None else experts.flops_per_step(
        step, lambda k: family.transformer.flops(dict(
            (pipe.transformer, pipe.transformer_2)[k].config), config))
    if flops is not None and "experts" not in out:
        out["experts"] = step.report()
    if programs.step is not None:  # a cached step counts what it runs
        flops = step_cache.flops_per_step(flops or family.transformer.flops(cfg, config), config,
                                          cfg)
    return out, flops, cfg
