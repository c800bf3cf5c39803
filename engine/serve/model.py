"""The warm model: load and place once, compile every (size, frames) bucket, warm up, then
run one job at a time on those programs.

It runs the CLI's own stages (``engine.pipeline``: the prologue, then ``stages``), so a
job's frames are the frames ``generate_flax.py`` gives for the same seed and settings: the
same placement, the same compiled step and VAE decode, the same loop
(``engine.programs.denoise.run_benchmark``, one timed run).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

import jax
from PIL import Image

from engine.files import embeddings_cache
from engine.files import report as reporting
from engine.files.image import decode_image
from engine.pipeline import prologue, stages, text_device
from engine.programs import denoise, executables
from engine.run import clock, runtime
from engine.run.errors import fail
from engine.run.mesh import make_mesh
from engine.serve.requests import VideoJob
from engine.weights.sharding import Fallbacks

# Pipeline components the families free after encoding; the server keeps them for every job
# (the text encoders stay in host RAM, as in a --prompts_file run before its encode).
ENCODERS = ("text_encoder", "text_encoder_2")
# Test hook: a job whose prompt equals this variable's value starts from NaN latents, so the
# server's NaN path (``denoise.check_finite``) runs on a real job. Unset in normal use.
NAN_HOOK_ENV = "GENERATE_FLAX_TEST_NAN_PROMPT"


@dataclasses.dataclass(frozen=True)
class Served:
    """What requests may ask for: the model's names, the buckets, and the settings fixed at
    start (a job that changes them would need a new compile, so it is refused).

    variable_guidance: the CFG scale is a traced input of the step (any value on the same
        side of 1); else only ``guidance_scale`` as served. fixed_steps: only
        ``num_inference_steps`` is served, for the reason ``steps_rule`` gives (step
        caching's schedule was checked for that count, or the step's inputs hold a per-step
        table whose length is compiled in). image_mode:
        ``ModelFamily.image.mode``: "required" (image-to-video: every job sends
        ``input_reference``), "none" or "optional" (served as text-to-video).
        output_sizes: (width, height) of the videos a job of each of ``sizes`` gets: the
        same, or with ``--sr`` the upscale stage's size (a request names the first stage's).
        fps_rule: why only ``fps`` is served (the family's own flag check, ``Flags.check``,
        refuses another fps: e.g. the audio length and the step follow it), or None (the
        fps is the mp4's rate only: any value).
    """

    model: str
    model_id: str
    sizes: tuple
    frames: tuple
    frame_step: int
    fps: int
    num_inference_steps: int
    guidance_scale: float
    guidance_scale_2: float | None
    negative_prompt: str
    variable_guidance: bool
    fixed_steps: bool
    image_mode: str
    output_sizes: tuple = ()
    steps_rule: str = "step caching was set up for them"
    fps_rule: str | None = None

    def describe(self) -> dict:
        """``GET /v1/models``' entry for the model."""
        return dict(id=self.model, object="model", owned_by="local", model_id=self.model_id,
                    sizes=[f"{w}x{h}" for w, h in self.sizes], frames=list(self.frames),
                    seconds=[f"{(f - 1) / self.fps:g}" for f in self.frames], fps=self.fps,
                    num_inference_steps=self.num_inference_steps,
                    guidance_scale=self.guidance_scale, image_mode=self.image_mode,
                    output_sizes=[f"{w}x{h}" for w, h in self.output_sizes or self.sizes])


@dataclasses.dataclass
class Bucket:
    """One compiled shape: its configuration, its programs (``denoise.Programs``; a job
    replaces their ``embeds``), and the seconds it took (text_encode_*, place_*, compile_*,
    warmup_*)."""

    config: Any
    programs: Any
    timings: dict


def model_name(model_id: str) -> str:
    """The name requests use: a local folder's base name, or the Hub id."""
    return os.path.basename(os.path.normpath(model_id)) if os.path.isdir(model_id) \
        else model_id


def bucket_key(width: int, height: int, frames: int) -> str:
    return f"{width}x{height}x{frames}"


class WarmModel:
    """The loaded, placed and compiled model (``build`` makes one); ``run`` generates one
    job's video on every process of the run."""

    def __init__(self, config, family, pipe, mesh, devices, oom_hint: str):
        self.config, self.family, self.pipe = config, family, pipe
        self.mesh, self.devices, self.oom_hint = mesh, devices, oom_hint
        self.encoders = {k: getattr(pipe, k, None) for k in ENCODERS}
        # Each text's embeddings: recent ones in memory (--embedding_cache_bytes), over the
        # CLI's --embeddings_cache folder; a job whose texts are in it runs no encoder.
        self.cache = embeddings_cache.open_cache(config, family,
                                                 config.serve.embedding_cache_bytes)
        self.image_mode = family.image.mode(config.model.model_id)
        # The image encoder and the placed VAE encoder, kept by the family's encode_image
        # for every job (families/base.py ``encode_image``'s ``resident``).
        self.resident: dict = {}
        # --text_encoder_device mesh: the encoders placed at the first encode, kept (or
        # parked in host memory) between jobs; their report entry, ["text_encoders"].
        self.mesh_encoders, self.encoders_report = None, {}
        self.text_hit = False
        self.buckets: dict[str, Bucket] = {}
        self.timings: dict = {}
        self.served: Served | None = None

    def encode(self, config) -> tuple[dict, dict]:
        """(this config's prompt embeddings, {"text_encode_s": seconds}); ``self.text_hit``:
        whether every text came from the embedding cache (no encoder ran)."""
        for name, module in self.encoders.items():  # stages.encode freed them after last use
            if module is not None:
                setattr(self.pipe, name, module)
        self.mesh_encoders = text_device.resume(self.mesh_encoders, self.pipe, self.family,
                                                config, self.mesh, self.encoders_report)
        try:
            embeds, seconds, hits = stages.encode(self.pipe, config, self.family, [None],
                                                  cache=self.cache)
        finally:
            text_device.rest(self.mesh_encoders)
        self.text_hit = hits[0]
        return embeds[0], {"text_encode_s": seconds}

    def encode_image(self, config, image) -> tuple[dict, dict]:
        """(the image conditioning of ``image``, an RGB PIL image, at this config's shape,
        {"image_encode_s": seconds}), on encoders placed once (``self.resident``)."""
        t0 = time.perf_counter()
        self.mesh_encoders = text_device.resume(self.mesh_encoders, self.pipe, self.family,
                                                config, self.mesh, self.encoders_report)
        try:
            cond = self.family.image.encode(self.pipe, config, image, self.devices,
                                            resident=self.resident)
        finally:
            text_device.rest(self.mesh_encoders)
        return cond, {"image_encode_s": time.perf_counter() - t0}

    def run(self, job_id: str, job: VideoJob, image: bytes | None,
            on_step: Callable[[int, int], None]):
        """Generate ``job`` (``engine.serve.requests.check``'s settings; ``image``: the
        ``input_reference`` bytes of an image-to-video job, else None) on its bucket's
        programs.

        Returns (frames (F, H, W, 3) float32 in [0, 1], the job's config, timings: text
        and image encode, text_cache_hit (the job's texts came from the embedding cache),
        denoise_s, s_per_step, step_seconds, vae_decode_s, total_s, to_frames_s (device ->
        host and [0, 1] frames), and
        the video's sound: ``engine.files.report.Audio`` (waveform (channels, samples)
        float32 on the host, rate in Hz) from a decoder with sound, as the CLI takes it
        (its ``audio``: the last decode's), else None).
        ``on_step(steps done, steps)`` is called after each denoising step; what it raises
        (a cancel: ``hosts.JobCancelled``) ends the job there, before the decode.

        Raises:
            GenerationError: NaN or Inf latents, out of device memory.
        """
        bucket = self.buckets[bucket_key(job.width, job.height, job.num_frames)]
        config = job.run_config(bucket.config)
        t0 = time.perf_counter()
        embeds, timings = self.encode(config)
        timings["text_cache_hit"] = self.text_hit
        steps = config.video.num_inference_steps
        with runtime.hardware_errors("running a job", self.oom_hint):
            if image is not None:
                cond, seconds = self.encode_image(config, decode_image(image))
                embeds = {**embeds, **cond}
                timings.update(seconds)
            inputs, latents0 = stages.place_model_inputs(config, self.family, self.pipe, embeds,
                                                         self.mesh)
            if os.environ.get(NAN_HOOK_ENV) == job.prompt:
                latents0 = latents0 * float("nan")
            sr = bucket.programs.upscale  # --sr: this job's SR noise and inputs
            chunks = bucket.programs.chunks  # a chunk loop: this job's seed and prompt
            programs = dataclasses.replace(bucket.programs, embeds=inputs,
                                           upscale=sr and sr.next_video(config, embeds),
                                           chunks=chunks and chunks.for_video(config, embeds))
            # a chunk loop counts its transformer calls over every chunk (more than
            # ``steps``; each count once, as the processes' hand-off needs): past ``steps``
            # its progress stays just under 100 % until the job ends
            _, decoded, runs = denoise.run_benchmark(
                programs, latents0, num_iterations=1, num_inference_steps=steps,
                desc=f"{job_id}: ", on_step=lambda i: on_step(i, max(steps, i)))
            t1 = time.perf_counter()
            frames = reporting.to_frames(self.pipe, decoded)
            audio = getattr(programs.vae_decode, "audio", None)
        timings.update(runs[0], to_frames_s=time.perf_counter() - t1,
                       job_s=time.perf_counter() - t0)
        return frames, config, timings, audio


def build(config, family, devices=None) -> WarmModel:
    """Load the pipeline, place the weights, compile and warm up every bucket of
    ``config.serve`` (a ``ServeSettings``), as ``engine.pipeline.generate`` does for one
    shape, after the same prologue. ``model.timings`` gets load_s, per-bucket
    place/compile/warmup seconds, the persistent compilation cache's hits and misses, the
    programs compiled and loaded from the executable cache, and ``split``: the time to ready
    in the CLI's time-to-first-video phases (``ready_split``).

    Raises:
        UsageError: the buckets would need different meshes.
        GenerationError: kernel self-check, out of memory, as the CLI raises them.
    """
    t0, before = time.perf_counter(), dict(executables.STATS)
    start = prologue.start(config, family, devices)
    prologue_s = time.perf_counter() - t0
    config, devices = start.config, start.devices
    configs = [_bucket_config(config, family, w, h, f) for w, h, f in config.serve.buckets]
    shapes = [prologue.resolve_mesh(c, family, len(devices), start.chip) for c in configs]
    if any(s != shapes[0] for s in shapes):
        fail("--serve_sizes", ",".join(f"{w}x{h}" for w, h in config.serve.sizes),
             f"the buckets choose different meshes ({sorted(set(map(str, shapes)))}); give "
             "--dp, --tp and --sp")
    pipe, load_s = start.load()
    model = WarmModel(config, family, pipe, make_mesh(shapes[0], devices), devices,
                      reporting.oom_hint(configs[0], devices, shapes[0]))
    _compile_buckets(model, configs, start.attention)
    model.timings = dict(
        load_s=load_s, buckets={k: b.timings for k, b in model.buckets.items()},
        compile_s=sum(v for b in model.buckets.values() for k, v in b.timings.items()
                      if k.startswith("compile_")),
        warmup_s=sum(b.timings.get("warmup_s", 0.0) for b in model.buckets.values()),
        compilation_cache=None if start.cache_before is None else
        runtime.cache_events_since(start.cache_before))
    model.timings["split"] = ready_split(model.timings, prologue_s, load_s,
                                         executables.stats_since(before))
    model.timings.update(programs_compiled=model.timings["split"].pop("programs_compiled"),
                         programs_loaded=model.timings["split"].pop("programs_loaded"))
    model.served = _served(config, family, model)
    return model


def _bucket_config(config, family, width: int, height: int, frames: int):
    """``config`` at one bucket's shape; with ``--sr`` the upscale stage's size follows."""
    out = config.replace(width=width, height=height, frames=frames)
    if config.upscale is None:
        return out
    return out.replace(upscale=family.upscale.for_size(config.upscale, height, width))


def ready_split(timings: dict, prologue_s: float, load_s: float, programs: dict) -> dict:
    """The server's time to ready in the CLI's phases (``report.time_to_first_video``, no
    video): imports (process start to the entry point's imports done), prologue, read,
    text encode, place, trace + lower, compile, executable load, warmup, each summed over
    the buckets (seconds), ``total_s`` from the process start, and the programs compiled
    and loaded (``programs``: ``executables.stats_since``)."""
    merged: dict = {}
    for bucket in timings["buckets"].values():
        for k, v in bucket.items():
            if isinstance(v, (int, float)):
                merged[k] = merged.get(k, 0.0) + v
    merged.update(prologue_s=prologue_s, read_s=load_s, trace_lower_s=programs["lower_s"],
                  xla_compile_s=programs["compile_s"], executable_load_s=programs["load_s"],
                  warmup_s=timings["warmup_s"])
    done = clock.imports_done_at()
    imports_s = None if done is None else done - clock.process_start_time()
    split = reporting.time_to_first_video(merged, [], imports_s=imports_s,
                                          total_s=time.time() - clock.process_start_time())
    for k in ("denoise_s", "decode_s"):
        split.pop(k, None)
    return dict(split, programs_compiled=programs["compiled"],
                programs_loaded=programs["loaded"])


def _compile_buckets(model: WarmModel, configs: list, attention: str) -> None:
    """Place once (with the first bucket, by ``prepare_programs``), then compile the step
    (``compile_transformer``) and the VAE decode (``family.vae.decoder``, as
    ``prepare_decode`` makes it) for each other bucket on the placed weights; warm each up."""
    fallbacks, first, placed, second, embeds = Fallbacks(), None, None, None, None
    for config in configs:
        timings: dict = {}
        if embeds is None:  # one prompt encode serves every bucket
            embeds, enc = model.encode(config)
            timings.update(enc)
        bucket_embeds = embeds
        if model.image_mode == "required":  # the image encode compiled for this shape too
            cond, enc = model.encode_image(config, _warmup_image(config))
            timings.update(enc)
            bucket_embeds = {**embeds, **cond}
        if first is None:
            programs, latents0, placed = stages.prepare_programs(
                config, model.family, model.pipe, model.mesh, bucket_embeds, None, attention,
                fallbacks, model.oom_hint, timings)
            first = programs
            experts = getattr(programs.step, "experts", None)  # two experts: both placed
            second = experts[1] if experts else None
        else:
            inputs, latents0 = stages.place_model_inputs(
                config, model.family, model.pipe, bucket_embeds, model.mesh)
            step, cache, sr, decode = _compile_bucket(
                model, config, (placed, second, first), latents0, inputs, bucket_embeds,
                timings, (fallbacks, attention))
            if hasattr(first.vae_decode, "with_decoder"):  # the same --park_weights
                decode = first.vae_decode.with_decoder(decode)
            programs = dataclasses.replace(first, step=step, cache=cache, vae_decode=decode,
                                           embeds=inputs, upscale=sr)
        with runtime.hardware_errors("running the warmup", model.oom_hint):
            timings.update(denoise.warmup(programs, latents0,
                                          warmup_steps=config.run.warmup_steps,
                                          num_inference_steps=config.video.num_inference_steps))
        key = bucket_key(config.video.width, config.video.height, config.video.frames)
        model.buckets[key] = Bucket(config=config, programs=programs, timings=timings)
        print(f"bucket {key}: " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()
                                            if k.endswith("_s")), flush=True)


