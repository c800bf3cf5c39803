"""Wan 2.2 through ``WanPipeline``: the two-expert A14B layout (one compiled step, the expert
chosen per step on the host) and the TI2V-5B layout (48 channels, the Wan 2.2 VAE), each
against diffusers' eager pipeline on a tiny random checkpoint (tools/make_tiny_checkpoint.py).
"""

import os

import jax
import numpy as np
import pytest
import torch
from parity import assert_frames_close, latents_of

import generate_flax
from engine.files.checkpoint import expert_count
from engine.pipeline import generate
from families import FAMILIES, wan, wan_vae

# Latent width 128 / 8 (Wan 2.1 VAE) or 128 / 16 (Wan 2.2 VAE) splits over 8 devices, so
# the decode on the 8-device mesh is width-sharded too.
SHAPE = dict(height=64, width=128, frames=9)
STEPS = 4
SHIFT = 5.0
# UniPC's 4 timesteps at flow_shift 5.0 are [999, 937, 833, 625]: with boundary_ratio 0.9
# (t >= 900) steps 0-1 run transformer and steps 2-3 transformer_2.
BOUNDARY = 0.9


@pytest.fixture(scope="session")
def two_expert_checkpoint(tmp_path_factory):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-a14b",
                  "--experts", "2", "--boundary_ratio", str(BOUNDARY))


def _reference(checkpoint, seed, frames=SHAPE["frames"], output_type="np", **kw):
    """diffusers' WanPipeline.__call__, eager float32 PyTorch on CPU: its frames, or with
    ``output_type="latent"`` its final latents (float32 numpy)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                   num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type=output_type, num_frames=frames, height=SHAPE["height"],
                   width=SHAPE["width"], **kw)
    return out.frames.float().numpy() if output_type == "latent" else out.frames[0]


def _ours(checkpoint, seed, flags=(), devices=None, frames=SHAPE["frames"]):
    args = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--dtype", "float32", "--seed", str(seed),
        "--flow_shift", str(SHIFT), "--num_inference_steps", str(STEPS),
        "--num_iterations", "1", "--warmup_steps", "0",
        "--height", str(SHAPE["height"]), "--width", str(SHAPE["width"]),
        "--frames", str(frames), "--attention", "xla",
        "--compilation_cache_dir", "none", *flags]))
    return generate(args, FAMILIES[args.model.family], devices=devices)


def _our_latents(*args, **kw):
    """``_ours``' (final latents, report)."""
    return latents_of(_ours, *args, **kw)


def test_two_experts_match_diffusers(two_expert_checkpoint):
    """Both experts run (steps 0-1 and 2-3) with different scales; 1 device and dp2 x tp2 x
    sp2 match diffusers' eager two-expert loop; swapping the scales moves the result by far
    more than the tolerance. Final latents are compared, not frames: the tiny VAE's sign
    step (tests/parity.py) made this test fail on frames."""
    # 5 frames (2 latent frames) keep it lean; the 3-program decode is covered by the TI2V
    # test and the decode test below.
    ck, seed, frames = two_expert_checkpoint, 7, 5
    latent = dict(output_type="latent", guidance_scale_2=2.0)
    ref = _reference(ck, seed, frames, guidance_scale=5.0, **latent)
    swapped = _reference(ck, seed, frames, guidance_scale=2.0,
                         **{**latent, "guidance_scale_2": 5.0})
    flags = ["--guidance_scale", "5", "--guidance_scale_2", "2"]
    one, report = _our_latents(ck, seed, flags, devices=jax.devices()[:1], frames=frames)
    mesh8, report8 = _our_latents(ck, seed, flags + ["--dp", "2", "--tp", "2", "--sp", "2"],
                                  frames=frames)
    assert ref.std() > 0.1  # not flat latents: the comparison means something
    # float32 on both sides; measured 3.8e-6 (1 device) and 3.7e-6 (8 devices) on latents up to 4.3.
    mesh = ["--dp", "2", "--tp", "2", "--sp", "2"]
    for latents, devices, extra in ((one, jax.devices()[:1], []), (mesh8, None, mesh)):
        assert_frames_close(latents, ref, atol=1e-4, what="latents",
                            again=lambda d=devices, e=extra: (
                                _our_latents(ck, seed, flags + e, devices=d, frames=frames)[0],
                                _reference(ck, seed, frames, guidance_scale=5.0, **latent)))
    assert np.abs(swapped - ref).max() > 1e-2  # measured 0.49
    for r in (report, report8):
        experts = r["experts"]
        assert experts["steps"] == {"transformer": [0, 1], "transformer_2": [2, 3]}
        assert (experts["guidance_scale"], experts["guidance_scale_2"]) == (5.0, 2.0)
        assert experts["compiled_programs"] == 1
        assert "place_transformer_2_s" in r["timings"]
    assert report8["mesh"] == {"dp": 2, "tp": 2, "sp": 2} and report8["fallbacks"] == []
    # FLOPs count each step's expert (the two have one config, so the mean is either's).
    cfg = dict(json_config(ck, "transformer"))
    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", ck, "--height", "64", "--width", "128", "--frames", str(frames)]))
    assert report["timings"]["transformer_flops_per_step"] == wan.transformer_flops(cfg, config)


