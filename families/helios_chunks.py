"""Helios' autoregressive chunk loop on the engine's compiled programs.

diffusers' ``HeliosPipeline`` and ``HeliosPyramidPipeline`` (0.42.1) generate a video as
chunks of ``num_latent_frames_per_chunk`` latent frames (9: 33 pixel frames), each from fresh
noise, each seeing the past through a fixed-size history (``history_sizes`` [16, 2, 1] latent
frames: long, mid and 1x, and with ``keep_first_frame`` the first frame's latent). Every
chunk has the same shapes, so one compiled transformer program serves every chunk (the
pyramid: one per stage resolution) and the history's compression (``patch_long`` /
``patch_mid`` / ``patch_short``) runs inside it.

This loop is the pipelines' own ``__call__`` loop with the transformer call and the VAE
decode on the device: the noise, the pyramid's resampling and block noise and the scheduler
step run on the host in torch, in the pipelines' order on one seeded ``torch.Generator``, so
every draw and every float64 scheduler operation (``HeliosDMDScheduler``'s x0 conversion) is
diffusers' own. A step moves one chunk's latents (1 x 16 x 9 x 48 x 80 float32 = 2.2 MB at
384 x 640) each way, against a 14B model call per step. Each chunk is decoded as soon as it is
done, with a fresh VAE cache (diffusers calls ``vae.decode`` per chunk), and handed to
``on_chunk``.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from engine.run.runtime import to_host
from engine.weights import placement

HISTORY_NAMES = ("latents_history_short", "latents_history_mid", "latents_history_long")


@dataclasses.dataclass(frozen=True)
class Settings:
    """A Helios run's chunking and sampling settings (the pipelines' argument names).

    history_sizes: latent frames of the long, mid and 1x history, sorted big to small as the
        pipelines sort them.
    num_latent_frames_per_chunk: latent frames a chunk makes (9: 33 pixel frames).
    pyramid_steps: ``pyramid_num_inference_steps_list`` (``HeliosPyramidPipeline``), or None
        (``HeliosPipeline``: ``num_inference_steps`` per chunk).
    is_distilled: the pyramid pipeline's ``is_distilled`` (``HeliosDMDScheduler``'s step).
    is_amplify_first_chunk: twice the steps on the first chunk (distilled only).
    keep_first_frame: the pipelines' default True (the first frame's latent in the history).
    """

    history_sizes: tuple[int, ...] = (16, 2, 1)
    num_latent_frames_per_chunk: int = 9
    pyramid_steps: tuple[int, ...] | None = None
    is_distilled: bool = False
    is_amplify_first_chunk: bool = False
    keep_first_frame: bool = True

    def window_frames(self, temporal: int = 4) -> int:
        """Pixel frames per chunk: (latent frames - 1) x temporal + 1 (33)."""
        return (self.num_latent_frames_per_chunk - 1) * temporal + 1

    def chunks(self, frames: int, temporal: int = 4) -> int:
        """Chunks for ``frames`` asked: ceil(frames / window), at least 1 (the pipelines)."""
        window = self.window_frames(temporal)
        return max(1, (max(frames, 1) + window - 1) // window)

    def frames_made(self, frames: int, temporal: int = 4) -> int:
        """Frames the video has: whole chunks, trimmed to ``temporal`` k + 1 (132 -> 129)."""
        decoded = self.chunks(frames, temporal) * self.window_frames(temporal)
        return (decoded - 1) // temporal * temporal + 1

    def stage_sizes(self, h: int, w: int) -> list[tuple[int, int]]:
        """The latent (h, w) of each pyramid stage, coarse to fine (one for the plain
        pipeline): halved per stage below the last, as the pipeline's bilinear
        downsampling sizes them."""
        n = len(self.pyramid_steps) if self.pyramid_steps else 1
        return [(h // 2 ** (n - 1 - s), w // 2 ** (n - 1 - s)) for s in range(n)]

    def indices(self) -> dict:
        """The frame indices of the chunk and of each history term (the pipelines' RoPE
        positions), (1, n) int64; fixed for every chunk."""
        sizes, n = list(self.history_sizes), self.num_latent_frames_per_chunk
        if self.keep_first_frame:
            idx = torch.arange(0, sum([1, *sizes, n]))
            prefix, long, mid, one, chunk = idx.split([1, *sizes, n])
            short = torch.cat([prefix, one])
        else:
            sizes[-1] += 1
            long, mid, short, chunk = torch.arange(0, sum([*sizes, n])).split([*sizes, n])
        return dict(indices_hidden_states=chunk[None], indices_latents_history_short=short[None],
                    indices_latents_history_mid=mid[None], indices_latents_history_long=long[None])


def block_noise_factor(gamma: float, block_size: int) -> torch.Tensor:
    """The Cholesky factor of the pyramid's block-noise covariance
    ``(1 + gamma) I - gamma 11^T + 1e-8 I`` (``HeliosPyramidPipeline.sample_block_noise``),
    (block_size, block_size) float32, computed in float64 on the host. At gamma 1/3 and 2 x 2
    blocks the covariance is singular but for the 1e-8, which float32 cannot hold next to
    4/3: diffusers' float32 ``cholesky`` stops with "not positive-definite" on CPU (and JAX's
    gives NaN); in float64 the factor exists and its last pivot is ~1e-4."""
    cov = np.eye(block_size) * (1 + gamma) - np.ones((block_size, block_size)) * gamma
    cov += np.eye(block_size) * 1e-8
    return torch.from_numpy(np.linalg.cholesky(cov).astype(np.float32))


def sample_block_noise(shape, gamma: float, patch: tuple, generator) -> torch.Tensor:
    """``HeliosPyramidPipeline.sample_block_noise`` with the host float64 factor: (B, C, F, H,
    W) float32, correlated within each ph x pw block; one ``randn`` draw from ``generator``."""
    b, c, f, h, w = shape
    _, ph, pw = patch
    factor = block_noise_factor(gamma, ph * pw)
    z = torch.randn(b * c * f * (h // ph) * (w // pw), ph * pw, generator=generator)
    noise = (z @ factor.T).view(b, c, f, h // ph, w // pw, ph, pw)
    return noise.permute(0, 1, 2, 3, 5, 4, 6).reshape(b, c, f, h, w)


def torch_of(x) -> torch.Tensor:
    """A ``jax.Array`` on this host as a torch tensor of the same dtype (bf16 kept)."""
    a = to_host(x)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _calculate_shift(seq_len: int, config) -> float:
    from diffusers.pipelines.helios.pipeline_helios import calculate_shift

    return calculate_shift(seq_len, config.get("base_image_seq_len", 256),
                           config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))


class ChunkLoop:
    """One video's chunk loop (``engine.programs.denoise.Programs.chunks``).

    Args:
        config: the run's ``RunConfig`` (seed, frames, size, guidance, dtype).
        pipe: the diffusers pipeline (scheduler config, transformer config, video processor).
        settings: ``Settings``.
        steps: {latent (h, w): compiled step ``(latents, t, inputs) -> prediction``}, one per
            stage resolution, weights bound.
        condition: host tensors of ``--image`` / ``--video`` (``families.helios_condition``)
            or None: the draws they need come first, as in the pipelines.
    """

    def __init__(self, config, pipe, settings: Settings, steps: dict, condition=None):
        self.config, self.pipe, self.settings = config, pipe, settings
        self.steps, self.condition = steps, condition
        self.dtype = getattr(torch, config.model.dtype)
        self.patch = tuple(pipe.transformer.config.patch_size)
        self.channels = pipe.transformer.config.in_channels
        self.temporal = getattr(pipe, "vae_scale_factor_temporal", 4)

    def for_video(self, config, embeds: dict | None = None) -> ChunkLoop:
        """The same programs for another video's config (seed, prompt); its embeddings carry
        no conditioning of their own (the run's is the same for every video)."""
        return ChunkLoop(config, self.pipe, self.settings, self.steps, self.condition)

    # -- the device parts ------------------------------------------------------------------
    def _place(self, x: torch.Tensor, sharding):
        return placement.place_array(placement.host_array(x.contiguous()), sharding)

    def _predict(self, programs, latents: torch.Tensor, t: float, inputs) -> torch.Tensor:
        """The compiled model call on host latents; the CFG-combined prediction on the host
        in the model dtype (as the pipelines' ``noise_pred``)."""
        replicated = programs.timesteps_sharding
        step = self.steps[tuple(latents.shape[-2:])]
        out = step(self._place(latents.float(), replicated),
                   jax.device_put(np.asarray([t], np.float32), replicated), inputs)
        return torch_of(out)

    def _inputs(self, programs, history: dict):
        """The step's inputs: the placed text inputs and this chunk's history terms, one
        copy per CFG pass (batch over "dp")."""
        batch = jax.tree.leaves(programs.embeds["encoder_hidden_states"])[0].shape[0]
        over_dp = NamedSharding(programs.timesteps_sharding.mesh, P("dp"))
        placed = {k: self._place(v.to(self.dtype).repeat(batch, 1, 1, 1, 1), over_dp)
                  for k, v in history.items()}
        return {**programs.embeds, **placed}

    # -- the pipelines' loop ---------------------------------------------------------------
    def _history(self, history: torch.Tensor, prefix) -> dict:
        """This chunk's history terms from the history buffer (the pipelines' split)."""
        s = self.settings
        sizes = list(s.history_sizes)
        recent = history[:, :, -sum(sizes):]
        if not s.keep_first_frame:
            sizes[-1] += 1
            long, mid, short = recent.split(sizes, dim=2)
        else:
            long, mid, one = recent.split(sizes, dim=2)
            if prefix is None:
                prefix = torch.zeros_like(one[:, :, :1])
            short = torch.cat([prefix, one], dim=2)
        return dict(zip(HISTORY_NAMES, (short, mid, long), strict=True))

    def _chunk_plain(self, programs, latents, inputs, scheduler, generator, on_step):
        """``HeliosPipeline``'s denoising of one chunk (``num_inference_steps`` steps)."""
        v = self.config.video
        p = self.patch
        seq = latents.shape[2] * latents.shape[3] * latents.shape[4] // (p[0] * p[1] * p[2])
        sigmas = np.linspace(0.999, 0.0, v.num_inference_steps + 1)[:-1]
        scheduler.set_timesteps(v.num_inference_steps, device="cpu", sigmas=sigmas,
                                mu=_calculate_shift(seq, scheduler.config))
        for t in scheduler.timesteps:
            pred = self._predict(programs, latents, float(t), inputs)
            latents = scheduler.step(pred, t, latents, generator=generator,
                                     return_dict=False)[0]
            on_step()
        return latents

    def _chunk_pyramid(self, programs, latents, inputs, scheduler, generator, first: bool,
                       on_step):
        """``HeliosPyramidPipeline``'s denoising of one chunk: bilinear down to the coarsest
        stage, then per stage its steps, each stage up by a nearest x2 and block noise."""
        s, cfg = self.settings, scheduler.config
        b, c, f, h, w = latents.shape
        x = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        for _ in range(len(s.pyramid_steps) - 1):
            h, w = h // 2, w // 2
            x = F.interpolate(x, size=(h, w), mode="bilinear") * 2
        latents = x.reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)
        starts = [latents] if s.is_distilled else None
        amplify = s.is_amplify_first_chunk and s.is_distilled and first
        for stage, n in enumerate(s.pyramid_steps):
            seq = latents.shape[-1] * latents.shape[-2] * latents.shape[-3] // math.prod(
                self.patch)
            scheduler.set_timesteps(n, stage, device="cpu", mu=_calculate_shift(seq, cfg),
                                    is_amplify_first_chunk=amplify)
            timesteps = scheduler.timesteps
            if stage > 0:
                latents = self._stage_up(latents, scheduler, stage, generator)
                if starts is not None:
                    starts.append(latents)
            for i, t in enumerate(timesteps):
                pred = self._predict(programs, latents, float(t.to(torch.int64)), inputs)
                extra = dict(cur_sampling_step=i, dmd_noisy_tensor=starts[stage],
                             dmd_sigmas=scheduler.sigmas, dmd_timesteps=scheduler.timesteps,
                             all_timesteps=timesteps) if s.is_distilled else {}
                latents = scheduler.step(pred, t, latents, generator=generator,
                                         return_dict=False, **extra)[0]
                on_step()
        return latents

    def _stage_up(self, latents, scheduler, stage: int, generator):
        """Nearest x2 and ``alpha x + beta block_noise`` (the pipeline's "fix the stage")."""
        b, c, f, h, w = latents.shape
        x = latents.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        x = F.interpolate(x, size=(2 * h, 2 * w), mode="nearest")
        latents = x.reshape(b, f, c, 2 * h, 2 * w).permute(0, 2, 1, 3, 4)
        gamma = scheduler.config.gamma
        ori_sigma = 1 - scheduler.ori_start_sigmas[stage]
        alpha = 1 / (math.sqrt(1 + (1 / gamma)) * (1 - ori_sigma) + ori_sigma)
        beta = alpha * (1 - ori_sigma) / math.sqrt(gamma)
        noise = sample_block_noise(latents.shape, gamma, self.patch, generator).to(self.dtype)
        return alpha * latents + beta * noise

    def _start(self, generator):
        """(the history buffer, the first frame's latent or None, latent frames given):
        zeros for text-to-video; ``--image`` / ``--video`` seed it (their draws first)."""
        s, v = self.settings, self.config.video
        spatial = getattr(self.pipe, "vae_scale_factor_spatial", 8)
        history = torch.zeros(1, self.channels, sum(s.history_sizes), v.height // spatial,
                              v.width // spatial)
        if self.condition is None:
            return history, None, 0
        return self.condition.start(generator, history, s)

    def run(self, programs, *, on_step=None, on_chunk=None):
        """Every chunk: its history, its noise, its denoising, its decode.

        Args:
            programs: the run's ``engine.programs.denoise.Programs`` (placed text inputs,
                VAE decode, scheduler config, timestep sharding).
            on_step: ``f(transformer calls done)`` after each step, or None.
            on_chunk: ``f(index, frames, last)`` as each chunk is decoded: frames (F, H, W, 3)
                float32 in [0, 1] on the host (33 per chunk; the last chunk's trimmed so the
                chunks add up to the video), ``last`` True for the last chunk; or None.

        Returns:
            (latents (1, C, F', h, w) float32 ``jax.Array``: every generated latent frame;
            video (1, 3, F, H, W) float32 ``jax.Array`` in [-1, 1], F the frames made;
            info: {"chunks", "frames_made", "frames_decoded", "first_chunk_s",
            "chunk_seconds", "transformer_calls"}).
        """
        import diffusers
        from diffusers.utils.torch_utils import randn_tensor

        s, v = self.settings, self.config.video
        config = programs.scheduler_config
        scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
        generator = torch.Generator("cpu").manual_seed(v.seed)
        history, prefix, total = self._start(generator)
        chunks = s.chunks(v.frames, self.temporal)
        made, window = s.frames_made(v.frames, self.temporal), s.window_frames(self.temporal)
        calls, videos, seconds, t0 = [0], [], [], time.perf_counter()

        def stepped():
            calls[0] += 1
            if on_step is not None:
                on_step(calls[0])

        for k in range(chunks):
            inputs = self._inputs(programs, self._history(history, prefix))
            latents = randn_tensor((1, self.channels, s.num_latent_frames_per_chunk,
                                    *history.shape[-2:]), generator=generator,
                                   device=torch.device("cpu"), dtype=torch.float32)
            if s.pyramid_steps:
                latents = self._chunk_pyramid(programs, latents, inputs, scheduler, generator,
                                              k == 0, stepped)
            else:
                latents = self._chunk_plain(programs, latents, inputs, scheduler, generator,
                                            stepped)
            if s.keep_first_frame and prefix is None:
                prefix = latents[:, :, :1]
            total += latents.shape[2]
            history = torch.cat([history, latents], dim=2)
            video = programs.vae_decode(self._place(latents.float(),
                                                    programs.timesteps_sharding))
            video = video[:, :, :made - k * window]  # the last chunk's tail (4k + 1)
            video.block_until_ready()
            seconds.append(time.perf_counter() - t0)
            videos.append(video)
            if on_chunk is not None:
                on_chunk(k, _frames(self.pipe, video), k == chunks - 1)
        info = dict(chunks=chunks, frames_made=made, frames_decoded=chunks * window,
                    first_chunk_s=seconds[0],
                    chunk_seconds=list(np.diff([0.0, *seconds])),
                    transformer_calls=calls[0])
        return (jnp.asarray(history[:, :, -total:].numpy()), jnp.concatenate(videos, axis=2),
                info)

    def warmup(self, programs) -> None:
        """Run every compiled program once (each stage's step and the chunk decode)."""
        s = self.settings
        spatial = getattr(self.pipe, "vae_scale_factor_spatial", 8)
        v = self.config.video
        h, w = v.height // spatial, v.width // spatial
        inputs = self._inputs(programs, self._history(
            torch.zeros(1, self.channels, sum(s.history_sizes), h, w), None))
        for size in self.steps:
            self._predict(programs, torch.zeros(1, self.channels, s.num_latent_frames_per_chunk,
                                                *size), 0.0, inputs)
        programs.vae_decode(self._place(torch.zeros(
            1, self.channels, s.num_latent_frames_per_chunk, h, w),
            programs.timesteps_sharding)).block_until_ready()


def _frames(pipe, video):
    """(1, 3, F, H, W) in [-1, 1] on device -> (F, H, W, 3) float32 in [0, 1] on the host, by
    diffusers' ``postprocess_video`` (as the pipelines' output)."""
    return pipe.video_processor.postprocess_video(torch.from_numpy(to_host(video)),
                                                  output_type="np")[0]
