"""Wan video-to-video (``--video PATH --strength S``): diffusers 0.42.1's
``WanVideoToVideoPipeline`` on a Wan 2.1 text-to-video checkpoint.

What the pipeline does (``pipeline_wan_video2video.py``; W:line below):
    - the timesteps: ``set_timesteps(N)``, then ``get_timesteps`` keeps the last
      ``min(int(N x strength), N)`` of them (W:448-455, 644-646); default strength 0.8;
    - the source frames: ``video_processor.preprocess_video(video, height, width)``, each frame
      stretched to (height, width) (Lanczos for PIL frames), mapped to [-1, 1] (W:648-651);
    - the initial latents: the VAE's posterior mode of the whole video, normalised with the
      VAE's ``latents_mean`` / ``latents_std``, then ``scheduler.add_noise(latents, noise, t0)``
      (UniPC; ``scale_noise`` for flow-match Euler) at the first kept timestep t0, the noise
      ``randn_tensor`` of the latent shape from the seeded CPU generator (W:422-441);
    - the loop is ``WanPipeline``'s (no ``transformer_2``, no ``boundary_ratio``: W:199-219).
Here the encode runs once per run in the encode stage on the devices
(``families.wan_vae.DeviceEncode``, chunked and width-sharded as the image-to-video encode),
the noising per video in ``start_latents`` and the cut in the engine's loop
(``Scheduling.first_step``: the scheduler's begin index, as the pipeline's first
``scheduler.step`` finds it with ``index_for_timestep``).

Input videos (``engine.files.video_input``): frames in order at the file's own rate (the
pipeline never resamples fps); ``--frames`` defaults to the video's length rounded down to
``4n + 1``; a longer video is cut to its first ``--frames`` frames, with a line saying so.
"""

from __future__ import annotations

import torch

from engine.files.video_input import VideoInfo, frames_for, probe_video, read_video
from engine.run.errors import fail

FLAG = "--video"
DEFAULT_STRENGTH = 0.8  # WanVideoToVideoPipeline.__call__'s default
NAME = "video_latents"  # the embeddings entry: the normalised posterior mode (1, z, F', h, w)


def check(inputs: dict, values: dict, kind: str, frame_step: int, args) -> tuple[dict, dict]:
    """``--video`` / ``--strength`` before any model loads; returns (inputs with "video" the
    probed ``VideoInfo`` and "strength" resolved, values with "frames" from the video when
    ``--frames`` is not given).

    kind: the checkpoint's Wan kind ("t2v" takes a video; "a14b", "ti2v", "i2v", "i2v-a14b"
    do not); args: the parsed command line (None in unit calls: --frames counts as not given).

    Raises:
        UsageError: one line (an unreadable video, too few frames, a strength outside (0, 1]
            or that keeps no step, a checkpoint or mode that cannot take a video).
    """
    path, strength = inputs.get("video"), inputs.get("strength")
    if path is None:
        if strength is not None:
            fail("--strength", strength, "needs --video PATH (video-to-video)")
        return inputs, values
    strength = DEFAULT_STRENGTH if strength is None else strength
    if not 0.0 < strength <= 1.0:
        fail("--strength", strength, "must be in (0, 1] (the fraction of the steps run)")
    n = values["num_inference_steps"]
    if min(int(n * strength), n) < 1:
        fail("--strength", strength, f"keeps int({n} x {strength}) = 0 of the {n} steps; "
             "needs at least one")
    if kind != "t2v":
        what = {"a14b": "a Wan 2.2 two-expert checkpoint", "ti2v": "a Wan 2.2 TI2V-5B checkpoint",
                }.get(kind, "an image-to-video checkpoint")
        fail(FLAG, path, f"video-to-video runs on a Wan 2.1 text-to-video checkpoint "
             f"(diffusers' WanVideoToVideoPipeline); --model_id is {what}")
    if args is not None:
        cache = getattr(args, "cache", None) or (
            "deepcache" if getattr(args, "enable_cache", False) else None)
        for flag, value, default in (("--stage", getattr(args, "stage", "all"), "all"),
                                     ("--cache", cache, None),
                                     ("--sparse", getattr(args, "sparse", "none"), "none"),
                                     ("--serve", getattr(args, "serve", False), False)):
            if value != default:
                fail(FLAG, path, f"is not taken with {flag} {value} yet (the strength cut "
                     "starts the loop part-way; video-to-video runs one --stage all CLI run)")
    info = probe_video(path, FLAG)
    return {**inputs, "video": info, "strength": strength}, _frames(info, values, frame_step,
                                                                      args)


