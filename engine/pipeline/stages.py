"""The stages of a generation, each a small verb: encode on the CPU, place the weights and
the model inputs, route torch SDPA to the kernel, compile the transformer step and the VAE
decode ahead of time.

The CLI (``engine.pipeline.generation``) and the server (``engine.serve.model``) call these
same functions, so a served job's frames are the frames a one-shot run gives for the same
seed and settings.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
import torchax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from custom_splash_attention import install_sdpa_override
from engine.files.image import read_image
from engine.pipeline import upscale
from engine.programs import executables, experts, parking, transformer_step
from engine.programs.denoise import Programs, run_sigmas, set_timesteps, timestep_array
from engine.programs.step import compile_step
from engine.run import chips, lowering, runtime
from engine.run.config import KernelSettings, RunConfig, RunSettings
from engine.weights import placement, sharding
from engine.weights.sharding import place_module


def for_video(config: RunConfig, video) -> RunConfig:
    """``config`` with ``video``'s prompt, negative prompt and seed (None: as it is)."""
    if video is None:
        return config
    return config.replace(prompt=video.prompt, negative_prompt=video.negative_prompt,
                          seed=video.seed)


def encode(pipe, config: RunConfig, family, videos, cached: list | None = None, cache=None):
    """Prompt embeddings on the CPU, before JAX places anything. Every video's texts are
    encoded before the text encoders are freed, each distinct text once
    (``family.text.encode_text``): a negative prompt every video shares is encoded once.

    ``cached``: each video's embeddings already read from the prompt-embedding cache
    (``cache.load_video``; None for a miss; default: none read). ``cache``: an
    ``engine.files.embeddings_cache.EmbeddingsCache`` or None; each text not in it is
    encoded and stored. Returns ([{name: tensor}] per video, seconds, [hit?] per video:
    True when that video needed no encoder call).
    """
    t0 = time.perf_counter()
    cached = [None] * len(videos) if cached is None else cached
    encoders = {k: getattr(pipe, k, None) for k in ("text_encoder", "text_encoder_2")}
    texts: dict = {}  # this call's texts: {text: tensors}
    embeds, hits = [], []
    for video, hit in zip(videos, cached, strict=True):
        if hit is not None:
            embeds.append(hit)
            hits.append(True)
            continue
        video_config, out, encoded = for_video(config, video), {}, False
        for prefix, text in family.text.prompt_sides(video_config):
            got = texts.get(text)
            if got is None and cache is not None:
                got = cache.load(video_config, text)
            if got is None:
                got, encoded = family.text.encode_text(pipe, video_config, text), True
                if cache is not None:
                    cache.store(video_config, text, got)
            texts[text] = got
            out.update({prefix + k: v for k, v in got.items()})
        embeds.append(out)
        hits.append(not encoded)
    for name in encoders:  # nothing needs the encoders after this (UMT5-XXL: ~11 GB bf16)
        if hasattr(pipe, name):
            setattr(pipe, name, None)
    return embeds, time.perf_counter() - t0, hits


def encode_image(pipe, config: RunConfig, family, embeds: list, devices):
    """The image conditioning (``family.image.encode``; the image None when the family
    wants an encode of other inputs, ``family.image.wanted``), computed once and joined to
    every video's embeddings: (embeds, seconds)."""
    t0 = time.perf_counter()
    image = None if config.video.image is None else read_image(config.video.image)
    cond = family.image.encode(pipe, config, image, devices)
    return [{**e, **cond} for e in embeds], time.perf_counter() - t0


# Settings that change no compiled program (what a video says, where files go, how often the
# benchmark repeats); every other setting is part of the executable cache's key, so a new
# flag misses rather than loads a wrong program.
NOT_PROGRAM_SETTINGS = ("prompt", "negative_prompt", "seed", "seeds", "prompts_file", "videos",
                        "output_dir", "work_dir", "num_iterations", "warmup_steps", "no_plots",
                        "save_frames", "compilation_cache_dir", "executable_cache_dir",
                        "embeddings_cache", "profile_dir", "verbose", "coordinator_address",
                        "num_processes", "process_id", "serve", "fps", "image", "model_id",
                        "lora", "lora_2", "stage", "overlap_compile", "text_encoder_device",
                        # the dry run's own options (--aot_export writes entries for a run)
                        "dry_run", "topology", "dry_run_layers", "dry_run_skip_vae",
                        "dry_run_exact_convs", "estimate", "aot_export")


def program_settings(config, pipe) -> dict:
    """The executable cache's settings part: every program-shaping setting of ``config``
    and the architecture configs of the pipeline's transformer(s) and VAE. A LoRA is left
    out: it is fused into the weights, which the programs take as arguments."""
    out = {k: v for k, v in config.settings().items() if k not in NOT_PROGRAM_SETTINGS}
    for name in ("transformer", "transformer_2", "vae"):
        module = getattr(pipe, name, None)
        if module is not None:
            out[f"{name}_config"] = {k: v for k, v in dict(module.config).items()
                                     if not k.startswith("_")}
    return out


