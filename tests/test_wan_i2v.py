"""Wan image-to-video (``WanImageToVideoPipeline``, ``--image``) against diffusers' eager
pipeline on tiny random checkpoints (tools/make_tiny_checkpoint.py --i2v): Wan 2.1 I2V with a
CLIP image encoder, and Wan 2.2 I2V-A14B with two experts and no CLIP.

The checkpoints with the tiny Wan 2.1 VAE (--i2v, --i2v --experts 2) are compared on the
final latents (``output_type="latent"``), not the frames: that VAE's one-channel RMS norm can
flip on a float32 rounding difference and move a patch of pixels by up to 0.07
(tests/parity.py). The TI2V-5B checkpoint's Wan 2.2 VAE (6 channels at its last block) has
no such step: its tests keep the frames.
"""

import os

import jax
import numpy as np
import pytest
import torch
from jax.sharding import PartitionSpec as P
from parity import assert_frames_close, latents_of
from PIL import Image, ImageOps

import generate_flax
from engine.pipeline import generate
from families import FAMILIES, wan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")
SHAPE = dict(height=64, width=128, frames=5)
STEPS, SHIFT, SEED = 3, 5.0, 4
# Final latents (1, 16, 2, 8, 16), float32 up to ~4.4: ours and diffusers' agree to 4.4e-6
# (measured: Wan 2.1 I2V 4.3e-6, its staged run 4.4e-6, Wan 2.2 I2V-A14B 2.4e-6); the bound
# is 23 times that. FAR, 100 times it: another image moved them by 0.32.
LATENT_ATOL, FAR = 1e-4, 1e-2


