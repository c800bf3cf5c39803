"""LTX-2 image-to-video (``--image``): diffusers' ``LTX2ImageToVideoPipeline`` on the family's
one step program.

Source: diffusers 0.42.1 ``pipelines/ltx2/pipeline_ltx2_image2video.py`` ("I:" below) and
``pipelines/ltx2/utils.py``. The pipeline takes the same components as ``LTX2Pipeline``;
what it does differently:

* **The image** is re-compressed as one H.264 frame at the checkpoint's CRF
  (``resolve_default_image_crf``: 33 for a Gemma 3 text encoder, LTX-2.0/2.3; 18 for Gemma 4,
  LTX-2.5; PyAV's libx264, ``apply_image_conditioning_crf``), resized to the video's size by
  its ``VideoProcessor`` (bilinear, no crop), cast to the prompt dtype and VAE-encoded alone
  (one frame, the posterior mode), normalised with the VAE's mean and std (I:1358-1364,
  830-848). Here the encode runs on the host (eager torch, float32 VAE as our decode's).
* **Frame 0 holds the image**: the initial latents are the text-to-video noise with latent
  frame 0's tokens (the first h x w packed tokens) replaced by the image's latents (I:850-865;
  the noise is the same draw: the encode takes the mode, not a sample). The scheduler steps
  frames 1.. only (I:1689-1693), so frame 0 stays the image's latents throughout.
* **Per-token video timestep**: ``t * (1 - conditioning_mask)``, (B, S_v): 0 on frame 0's
  tokens, t elsewhere; ``audio_timestep`` and ``sigma`` stay t (B,) (I:1486-1497).
* Guidance is the text-to-video one, on latents whose frame 0 is the image's (I:1514-1650).

On the engine the latents stay the packed (1, size) array: the step overwrites frame 0's
tokens with the image's latents before the passes (``with_first_frame``), passes the
per-token timestep (``timesteps``) and returns a zero velocity on frame 0
(``hold_first_frame``); ``finish`` writes the image's latents back on frame 0 before the
decode. Every other token sees the pipeline's float32 operations on the same numbers
(tests/test_ltx2_i2v.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import torch
from PIL import Image

from engine.files.checkpoint import read_component_config
from engine.run.errors import GenerationError, first_line

NAME = "image_latents"  # the model input: (B, n0, C) float32, frame 0's packed tokens


def image_mode(model_id: str) -> str:
    """"optional": every LTX-2 checkpoint runs text- and image-to-video (the same
    components load as ``LTX2Pipeline`` and ``LTX2ImageToVideoPipeline``)."""
    return "optional"


def image_crf(model_id: str) -> int:
    """The H.264 CRF the pipeline re-compresses the image at by default: diffusers'
    ``resolve_default_image_crf`` of the checkpoint's text encoder (read from its config,
    since the encoder is freed after the prompts)."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    cfg = read_component_config(model_id, "text_encoder") or {}
    return resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(
        model_type=cfg.get("model_type"))))


def _pipeline(pipe):
    """``LTX2ImageToVideoPipeline`` on the loaded components (our ``pipe.vae`` is the joined
    decode module; the transformer's weights are meta: only its config is read)."""
    from diffusers import LTX2ImageToVideoPipeline

    return LTX2ImageToVideoPipeline(
        scheduler=pipe.scheduler, vae=pipe.vae.video, audio_vae=pipe.vae.audio,
        text_encoder=None, tokenizer=None, connectors=None, transformer=pipe.transformer,
        vocoder=pipe.vae.vocoder)


