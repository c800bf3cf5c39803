"""LTX-2's two-stage run, ``--sr 2x`` (families/ltx2_upscale.py), against diffusers' own
composition run eagerly in float32 on the CPU: ``LTX2Pipeline`` at half size (output_type
"latent") -> ``LTX2LatentUpsamplePipeline`` -> ``LTX2Pipeline`` at full size with
STAGE_2_DISTILLED_SIGMA_VALUES and ``noise_scale`` their first, one generator through all
three, every guidance term off in both stages (the distilled recipe in stage 1, Lightricks'
unguided stage 2).

Checkpoints: the tiny LTX-2 checkpoint with the distilled scheduler
(tools/make_tiny_ltx2_checkpoint.py --distilled) and a tiny random latent upsampler in its
``latent_upsampler/`` (tools/make_tiny_ltx2_upsampler.py), so the default folder is read.
128 x 128 final (stage 1 at 64 x 64: 2 x 2 latents, upsampled to 4 x 4), 9 frames.
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
from test_ltx2 import _Recorder

import generate_flax
from engine.pipeline import Generation
from families import FAMILIES

PROMPT, SEED = "A cat walks on the grass", 42
FINAL = dict(height=128, width=128, frames=9)
# Measured on this host (with ``_with_statistics``): final packed latents 7.2e-7 of values up
# to 3.6; frames 1.7e-6; waveform 1.0e-7 of a peak 0.25. The bound is test_ltx2.py's ATOL.
ATOL = 2e-5
# Sharded (8 CPU devices, the default layout) against one device: measured 4.8e-7; the
# bound is the other sharded comparisons' on final latents (docs/testing.md).
SHARDED_ATOL = 1e-4


def _with_statistics(path: str) -> None:
    """Give the checkpoint's video and audio VAEs non-trivial latent statistics (mean
    0.5 N(0, 1), std in [0.5, 1.5], seeded) and the video VAE a scaling factor of 0.8: the
    tiny builder leaves them 0, 1 and 1, which would make every (de-)normalisation of the
    hand-off the identity."""
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    for sub in ("vae", "audio_vae"):
        file = os.path.join(path, sub, "diffusion_pytorch_model.safetensors")
        tensors = load_file(file)
        n = tensors["latents_mean"].shape
        tensors["latents_mean"] = 0.5 * torch.randn(n, generator=generator)
        tensors["latents_std"] = 0.5 + torch.rand(n, generator=generator)
        save_file(tensors, file, metadata={"format": "pt"})
    config_file = os.path.join(path, "vae", "config.json")
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump({**config, "scaling_factor": 0.8}, f)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The distilled tiny LTX-2 checkpoint (with ``_with_statistics``) and a tiny upsampler
    in its ``latent_upsampler/``."""
    path = _build(tmp_path_factory, "make_tiny_ltx2_checkpoint.py", "tiny-ltx2-two-stage",
                  "--distilled")
    _with_statistics(path)
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_ltx2_upsampler.py"),
                    "--output", os.path.join(path, "latent_upsampler")], check=True,
                   capture_output=True, text=True)
    return path


def _argv(checkpoint, *extra):
    return ["--model_id", checkpoint, "--prompt", PROMPT, "--dtype", "float32",
            "--seeds", f"7,{SEED}", "--warmup_steps", "0", "--height", str(FINAL["height"]),
            "--width", str(FINAL["width"]), "--frames", str(FINAL["frames"]),
            "--compilation_cache_dir", "none", "--executable_cache_dir", "none",
            "--attention", "xla", "--sr", "2x", *extra]


def _ours(checkpoint, devices):
    """Our run of two videos, seeds 7 then SEED (the second takes the per-video path: its
    own noise and hand-off inputs on the compiled programs): (config, the last video's
    frames (F, H, W, 3), waveform and packed final latents (1, size))."""
    config = generate_flax.validate_args(generate_flax.parse_args(_argv(checkpoint)))
    run = Generation(config, FAMILIES[config.model.family], devices)
    run.load()
    run.encode()
    run.compile()
    recorder = _Recorder(run.programs.vae_decode.decoder)
    run.programs.vae_decode.decoder = recorder
    frames = run.time_videos()
    return (config, np.asarray(frames), run.programs.vae_decode.audio.waveform,
            recorder.latents)