def json_config(checkpoint, sub):
    import json
    import os

    with open(os.path.join(checkpoint, sub, "config.json")) as f:
        return json.load(f)


def test_two_expert_defaults_and_refusals(two_expert_checkpoint, tiny_checkpoint):
    from engine.run.errors import UsageError

    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", two_expert_checkpoint]))
    video = config.video
    assert (video.num_inference_steps, video.height, video.width, video.frames,
            video.fps) == (40, 720, 1280, 81, 16)
    assert (video.guidance_scale, video.guidance_scale_2, video.flow_shift) == \
        (4.0, 3.0, 12.0)
    assert "sample_shift 12.0" in config.video.default_sources["flow_shift"]
    with pytest.raises(UsageError, match=r"--guidance_scale_2=2.0: needs a two-expert"):
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", tiny_checkpoint, "--guidance_scale_2", "2"]))
    # Step caching works per expert (tests/test_step_cache_experts.py); this tiny checkpoint
    # has no shipped ratios.
    with pytest.raises(UsageError, match=r"--cache='magcache': no calibrated ratios"):
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", two_expert_checkpoint, "--cache", "magcache"]))


def test_resident_weight_bytes_count_both_experts(two_expert_checkpoint):
    # What the v6e default layout weighs (chips.prefers_ulysses): both experts, as diffusers
    # loads them in bfloat16.
    from test_mesh_defaults import loaded_transformer

    from engine.files.checkpoint import read_component_config
    from engine.weights.layout import resident_weight_bytes

    loaded = sum(p.numel() * p.element_size()
                 for name in ("transformer", "transformer_2")
                 for p in loaded_transformer(two_expert_checkpoint, name).parameters())
    cfg = read_component_config(two_expert_checkpoint, "transformer")
    assert resident_weight_bytes(FAMILIES["wan"], two_expert_checkpoint, cfg,
                                 "bfloat16") == loaded


