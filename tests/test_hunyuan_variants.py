"""The distilled HunyuanVideo-1.5 checkpoints against diffusers' eager
``HunyuanVideo15ImageToVideoPipeline`` on tiny random copies, float32, the bound of the
other HunyuanVideo tests (tools/make_tiny_hunyuan_checkpoint.py):

* CFG-distilled (``-480p_i2v_distilled``, ``-720p_i2v_distilled``): the guider's
  guidance_scale 1.0, so one batch-1 pass per step;
* step-distilled (``-480p_i2v_step_distilled``): ``use_meanflow``, the second timestep
  embedder fed ``timestep_r`` = the next timestep, 0 at the last step; shift 7, guidance 1,
  12 steps by default.

And the shipped configs of every diffusers-format checkpoint give their own defaults.
"""

import os

import jax
import numpy as np
import pytest
import torch

import generate_flax
from engine.pipeline import generate
from families import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")
PROMPT = 'A house under the sun, a sign that says "home"'
FRAMES, SEED = 5, 3
COMMUNITY = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-"


def _build(tmp_path_factory, name, *flags):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py", name, "--i2v", *flags)


@pytest.fixture(scope="module")
def meanflow_checkpoint(tmp_path_factory):
    return _build(tmp_path_factory, "tiny-hunyuan15-meanflow", "--meanflow", "--shift", "7",
                  "--guidance_scale", "1")


@pytest.fixture(scope="module")
def distilled_checkpoint(tmp_path_factory):
    return _build(tmp_path_factory, "tiny-hunyuan15-distilled", "--shift", "5",
                  "--guidance_scale", "1")


def _reference(checkpoint, steps):
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from diffusers.utils import load_image

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(image=load_image(FIRST_FRAME), prompt=PROMPT, num_frames=FRAMES,
                    num_inference_steps=steps,
                    generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="np").frames[0]


def _config(checkpoint, *extra):
    return generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--image", FIRST_FRAME, "--prompt", PROMPT,
        "--dtype", "float32", "--seed", str(SEED), "--num_iterations", "1",
        "--warmup_steps", "0", "--frames", str(FRAMES), "--compilation_cache_dir", "none",
        *extra]))


def _ours(checkpoint, devices, *extra):
    config = _config(checkpoint, *extra)
    return generate(config, FAMILIES[config.model.family], devices=devices)


def test_meanflow_matches_diffusers(meanflow_checkpoint):
    """Three steps: timestep_r is the next timestep twice, then 0."""
    video = _config(meanflow_checkpoint).video  # the checkpoint's own defaults
    assert (video.num_inference_steps, video.flow_shift, video.guidance_scale,
            video.use_cfg) == (12, 7.0, 1.0, False)
    ref = _reference(meanflow_checkpoint, 3)
    assert ref.shape == (FRAMES, 48, 80, 3) and ref.std() > 0.01
    one, report = _ours(meanflow_checkpoint, jax.devices()[:1], "--num_inference_steps", "3",
                        "--attention", "xla")
    np.testing.assert_allclose(one, ref, atol=1e-3, rtol=0)
    # The MeanFlow embedder counts: the same weights without timestep_r give other frames.
    assert np.abs(_reference_without_r(meanflow_checkpoint, 3) - ref).max() > 1e-2


def _reference_without_r(checkpoint, steps):
    """diffusers' pipeline with the transformer's timestep_r dropped (None)."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from diffusers.utils import load_image

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    forward = pipe.transformer.forward
    pipe.transformer.forward = lambda *a, timestep_r=None, **k: forward(*a, **k)
    with torch.no_grad():
        return pipe(image=load_image(FIRST_FRAME), prompt=PROMPT, num_frames=FRAMES,
                    num_inference_steps=steps,
                    generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="np").frames[0]


def test_cfg_distilled_is_one_pass_and_matches_diffusers(distilled_checkpoint):
    """guidance_scale 1.0 in the guider: diffusers' guider runs the conditional pass only;
    so does ours, batch 1, with no dp (the whole mesh on tp x sp)."""
    video = _config(distilled_checkpoint).video
    assert (video.num_inference_steps, video.flow_shift, video.guidance_scale,
            video.use_cfg, video.batch) == (50, 5.0, 1.0, False, 1)
    ref = _reference(distilled_checkpoint, 2)
    ours, report = _ours(distilled_checkpoint, None, "--num_inference_steps", "2",
                         "--attention", "splash")
    assert report["mesh"]["dp"] == 1 and report["mesh"]["tp"] * report["mesh"]["sp"] == 8
    np.testing.assert_allclose(ours, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("suffix,want", [
    ("480p_t2v", (50, 5.0, 6.0)),
    ("720p_t2v", (50, 9.0, 6.0)),
    ("480p_i2v", (50, 5.0, 6.0)),
    ("720p_i2v", (50, 7.0, 6.0)),
    ("480p_t2v_distilled", (50, 5.0, 1.0)),
    ("480p_i2v_distilled", (50, 5.0, 1.0)),
    ("720p_i2v_distilled", (50, 7.0, 1.0)),
    ("480p_i2v_step_distilled", (12, 7.0, 1.0)),
])
def test_shipped_configs_give_their_defaults(suffix, want):
    """(steps, shift, guidance) of each public diffusers-format checkpoint, from its files
    (configs/README.md gives their source); the sizes: 480p I2V buckets at target_size 640."""
    argv = ["--model_id", COMMUNITY + suffix, "--dry_run", "--topology", "v6e:2x4"]
    # Without an image (the dry run's case) the 16:9 bucket at target_size, as for T2V.
    imageless = generate_flax.validate_args(generate_flax.parse_args(argv)).video
    assert (imageless.height, imageless.width) == (
        (480, 848) if "480p" in suffix else (720, 1280))
    if "i2v" in suffix:
        argv += ["--image", FIRST_FRAME]
    video = generate_flax.validate_args(generate_flax.parse_args(argv)).video
    assert (video.num_inference_steps, video.flow_shift, video.guidance_scale) == want
    if "t2v" in suffix:  # the 16:9 bucket at the transformer's target_size
        assert (video.height, video.width) == ((480, 848) if "480p" in suffix else (720, 1280))
    else:  # the image's bucket, as HunyuanVideo15ImageProcessor picks it
        from diffusers.pipelines.hunyuan_video1_5.image_processor import (
            HunyuanVideo15ImageProcessor,
        )

        bucket = HunyuanVideo15ImageProcessor(vae_scale_factor=16).calculate_default_height_width(
            height=96, width=160, target_size=640 if "480p" in suffix else 960)
        assert (video.height, video.width) == tuple(bucket)