def _compile_bucket(model: WarmModel, config, weights: tuple, latents0, inputs, embeds,
                    timings: dict, routes: tuple):
    """A bucket after the first: its step, its upscale stage (``--sr``) and its VAE decode
    compiled on the weights placed with the first (``weights``: (placed transformer, second
    expert, the first bucket's programs)), through the executable cache with this bucket's
    settings (as ``prepare_programs`` does for the first). ``routes``: (fallbacks, attention
    backend). Returns (step, step cache, upscale or None, decoder)."""
    (placed, second, first), (fallbacks, attention) = weights, routes
    with executables.caching(config.run.executable_cache_dir,
                             stages.program_settings(config, model.pipe), model.mesh):
        with runtime.hardware_errors("compiling the transformer step", model.oom_hint):
            step, cache = stages.compile_transformer(
                config, model.family, model.pipe, placed, model.mesh, latents0, inputs,
                timings, second)
        sr, final = None, latents0
        if first.upscale is not None:  # on the SR weights placed with the first bucket
            with runtime.hardware_errors("compiling the upscale stage", model.oom_hint):
                sr, final = first.upscale.for_shape(config, embeds, latents0, timings)
            stages.install_attention(config.kernel, model.mesh, attention, fallbacks)
        # The VAE decoder's weights placed with the first bucket (placing frees the host
        # copies), compiled for this shape.
        decode = model.family.vae.decoder(first.vae_decode.placed, model.pipe.vae,
                                          model.mesh, tiling=config.run.vae_tiling,
                                          fallbacks=fallbacks)
        with runtime.hardware_errors("compiling the VAE decode", model.oom_hint):
            timings["compile_vae_s"] = decode.compile(final)
    return step, cache, sr, decode


