"""LTX-2 conditions (``--condition PATH@FRAME[:STRENGTH]``): diffusers' ``LTX2ConditionPipeline``
on the family's one step program.

Source: diffusers 0.42.1 ``pipelines/ltx2/pipeline_ltx2_condition.py`` ("C:" below). A condition
is ``LTX2VideoCondition(frames, index, strength, crf)`` (C:126-148): an image or a video placed
at a **latent** index. Latent index k > 0 starts at pixel frame (k - 1) r + 1 for the video
VAE's temporal compression r (C:939-955), so the flag takes a pixel frame that maps to one:
0 (index 0) or 1 + r j (index j + 1); any other frame is refused. For r = 8: 0, 1, 9, 17, ...;
the last latent frame starts at pixel frame ``frames - r``.

What the pipeline does with them, and what runs here:

* **Preparation and encode** are the pipeline's own functions, called on the host: its
  ``prepare_latents`` (C:1087-1234) re-compresses single frames as one H.264 frame at the
  checkpoint's CRF (``ltx2_i2v.image_crf``: 33 for LTX-2.0), resizes bilinearly to cover
  the video and center-crops, trims a video to r m + 1 frames that fit, VAE-encodes
  (posterior mode) and normalises. Index 0 overwrites the first tokens (mask = strength);
  an index > 0 is appended as extra tokens with their own RoPE coordinates (C:1011-1069).
  We keep its mask, clean latents and keyframe coordinates (``encode``, once per run at
  load); they do not depend on the seed.
* **Initial noise** is the pipeline's draw from the seeded generator: packed video noise
  (1, S + K, C) over base and keyframe tokens, blended ``noise s + clean (1 - s)``,
  s = (1 - mask) noise_scale (C:1228-1234), then the audio noise (``initial_latents``).
  noise_scale is ``sigmas[0]`` with ``--sigmas``, else 1 (C:1635-1637).
* **The scheduler's shift** uses the whole sequence, S + K tokens (C:1771-1777).
* **Each step** gives the transformer the per-token timestep t (1 - mask) (C:1839) and the
  base RoPE coordinates with the keyframes' appended; after the guidance, x0 is blended as
  ``x0 (1 - mask) + clean mask`` before the velocity (C:2033-2039).
* **Decode** drops the K keyframe tokens (C:2064-2066).

On the engine the packed latent array is [base video tokens, audio, keyframe tokens], so the
decode reads the base video and the audio where it always does; the mask and the clean
latents are model inputs, (B, S + K) and (B, S + K, C) float32, one row per CFG side.
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import numpy as np
import torch

from engine.files.image import check_image, read_image
from engine.files.video_input import frames_for, probe_video, read_video
from engine.run.errors import GenerationError, UsageError, fail
from families import ltx2_i2v

NAME = "condition"
MASK = "condition_mask"  # (B, S + K) float32: the pipeline's conditioning mask, squeezed
CLEAN = "condition_latents"  # (B, S + K, C) float32: clean condition latents, 0 elsewhere
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")

FLAGS = {NAME: dict(
    action="append", metavar="PATH@FRAME[:STRENGTH]",
    help="LTX-2 condition (repeatable), as LTX2ConditionPipeline's LTX2VideoCondition: an "
         "image (PNG, JPEG, WebP) or a video at pixel frame FRAME with STRENGTH in [0, 1] "
         "(default 1). FRAME maps to the latent index: 0 -> 0, 1 + r*j -> j + 1, r the VAE's "
         "temporal compression (8 for LTX-2: 0, 1, 9, 17, ...; the last latent frame starts "
         "at frames - r); index 0 replaces the first latent frames, a later one is appended "
         "as keyframe tokens")}


@dataclasses.dataclass(frozen=True)
class Condition:
    """One resolved ``--condition``: ``path`` (absolute), ``kind`` ("image" or "video"),
    ``frame`` (the pixel frame given), ``index`` (the latent index it maps to), ``strength``
    in [0, 1], ``frames`` (the pixel frames used: 1 for an image, a video trimmed to r m + 1
    frames that fit, as the pipeline trims it, C:829-844), ``sha256`` of the file."""

    path: str
    kind: str
    frame: int
    index: int
    strength: float
    frames: int
    sha256: str


def parse(text: str, frames: int, r: int) -> Condition:
    """One ``PATH@FRAME[:STRENGTH]`` for a video of ``frames`` pixel frames and temporal
    compression ``r``.

    Raises:
        UsageError: one line: bad syntax, a frame that maps to no latent index or lies past
            the video, a strength outside [0, 1], an unreadable file.
    """
    flag = f"--{NAME}"
    path, at, spec = text.rpartition("@")
    if not at or not path:
        fail(flag, text, "expected PATH@FRAME[:STRENGTH], e.g. first.png@0 or last.png@"
             f"{frames - r}:0.8")
    frame_text, _, strength_text = spec.partition(":")
    try:
        frame = int(frame_text)
        strength = float(strength_text) if strength_text else 1.0
    except ValueError:
        fail(flag, text, "FRAME must be an integer and STRENGTH a number "
             "(PATH@FRAME[:STRENGTH])")
    if not 0.0 <= strength <= 1.0:
        fail(flag, text, f"strength {strength} is outside [0, 1]")
    if not 0 <= frame < frames:
        fail(flag, text, f"frame {frame} is outside the video's frames 0..{frames - 1}")
    if frame != 0 and (frame - 1) % r:
        fail(flag, text, f"frame {frame} starts no latent frame: a condition starts at frame 0 "
             f"or 1 + {r}*j (the VAE compresses {r} frames into one; nearest "
             f"{(frame - 1) // r * r + 1} or {(frame - 1) // r * r + 1 + r})")
    index = 0 if frame == 0 else (frame - 1) // r + 1
    if path.lower().endswith(IMAGE_SUFFIXES):
        info = check_image(path, flag)
        return Condition(info.path, "image", frame, index, strength, 1, info.sha256)
    info = probe_video(path, flag)
    used = frames_for(min(info.frames, frames - frame), r)  # the pipeline's trim (C:829-844)
    return Condition(os.path.abspath(path), "video", frame, index, strength, used, info.sha256)


def check_inputs(inputs: dict, values: dict, model_id: str, r: int,
                 args=None) -> tuple[dict, dict]:
    """``Flags.check_inputs`` for LTX-2: each ``--condition`` resolved (``parse``) against the
    run's ``values["frames"]`` and the checkpoint's temporal compression ``r``; the inputs
    become {NAME: (Condition, ...)} or {NAME: None}. ``args`` (the command line): a server
    takes no conditions yet, refused here, before the server starts (``check_run``'s rule)."""
    given = inputs.get(NAME) or []
    if given and args is not None and getattr(args, "serve", False):
        raise UsageError(f"--{NAME}: not supported with --serve yet (a served job takes no "
                         "conditions)")
    conditions = tuple(parse(text, values["frames"], r) for text in given)
    return {**inputs, NAME: conditions or None}, values


def conditions(config) -> tuple:
    """The run's resolved conditions (possibly empty)."""
    return tuple((config.video.inputs or {}).get(NAME) or ())


def check_run(config) -> None:
    """What a run with conditions cannot combine with, one line before any weights load:
    ``--image`` (give the first frame as ``--condition PATH@0``: the two pipelines prepare it
    differently), ``--serve`` (jobs take no conditions yet), ``--sr`` (the second stage takes
    none), the dry run (its latent shape does not count the keyframe tokens yet)."""
    if not conditions(config):
        return
    text = f"--{NAME}"
    if config.video.image is not None:
        raise UsageError(f"--image={config.video.image.path!r}: not with {text} (give the first "
                         f"frame as {text} PATH@0: LTX2ConditionPipeline prepares it)")
    if config.serve is not None:
        raise UsageError(f"{text}: not supported with --serve yet (a served job takes no "
                         "conditions)")
    if config.upscale is not None:
        raise UsageError(f"{text}: not supported with --sr yet (the two-stage run's second "
                         "stage takes no conditions)")
    if config.dry.dry_run:
        raise UsageError(f"{text}: not supported with --dry_run yet (its latent shape does not "
                         "count the keyframe tokens)")


def extra_tokens(config, g: dict, r: int) -> int:
    """K: the keyframe tokens appended for conditions at index > 0 (``g``: the family's
    ``layout``; ``r`` the VAE's temporal compression): per condition (latent frames / pt) x
    (h / p) x (w / p), its latent frames (frames - 1) / r + 1 (the encode's output)."""
    per_frame = (g["h"] // g["p"]) * (g["w"] // g["p"])
    return sum(((c.frames - 1) // r + 1) // g["pt"] * per_frame
               for c in conditions(config) if c.index > 0)


def _key(config) -> tuple:
    v = config.video
    return (config.model.model_id, conditions(config), v.height, v.width, v.frames, v.fps)


# The host encode of one run's conditions, by ``_key``: ``encode`` fills it at load (where the
# VAE is), ``model_inputs`` / ``step_inputs`` / ``initial_latents`` read it. A pure function of
# the files (named by sha256) and the settings; a new run's key replaces an old one.
_ENCODED: dict = {}


def _pipeline(pipe):
    """``LTX2ConditionPipeline`` on the loaded components (``pipe.vae`` is the family's joined
    decode module; the transformer's weights are meta: only its config is read)."""
    from diffusers import LTX2ConditionPipeline

    return LTX2ConditionPipeline(
        scheduler=pipe.scheduler, vae=pipe.vae.video, audio_vae=pipe.vae.audio,
        text_encoder=None, tokenizer=None, connectors=None, transformer=pipe.transformer,
        vocoder=pipe.vae.vocoder)


def _frames(c: Condition):
    """The condition's pixels as the diffusers example passes them: a PIL image, or the
    video's first ``c.frames`` frames as a list of PIL images."""
    if c.kind == "image":
        return read_image(SimpleNamespace(path=c.path))
    return read_video(c.path, f"--{NAME}", c.frames)


def encode(pipe, config) -> None:
    """Prepare and encode the run's conditions with the pipeline's ``prepare_latents`` on the
    host (eager torch, float32 VAE as our decode's); kept for the run (``_ENCODED``): mask
    (1, S + K) float32, clean latents (1, S + K, C) float32, keyframe RoPE coordinates
    (1, 3, K, 2) float32 or None, and the pipeline for its audio noise.

    Raises:
        GenerationError: the re-compression (PyAV) or the encode failed.
    """
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    _ENCODED.clear()
    if not conditions(config):
        return
    video = config.video
    cond, crf = _pipeline(pipe), ltx2_i2v.image_crf(config.model.model_id)
    # The CRF the pipeline would resolve from its text encoder (freed after the prompts here).
    items = [LTX2VideoCondition(frames=_frames(c), index=c.index, strength=c.strength, crf=crf)
             for c in conditions(config)]
    try:
        with torch.no_grad():  # the noise drawn here is discarded: ``initial_latents`` draws
            _, mask, clean, coords = cond.prepare_latents(
                conditions=items, batch_size=1,
                num_channels_latents=pipe.transformer.config.in_channels, height=video.height,
                width=video.width, num_frames=video.frames, frame_rate=float(video.fps),
                noise_scale=1.0, dtype=torch.float32, device=torch.device("cpu"),
                generator=torch.Generator("cpu").manual_seed(0))
    except (ImportError, ValueError, OSError, RuntimeError) as e:
        raise GenerationError(f"--{NAME}: preparing the conditions failed ({e})") from None
    g, r = pipe.geometry, cond.vae_temporal_compression_ratio
    appended, counted = clean.shape[1] - g["video_tokens"], extra_tokens(config, g, r)
    if appended != counted:  # the scheduler's shift and the packed layout use the count
        raise GenerationError(f"--{NAME}: the pipeline appended {appended} keyframe tokens, "
                              f"{counted} were counted")
    _ENCODED[_key(config)] = dict(mask=mask[..., 0].float().contiguous(),
                                  clean=clean.float().contiguous(), coords=coords,
                                  pipeline=cond)


def encoded(config) -> dict | None:
    """The run's encoded conditions (``encode``), or None without conditions.

    Raises:
        GenerationError: the run has conditions that were not encoded at load.
    """
    if not conditions(config):
        return None
    got = _ENCODED.get(_key(config))
    if got is None:
        raise GenerationError(f"--{NAME}: the conditions were not encoded at load")
    return got


def noise_scale(config) -> float:
    """The pipeline's noise_scale: the first of ``--sigmas`` when given, else 1 (C:1635)."""
    sigmas = config.video.sigmas
    return float(sigmas[0]) if sigmas is not None else 1.0


def initial_latents(pipe, config, base_tokens: int, audio_frames: int) -> torch.Tensor:
    """(1, size + K C) float32: the pipeline's initial latents from ``config.video.seed``:
    video noise drawn packed (1, S + K, C) and blended with the clean latents by the mask
    (C:1228-1234), then the audio noise (its ``prepare_audio_latents``), packed as
    [base video, audio, keyframe tokens]."""
    from diffusers.utils.torch_utils import randn_tensor

    got, cpu = encoded(config), torch.device("cpu")
    generator = torch.Generator("cpu").manual_seed(config.video.seed)
    clean, mask = got["clean"], got["mask"][..., None]
    noise = randn_tensor(clean.shape, generator=generator, device=cpu, dtype=torch.float32)
    scaled = (1.0 - mask) * noise_scale(config)
    video = noise * scaled + clean * (1 - scaled)
    audio_vae = got["pipeline"].audio_vae
    audio = got["pipeline"].prepare_audio_latents(
        1, audio_vae.config.latent_channels, audio_frames, audio_vae.config.mel_bins,
        noise_scale(config), torch.float32, cpu, generator)
    return torch.cat([video[:, :base_tokens].reshape(1, -1), audio.reshape(1, -1),
                      video[:, base_tokens:].reshape(1, -1)], dim=1)


def model_inputs(config, batch: int) -> dict:
    """{MASK: (batch, S + K), CLEAN: (batch, S + K, C)} float32 with conditions (one row per
    CFG side, split over dp as the text inputs), else {}."""
    got = encoded(config)
    if got is None:
        return {}
    return {MASK: got["mask"].expand(batch, -1).contiguous(),
            CLEAN: got["clean"].expand(batch, -1, -1).contiguous()}


def keyframe_coords(config) -> np.ndarray | None:
    """(1, 3, K, 2) float32 RoPE coordinates of the keyframe tokens (the pipeline's
    ``_prepare_keyframe_coords``), or None."""
    got = encoded(config)
    if got is None or got["coords"] is None:
        return None
    return got["coords"].float().numpy()


def video_with_keyframes(latents, n: int, skip: int, width: int):
    """(1, S + K, C) video tokens of the packed (1, size + K C) ``latents``: the first ``n``
    entries (base video) and those after ``skip`` (the keyframe tokens past the audio)."""
    return torch.cat([latents[:, :n], latents[:, skip:]], dim=1).reshape(1, -1, width)


def timesteps(t: torch.Tensor, mask: torch.Tensor) -> dict:
    """The transformer's timestep arguments for the (b,) float32 step timestep with the
    (b, S + K) mask: video ``t (1 - mask)``, audio and sigma t (C:1838-1853)."""
    return dict(timestep=t.unsqueeze(-1) * (1 - mask), audio_timestep=t, sigma=t)


def blend(mask: torch.Tensor, clean: torch.Tensor):
    """x0 -> x0 (1 - mask) + clean mask for the (1, S + K, C) guided x0 (C:2033-2035)."""
    m = mask[:1, :, None]
    return lambda x0: x0 * (1 - m) + clean[:1] * m