def _theirs(checkpoint):
    """diffusers' three-pipeline composition (module docstring), eager float32: (frames,
    waveform, stage 2's final packed latents (1, size) as ours are packed: video tokens, then
    audio tokens), the latents taken at the last step by ``callback_on_step_end`` (the audio
    latents added to the instance's callback inputs)."""
    from diffusers import LTX2Pipeline
    from diffusers.pipelines.ltx2 import LTX2LatentUpsamplePipeline
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel
    from diffusers.pipelines.ltx2.utils import (
        DISTILLED_SIGMA_VALUES,
        STAGE_2_DISTILLED_SIGMA_VALUES,
    )
    from test_ltx2 import OFF

    pipe = LTX2Pipeline.from_pretrained(checkpoint, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe._callback_tensor_inputs = [*pipe._callback_tensor_inputs, "audio_latents"]
    last = {}

    def keep(_pipe, _i, _t, tensors):
        last.update(tensors)
        return {}

    upsampler = LTX2LatentUpsamplerModel.from_pretrained(
        os.path.join(checkpoint, "latent_upsampler"), dtype=torch.float32)
    upsample = LTX2LatentUpsamplePipeline(vae=pipe.vae, latent_upsampler=upsampler)
    generator = torch.Generator("cpu").manual_seed(SEED)
    common = dict(prompt=PROMPT, num_frames=FINAL["frames"], frame_rate=24.0,
                  generator=generator, return_dict=False, **OFF)
    s2 = STAGE_2_DISTILLED_SIGMA_VALUES
    with torch.no_grad():
        video, audio = pipe(height=FINAL["height"] // 2, width=FINAL["width"] // 2,
                            sigmas=DISTILLED_SIGMA_VALUES, num_inference_steps=8,
                            output_type="latent", **common)
        video = upsample(latents=video, output_type="latent", return_dict=False)[0]
        frames, wave = pipe(height=FINAL["height"], width=FINAL["width"], latents=video,
                            audio_latents=audio, sigmas=s2, num_inference_steps=len(s2),
                            noise_scale=s2[0], output_type="np", callback_on_step_end=keep,
                            callback_on_step_end_tensor_inputs=["latents", "audio_latents"],
                            **common)
    latents = torch.cat([last["latents"].reshape(1, -1), last["audio_latents"].reshape(1, -1)],
                        dim=1)
    return frames[0], wave[0].float().numpy(), latents.numpy()


def test_two_stage_run_equals_diffusers_composition(checkpoint):
    """--sr 2x at 128 x 128 x 9: stage 1 runs at 64 x 64 (8 distilled steps), stage 2 three
    steps at 128 x 128; the second video's final latents, frames and waveform equal
    diffusers' composition within ATOL."""
    config, frames, wave, latents = _ours(checkpoint, jax.devices()[:1])
    assert (config.video.height, config.video.width) == (64, 64)
    assert (config.upscale.height, config.upscale.width, config.upscale.steps) == (128, 128, 3)
    assert config.upscale.model_dir == os.path.join(checkpoint, "latent_upsampler")
    want_frames, want_wave, want_latents = _theirs(checkpoint)
    # 2 x 4 x 4 video tokens x 8 channels, then 9 audio tokens x 32
    assert latents.shape == want_latents.shape == (1, 32 * 8 + 9 * 32)
    np.testing.assert_allclose(latents, want_latents, atol=ATOL)
    assert frames.shape == want_frames.shape == (9, 128, 128, 3)
    np.testing.assert_allclose(frames, want_frames, atol=ATOL)
    np.testing.assert_allclose(wave, want_wave, atol=ATOL)
    assert np.abs(want_latents).max() > 1.0  # the comparison is not of zeros


@pytest.mark.slow
def test_sharded_two_stage_equals_one_device(checkpoint):
    """8 CPU devices in the default layout (both stages, the hand-off on the stage's mesh)
    against one device: final latents within SHARDED_ATOL (~100 s: slow tier)."""
    one = _ours(checkpoint, jax.devices()[:1])[3]
    eight = _ours(checkpoint, jax.devices()[:8])[3]
    assert len(jax.devices()) >= 8
    np.testing.assert_allclose(eight, one, atol=SHARDED_ATOL)


@pytest.mark.slow
def test_dry_run_estimate_compiles_both_stages_and_the_final_decode(checkpoint, tmp_path):
    """--dry_run --estimate --sr 2x (v5e:2x2, one block): stage 1's step at 64 x 64, stage
    2's on its own mesh (3 steps, batch 1) and the decode at 128 x 128, both stages estimated
    (~6 min wall on the loaded 2-core host, 1.5 min of CPU: slow tier)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id", checkpoint,
         "--dry_run", "--estimate", "--topology", "v5e:2x2", "--dry_run_layers", "1",
         "--height", "128", "--width", "128", "--frames", "9", "--sr", "2x",
         "--output_dir", str(tmp_path), "--no_plots"],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    with open(path) as f:
        report = json.load(f)
    assert (report["settings"]["height"], report["settings"]["width"]) == (64, 64)
    up = report["upscale"]
    assert (up["height"], up["width"], up["steps"], up["version"]) == (128, 128, 3, "2x")
    assert up["estimate"]["seconds_per_step"] > 0 and up["denoise_s"]["sr_stage"] > 0
    rows = {row["program"]: row for row in report["per_chip"]}
    assert "transformer step (SR)" in rows
    decode = next(row for name, row in rows.items() if name.startswith("VAE decode"))
    assert decode["output_bytes"] >= 3 * 9 * 128 * 128 * 4  # the final size's frames


def _bad_upsampler(tmp_path, **changes):
    """A copy of a valid upsampler config with ``changes``, in a folder of its own."""
    folder = tmp_path / "up"
    folder.mkdir()
    cfg = dict(_class_name="LTX2LatentUpsamplerModel", in_channels=8, mid_channels=32,
               num_blocks_per_stage=1, dims=3, spatial_upsample=True, temporal_upsample=False,
               rational_spatial_scale=2.0)
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(b"")
    return str(folder)


BAD = [
    (["--height", "96"], "--height=96", "must be a multiple of 64 with --sr 2x"),
    (["--width", "160"], "--width=160", "must be a multiple of 64 with --sr 2x"),
    (["--sr_steps", "4"], "--sr_steps=4", "not with --sr 2x for LTX-2"),
    (["--sr_flow_shift", "3"], "--sr_flow_shift=3.0", "not with --sr 2x for LTX-2"),
    (["--stage", "denoise"], "--stage='denoise'", "staged runs are not supported"),
    ("missing", "--sr_model_dir=", "no readable latent upsampler config.json"),
    ("class", "--sr_model_dir=", "expected LTX2LatentUpsamplerModel"),
    ("channels", "--sr_model_dir=", "in_channels=16, expected the video VAE's 8"),
    ("temporal", "--sr_model_dir=", "not a 2x spatial upsampler"),
    ("dev", "--sr='2x'", "is not the distilled checkpoint"),
]


@pytest.mark.parametrize("flags,flag,rule", BAD, ids=[str(b[0]) for b in BAD])
def test_bad_combinations_are_one_line_before_loading(checkpoint, ltx2_checkpoint, tmp_path,
                                                      capsys, monkeypatch, flags, flag, rule):
    """One line on stderr naming the flag and the rule, exit 2, nothing written, and no model
    loaded (loading raises here)."""
    import diffusers

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.LTX2Pipeline, "from_pretrained", no_load)
    model = checkpoint
    if flags == "missing":
        flags = ["--sr_model_dir", str(tmp_path / "none")]
    elif flags == "class":
        flags = ["--sr_model_dir", _bad_upsampler(tmp_path, _class_name="LTXLatentUpsampler")]
    elif flags == "channels":
        flags = ["--sr_model_dir", _bad_upsampler(tmp_path, in_channels=16)]
    elif flags == "temporal":
        flags = ["--sr_model_dir", _bad_upsampler(tmp_path, temporal_upsample=True)]
    elif flags == "dev":  # the dev (dynamic-shift) tiny checkpoint
        model, flags = ltx2_checkpoint, []
    out = tmp_path / "out"
    argv = _argv(model, "--output_dir", str(out), *flags)
    code = generate_flax.cli(argv)
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert flag in lines[0] and rule in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_other_families_refuse_2x(tiny_checkpoint, capsys):
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--sr", "2x"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line
    assert "--sr=2x: not supported for Wan" in line, line