def _reference(checkpoint, image_path, output_type="np", **kw):
    """diffusers' WanImageToVideoPipeline.__call__, eager float32 PyTorch on CPU: its frames,
    or with ``output_type="latent"`` its final latents (float32 numpy)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline
    from diffusers.utils import load_image

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanImageToVideoPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(image=load_image(image_path), prompt=wan.DEFAULTS["prompt"],
                   negative_prompt=wan.DEFAULTS["negative_prompt"], num_inference_steps=STEPS,
                   generator=torch.Generator("cpu").manual_seed(SEED), output_type=output_type,
                   num_frames=SHAPE["frames"], height=SHAPE["height"], width=SHAPE["width"],
                   **kw)
    return out.frames.float().numpy() if output_type == "latent" else out.frames[0]


def _ours(checkpoint, image_path, flags=(), devices=None):
    image = ["--image", image_path] if image_path else []
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, *image, "--dtype", "float32",
        "--seed", str(SEED), "--flow_shift", str(SHIFT), "--num_inference_steps", str(STEPS),
        "--num_iterations", "1", "--warmup_steps", "0", "--height", str(SHAPE["height"]),
        "--width", str(SHAPE["width"]), "--frames", str(SHAPE["frames"]),
        "--attention", "xla", "--compilation_cache_dir", "none", *flags]))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def _assert_latents(ours, want, again):
    """``parity.assert_frames_close`` on latents at LATENT_ATOL, printing the margin."""
    print(f"latents: max |ours - diffusers| {np.abs(ours - want).max():.3g} of "
          f"max |latent| {np.abs(want).max():.3g}")
    assert_frames_close(ours, want, atol=LATENT_ATOL, what="latents", again=again)


def test_wan21_i2v_matches_diffusers(i2v_checkpoint, tmp_path):
    """CLIP embeddings, the 20-channel condition and the image cross-attention: 1 device and
    dp2 x tp2 x sp2 equal diffusers' eager pipeline (final latents); another image moves the
    video by far more than the tolerance."""
    flags = ["--guidance_scale", "5"]
    want = _reference(i2v_checkpoint, FIRST_FRAME, output_type="latent", guidance_scale=5.0)
    one, report = latents_of(_ours, i2v_checkpoint, FIRST_FRAME, flags,
                             devices=jax.devices()[:1])
    assert want.std() > 0.01
    _assert_latents(one, want, again=lambda: (
        latents_of(_ours, i2v_checkpoint, FIRST_FRAME, flags, devices=jax.devices()[:1])[0],
        _reference(i2v_checkpoint, FIRST_FRAME, output_type="latent", guidance_scale=5.0)))
    assert report["settings"]["image"]["sha256"] and "image_encode_s" in report["timings"]
    mesh8, report8 = latents_of(_ours, i2v_checkpoint, FIRST_FRAME,
                                flags + ["--dp", "2", "--tp", "2", "--sp", "2"])
    np.testing.assert_allclose(mesh8, want, atol=LATENT_ATOL, rtol=0)
    assert report8["mesh"] == {"dp": 2, "tp": 2, "sp": 2} and report8["fallbacks"] == []
    # The image cross-attention's K/V projections are split over tp like to_k/to_v.
    matched = report8["sharding_rule_matches"]
    assert any("add_k_proj" in rule and n > 0 for rule, n in matched.items()), matched
    flipped = str(tmp_path / "flipped.png")
    ImageOps.mirror(Image.open(FIRST_FRAME)).save(flipped)
    other = latents_of(_ours, i2v_checkpoint, flipped, flags, devices=jax.devices()[:1])[0]
    print("flipped image: latents max |d|", np.abs(other - want).max())
    assert np.abs(other - want).max() > FAR


def test_wan22_i2v_two_experts_match_diffusers(i2v_two_expert_checkpoint):
    """No CLIP; the high-noise expert for t >= 900, then the low-noise one, each with its
    scale, as diffusers' two-expert image-to-video loop."""
    scales = dict(guidance_scale=4.0, guidance_scale_2=2.0)
    want = _reference(i2v_two_expert_checkpoint, FIRST_FRAME, output_type="latent", **scales)
    flags = ["--guidance_scale", "4", "--guidance_scale_2", "2"]
    ours, report = latents_of(_ours, i2v_two_expert_checkpoint, FIRST_FRAME, flags,
                              devices=jax.devices()[:1])
    _assert_latents(ours, want, again=lambda: (
        latents_of(_ours, i2v_two_expert_checkpoint, FIRST_FRAME, flags,
                   devices=jax.devices()[:1])[0],
        _reference(i2v_two_expert_checkpoint, FIRST_FRAME, output_type="latent", **scales)))
    assert report["experts"]["steps_per_expert"]["transformer"] > 0
    assert report["experts"]["steps_per_expert"]["transformer_2"] > 0


