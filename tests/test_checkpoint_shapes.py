"""Every shape read from the checkpoint (issue 66 item 5): the VAE compression ratios, the
transformer patch sizes and the audio VAE's hop and mel bins come from the checkpoint's
configs, as diffusers' pipelines read them from their loaded components, in the run and in
the dry run (``families.ltx2.layout``, ``families.hunyuan.vae_compression``).

Tiny random checkpoints whose VAEs compress unlike the real ones (our weights are random):

- LTX-2 (tools/make_tiny_ltx2_checkpoint.py ``--vae_spatial 16 --vae_temporal 4``; real: 32
  x 8): 64 x 64 x 9 frames -> a 3 x 4 x 4 latent grid (48 video tokens; with the real
  ratios it would be 2 x 2 x 2). Before, the step stopped with a reshape error.
- HunyuanVideo-1.5 T2V and I2V (tools/make_tiny_hunyuan_checkpoint.py ``--vae_temporal 2
  --vae_spatial 8``; real: 4 x 16): 5 frames -> 3 latent frames. Before, the I2V step
  stopped in torch.cat (the condition had 2 latent frames, the noise 3).

Each run is compared with diffusers' pipeline, eager float32, on the same checkpoint, prompt,
seed and steps (2); the dry runs (``--dry_run``, deviceless libtpu compiles, no TPU) report
the video token counts worked out by hand here.
"""

import glob
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch
from conftest import ROOT, _build
from parity import latents_of
from test_ltx2 import OFF, _argv, run_recorded

import generate_flax
from engine.pipeline import generate
from engine.run.errors import UsageError
from families import FAMILIES

SEED, STEPS = 3, 2
# Measured max |ours - diffusers| on this 2-core CPU host (see each test); the bounds are
# test_ltx2.py's and test_hunyuan.py's, but the LTX-2 latents': 48 video tokens (test_ltx2.py
# has 8) sum more terms, and the video latents (peak 3.2) came 1.4e-5 off, 70% of 2e-5.
LTX_ATOL = 2e-5
LTX_LATENTS_ATOL = 5e-5
FRAMES_ATOL = 1e-3
# HunyuanVideo-1.5's final latents (peak 4.6): measured 4.2e-6 (T2V) and 4.6e-6 (I2V).
LATENTS_ATOL = 2e-5


@pytest.fixture(scope="module")
def ltx2_16x4(tmp_path_factory):
    return _build(tmp_path_factory, "make_tiny_ltx2_checkpoint.py", "tiny-ltx2-16x4",
                  "--vae_spatial", "16", "--vae_temporal", "4")


@pytest.fixture(scope="module")
def hunyuan_2x(tmp_path_factory):
    return _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py", "tiny-hunyuan-2x",
                  "--vae_temporal", "2", "--vae_spatial", "8")


@pytest.fixture(scope="module")
def hunyuan_i2v_2x(tmp_path_factory):
    return _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py", "tiny-hunyuan-i2v-2x",
                  "--vae_temporal", "2", "--vae_spatial", "8", "--i2v")


def _dry_run(checkpoint, tmp_path, *flags) -> dict:
    """``--dry_run`` of one block on v5e:2x2 without the VAE programs: its JSON report."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id", checkpoint,
         "--dry_run", "--topology", "v5e:2x2", "--dry_run_layers", "1", "--dry_run_skip_vae",
         "--output_dir", str(tmp_path), "--no_plots", *flags],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# LTX-2 with a 16x / 4x video VAE
# ---------------------------------------------------------------------------------------------


def _ltx2_reference(checkpoint):
    """diffusers' LTX2Pipeline at ``OFF`` (one pass per step), 64 x 64 x 9: (frames (9, 64,
    64, 3), waveform (2, samples), video latents (1, 8, 3, 4, 4), audio latents (1, 2, 9,
    16)), and the pipeline's own ratios."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(checkpoint, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    ratios = (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio)
    runs = []
    for output_type in ("np", "latent"):
        with torch.no_grad():
            runs.append(pipe(
                prompt="A cat walks on the grass", negative_prompt="blurry", num_frames=9,
                height=64, width=64, frame_rate=24.0, num_inference_steps=STEPS,
                output_type=output_type, return_dict=False,
                generator=torch.Generator("cpu").manual_seed(SEED), **OFF))
    (video, audio), (video_latents, audio_latents) = runs
    return (video[0], audio[0].float().numpy(), video_latents.numpy(), audio_latents.numpy(),
            ratios)


