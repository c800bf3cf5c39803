"""LTX-2 image-to-video (families/ltx2_i2v.py, ``--image``) against diffusers' own eager
``LTX2ImageToVideoPipeline`` on CPU.

Float32 on the tiny random LTX-2 checkpoint (tools/make_tiny_ltx2_checkpoint.py; our weights
are random), the prompts, seed, steps and bound of tests/test_ltx2.py, at the pipeline's
default guidance (CFG batch 2, STG and modality-isolation passes). 96 x 96 pixels, 17
frames: 3 x 3 x 3 = 27 video tokens (9 on the image's latent frame 0), 18 audio tokens (3
latent frames: the RoPE coordinates' float32 rounding matters from there, ``ltx2.rope_coords``).
Ours runs on all 8 CPU devices as dp 2 x sp 4, so the CFG pair and the image's latents split
over dp and the 27 tokens are padded to 28 between blocks (the per-token ``temb`` with them). The
image is tests/data/first_frame.png (160 x 96: resized by the pipeline's processor); both
sides re-compress it at the default CRF 33 with PyAV.
"""

import os

import jax
import numpy as np
import pytest
import torch
from test_ltx2 import ATOL, NEGATIVE, PROMPT, SEED, STEPS, _argv, run_recorded

import generate_flax
from families import ltx2_i2v

FIRST_FRAME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "first_frame.png")
SHAPE = dict(height=96, width=96, frames=17)
GRID = (3, 3, 3)  # latent frames, height, width
FRAME0 = 9  # latent frame 0's tokens
AUDIO = 18  # latent audio frames: round(17 / 24 x 25)
LAYOUT = ("--dp", "2", "--tp", "1", "--sp", "4")


def _unpacked(latents):
    """Our packed (1, size) final latents -> (video (1, 8, 3, 3, 3), audio (1, 2, 18, 16)) as
    the pipeline unpacks them."""
    from diffusers import LTX2Pipeline

    latents = torch.from_numpy(np.array(latents))  # a writable copy
    tokens = int(np.prod(GRID))
    n = tokens * 8  # x 8 channels
    video = LTX2Pipeline._unpack_latents(latents[:, :n].reshape(1, tokens, 8), *GRID, 1, 1)
    audio = LTX2Pipeline._unpack_audio_latents(latents[:, n:].reshape(1, AUDIO, 32), AUDIO,
                                               num_mel_bins=16)
    return video.numpy(), audio.numpy()


@pytest.fixture(scope="module")
def reference(ltx2_checkpoint):
    """diffusers, eager float32: {"i2v": (frames, waveform, video latents (1, C, F', h, w),
    audio latents), "t2v": frames of ``LTX2Pipeline`` on the same components and seed}."""
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
    from diffusers.utils import load_image

    i2v = LTX2ImageToVideoPipeline.from_pretrained(ltx2_checkpoint, dtype=torch.float32)
    i2v.set_progress_bar_config(disable=True)
    for vae in (i2v.vae, i2v.audio_vae):  # so the latents returned are the packed ones
        assert not vae.latents_mean.any() and (vae.latents_std == 1).all()
    t2v = LTX2Pipeline(**i2v.components)
    t2v.set_progress_bar_config(disable=True)
    common = dict(prompt=PROMPT, negative_prompt=NEGATIVE, num_frames=SHAPE["frames"],
                  height=SHAPE["height"], width=SHAPE["width"], frame_rate=24.0,
                  num_inference_steps=STEPS, return_dict=False)
    image, runs = load_image(FIRST_FRAME), []
    with torch.no_grad():
        for output_type in ("np", "latent"):
            runs.append(i2v(image=image, output_type=output_type,
                            generator=torch.Generator("cpu").manual_seed(SEED), **common))
        t2v_frames = t2v(output_type="np", generator=torch.Generator("cpu").manual_seed(SEED),
                         **common)[0][0]
    (video, audio), (video_latents, audio_latents) = runs
    return dict(i2v=(video[0], audio[0].float().numpy(), video_latents.numpy(),
                     audio_latents.numpy()), t2v=t2v_frames)


@pytest.fixture(scope="module")
def ours(ltx2_checkpoint):
    """Our run with --image on 8 devices, dp 2 x sp 4 (XLA attention): (frames, waveform,
    report, (final video latents, final audio latents), the placed model inputs)."""
    size = [f"--{k}={v}" for k, v in SHAPE.items()]
    config = generate_flax.validate_args(generate_flax.parse_args(
        _argv(ltx2_checkpoint, {}, *size, *LAYOUT, "--attention", "xla", "--image",
              FIRST_FRAME)))
    run, frames, recorder = run_recorded(config, jax.devices())
    wave = run.programs.vae_decode.audio.waveform
    return frames, wave, run.finish(), _unpacked(recorder.latents), run.programs.embeds


def test_frames_and_waveform_match_diffusers(reference, ours):
    """Final latents of both modalities, frames and waveform within test_ltx2's ATOL."""
    frames, wave, report, (video_latents, audio_latents), _ = ours
    want_frames, want_wave, want_video_latents, want_audio_latents = reference["i2v"]
    np.testing.assert_allclose(video_latents, want_video_latents, atol=ATOL)
    np.testing.assert_allclose(audio_latents, want_audio_latents, atol=ATOL)
    assert frames.shape == want_frames.shape == (SHAPE["frames"], SHAPE["height"],
                                                 SHAPE["width"], 3)
    np.testing.assert_allclose(frames, want_frames, atol=ATOL)
    np.testing.assert_allclose(wave, want_wave, atol=ATOL)
    assert report["settings"]["image"]["sha256"] and "image_encode_s" in report["timings"]
    assert report["mesh"] == {"dp": 2, "tp": 1, "sp": 4}


def test_frame_zero_is_the_images_latents(ours):
    """The decoded latents' frame 0 is the encoded image bit for bit (never stepped; put back
    by ``finish``), one row per CFG pass in the step's inputs."""
    _, _, _, (video_latents, _), embeds = ours
    image = np.asarray(jax.device_get(embeds[ltx2_i2v.NAME]))
    assert image.shape == (2, FRAME0, 8) and image.dtype == np.float32
    np.testing.assert_array_equal(image[0], image[1])
    first = video_latents[0, :, 0].reshape(8, FRAME0).T  # (C, h, w) -> tokens x C
    np.testing.assert_array_equal(first, image[0])


def test_the_image_matters(reference, ours):
    """The frames differ from text-to-video's (same seed and prompts) by far more than the
    bound, on the first frame and on the later ones."""
    frames = ours[0]
    diff = np.abs(frames - reference["t2v"])
    assert diff[0].max() > 100 * ATOL and diff[1:].max() > 10 * ATOL


def test_default_crf_is_the_checkpoints(ltx2_checkpoint):
    """The tiny checkpoint's text encoder is Gemma 3: diffusers' default CRF 33 (LTX-2.0/2.3)."""
    assert ltx2_i2v.image_crf(ltx2_checkpoint) == 33