def test_image_is_required_for_an_i2v_checkpoint(i2v_checkpoint, tmp_path, capsys):
    code = generate_flax.cli(["--model_id", i2v_checkpoint, "--output_dir",
                              str(tmp_path / "out")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--image=None" in line and "image-to-video checkpoint" in line, line
    code = generate_flax.cli(["--model_id", i2v_checkpoint, "--image", FIRST_FRAME,
                              "--max_sequence_length", "256", "--output_dir",
                              str(tmp_path / "out")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and line.endswith("--max_sequence_length=256: must be 512 for a "
                                       "checkpoint with CLIP image embeddings (Wan 2.1 I2V: "
                                       "diffusers splits the image keys off at 512 text "
                                       "tokens)"), line
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_staged_i2v_denoise_needs_no_image(i2v_checkpoint, tmp_path):
    """--stage encode stores the CLIP embeddings and the condition with the prompt
    embeddings; denoise and decode run without --image (no image encoder loads) and the
    decode's input equals diffusers' final latents."""
    want = _reference(i2v_checkpoint, FIRST_FRAME, output_type="latent", guidance_scale=5.0)
    stage = ["--guidance_scale", "5", "--work_dir", str(tmp_path / "work"), "--stage"]
    one = jax.devices()[:1]
    _ours(i2v_checkpoint, FIRST_FRAME, stage + ["encode"], devices=one)
    _ours(i2v_checkpoint, None, stage + ["denoise"], devices=one)
    latents, _ = latents_of(_ours, i2v_checkpoint, None, stage + ["decode"], devices=one)
    print("staged: latents max |d|", np.abs(latents - want).max())
    np.testing.assert_allclose(latents, want, atol=LATENT_ATOL, rtol=0)


def test_image_cross_attention_is_split_over_tp_and_sp(i2v_checkpoint):
    """Streamed from the checkpoint (whose file also holds ``attn2.norm_added_q`` tensors
    the model lacks: skipped as ``from_pretrained`` skips them), add_k_proj / add_v_proj /
    norm_added_k land split over tp and sp together: each device holds a quarter of their
    bytes at tp2 x sp2, by ``jax.live_arrays()`` accounting, with the checkpoint's values;
    at dp2 x sp4 (Ulysses, tp 1) a quarter too, so Wan 2.1 I2V 14B fits that layout."""
    from diffusers import WanTransformer3DModel
    from safetensors import safe_open

    from engine.files.checkpoint import read_component_config
    from engine.run.mesh import MeshShape, make_mesh
    from engine.weights import placement, sharding

    folder = os.path.join(i2v_checkpoint, "transformer")
    with safe_open(os.path.join(folder, "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert any("norm_added_q" in k for k in f.keys())  # the builder added them
    expected = dict(WanTransformer3DModel.from_pretrained(
        i2v_checkpoint, subfolder="transformer").state_dict())
    model = wan.empty_transformer(read_component_config(i2v_checkpoint, "transformer"),
                                  torch.float32)
    mesh = make_mesh(MeshShape(2, 2, 2), jax.devices())
    placed = sharding.place_transformer(model, mesh, wan.transformer_sharding_rules(),
                                        checkpoint=folder, fsdp=False, scan=False)
    image = {k: v for k, v in placed["params"].items()
             if ".add_k_proj." in k or ".add_v_proj." in k or ".norm_added_k." in k}
    assert len(image) == 5 * 2  # weight, bias (k, v) and norm_added_k in each of 2 blocks
    live = {id(a) for a in jax.live_arrays()}
    assert all(id(a) in live for a in image.values())
    per_device = placement.per_device_bytes(list(image.values()))
    whole = sum(a.size * a.dtype.itemsize for a in image.values())
    assert set(per_device.values()) == {whole // 4}  # every device: a quarter of each
    w = image["blocks.0.attn2.add_k_proj.weight"]  # (out 24, in 24): rows over tp x sp
    assert {s.data.shape for s in w.addressable_shards} == {(6, 24)}
    for name, arr in image.items():
        np.testing.assert_array_equal(np.asarray(arr), expected[name].numpy(), err_msg=name)
    specs, _, _ = sharding.sharding_specs({"blocks.0.attn2.add_v_proj.weight": (24, 24)},
                                          wan.transformer_sharding_rules(),
                                          make_mesh(MeshShape(2, 1, 4), jax.devices()))
    assert specs["blocks.0.attn2.add_v_proj.weight"] == P(("tp", "sp"), None)


def test_ti2v_i2v_matches_diffusers(ti2v_checkpoint, tmp_path):
    """TI2V-5B image-to-video (``WanImageToVideoPipeline`` with ``expand_timesteps``): the
    image's latents on frame 0 at t = 0 through the two-valued modulation select, frame 0
    put back after the loop, the one-frame Wan 2.2 VAE encode on device. 1 device and dp2 x
    tp2 x sp2 equal diffusers' eager pipeline (whose transformer runs the (B, S) timestep
    path); another image moves the video by far more than the tolerance."""
    flags = ["--guidance_scale", "5"]
    ref = _reference(ti2v_checkpoint, FIRST_FRAME, guidance_scale=5.0)
    one, report = _ours(ti2v_checkpoint, FIRST_FRAME, flags, devices=jax.devices()[:1])
    assert ref.std() > 0.01
    np.testing.assert_allclose(one, ref, atol=1e-3, rtol=0)
    assert report["settings"]["image"]["sha256"]
    mesh8, report8 = _ours(ti2v_checkpoint, FIRST_FRAME, flags + ["--dp", "2", "--tp", "2",
                                                                  "--sp", "2"])
    np.testing.assert_allclose(mesh8, ref, atol=1e-3, rtol=0)
    assert report8["mesh"] == {"dp": 2, "tp": 2, "sp": 2} and report8["fallbacks"] == []
    flipped = str(tmp_path / "flipped.png")
    ImageOps.mirror(Image.open(FIRST_FRAME)).save(flipped)
    other, _ = _ours(ti2v_checkpoint, flipped, flags, devices=jax.devices()[:1])
    # 0.079 here: the tiny random Wan 2.2 VAE passes less of the picture than Wan 2.1's.
    assert np.abs(other - ref).max() > 0.02


def test_staged_ti2v_saves_latents_after_the_first_frame_is_put_back(ti2v_checkpoint,
                                                                     tmp_path):
    """--stage encode stores the image's latents; denoise (no --image) saves latents whose
    frame 0 is the image's (the pipeline's post-loop replacement), decode gives diffusers'
    frames."""
    from safetensors.torch import load_file

    ref = _reference(ti2v_checkpoint, FIRST_FRAME, guidance_scale=5.0)
    work = tmp_path / "work"
    stage = ["--guidance_scale", "5", "--work_dir", str(work), "--stage"]
    one = jax.devices()[:1]
    _ours(ti2v_checkpoint, FIRST_FRAME, stage + ["encode"], devices=one)
    _ours(ti2v_checkpoint, None, stage + ["denoise"], devices=one)
    embeds = load_file(str(work / "embeddings.safetensors"))
    latents = next(iter(load_file(str(work / "latents.safetensors")).values()))
    assert embeds["first_frame"].shape == (1, 48, 1, 4, 8)
    np.testing.assert_array_equal(latents[:, :, :1].numpy(), embeds["first_frame"].numpy())
    frames, _ = _ours(ti2v_checkpoint, None, stage + ["decode"], devices=one)
    np.testing.assert_allclose(frames, ref, atol=1e-3, rtol=0)


@pytest.mark.parametrize("scan", [False, True])
def test_first_frame_timesteps_equal_the_per_token_path(ti2v_checkpoint, scan):
    """Eager PyTorch, one model call: the (B,) timestep with ``FirstFrameTimesteps`` equals
    diffusers' own (B, S) path with t = 0 on frame 0's tokens (what the pipeline passes), for
    the unrolled blocks and the scanned stack; the plain (B,) call (t everywhere) does not."""
    from diffusers import WanTransformer3DModel

    from engine.weights.scan_layers import scan_blocks
    from families import wan_ti2v

    model = WanTransformer3DModel.from_pretrained(ti2v_checkpoint, subfolder="transformer")
    model.eval()
    if scan:
        scan_blocks(model)
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 48, 3, 4, 8, generator=g)  # 3 latent frames of 2 x 4 tokens
    first = torch.randn(2, 48, 1, 4, 8, generator=g)
    text = torch.randn(2, 16, 32, generator=g)
    x = wan_ti2v.model_input(latents, first)
    t = torch.tensor([937, 937])
    per_token = (torch.arange(24) >= 8).long() * 937  # frame 0: 8 tokens at t = 0
    with torch.no_grad():
        want = model(x, per_token.expand(2, -1), text, return_dict=False)[0]
        plain = model(x, t, text, return_dict=False)[0]
        with wan_ti2v.timesteps_scope(model, latents, first):
            got = model(x, t, text, return_dict=False)[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (plain - want).abs().max() > 100 * (got - want).abs().max() + 1e-4
