"""The HunyuanVideo-1.5 family against diffusers' own eager HunyuanVideo15Pipeline on CPU.

Float32 on the tiny random checkpoint (tools/make_tiny_hunyuan_checkpoint.py): two prompts,
one with quoted text (the ByT5 path) and one without; one device and a dp2 x tp2 x sp2 mesh
of 8 CPU devices, where the 45 video tokens do not divide over sp (padding), through our
Splash kernel in interpret mode with the text padding as segment ids.
"""

import json
import os

import jax
import numpy as np
import pytest
import torch

import generate_flax
from engine.pipeline import generate
from families import FAMILIES, hunyuan

QUOTED = 'A sign that says "hello"'
PLAIN = "A cat walks on the grass, realistic style"
# Latents (32, 3, 3, 5): non-square, and 45 video tokens, odd, so sp must pad.
SHAPE = dict(height=48, width=80, frames=9)
STEPS = 2
SEED = 3


@pytest.fixture(scope="module")
def reference(hunyuan_checkpoint):
    """diffusers' HunyuanVideo15Pipeline.__call__, eager PyTorch: {prompt: frames}."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(hunyuan_checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    out = {}
    for prompt in (QUOTED, PLAIN):
        with torch.no_grad():
            out[prompt] = pipe(
                prompt=prompt, num_frames=SHAPE["frames"], height=SHAPE["height"],
                width=SHAPE["width"], num_inference_steps=STEPS,
                generator=torch.Generator("cpu").manual_seed(SEED), output_type="np",
            ).frames[0]
    return out


def _ours(checkpoint, prompt, devices, *extra):
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--prompt", prompt, "--dtype", "float32",
        "--seed", str(SEED), "--num_inference_steps", str(STEPS), "--num_iterations", "1",
        "--warmup_steps", "0", "--height", str(SHAPE["height"]), "--width",
        str(SHAPE["width"]), "--frames", str(SHAPE["frames"]),
        "--compilation_cache_dir", "none", *extra,
    ]))
    return generate(config, FAMILIES[config.model.family], devices=devices)


@pytest.fixture(scope="module")
def ours(hunyuan_checkpoint):
    """Our frames: {(prompt, layout): (frames, report)}. Both prompts on one device; the
    quoted one (both encoders' padding, so the most masking) on the 8-device mesh."""
    out = {}
    for prompt in (QUOTED, PLAIN):
        out[prompt, "1 device"] = _ours(hunyuan_checkpoint, prompt, jax.devices()[:1],
                                        "--attention", "xla")
    out[QUOTED, "dp2 tp2 sp2"] = _ours(hunyuan_checkpoint, QUOTED, None, "--attention",
                                       "splash", "--dp", "2", "--tp", "2", "--sp", "2")
    return out


@pytest.mark.parametrize("prompt,layout", [(QUOTED, "1 device"), (PLAIN, "1 device"),
                                           (QUOTED, "dp2 tp2 sp2")])
def test_frames_match_diffusers(reference, ours, prompt, layout):
    frames, report = ours[prompt, layout]
    want = reference[prompt]
    assert frames.shape == want.shape == (SHAPE["frames"], SHAPE["height"], SHAPE["width"], 3)
    assert report["mesh"] == ({"dp": 1, "tp": 1, "sp": 1} if layout == "1 device"
                              else {"dp": 2, "tp": 2, "sp": 2})
    # Same float32 math; XLA's and ATen's summation orders differ far below 1e-3.
    np.testing.assert_allclose(frames, want, atol=1e-3)


def test_prompts_give_different_videos(reference, ours):
    """The ByT5 (quoted text) path changes the video: the parity above is not vacuous."""
    a, b = reference[QUOTED], reference[PLAIN]
    assert np.abs(a - b).max() > 0.05
    assert np.abs(ours[QUOTED, "1 device"][0] - ours[PLAIN, "1 device"][0]).max() > 0.05


def test_sharded_equals_unsharded(ours):
    np.testing.assert_allclose(ours[QUOTED, "dp2 tp2 sp2"][0], ours[QUOTED, "1 device"][0],
                               atol=2e-5)


def _with_guider(checkpoint, tmp_path, guider: dict) -> str:
    """A copy of ``checkpoint`` (symlinks) whose guider config is ``guider``."""
    copy = tmp_path / "ckpt"
    copy.mkdir()
    for name in os.listdir(checkpoint):
        if name != "guider":
            os.symlink(os.path.join(checkpoint, name), copy / name)
    (copy / "guider").mkdir()
    (copy / "guider" / "guider_config.json").write_text(json.dumps(guider))
    return str(copy)


def test_defaults_come_from_the_checkpoint(hunyuan_checkpoint, tmp_path):
    """Guidance scale and flow shift are the checkpoint's (its guider and scheduler configs),
    height and width the 16:9 bucket HunyuanVideo15Pipeline picks at the transformer's
    target_size (the tiny checkpoint's 64: 48 x 80; the shipped 480p config: 480 x 848, as
    its model card's 480p; 720p: 720 x 1280), frames and fps the family's; a flag still
    wins."""
    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", hunyuan_checkpoint]))
    assert config.model.family == "hunyuanvideo"
    video = config.video
    assert (video.guidance_scale, video.flow_shift, video.flow_shift_source) == (
        6.0, 9.0, "checkpoint")
    assert (video.frames, video.height, video.width, video.fps) == (121, 48, 80, 24)
    for size, want in (("480p", (480, 848)), ("720p", (720, 1280))):
        shipped = generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", f"hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-{size}_t2v",
             "--dry_run", "--topology", "v6e:2x4"])).video
        assert (shipped.height, shipped.width) == want
    flagged = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", hunyuan_checkpoint, "--height", "64", "--width", "96"])).video
    assert (flagged.height, flagged.width) == (64, 96)
    with open(os.path.join(hunyuan_checkpoint, "guider", "guider_config.json")) as f:
        guider = json.load(f)
    copy = _with_guider(hunyuan_checkpoint, tmp_path, {**guider, "guidance_scale": 3.5})
    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", copy, "--flow_shift", "7"]))
    video = config.video
    assert (video.guidance_scale, video.flow_shift, video.flow_shift_source) == (
        3.5, 7.0, "flag")