def prepare_programs(config, family, pipe, mesh, embeds, staged, attention, fallbacks,
                     oom_hint: str, timings: dict, ahead=None):
    """Place weights and inputs and AOT-compile what ``config.run.stage`` runs, through the
    executable cache (``--executable_cache_dir``; ``engine.programs.executables``).
    ``ahead``: an ``engine.pipeline.ahead.Ahead`` compiling from shapes since before the
    load (the attention then already installed), joined once everything is placed; what it
    compiled for the placed signatures is used instead of compiling again.

    Returns (``denoise.Programs``, initial latents on the mesh, the placed transformer
    or None). Placement and compile seconds go into ``timings``.
    """
    with executables.caching(config.run.executable_cache_dir, program_settings(config, pipe),
                             mesh):
        return _prepare_programs(config, family, pipe, mesh, embeds, staged, attention,
                                 fallbacks, oom_hint, timings, ahead)


def _prepare_programs(config, family, pipe, mesh, embeds, staged, attention, fallbacks,
                      oom_hint: str, timings: dict, ahead):

    replicated = NamedSharding(mesh, P())
    parts, placed, sr_placed = dict(timesteps_sharding=replicated), None, None
    if config.run.stage in ("all", "denoise"):
        if ahead is None:  # else installed before the background compile started
            install_attention(config.kernel, mesh, attention, fallbacks)
        with runtime.hardware_errors("placing the transformer weights", oom_hint):
            placed = sharding.place_expert(config, family, pipe.transformer, "transformer", mesh,
                                            fallbacks)
            second = experts.second_expert(pipe) and experts.place_second(
                config, family, pipe, mesh, fallbacks)  # Wan 2.2 A14B: both stay resident
            inputs, latents0 = place_model_inputs(config, family, pipe, embeds, mesh)
        ahead = ahead and ahead.join()  # the load chain is done: wait for the compile
        timings["place_transformer_s"] = placed["seconds"]
        timings["place_transformer_gbps"] = placed["bytes"] / max(placed["seconds"], 1e-9) / 1e9
        if second:
            timings["place_transformer_2_s"] = second["seconds"]
            placed["loras_2"] = second["loras"]
        with runtime.hardware_errors("compiling the transformer step", oom_hint):
            step, cache = compile_transformer(config, family, pipe, placed, mesh, latents0,
                                              inputs, timings, second, ahead)
        parts.update(step=step, scheduler_config=pipe.scheduler.config, embeds=inputs,
                     sigmas=run_sigmas(config, family), cache=cache,
                     finish=family.image.finish_latents,
                     first_step=family.scheduler.first_step(config))
        if family.chunks is not None:  # Helios: its chunk loop on this step (and others)
            parts["chunks"] = family.chunks(config, pipe, embeds, step, _compile_for(
                config, family, placed, mesh, inputs, timings))
        if config.upscale is not None:  # --sr: its programs, then the decode for its latents
            parts["upscale"], sr_placed, latents_out = _prepare_upscale(
                config, family, pipe, mesh, embeds, latents0, attention, fallbacks, oom_hint,
                timings)
    else:
        latents0 = placement.place_array(placement.host_array(staged), replicated)
    if config.run.stage in ("all", "decode"):
        parts["vae_decode"] = prepare_decode(config.run, family, pipe, mesh,
                                             latents_out if config.upscale else latents0,
                                             fallbacks, oom_hint, timings, ahead)
        if placed is not None:  # --park_weights: the transformer's weights, while it decodes
            chip = chips.chip_for_device_kind(mesh.devices.flat[0].device_kind)
            parts["vae_decode"] = parking.ParkingDecoder(
                parts["vae_decode"], [p for p in (placed, second, sr_placed) if p],
                config.run.park_weights, chip and chip.usable_hbm_bytes, config.run.park_memory)
    return Programs(**parts), latents0, placed


def _prepare_upscale(config, family, pipe, mesh, embeds, latents0, attention, fallbacks,
                     oom_hint, timings):
    """``upscale.prepare_upscale`` with SDPA routed on its own mesh while it traces, then back
    on the run's mesh (the decode traces next)."""
    def install(kernel, on_mesh):
        install_attention(kernel, on_mesh, attention, fallbacks)

    with runtime.hardware_errors("placing and compiling the upscale stage", oom_hint):
        out = upscale.prepare_upscale(config, family, pipe, list(mesh.devices.flat), embeds,
                                      latents0, fallbacks, timings, install)
    install(config.kernel, mesh)
    return out


def install_attention(kernel: KernelSettings, mesh, attention: str, fallbacks) -> None:
    """Route torch SDPA to ``attention`` (our Splash kernel, JAX's, or XLA) on ``mesh``, with
    the kernel flags' one ``AttentionOptions`` value; RoPE's indexing without scatters."""

    lowering.install(torchax.default_env())
    install_sdpa_override(torchax.default_env(), attention=attention, mesh=mesh,
                          options=kernel.options(),
                          interpret=jax.default_backend() != "tpu", on_fallback=fallbacks)


