"""Wan first-and-last-frame video (``--last_image``, ``families.wan_flf2v``) against diffusers'
eager ``WanImageToVideoPipeline(last_image=...)`` on tiny random checkpoints: Wan 2.1 FLF2V
(tools/make_tiny_checkpoint.py --i2v --flf2v: CLIP for both images, ``pos_embed_seq_len``
with random learned positions) and Wan 2.2 I2V-A14B (two experts, no CLIP: the last image
through the condition alone). Compared on the final latents (``output_type="latent"``), as
tests/test_wan_i2v.py does for the tiny Wan 2.1 VAE (its module docstring says why).
"""

import os

import jax
import numpy as np
import pytest
import torch
from parity import assert_frames_close, latents_of
from PIL import Image, ImageOps

import generate_flax
from engine.pipeline import generate
from families import FAMILIES, wan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")
SHAPE = dict(height=32, width=32, frames=5)
STEPS, SHIFT, SEED = 2, 5.0, 4
# Final latents (1, 16, 2, 4, 4) float32; the bound is test_wan_i2v's (its measured I2V
# differences are 2.4e-6 .. 4.4e-6). FAR: another last image must move them by more.
LATENT_ATOL, FAR = 1e-4, 1e-2


@pytest.fixture(scope="module")
def last_frame(tmp_path_factory):
    """The first frame mirrored and darkened: a last frame unlike the first."""
    path = str(tmp_path_factory.mktemp("flf2v") / "last.png")
    image = ImageOps.mirror(Image.open(FIRST_FRAME).convert("RGB"))
    Image.eval(image, lambda v: v // 2).save(path)
    return path


def _reference(checkpoint, last, **kw):
    """diffusers' WanImageToVideoPipeline.__call__ with ``last_image``, eager float32 on the
    CPU: its final latents (float32 numpy)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline
    from diffusers.utils import load_image

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanImageToVideoPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(image=load_image(FIRST_FRAME), last_image=load_image(last),
                   prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                   num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED),
                   output_type="latent", num_frames=SHAPE["frames"], height=SHAPE["height"],
                   width=SHAPE["width"], **kw)
    return out.frames.float().numpy()


def _args(checkpoint, last, flags=()):
    last = ["--last_image", last] if last else []
    return ["--model_id", checkpoint, "--image", FIRST_FRAME, *last, "--dtype", "float32",
            "--seed", str(SEED), "--flow_shift", str(SHIFT), "--num_inference_steps", str(STEPS),
            "--num_iterations", "1", "--warmup_steps", "0", "--height", str(SHAPE["height"]),
            "--width", str(SHAPE["width"]), "--frames", str(SHAPE["frames"]),
            "--attention", "xla", "--compilation_cache_dir", "none", *flags]


def _ours(checkpoint, last, flags=(), devices=None):
    config = generate_flax.validate_args(generate_flax.parse_args(_args(checkpoint, last,
                                                                        flags)))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def _assert_latents(ours, want, again):
    print(f"latents: max |ours - diffusers| {np.abs(ours - want).max():.3g} of "
          f"max |latent| {np.abs(want).max():.3g}")
    assert_frames_close(ours, want, atol=LATENT_ATOL, what="latents", again=again)


def test_wan21_flf2v_matches_diffusers(flf2v_checkpoint, last_frame, tmp_path):
    """Both images through CLIP (two rows of 17 tokens, viewed as one row of 34 with the
    learned positions), the [first, zeros, last] condition with the mask on both ends equal
    diffusers' eager pipeline; the report names the last image; another last image moves
    the video."""
    flags = ["--guidance_scale", "5"]
    want = _reference(flf2v_checkpoint, last_frame, guidance_scale=5.0)
    one, report = latents_of(_ours, flf2v_checkpoint, last_frame, flags,
                             devices=jax.devices()[:1])
    assert want.std() > 0.01
    _assert_latents(one, want, again=lambda: (
        latents_of(_ours, flf2v_checkpoint, last_frame, flags, devices=jax.devices()[:1])[0],
        _reference(flf2v_checkpoint, last_frame, guidance_scale=5.0)))
    recorded = report["settings"]["inputs"]["last_image"]
    assert recorded["path"] == os.path.abspath(last_frame) and len(recorded["sha256"]) == 64
    other = str(tmp_path / "other.png")
    ImageOps.flip(Image.open(last_frame)).save(other)
    moved = latents_of(_ours, flf2v_checkpoint, other, flags, devices=jax.devices()[:1])[0]
    print("another last image: latents max |d|", np.abs(moved - want).max())
    assert np.abs(moved - want).max() > FAR


def test_wan21_flf2v_dp2_matches_diffusers(flf2v_checkpoint, last_frame):
    """dp2 on 2 devices: each dp shard holds its CFG pass's pair of image rows (the
    transformer views adjacent rows as one), so the split keeps the pairs. (2 devices, not
    8: the width-sharded VAE encode cannot split this 32-pixel-wide tiny video 8 ways.)"""
    flags, two = ["--guidance_scale", "5", "--dp", "2"], jax.devices()[:2]
    want = _reference(flf2v_checkpoint, last_frame, guidance_scale=5.0)
    ours, report = latents_of(_ours, flf2v_checkpoint, last_frame, flags, devices=two)
    assert report["mesh"] == {"dp": 2, "tp": 1, "sp": 1} and report["fallbacks"] == []
    _assert_latents(ours, want, again=lambda: (
        latents_of(_ours, flf2v_checkpoint, last_frame, flags, devices=two)[0],
        _reference(flf2v_checkpoint, last_frame, guidance_scale=5.0)))


def test_wan22_i2v_two_experts_flf2v_matches_diffusers(i2v_two_expert_checkpoint, last_frame):
    """No CLIP: the last image enters through the condition; both experts run."""
    scales = dict(guidance_scale=4.0, guidance_scale_2=2.0)
    flags = ["--guidance_scale", "4", "--guidance_scale_2", "2"]
    want = _reference(i2v_two_expert_checkpoint, last_frame, **scales)
    ours, report = latents_of(_ours, i2v_two_expert_checkpoint, last_frame, flags,
                              devices=jax.devices()[:1])
    _assert_latents(ours, want, again=lambda: (
        latents_of(_ours, i2v_two_expert_checkpoint, last_frame, flags,
                   devices=jax.devices()[:1])[0],
        _reference(i2v_two_expert_checkpoint, last_frame, **scales)))
    assert set(report["experts"]["steps_per_expert"]) == {"transformer", "transformer_2"}
    # Without --last_image the same run is image-to-video, far from the FLF2V latents.
    i2v = latents_of(_ours, i2v_two_expert_checkpoint, None, flags,
                     devices=jax.devices()[:1])[0]
    print("without the last image: latents max |d|", np.abs(i2v - want).max())
    assert np.abs(i2v - want).max() > FAR


def test_abstract_inputs_match_the_model_inputs(flf2v_checkpoint, i2v_checkpoint, last_frame):
    """The dry run's shapes (``abstract_model_inputs``) are the run's (``model_inputs``): with
    CFG, 2 passes x 2 images of 17 CLIP tokens on the FLF2V checkpoint (the count from its
    ``pos_embed_seq_len``), 2 x 1 on Wan 2.1 I2V."""
    from engine.files.checkpoint import read_component_config

    for checkpoint, last, images in ((flf2v_checkpoint, last_frame, 2), (i2v_checkpoint, None, 1)):
        config = generate_flax.validate_args(generate_flax.parse_args(
            _args(checkpoint, last, ["--guidance_scale", "5"])))
        cfg = read_component_config(checkpoint, "transformer")
        abstract = wan.abstract_model_inputs(cfg, config)["encoder_hidden_states_image"]
        embeds = {"prompt_embeds": torch.zeros(1, 512, 32),
                  "negative_prompt_embeds": torch.zeros(1, 512, 32),
                  "image_embeds": torch.zeros(images, 17, cfg["image_dim"])}
        real = wan.model_inputs(embeds, config)["encoder_hidden_states_image"]
        assert abstract.shape == tuple(real.shape) == (2 * images, 17, cfg["image_dim"])


def _refused(capsys, tmp_path, argv):
    """generate_flax.cli's exit code and its one stderr line; nothing was written."""
    out = tmp_path / "out"
    code = generate_flax.cli([*argv, "--output_dir", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not out.exists() or not os.listdir(out)
    return code, lines[0]


def test_refusals_are_one_line(flf2v_checkpoint, i2v_checkpoint, tiny_checkpoint,
                               last_frame, tmp_path, capsys):
    """Before any model loads, exit 2, one line, no file."""
    def base(model, last, *more):
        return ["--model_id", model, "--image", FIRST_FRAME, *(
            ["--last_image", last] if last else []), "--height", "32", "--width", "32",
            "--frames", "5", *more]

    code, line = _refused(capsys, tmp_path, base(i2v_checkpoint, last_frame))
    assert code == 2 and f"error: --last_image={last_frame!r}: " in line \
        and "no pos_embed_seq_len" in line, line
    code, line = _refused(capsys, tmp_path, base(flf2v_checkpoint, None))
    assert code == 2 and "error: --last_image=None: " in line and "two images" in line, line
    code, line = _refused(capsys, tmp_path, ["--model_id", flf2v_checkpoint, "--last_image",
                                             last_frame])
    # --image's own rule comes first: an image-to-video checkpoint needs the first frame.
    assert code == 2 and "error: --image=None: " in line, line
    code, line = _refused(capsys, tmp_path, base(flf2v_checkpoint, str(tmp_path / "no.png")))
    assert code == 2 and "no.png" in line and "file not found" in line, line
    code, line = _refused(capsys, tmp_path, ["--model_id", flf2v_checkpoint, "--serve"])
    assert code == 2 and "error: --serve=True: " in line and "two images per job" in line, line
    t2v = ["--model_id", tiny_checkpoint, "--last_image", last_frame]
    code, line = _refused(capsys, tmp_path, t2v)
    assert code == 2 and "error: --last_image=" in line and "text-to-video" in line, line