def _ltx2_unpacked(latents):
    """Our packed (1, 672) final latents -> video (1, 8, 3, 4, 4) and audio (1, 2, 9, 16), as
    the pipeline unpacks them (P:1611-1626): 3 x 4 x 4 = 48 video tokens of 8 channels, then
    9 audio frames of 2 channels x 16 mel bins (64 / 4)."""
    from diffusers import LTX2Pipeline

    latents = torch.from_numpy(np.array(latents))
    n = 48 * 8
    assert latents.shape == (1, n + 9 * 32)
    video = LTX2Pipeline._unpack_latents(latents[:, :n].reshape(1, 48, 8), 3, 4, 4, 1, 1)
    audio = LTX2Pipeline._unpack_audio_latents(latents[:, n:].reshape(1, 9, 32), 9,
                                               num_mel_bins=16)
    return video.numpy(), audio.numpy()


def test_ltx2_16x4_vae_matches_diffusers(ltx2_16x4):
    """Final latents of both modalities (``LTX_LATENTS_ATOL``), frames and waveform
    (``LTX_ATOL``). Measured: video latents 1.4e-5 (peak 3.2), audio latents 8.9e-6 (peak
    4.2), frames 7.6e-6, waveform 1.0e-7 (peak 0.21: 5e-7 of it)."""
    frames_ref, wave_ref, video_ref, audio_ref, ratios = _ltx2_reference(ltx2_16x4)
    assert ratios == (16, 4)  # the checkpoint is what the builder was asked for
    config = generate_flax.validate_args(generate_flax.parse_args(
        _argv(ltx2_16x4, OFF, "--attention", "xla")))
    run, frames, recorder = run_recorded(config, jax.devices()[:1])
    video, audio = _ltx2_unpacked(recorder.latents)
    assert video.shape == video_ref.shape == (1, 8, 3, 4, 4)
    np.testing.assert_allclose(video, video_ref, atol=LTX_LATENTS_ATOL)
    np.testing.assert_allclose(audio, audio_ref, atol=LTX_LATENTS_ATOL)
    assert frames.shape == frames_ref.shape == (9, 64, 64, 3)
    np.testing.assert_allclose(frames, frames_ref, atol=LTX_ATOL)
    wave = run.programs.vae_decode.audio.waveform
    assert wave.shape == wave_ref.shape == (2, (4 * 9 - 3) * 240)
    np.testing.assert_allclose(wave, wave_ref, atol=LTX_ATOL)
    assert run.finish()["tokens"] == 48


def test_ltx2_16x4_flags_follow_the_vae(ltx2_16x4):
    """--frames must be 4n + 1 and the size a multiple of 16 on this checkpoint (32 on the
    real one): one line naming the flag, before any model loads."""
    generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", ltx2_16x4, "--height", "48", "--width", "80", "--frames", "13"]))
    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", ltx2_16x4, "--height", "64", "--width", "64", "--frames", "11"]))
    assert str(e.value).startswith("--frames=11: must be of the form 4n+1")
    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", ltx2_16x4, "--height", "40", "--width", "64", "--frames", "9"]))
    assert str(e.value).startswith("--height=40: must be a positive multiple of 16")


def test_ltx2_16x4_dry_run(ltx2_16x4, tmp_path):
    """The dry run reads the checkpoint's configs: 64 x 96 x 9 is 3 x 4 x 6 = 72 tokens."""
    report = _dry_run(ltx2_16x4, tmp_path, "--height", "64", "--width", "96", "--frames", "9")
    assert report["tokens"] == 72 and report["fits"]


# ---------------------------------------------------------------------------------------------
# HunyuanVideo-1.5 with a 2x (time) / 8x (space) VAE
# ---------------------------------------------------------------------------------------------


HY_PROMPT = 'A house under the sun, a sign that says "home"'
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")


