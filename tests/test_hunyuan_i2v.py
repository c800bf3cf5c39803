"""HunyuanVideo-1.5 image-to-video (``HunyuanVideo15ImageToVideoPipeline``, ``--image``)
against diffusers' eager pipeline on a tiny random checkpoint with a tiny SigLIP encoder
(tools/make_tiny_hunyuan_checkpoint.py --i2v): the image tokens in the joint attention,
the 65-channel input with the image latents and mask, and the size from the image's
aspect-ratio bucket."""

import os

import jax
import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

import generate_flax
from engine.pipeline import generate
from families import FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")
PROMPT = 'A house under the sun, a sign that says "home"'
FRAMES, STEPS, SEED = 5, 2, 3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py", "tiny-hunyuan15-i2v",
                  "--i2v")


def _reference(checkpoint, image_path):
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from diffusers.utils import load_image

    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return pipe(image=load_image(image_path), prompt=PROMPT, num_frames=FRAMES,
                    num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="np").frames[0]


def _ours(checkpoint, image_path, devices, *extra):
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--image", image_path, "--prompt", PROMPT,
        "--dtype", "float32", "--seed", str(SEED), "--num_inference_steps", str(STEPS),
        "--num_iterations", "1", "--warmup_steps", "0", "--frames", str(FRAMES),
        "--compilation_cache_dir", "none", *extra]))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def test_hunyuan_i2v_matches_diffusers(checkpoint, tmp_path):
    ref = _reference(checkpoint, FIRST_FRAME)
    # 160 x 96 pixels (0.6) at target_size 64: the pipeline's bucket is 48 x 80 (0.6).
    assert ref.shape == (FRAMES, 48, 80, 3) and ref.std() > 0.01
    one, report = _ours(checkpoint, FIRST_FRAME, jax.devices()[:1], "--attention", "xla")
    assert (report["settings"]["height"], report["settings"]["width"]) == (48, 80)
    np.testing.assert_allclose(one, ref, atol=1e-3, rtol=0)
    mesh8, report8 = _ours(checkpoint, FIRST_FRAME, None, "--attention", "splash", "--dp", "2",
                           "--tp", "2", "--sp", "2")
    assert report8["mesh"] == {"dp": 2, "tp": 2, "sp": 2}
    np.testing.assert_allclose(mesh8, ref, atol=1e-3, rtol=0)
    flipped = str(tmp_path / "flipped.png")
    ImageOps.mirror(Image.open(FIRST_FRAME)).save(flipped)
    other, _ = _ours(checkpoint, flipped, jax.devices()[:1], "--attention", "xla")
    assert np.abs(other - ref).max() > 0.1
