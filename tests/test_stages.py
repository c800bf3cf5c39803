"""--stage encode | denoise | decode: same frames as one shot, reuse, and clear refusals."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

import generate_flax as gf
from engine.files import staging
from engine.pipeline import generate
from families import FAMILIES, wan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "3",
         "--num_iterations", "1", "--warmup_steps", "0", "--dtype", "float32", "--attention", "xla",
         "--compilation_cache_dir", "none"]


def _run(checkpoint, stage, work_dir, seed=42, extra=()):
    args = gf.validate_args(gf.parse_args(["--model_id", checkpoint, *FLAGS, "--stage", stage,
                                           "--work_dir", str(work_dir), "--seed", str(seed),
                                           *extra]))
    # One device keeps these runs short; the mesh tests cover sharding.
    return generate(args, FAMILIES[args.model.family], devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def no_text_encoder(tiny_checkpoint, tmp_path_factory):
    """The checkpoint without text-encoder weights: denoise and decode must not need them."""
    path = tmp_path_factory.mktemp("stages") / "no-te"
    shutil.copytree(tiny_checkpoint, path)
    os.remove(path / "text_encoder" / "model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def staged(tiny_checkpoint, no_text_encoder, tmp_path_factory):
    """encode once, then denoise + decode for two seeds reusing the same embeddings."""
    work = tmp_path_factory.mktemp("work")
    frames_none, report = _run(tiny_checkpoint, "encode", work)
    assert frames_none is None and "text_encode_s" in report["timings"]
    out = {}
    for seed in (5, 6):
        frames_none, report = _run(no_text_encoder, "denoise", work, seed)
        assert frames_none is None and report["timings"]["runs"][0]["s_per_step"] > 0
        assert "compile_transformer_s" in report["timings"]
        out[seed] = _run(no_text_encoder, "decode", work)
    return work, out


def test_three_stages_equal_one_shot_and_seeds_reuse_embeddings(tiny_checkpoint, staged):
    work, out = staged
    for seed, (frames, report) in out.items():
        one_shot, _ = _run(tiny_checkpoint, "all", work, seed)
        # float32, same compiled programs on both paths; only I/O in between.
        np.testing.assert_allclose(frames, one_shot, atol=1e-5, rtol=0)
        assert report["settings"]["seed"] == seed  # decode reports the latents' own settings
        assert report["timings"]["runs"][0]["vae_decode_s"] > 0
    assert np.abs(out[5][0] - out[6][0]).max() > 0.05  # two seeds, two videos
    gen = json.loads((work / "generation_config.json").read_text())
    assert gen["max_sequence_length"] == 512 and gen["prompt"] == wan.DEFAULTS["prompt"]


def test_bf16_embeddings_round_trip_exactly(tmp_path):
    x = torch.randn(1, 7, 5).to(torch.bfloat16)
    staging.save_tensors(dict(prompt_embeds=x, negative_prompt_embeds=x), str(tmp_path / "e.st"),
                    {"max_sequence_length": 7})
    t, meta = staging.load_tensors(str(tmp_path / "e.st"), ["prompt_embeds"], "encode")
    assert t["prompt_embeds"].dtype == torch.bfloat16 and torch.equal(t["prompt_embeds"], x)
    assert meta == {"max_sequence_length": 7}


def _cli(args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    return subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"), *args],
                          capture_output=True, text=True, timeout=120, env=env)


def _decode_error(checkpoint, work, tmp_path):
    proc = _cli(["--model_id", checkpoint, "--stage", "decode", "--work_dir", str(work),
                 "--output_dir", str(tmp_path / "out")])
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
    return lines[0]


def test_truncated_latents_fail_with_one_line(tiny_checkpoint, staged, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(staged[0], work)
    data = (work / "latents.safetensors").read_bytes()
    (work / "latents.safetensors").write_bytes(data[: len(data) // 2])
    line = _decode_error(tiny_checkpoint, work, tmp_path)
    assert "latents.safetensors" in line and "truncated" in line


def test_shape_mismatched_latents_fail_with_one_line(tiny_checkpoint, staged, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    work = tmp_path / "w"
    shutil.copytree(staged[0], work)
    path = str(work / "latents.safetensors")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata()
    save_file({"latents": torch.zeros(1, 16, 3, 8, 10)}, path, metadata=meta)
    line = _decode_error(tiny_checkpoint, work, tmp_path)
    assert "latents.safetensors" in line and "expected latents of shape (1, 16, 3, 8, 12)" in line


def test_latents_from_another_vae_are_refused(tiny_checkpoint, staged, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    cfg_path = other / "vae" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["latents_std"] = [s * 2 for s in cfg["latents_std"]]
    cfg_path.write_text(json.dumps(cfg))
    line = _decode_error(str(other), staged[0], tmp_path)
    assert "different VAE config" in line


def test_denoise_without_embeddings_says_which_stage_to_run(tiny_checkpoint, tmp_path):
    proc = _cli(["--model_id", tiny_checkpoint, "--stage", "denoise", "--work_dir",
                 str(tmp_path / "empty")])
    assert proc.returncode == 2
    assert "embeddings.safetensors: not found; run --stage encode" in proc.stderr