def _hunyuan_reference(checkpoint, **call):
    """diffusers' pipeline (the checkpoint's class), 5 frames: (frames, final latents before
    the VAE's scaling, the pipeline's (temporal, spatial) ratios)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    out = []
    for output_type in ("np", "latent"):
        with torch.no_grad():
            out.append(pipe(prompt=HY_PROMPT, num_frames=5, num_inference_steps=STEPS,
                            generator=torch.Generator("cpu").manual_seed(SEED),
                            output_type=output_type, **call).frames[0])
    return out[0], out[1][None].numpy(), (pipe.vae_scale_factor_temporal,
                                          pipe.vae_scale_factor_spatial)


def _compare_hunyuan(checkpoint, reference_call: dict, *extra):
    """Both runs; the final latents compared (``LATENTS_ATOL``): (reference frames, reference
    latents, our latents, our report); our frames are ``_FRAMES[checkpoint]``."""
    frames_ref, latents_ref, ratios = _hunyuan_reference(checkpoint, **reference_call)
    assert ratios == (2, 8)
    latents, report = latents_of(_hunyuan_ours_frames, checkpoint, *extra)
    np.testing.assert_allclose(latents, latents_ref, atol=LATENTS_ATOL)
    return frames_ref, latents_ref, latents, report


def _hunyuan_ours_frames(checkpoint, *extra):
    """``generate``'s (frames, report) for ``checkpoint`` on one device; the frames are kept
    in ``_FRAMES``."""
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--prompt", HY_PROMPT, "--dtype", "float32",
        "--seed", str(SEED), "--num_inference_steps", str(STEPS), "--num_iterations", "1",
        "--warmup_steps", "0", "--frames", "5", "--compilation_cache_dir", "none",
        "--attention", "xla", *extra]))
    frames, report = generate(config, FAMILIES[config.model.family], devices=jax.devices()[:1])
    _FRAMES[checkpoint] = frames
    return frames, report


_FRAMES: dict = {}


def test_hunyuan_t2v_2x_vae_matches_diffusers(hunyuan_2x):
    """32 x 48 x 5 frames: latents (1, 32, 3, 4, 6), 72 video tokens (measured: latents
    4.2e-6 off, frames 9.5e-7). The code before this test's commit reported 12 tokens (the
    real ratios' 2 x 2 x 3 grid)."""
    frames_ref, latents_ref, latents, report = _compare_hunyuan(
        hunyuan_2x, dict(height=32, width=48), "--height", "32", "--width", "48")
    assert latents.shape == latents_ref.shape == (1, 32, 3, 4, 6)
    assert _FRAMES[hunyuan_2x].shape == frames_ref.shape == (5, 32, 48, 3)
    np.testing.assert_allclose(_FRAMES[hunyuan_2x], frames_ref, atol=FRAMES_ATOL)
    assert report["tokens"] == 72


def test_hunyuan_i2v_2x_vae_matches_diffusers(hunyuan_i2v_2x):
    """The image's bucket at target_size 64 in 8-pixel steps (48 x 80), 5 frames: the
    condition latents (frame 0 and the mask) on 3 latent frames, as the noise (measured:
    latents 4.6e-6 off, frames 1.1e-6). Before, the step stopped in torch.cat: a condition of
    2 latent frames beside noise of 3."""
    from diffusers.utils import load_image

    frames_ref, latents_ref, latents, report = _compare_hunyuan(
        hunyuan_i2v_2x, dict(image=load_image(FIRST_FRAME)), "--image", FIRST_FRAME)
    h, w = report["settings"]["height"], report["settings"]["width"]
    assert frames_ref.shape == _FRAMES[hunyuan_i2v_2x].shape == (5, h, w, 3)
    assert latents.shape == latents_ref.shape == (1, 32, 3, h // 8, w // 8)
    np.testing.assert_allclose(_FRAMES[hunyuan_i2v_2x], frames_ref, atol=FRAMES_ATOL)
    assert report["tokens"] == 3 * (h // 8) * (w // 8)


def test_hunyuan_flags_follow_the_vae(hunyuan_2x):
    """--frames 2n + 1 and sizes in 8-pixel steps on this checkpoint (4n + 1 and 16 on the
    real ones)."""
    generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", hunyuan_2x, "--height", "40", "--width", "56", "--frames", "7"]))
    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", hunyuan_2x, "--height", "36", "--width", "48", "--frames", "5"]))
    assert str(e.value).startswith("--height=36: must be a positive multiple of 8")


def test_hunyuan_i2v_2x_dry_run(hunyuan_i2v_2x, tmp_path):
    """The I2V step's abstract inputs (the condition latents, the image tokens) follow the
    checkpoint: 32 x 48 x 5 is 3 x 4 x 6 = 72 video tokens."""
    report = _dry_run(hunyuan_i2v_2x, tmp_path, "--height", "32", "--width", "48", "--frames",
                      "5")
    assert report["tokens"] == 72 and report["fits"]


def test_image_tokens_are_the_image_encoders(hunyuan_i2v_2x, i2v_checkpoint):
    """The dry run's image-embedding inputs have as many tokens as the checkpoint's image
    encoder gives the pipeline: the tiny SigLIP's 4 x 4 patches (not the released 729) and
    the tiny CLIP's 4 x 4 patches and class token (not the released 257)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, WanImageToVideoPipeline
    from PIL import Image

    from families import hunyuan, wan

    image = Image.new("RGB", (64, 48), (128, 128, 128))
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(hunyuan_i2v_2x)
    with torch.no_grad():
        embeds = pipe.encode_image(image=image, batch_size=1, device="cpu",
                                   dtype=torch.float32)
    assert hunyuan.image_tokens(hunyuan_i2v_2x) == embeds.shape[1] == 16
    pipe = WanImageToVideoPipeline.from_pretrained(i2v_checkpoint)
    with torch.no_grad():
        embeds = pipe.encode_image(image, "cpu")
    assert wan.image_tokens(i2v_checkpoint) == embeds.shape[1] == 17