def encode_image(pipe, config, image, devices, resident: dict | None = None) -> dict:
    """The image conditioning, by the pipeline's own functions (I:1358-1364 then its
    ``prepare_latents``), on the host.

    Args:
        pipe: the family's loaded ``LTX2Pipeline`` (``families.ltx2.load_pipeline``).
        image: an RGB ``PIL.Image.Image`` of any size (resized to the video's).
        devices, resident: unused (the encode is one frame, eager on the host).

    Returns:
        {NAME: (1, n0, C) float32}: the normalised VAE posterior mode of the image, packed;
        n0 = (height / s) x (width / s) tokens of latent frame 0, s the video VAE's spatial
        compression (32 for LTX-2.0), C its latent channels (128).

    Raises:
        GenerationError: the re-compression needs PyAV (``av``, requirements.txt) and it is
            missing or fails.
    """
    video, cpu = config.video, torch.device("cpu")
    crf = image_crf(config.model.model_id)
    if crf:
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

        try:
            image = Image.fromarray(apply_image_conditioning_crf(
                np.array(image.convert("RGB")), crf))
        except (ImportError, ValueError, OSError) as e:
            raise GenerationError(f"--image: the H.264 re-compression at CRF {crf} failed "
                                  f"({first_line(e)})") from None
    i2v = _pipeline(pipe)
    pixels = i2v.video_processor.preprocess(image, height=video.height, width=video.width)
    # The pipeline casts the image to the prompt dtype; our VAE runs in float32 (as the
    # decode), so the rounding is the pipeline's and the convolutions float32.
    pixels = pixels.to(getattr(torch, config.model.dtype)).to(cpu, torch.float32)
    with torch.no_grad():  # its noise draw is discarded: only frame 0's tokens are kept
        latents, mask = i2v.prepare_latents(
            pixels, 1, pipe.transformer.config.in_channels, video.height, video.width,
            video.frames, 0.0, torch.float32, cpu, torch.Generator("cpu").manual_seed(0))
    n0 = int(mask[0].sum())
    if not (mask[0, :n0].all() and not mask[0, n0:].any()):
        raise GenerationError("LTX-2 image-to-video: the conditioning mask is not frame 0's "
                              "leading tokens (a transformer patch size other than 1?)")
    return {NAME: latents[:, :n0].float().contiguous()}


def model_inputs(embeds: dict, batch: int) -> dict:
    """{NAME: (batch, n0, C) float32} with ``--image`` (one row per CFG pass, so it splits over
    dp as the text inputs do), else {}."""
    if NAME not in embeds:
        return {}
    return {NAME: embeds[NAME].float().expand(batch, -1, -1).contiguous()}


def abstract_model_inputs(config, geometry: dict, batch: int) -> dict:
    """``model_inputs``' shapes for the dry run: {} without ``--image``."""
    if config.video.image is None:
        return {}
    n0 = geometry["video_tokens"] // (geometry["f"] // geometry["pt"])
    return {NAME: jax.ShapeDtypeStruct((batch, n0, geometry["video_width"]), jnp.float32)}


def with_first_frame(video: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """(1, S, C) packed video latents with frame 0's n0 tokens replaced by ``image``
    (B, n0, C) float32: the pipeline's latents, whose frame 0 is never stepped."""
    return torch.cat([image[:1], video[:, image.shape[1]:]], dim=1)


def timesteps(t: torch.Tensor, image: torch.Tensor | None, tokens: int) -> dict:
    """The transformer's timestep arguments for the (b,) float32 step timestep ``t``:
    text-to-video ``timestep = sigma = t``; image-to-video the per-token video timestep
    ``t * (1 - mask)`` (b, tokens), mask 1 on frame 0's tokens, with ``audio_timestep``
    and ``sigma`` t (I:1486-1497)."""
    if image is None:
        return dict(timestep=t, sigma=t)
    n0 = image.shape[1]  # built from t: a constant tensor would not be traced
    mask = torch.cat([t.new_ones(n0), t.new_zeros(tokens - n0)])
    return dict(timestep=t.unsqueeze(-1) * (1 - mask), audio_timestep=t, sigma=t)


def hold_first_frame(velocity: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
    """(1, S, C) guided video velocity with frame 0's tokens zeroed: the Euler step
    x + dt * 0 leaves them as they are (the pipeline steps frames 1.. only)."""
    n0 = image.shape[1]
    return torch.cat([torch.zeros_like(velocity[:, :n0]), velocity[:, n0:]], dim=1)


def finish(latents, inputs: dict):
    """After the loop: frame 0's tokens (the first n0 x C entries of the packed (1, size)
    float32 ``jax.Array``) set to the image's latents, as the pipeline's latents hold them;
    same shape and sharding. Text-to-video returns ``latents`` unchanged."""
    if NAME not in inputs:
        return latents
    return _first_frame_setter(latents.sharding)(latents, inputs[NAME])


@functools.cache
def _first_frame_setter(sharding):
    """Jitted once per sharding: the decode's AOT program takes the latents as placed."""
    def put(latents, image):
        first = image[:1].reshape(1, -1).astype(latents.dtype)
        return latents.at[:, :first.shape[1]].set(first)

    return jax.jit(put, out_shardings=sharding)