def _warmup_image(config):
    """A grey frame of the bucket's size: any image compiles and warms up the image encode
    (the programs depend on the shape only)."""
    return Image.new("RGB", (config.video.width, config.video.height), (128, 128, 128))


def _served(config, family, model: WarmModel) -> Served:
    programs = next(iter(model.buckets.values())).programs
    two_experts = hasattr(programs.step, "experts")
    v = config.video
    steps_rule = _steps_in_inputs(config, family, dict(model.pipe.transformer.config))
    return Served(
        model=model_name(config.model.model_id), model_id=config.model.model_id,
        sizes=config.serve.sizes, frames=config.serve.frames,
        frame_step=family.sizes.frame_step(config.model.model_id),
        fps=v.fps, num_inference_steps=v.num_inference_steps, guidance_scale=v.guidance_scale,
        guidance_scale_2=v.guidance_scale_2, negative_prompt=v.negative_prompt,
        variable_guidance="guidance_scale" in programs.embeds and not two_experts,
        fixed_steps=programs.cache is not None or steps_rule is not None,
        steps_rule=steps_rule or Served.steps_rule,
        image_mode=family.image.mode(config.model.model_id),
        fps_rule=_fps_rule(config, family),
        output_sizes=tuple(_output_size(model, w, h) for w, h in config.serve.sizes))


def _output_size(model: WarmModel, width: int, height: int) -> tuple:
    """(width, height) of a job's video at a served size: the upscale stage's with --sr."""
    bucket = next(b for b in model.buckets.values()
                  if (b.config.video.width, b.config.video.height) == (width, height))
    sr = bucket.programs.upscale
    return (width, height) if sr is None else sr.size


def _steps_in_inputs(config, family, cfg: dict) -> str | None:
    """Why the step count is compiled in, or None: the step's inputs change shape with it
    (a per-step table, such as a (B, 2, steps) timestep and sigma table)."""
    n = config.video.num_inference_steps

    def shapes(steps):
        return [tuple(x.shape) for x in jax.tree.leaves(family.transformer.abstract_model_inputs(
            cfg, config.replace(num_inference_steps=steps)))]

    if shapes(n) == shapes(n + 1):
        return None
    return "the step program's inputs hold a per-step table of that length"


def _fps_rule(config, family) -> str | None:
    """The family's rule (``Flags.check``) against another fps than the served one, or None
    when it takes one (then a job's fps is its mp4's rate only)."""
    fps = config.video.fps
    broken = family.flags.check({**config.settings(), "fps": fps + 1})
    return broken[1] if broken is not None and broken[0] == "--fps" else None
