"""Helios image-to-video (``--image``) and video continuation (``--video``): the pipelines'
conditioning, encoded on the host.

``HeliosPipeline.prepare_image_latents`` (diffusers 0.42.1) VAE-encodes the image as one
frame and, as a "fake" last history frame, the image repeated over a chunk's 33 frames (the
last latent frame of that encode). Both are posterior *samples* drawn from the run's
generator, then noised with sigma ~ U(0.111, 0.135) (image) and U(0.111, 0.135) (fake) from
the same generator, before the first chunk's noise. ``encode`` keeps each posterior's mean
and std (no draw: the encode is once per run, the draws are per video's seed);
``Condition.start`` makes the draws in the pipeline's order.

``--video`` (``prepare_video_latents``): the first frame, and the video's last whole chunks
of 33 frames, each VAE-encoded on its own (posterior samples, in that order), then the first
frame's latent noised as the image's and each chunk's latent frames with their own sigma;
they fill the history's newest frames (the video is not part of the output).
"""

from __future__ import annotations

import dataclasses

import torch

from engine.files.video_input import read_video
from families.helios_chunks import Settings

NAMES = ("helios_image_mean", "helios_image_std", "helios_fake_mean", "helios_fake_std",
         "helios_video_mean", "helios_video_std")
# HeliosPipeline.__call__'s defaults: image_noise_sigma_min/max and video_noise_sigma_min/max
# (the fake image latent is noised with the video's bounds, pipeline_helios.py:641-648).
IMAGE_SIGMA = (0.111, 0.135)
VIDEO_SIGMA = (0.111, 0.135)


def encode(pipe, config, image, devices=None, resident=None) -> dict:
    """``ImageConditioning.encode`` (``image`` given) and ``Condition.of``'s encode of
    ``--video`` (``image`` None): float32 host tensors, the VAE posteriors' mean and std
    (through the pipeline's own preprocessing and the CPU VAE, float32). ``--image``: of the
    image (1, C, 1, h, w) and of the image repeated over a chunk's frames (1, C, F', h, w).
    ``--video``: of its first frame ("image") and of each of its last whole chunks, on the
    frame axis ("video", (1, C, n F', h, w))."""
    v = config.video
    window = Settings(num_latent_frames_per_chunk=(v.inputs or {}).get(
        "num_latent_frames_per_chunk") or 9).window_frames(
        getattr(pipe, "vae_scale_factor_temporal", 4))
    with torch.no_grad():
        if image is not None:
            x = pipe.video_processor.preprocess(image, height=v.height, width=v.width)
            x = x.unsqueeze(2).to(torch.float32)
            one = pipe.vae.encode(x).latent_dist
            fake = pipe.vae.encode(x.repeat(1, 1, window, 1, 1)).latent_dist
            return dict(zip(NAMES, (one.mean, one.std, fake.mean, fake.std), strict=False))
        info = v.inputs["video"]
        video = pipe.video_processor.preprocess_video(
            read_video(info.path, "--video"), height=v.height, width=v.width).float()
        start = video.shape[2] - video.shape[2] // window * window
        one = pipe.vae.encode(video[:, :, :1]).latent_dist
        pieces = [pipe.vae.encode(video[:, :, i:i + window]).latent_dist
                  for i in range(start, video.shape[2], window)]
        return {NAMES[0]: one.mean, NAMES[1]: one.std,
                NAMES[4]: torch.cat([p.mean for p in pieces], dim=2),
                NAMES[5]: torch.cat([p.std for p in pieces], dim=2)}


@dataclasses.dataclass(frozen=True)
class Condition:
    """The encoded image (``encode_image``'s tensors) and the VAE's latent statistics."""

    tensors: dict
    latents_mean: torch.Tensor
    latents_inv_std: torch.Tensor
    chunk_frames: int = 9

    @staticmethod
    def of(pipe, config, embeds: dict | None):
        """The run's condition: ``--image``'s in ``embeds`` (``ImageConditioning.encode``
        ran in the encode stage), ``--video``'s encoded now (once per run, on the host VAE
        the decode was placed from), or None (text-to-video)."""
        if (config.video.inputs or {}).get("video") is not None:
            embeds = encode(pipe, config, None)
        if not embeds or NAMES[0] not in embeds:
            return None
        cfg = pipe.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, cfg.z_dim, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, cfg.z_dim, 1, 1, 1)
        return Condition({k: embeds[k].float() for k in NAMES if k in embeds}, mean, inv_std)

    def _sample(self, name: str, generator, frames=None) -> torch.Tensor:
        """A normalised posterior sample (``latent_dist.sample(generator)``), of the frames
        ``frames`` (a slice) only when given."""
        from diffusers.utils.torch_utils import randn_tensor

        mean, std = self.tensors[f"helios_{name}_mean"], self.tensors[f"helios_{name}_std"]
        if frames is not None:
            mean, std = mean[:, :, frames], std[:, :, frames]
        x = mean + std * randn_tensor(mean.shape, generator=generator, dtype=mean.dtype)
        return (x - self.latents_mean) * self.latents_inv_std

    @staticmethod
    def _noised(x: torch.Tensor, bounds: tuple, generator) -> torch.Tensor:
        from diffusers.utils.torch_utils import randn_tensor

        sigma = torch.rand(1, generator=generator) * (bounds[1] - bounds[0]) + bounds[0]
        return sigma * randn_tensor(x.shape, generator=generator) + (1 - sigma) * x

    def start(self, generator, history: torch.Tensor, settings):
        """(history, first-frame latent, latent frames given): the pipeline's draws before
        the first chunk. ``--image``: two posterior samples, then each one's noise, the fake
        latent in the history's last frame. ``--video``: ``_start_video``."""
        if "helios_video_mean" in self.tensors:
            return self._start_video(generator, history, settings)
        image = self._sample("image", generator)
        fake = self._sample("fake", generator)[:, :, -1:]
        image = self._noised(image, IMAGE_SIGMA, generator)
        fake = self._noised(fake, VIDEO_SIGMA, generator)
        return torch.cat([history[:, :, :-1], fake], dim=2), image, 1

    def _start_video(self, generator, history: torch.Tensor, settings):
        """The first frame's and each chunk's posterior samples, the first frame's noise
        (one sigma), each chunk's (a sigma per latent frame); the video's latents as the
        history's newest frames."""
        n = settings.num_latent_frames_per_chunk
        first = self._sample("image", generator)
        total = self.tensors["helios_video_mean"].shape[2]
        video = torch.cat([self._sample("video", generator, slice(i, i + n))
                           for i in range(0, total, n)], dim=2)
        first = self._noised(first, IMAGE_SIGMA, generator)
        pieces = []
        for i in range(0, total, n):
            piece = video[:, :, i:i + n]
            sigma = (torch.rand(piece.shape[2], generator=generator)
                     * (VIDEO_SIGMA[1] - VIDEO_SIGMA[0]) + VIDEO_SIGMA[0]).view(1, 1, -1, 1, 1)
            pieces.append(sigma * _randn(piece.shape, generator) + (1 - sigma) * piece)
        video = torch.cat(pieces, dim=2)
        keep = history.shape[2] - total
        history = torch.cat([history[:, :, :keep], video], dim=2) if keep > 0 else video
        return history, first, total


def _randn(shape, generator) -> torch.Tensor:
    from diffusers.utils.torch_utils import randn_tensor

    return randn_tensor(shape, generator=generator)