def place_model_inputs(config, family, pipe, embeds: dict, mesh):
    """The model inputs (batch over "dp") and the seeded initial latents (replicated),
    streamed to their shardings. Every host encoded the prompt and drew the noise itself
    (no broadcast), so the hosts' copies of one global array must agree: checked."""
    inputs = family.transformer.model_inputs(embeds, config)
    latents = family.image.start_latents(pipe, config, family.text.prepare_latents(pipe, config),
                                         embeds)
    for name, x in {**inputs, "initial latents": latents}.items():
        runtime.check_same_on_every_host(name, placement.host_array(x))
    # Placed explicitly: torchax does not shard inputs by itself, and an earlier port
    # measured 54 vs 5.9 s/step without and with this.
    over_dp = NamedSharding(mesh, P("dp"))
    inputs = jax.tree.map(lambda x: placement.place_array(placement.host_array(x), over_dp),
                          inputs)
    latents0 = placement.place_array(placement.host_array(latents), NamedSharding(mesh, P()))
    return inputs, latents0


def compile_transformer(config, family, pipe, placed, mesh, latents0, inputs, timings,
                        second=None, ahead=None):
    """AOT-compile one denoising step's model call; returns (step(latents, t, inputs),
    ``step_cache.StepCache`` or None). The weights are bound, so the timed loop passes only
    what changes (``transformer_step.compile_transformer_step``): with step caching the full
    and the cached programs; with a ``second`` expert one program serves both. ``ahead``
    (joined): its step is used when compiled for these arguments' signature. Through the
    executable cache when called within ``executables.caching`` (``prepare_programs``,
    the server's other buckets)."""
    t = jax.device_put(_example_timestep(config, family, pipe), NamedSharding(mesh, P()))
    fn = family.transformer.step_fn(placed["module"], config)
    precompiled = ahead.step_for((placed["params"], placed["buffers"], latents0, t, inputs)) \
        if ahead is not None else None
    return transformer_step.compile_transformer_step(
        config, family.transformer.block_stack, pipe, placed, second, mesh, fn, latents0, t,
        inputs, timings, precompiled)


def _example_timestep(config, family, pipe):
    """The (1,) timestep the step compiles with: the schedule's first (the pipeline's
    scheduler set as the loop sets it), or for a chunk loop, whose loop sets its scheduler
    per chunk and stage, a zero of ``family.transformer.timestep_dtype``."""
    if family.chunks is not None:
        return np.zeros(1, family.transformer.timestep_dtype)
    set_timesteps(pipe.scheduler, config.video.num_inference_steps, run_sigmas(config, family))
    return timestep_array(pipe.scheduler.timesteps[0])


def _compile_for(config, family, placed, mesh, inputs, timings):
    """``compile_for(latents)`` of ``ModelFamily.chunks``: the step compiled for another
    latents shape on the same placed weights and inputs, weights bound; its seconds add to
    ``timings["compile_transformer_s"]``."""
    def compile_for(latents):
        t = jax.device_put(np.zeros(1, family.transformer.timestep_dtype),
                           NamedSharding(mesh, P()))
        fn = family.transformer.step_fn(placed["module"], config)
        compiled, seconds = compile_step(placed, mesh, fn, latents, t, inputs)
        timings["compile_transformer_s"] = timings.get("compile_transformer_s", 0) + seconds
        params, buffers = placed["params"], placed["buffers"]
        return lambda lat, ts, inp: compiled(params, buffers, lat, ts, inp)

    return compile_for


def prepare_decode(run: RunSettings, family, pipe, mesh, latents0, fallbacks, oom_hint,
                   timings, ahead=None):
    """Place the VAE's decode weights (replicated: a conv net's weights are small; its
    activations are what the decode shards) and AOT-compile its programs, or take those
    ``ahead`` (joined) compiled from shapes for the same signature."""
    with runtime.hardware_errors("placing the VAE weights", oom_hint):
        placed = place_module(pipe.vae, mesh, include=family.vae.is_decode_weight,
                              desc="VAE decoder")
    timings["place_vae_s"] = placed["seconds"]
    decoder = family.vae.decoder(placed, pipe.vae, mesh, tiling=run.vae_tiling,
                                 fallbacks=fallbacks)
    if ahead is not None and ahead.decoder_for(decoder, latents0):
        timings["compile_vae_s"] = ahead.vae_s
        return decoder
    with runtime.hardware_errors("compiling the VAE decode", oom_hint):
        timings["compile_vae_s"] = decoder.compile(latents0)
    return decoder


def next_video(config, family, pipe, mesh, programs, embeds, staged):
    """(programs with this video's model inputs, its initial latents) for a video after the
    first; the decode stage's "initial latents" are the video's staged final latents."""

    if config.run.stage == "decode":
        return programs, placement.place_array(placement.host_array(staged),
                                               NamedSharding(mesh, P()))
    inputs, latents0 = place_model_inputs(config, family, pipe, embeds, mesh)
    sr = programs.upscale and programs.upscale.next_video(config, embeds)
    chunks = programs.chunks and programs.chunks.for_video(config, embeds)
    return dataclasses.replace(programs, embeds=inputs, upscale=sr, chunks=chunks), latents0