@pytest.mark.parametrize("argv,needle", [
    (["--max_sequence_length", "512"], "--max_sequence_length=512: is fixed at 1000"),
    (["--frames", "10"], "--frames=10"),
    (["--height", "40"], "--height=40"),
    (["--megatron_sp"], "--megatron_sp=True: not supported for HunyuanVideo-1.5"),
    (["--vae_tiling"], "--vae_tiling=True: not available for HunyuanVideo-1.5"),
    (["--scheduler", "unipc"], "--scheduler='unipc': HunyuanVideo-1.5 runs euler only"),
    (["--lora", "x.safetensors"], "--lora='x.safetensors': file not found"),
])
def test_bad_flags_are_one_line_errors(hunyuan_checkpoint, argv, needle):
    from engine.run.errors import UsageError

    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", hunyuan_checkpoint, *argv]))
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_unsupported_guider_option_is_refused(hunyuan_checkpoint, tmp_path):
    from engine.run.errors import UsageError

    copy = _with_guider(hunyuan_checkpoint, tmp_path, {
        "_class_name": "ClassifierFreeGuidance", "guidance_scale": 6.0,
        "guidance_rescale": 0.7})
    with pytest.raises(UsageError, match="guidance_rescale"):
        generate_flax.validate_args(generate_flax.parse_args(["--model_id", copy]))


def test_transformer_weights_are_sharded_by_the_rules(hunyuan_checkpoint):
    """Per-device accounting: every Megatron rule matches, and each matched weight's shard
    on every device is 1/tp of it (stacked layer axis whole), not a whole copy."""
    from engine.run.mesh import MeshShape, make_mesh
    from engine.weights import sharding

    cfg = json.load(open(os.path.join(hunyuan_checkpoint, "transformer", "config.json")))
    transformer = hunyuan.empty_transformer(cfg, torch.float32)
    mesh = make_mesh(MeshShape(1, 2, 1), jax.devices()[:2])
    rules = hunyuan.COLUMN_PARALLEL_RULES + hunyuan.ROW_PARALLEL_RULES
    placed = sharding.place_transformer(
        transformer, mesh, rules, checkpoint=os.path.join(hunyuan_checkpoint, "transformer"),
        fsdp=False, scan=True, stack=hunyuan.BLOCKS)
    assert all(n > 0 for n in placed["rule_counts"].values()), placed["rule_counts"]
    layers = cfg["num_layers"]
    checked = 0
    for name, array in placed["params"].items():
        spec = tuple(placed["specs"][name])
        if "tp" not in spec:
            continue
        axis = spec.index("tp")
        assert name.startswith("transformer_blocks.stacked.") and array.shape[0] == layers
        for shard in array.addressable_shards:
            assert shard.data.shape[axis] * 2 == array.shape[axis], name
        checked += 1
    # 2 modulation linears (w+b), q, k, v, add_q/k/v (w+b), to_out, to_add_out,
    # 2 x (MLP up w+b, MLP down).
    assert checked == 4 + 12 + 2 + 6


def test_three_stages_equal_one_shot(hunyuan_checkpoint, ours, tmp_path):
    """--stage encode | denoise | decode through files gives the one-shot frames; the staged
    embeddings carry both encoders' masks."""
    from safetensors import safe_open

    work = str(tmp_path / "work")
    for stage in ("encode", "denoise", "decode"):
        frames, _ = _ours(hunyuan_checkpoint, PLAIN, jax.devices()[:1], "--attention", "xla",
                          "--stage", stage, "--work_dir", work)
    with safe_open(os.path.join(work, "embeddings.safetensors"), "pt") as f:
        names = set(f.keys())
    assert set(hunyuan.EMBEDDING_NAMES) <= names
    np.testing.assert_allclose(frames, ours[PLAIN, "1 device"][0], atol=1e-5)


def test_dry_run_compiles_the_480p_step(tmp_path):
    """The shipped 480p T2V config compiles for a TPU topology with our kernel and the text
    padding as segment ids (one block, deviceless libtpu compile)."""
    import glob
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "generate_flax.py"), "--model_id",
         "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v", "--dry_run",
         "--topology", "v5e:2x2", "--dry_run_layers", "1", "--dry_run_skip_vae",
         "--height", "480", "--width", "848", "--frames", "21", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(open(glob.glob(str(tmp_path / "*_dry_run.json"))[0]).read())
    assert report["tokens"] == 6 * 30 * 53 and report["fits"] is True
    assert report["settings"]["flow_shift"] == 5.0  # the 480p checkpoint's scheduler shift
    assert report["per_chip"][0]["program"] == "transformer step"