def test_ti2v_matches_diffusers(ti2v_checkpoint):
    """48 channels, the Wan 2.2 VAE (patchify, 16x) and expand_timesteps: diffusers feeds
    per-token timesteps, we feed the scalar; 1 device and dp2 x tp2 x sp2."""
    ck, seed = ti2v_checkpoint, 5
    ref = _reference(ck, seed, guidance_scale=5.0)
    one, report = _ours(ck, seed, ["--guidance_scale", "5"], devices=jax.devices()[:1])
    mesh8, report8 = _ours(ck, seed, ["--guidance_scale", "5", "--dp", "2", "--tp", "2",
                                      "--sp", "2"])
    assert ref.shape == (9, 64, 128, 3) and ref.std() > 0.01
    # Measured 2.2e-6 (1 device) and 1.3e-6 (8 devices).
    np.testing.assert_allclose(one, ref, atol=1e-3, rtol=0)
    np.testing.assert_allclose(mesh8, ref, atol=1e-3, rtol=0)
    assert report["tokens"] == 3 * (64 // 32) * (128 // 32)  # 16x VAE, 2x2 patch
    assert report8["fallbacks"] == []  # the decode really was width-sharded


def test_ti2v_scalar_timestep_equals_per_token(ti2v_checkpoint):
    """The transformer's (B, S) timestep path with every token at t equals its (B,) path up
    to float32 rounding (not bitwise: the time embedding's matmuls see other shapes)."""
    from diffusers import WanTransformer3DModel

    m = WanTransformer3DModel.from_pretrained(ti2v_checkpoint, subfolder="transformer").eval()
    g = torch.Generator().manual_seed(0)
    x, e = torch.randn(2, 48, 3, 4, 8, generator=g), torch.randn(2, 512, 32, generator=g)
    t = torch.tensor([937, 937])
    with torch.no_grad():
        scalar = m(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
        per_token = m(hidden_states=x, timestep=t[:, None].expand(2, 3 * 2 * 4),
                      encoder_hidden_states=e, return_dict=False)[0]
    assert per_token.abs().mean() > 0.1
    assert (scalar - per_token).abs().max() < 1e-5  # measured 4.8e-7


@pytest.mark.parametrize("n_devices", [1, 8])
def test_wan22_vae_decode_equals_diffusers(ti2v_checkpoint, n_devices):
    from diffusers import AutoencoderKLWan
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from engine.run.mesh import MeshShape, make_mesh
    from engine.weights.sharding import place_module

    vae = AutoencoderKLWan.from_pretrained(ti2v_checkpoint, subfolder="vae").eval()
    assert vae.config.patch_size == 2 and vae.config.z_dim == 48
    # 3 latent frames: the first, second and later-frame programs; latent width 8 splits
    # over 8 devices.
    z = torch.randn(1, 48, 3, 2, 8, generator=torch.Generator().manual_seed(1))
    mean = torch.tensor(vae.config.latents_mean).view(1, 48, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 48, 1, 1, 1)
    with torch.no_grad():  # as WanPipeline de-normalises: latents / (1 / std) + mean
        ref = vae.decode(z / (1.0 / std) + mean, return_dict=False)[0].numpy()
    mesh = make_mesh(MeshShape(1, 1, n_devices), jax.devices()[:n_devices])
    placed = place_module(vae, mesh, include=wan_vae.is_vae_decode_weight, desc="vae")
    decoder = wan_vae.vae_decoder(placed, vae, mesh)
    zj = jax.device_put(z.numpy(), NamedSharding(mesh, P()))
    decoder.compile(zj)
    video = decoder(zj)
    assert video.shape == ref.shape == (1, 3, 9, 32, 128)
    np.testing.assert_allclose(np.asarray(video), ref, atol=1e-5, rtol=0)
    if n_devices == 8:
        assert {s.data.shape[-1] for s in video.addressable_shards} == {128 // 8}


def test_dry_run_counts_both_experts_resident():
    """--dry_run's "kept" column: the step program's arguments are one expert; the other
    expert stays in HBM beside it and both beside the VAE decode."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from engine.dry_run import fit as dry_run
    from engine.run.mesh import MeshShape, make_mesh

    mesh = make_mesh(MeshShape(2, 4, 1))

    def struct(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    placed = dict(params={"w": struct((64, 32), P("tp"))}, buffers={})  # 2 KiB per chip
    vae = dict(params={"v": struct((16,), P())}, buffers={})  # 64 B per chip
    inputs = {"x": struct((2, 8), P("dp"))}  # 32 B per chip
    for n, step_kept, vae_kept in ((1, 64, 2048 + 32 + 200), (2, 64 + 2048, 4096 + 32 + 200)):
        rows = [dict(program="transformer step", total_bytes=0, fits=True, capacity_bytes=1e9),
                dict(program="VAE decode (3 programs, peak)", total_bytes=0, fits=True,
                     capacity_bytes=1e9)]
        dry_run._add_resident(rows, placed, vae, inputs, 100, n)
        assert [r["resident_bytes"] for r in rows] == [step_kept, vae_kept]
    index = {"boundary_ratio": 0.875, "transformer_2": ["diffusers", "WanTransformer3DModel"]}
    assert expert_count(index) == 2
    assert expert_count({**index, "transformer_2": [None, None]}) == 1
    assert expert_count({**index, "boundary_ratio": None}) == 1


def test_lora_2_fuses_into_the_second_expert(two_expert_checkpoint, tmp_path):
    """--lora into transformer and --lora_2 into transformer_2, fused at placement, equal
    diffusers' eager load_lora_weights(...) / load_lora_weights(..., load_into_transformer_2=
    True) + fuse_lora(components=both, lora_scale=0.7), on the final latents (the tiny VAE's
    sign step, tests/parity.py); the --lora_2 file alone changes the video by far more than
    the tolerance (so it reaches the second expert's steps)."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    from tiny_lora import write_lora

    ck, seed, frames = two_expert_checkpoint, 3, 5
    cfg = json.loads(open(os.path.join(ck, "transformer_2", "config.json")).read())
    first, second = str(tmp_path / "high.safetensors"), str(tmp_path / "low.safetensors")
    write_lora(first, cfg, fmt="original", rank=4, seed=11)
    write_lora(second, cfg, fmt="peft", rank=4, seed=12)

    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(ck, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(ck, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    # low_cpu_mem_usage=False: with the default, PEFT leaves the lora_B biases a file does not
    # carry on the meta device and fuse_lora adds uninitialised memory (a flaky reference);
    # materialised, they start at zero, the value our fusion gives an absent bias.
    pipe.load_lora_weights(first, adapter_name="high", low_cpu_mem_usage=False)
    pipe.load_lora_weights(second, adapter_name="low", load_into_transformer_2=True,
                           low_cpu_mem_usage=False)
    pipe.fuse_lora(components=["transformer", "transformer_2"], lora_scale=0.7)
    with torch.no_grad():
        ref = pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                   num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(seed),
                   output_type="latent", num_frames=frames, height=SHAPE["height"],
                   width=SHAPE["width"], guidance_scale=4.0,
                   guidance_scale_2=2.0).frames.float().numpy()
    del pipe
    flags = ["--guidance_scale", "4", "--guidance_scale_2", "2", "--lora", f"{first}:0.7",
             "--lora_2", f"{second}:0.7"]
    ours, report = _our_latents(ck, seed, flags, devices=jax.devices()[:1], frames=frames)
    print("LoRA 2: latents max |ours - diffusers|", np.abs(ours - ref).max())
    # Measured 2.1e-6 on latents up to ~4; 1e-4 as the two-expert test above.
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)
    assert [x["path"] for x in report["loras"]] == [first]
    (entry,) = report["loras_2"]
    assert entry["path"] == second and entry["scale"] == 0.7 and entry["matched_weights"] == 40
    without_2 = _our_latents(ck, seed, flags[:6], devices=jax.devices()[:1], frames=frames)[0]
    print("without --lora_2: latents max |d|", np.abs(without_2 - ref).max())
    assert np.abs(without_2 - ref).max() > 1e-2  # 100 times the tolerance; measured 0.46


def test_lora_2_needs_a_second_expert(tiny_checkpoint, tmp_path, capsys):
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--lora_2",
                              str(tmp_path / "x.safetensors"), "--output_dir",
                              str(tmp_path / "out")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--lora_2=" in line and "needs a two-expert checkpoint" in line, line


@pytest.mark.parametrize("case,rule", [("unmatched keys", "match no transformer weight"),
                                       ("wrong shape", "does not fit its weight"),
                                       ("pickle", "pickled checkpoints are refused")])
def test_bad_lora_2_is_one_line_before_loading(two_expert_checkpoint, tmp_path, capsys, case,
                                               rule):
    from test_cli import _bad_lora

    value, out = _bad_lora(tmp_path, two_expert_checkpoint, case), tmp_path / "out"
    code = generate_flax.cli(["--model_id", two_expert_checkpoint, "--lora_2", value,
                              "--output_dir", str(out)])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--lora_2=" in line and rule in line, line
    assert not out.exists() or not os.listdir(out)