def _frames(info: VideoInfo, values: dict, frame_step: int, args) -> dict:
    """``values`` with the run's frames: the video's length rounded down to ``frame_step *
    n + 1`` unless ``--frames`` was given; refuses a video shorter than the run."""
    given = args is not None and args.frames is not None
    frames = values["frames"] if given else frames_for(info.frames, frame_step)
    if info.frames < frames:
        fail(FLAG, info.path, f"has {info.frames} frames, fewer than --frames {frames}")
    if info.frames > frames:
        print(f"{FLAG}: {info.path} has {info.frames} frames; using the first {frames} "
              f"({'--frames' if given else f'its length rounded down to {frame_step}n+1'})")
    return {**values, "frames": frames}


def is_wanted(config) -> bool:
    """Whether the run encodes a source video (``ImageConditioning.wanted``'s part)."""
    return (config.video.inputs or {}).get("video") is not None


def first_step(config) -> int:
    """``get_timesteps``' cut: the index of the first kept timestep, ``(N - min(int(N x
    strength), N)) x order`` (both schedulers Wan runs have order 1); 0 without --video."""
    if not is_wanted(config):
        return 0
    n, strength = config.video.num_inference_steps, config.video.inputs["strength"]
    return max(n - min(int(n * strength), n), 0) * _scheduler_class(config).order


def _scheduler_class(config):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    return FlowMatchEulerDiscreteScheduler if config.video.scheduler == "euler" \
        else UniPCMultistepScheduler


def encode(pipe, config, vae_encode) -> dict:
    """{NAME: (1, z_dim, F', h, w) float32}: the source video's first ``config.video.frames``
    frames preprocessed as ``WanVideoToVideoPipeline`` does (its own ``VideoProcessor``),
    VAE-encoded by ``vae_encode`` (a ``wan_vae.DeviceEncode``; posterior mode), normalised."""
    from diffusers.pipelines.wan.pipeline_wan_video2video import retrieve_latents
    from diffusers.video_processor import VideoProcessor

    v, vae = config.video, pipe.vae
    frames = read_video(v.inputs["video"].path, FLAG, v.frames)
    processor = VideoProcessor(vae_scale_factor=2 ** len(vae.temperal_downsample))  # W:217-219
    video = processor.preprocess_video(frames, height=v.height, width=v.width).to(
        torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        latents = retrieve_latents(vae_encode(video), sample_mode="argmax").float()
    z = vae.config.z_dim
    mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    return {NAME: (latents - mean) * inv_std}


def start_latents(pipe, config, noise, embeds):
    """``ImageConditioning.start_latents``: the source video's latents noised to the first
    kept timestep by a fresh scheduler of the run's (``add_noise``, or ``scale_noise`` where
    the scheduler has no ``add_noise``), as ``prepare_latents`` does; ``noise`` as given
    without a source video."""
    if NAME not in embeds:
        return noise
    scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config)
    scheduler.set_timesteps(config.video.num_inference_steps)
    first = first_step(config)
    t0 = scheduler.timesteps[first:first + 1]
    video = embeds[NAME].float()
    if hasattr(scheduler, "add_noise"):
        return scheduler.add_noise(video, noise, t0)
    return scheduler.scale_noise(video, t0, noise)
