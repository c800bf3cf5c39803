"""LTX-2's recipes (families/ltx2.py): the distilled checkpoint's defaults, ``--sigmas``, and
the STG pass that LTX-2.0's config makes the plain pass, each against diffusers' own eager
``LTX2Pipeline`` on CPU in float32 on the tiny random checkpoint
(tools/make_tiny_ltx2_checkpoint.py; ``--distilled`` writes the distilled checkpoint's
scheduler config): 64 x 64 pixels, 9 frames, test_ltx2.py's prompts, seed and bound ATOL.

Passes are counted with a forward pre-hook on the first transformer block, which both sides
call once per transformer pass: diffusers per eager step, ours while the step program is
traced (every pass of the compiled step is one traced call).
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
from test_ltx2 import ATOL, NEGATIVE, OFF, PROMPT, SEED, SHAPE, _Recorder, _unpacked

import generate_flax
from engine.pipeline import Generation
from families import FAMILIES, ltx2

DISTILLED = [1.0, 0.99375, 0.9875, 0.98125, 0.975, 0.909375, 0.725, 0.421875]  # utils.py:27
SIGMAS = [0.9, 0.5, 0.2]


@pytest.fixture(scope="module")
def distilled_checkpoint(tmp_path_factory):
    """The tiny LTX-2 checkpoint with the distilled checkpoint's scheduler config."""
    return _build(tmp_path_factory, "make_tiny_ltx2_checkpoint.py", "tiny-ltx2-distilled",
                  "--distilled")


def _argv(checkpoint, *extra):
    """Our command line at the checkpoint's own defaults but for the size, seed, prompts and
    dtype (no --num_inference_steps: the recipe or --sigmas sets it)."""
    return ["--model_id", checkpoint, "--prompt", PROMPT, "--negative_prompt", NEGATIVE,
            "--dtype", "float32", "--seed", str(SEED), "--warmup_steps", "0",
            "--height", str(SHAPE["height"]), "--width", str(SHAPE["width"]),
            "--frames", str(SHAPE["frames"]), "--compilation_cache_dir", "none",
            "--executable_cache_dir", "none", "--attention", "xla", *extra]


def _count_passes(transformer, batches: list):
    """Record the batch of every call of ``transformer``'s first block into ``batches``."""
    def hook(_module, args, kwargs):
        batches.append((kwargs.get("hidden_states", args[0] if args else None)).shape[0])

    return transformer.transformer_blocks[0].register_forward_pre_hook(hook, with_kwargs=True)


def _ours(argv):
    """Our run on one device: (config, frames, waveform, report, (video latents, audio
    latents), [batch of each traced transformer pass])."""
    config = generate_flax.validate_args(generate_flax.parse_args(argv))
    batches: list = []
    run = Generation(config, FAMILIES[config.model.family], jax.devices()[:1])
    run.load()
    run.encode()
    handle = _count_passes(run.pipe.transformer, batches)
    run.compile()
    handle.remove()
    recorder = _Recorder(run.programs.vae_decode.decoder)
    run.programs.vae_decode.decoder = recorder
    frames = run.time_videos()
    return (config, frames, run.programs.vae_decode.audio.waveform, run.finish(),
            _unpacked(recorder.latents), batches)


def _theirs(checkpoint, **kwargs):
    """diffusers' LTX2Pipeline, eager float32: (frames, waveform, video latents, audio
    latents, [batch of each transformer pass])."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(checkpoint, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for vae in (pipe.vae, pipe.audio_vae):  # de-normalised latents = the packed ones
        assert not vae.latents_mean.any() and (vae.latents_std == 1).all()
    runs, batches = [], []
    handle = _count_passes(pipe.transformer, batches)
    for output_type in ("np", "latent"):
        with torch.no_grad():
            runs.append(pipe(prompt=PROMPT, negative_prompt=NEGATIVE,
                             num_frames=SHAPE["frames"], height=SHAPE["height"],
                             width=SHAPE["width"], frame_rate=24.0, output_type=output_type,
                             return_dict=False,
                             generator=torch.Generator("cpu").manual_seed(SEED), **kwargs))
    handle.remove()
    (video, audio), (video_latents, audio_latents) = runs
    return (video[0], audio[0].float().numpy(), video_latents.numpy(), audio_latents.numpy(),
            batches[:len(batches) // 2])


def _assert_same(ours, theirs):
    _, frames, wave, _, (video_latents, audio_latents), _ = ours
    want_frames, want_wave, want_video, want_audio, _ = theirs
    np.testing.assert_allclose(video_latents, want_video, atol=ATOL)
    np.testing.assert_allclose(audio_latents, want_audio, atol=ATOL)
    assert frames.shape == want_frames.shape == (SHAPE["frames"], SHAPE["height"],
                                                 SHAPE["width"], 3)
    np.testing.assert_allclose(frames, want_frames, atol=ATOL)
    np.testing.assert_allclose(wave, want_wave, atol=ATOL)


def test_distilled_checkpoint_runs_the_distilled_recipe(distilled_checkpoint):
    """Our defaults on the distilled scheduler = LTX2Pipeline(sigmas=DISTILLED_SIGMA_VALUES,
    every guidance term off): 8 steps, one batch-1 pass a step, frames, waveform and both
    latents within ATOL; the report and log name the recipe and its source."""
    ours = _ours(_argv(distilled_checkpoint))
    config, report = ours[0], ours[3]
    assert config.video.num_inference_steps == 8 and list(config.video.sigmas) == DISTILLED
    assert ltx2.sample_passes(config) == 1 and set(ours[5]) == {1}
    theirs = _theirs(distilled_checkpoint, sigmas=DISTILLED, num_inference_steps=8, **OFF)
    assert theirs[4] == [1] * 8  # diffusers: one pass a step too
    _assert_same(ours, theirs)
    recipe = report["settings"]["recipe"]
    assert recipe["name"] == "distilled" and recipe["source"] == (
        "distilled: scheduler_config.json has use_dynamic_shifting=false, shift_terminal=null")
    assert report["settings"]["default_sources"]["stg_scale"] == recipe["source"]
    assert "LTX-2 recipe: distilled" in ltx2.recipe_line(config)


def test_given_sigmas_are_shifted_as_the_pipeline_shifts_them(ltx2_checkpoint):
    """--sigmas 0.9,0.5,0.2 (3 steps, guidance off) on the normal tiny checkpoint =
    LTX2Pipeline(sigmas=[0.9, 0.5, 0.2]); its dynamic shift and terminal stretch move them
    (the table is not the given list), and our table equals diffusers' scheduler's."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx2.pipeline_ltx2 import retrieve_timesteps

    flags = [f"--{k}={v}" for k, v in OFF.items()]
    ours = _ours(_argv(ltx2_checkpoint, "--sigmas", ",".join(map(str, SIGMAS)), *flags))
    config, report = ours[0], ours[3]
    assert config.video.num_inference_steps == 3
    assert report["settings"]["recipe"]["source"] == "flag"
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(ltx2_checkpoint,
                                                            subfolder="scheduler")
    retrieve_timesteps(sched, 3, "cpu", sigmas=SIGMAS, mu=ltx2.shift_mu(sched.config, 8))
    table = ltx2.sigma_table(config)[0]
    np.testing.assert_allclose(table[1].numpy(), sched.sigmas[:-1].numpy(), rtol=1e-6)
    np.testing.assert_allclose(table[0].numpy(), sched.timesteps.numpy(), rtol=1e-6)
    assert np.abs(table[1].numpy() - SIGMAS).max() > 1e-2  # the shift did something
    _assert_same(ours, _theirs(ltx2_checkpoint, sigmas=SIGMAS, num_inference_steps=3, **OFF))


def test_stg_pass_is_skipped_where_it_equals_the_plain_pass(ltx2_checkpoint):
    """LTX-2.0's perturbed_attn is false: at the pipeline's defaults diffusers runs CFG (batch
    2), STG and modality (batch 1 each) per step; we run the CFG pair and the modality pass
    only, and the frames, waveform and latents still equal diffusers' within ATOL."""
    assert not ltx2.stg_perturbs(ltx2.configs(ltx2_checkpoint)[0])
    steps = ["--num_inference_steps", "2"]
    ours = _ours(_argv(ltx2_checkpoint, *steps))
    config = ours[0]
    assert ltx2.scales(config)["stg_scale"] == 1.0 and not ltx2.passes(config)["stg"]
    assert ltx2.sample_passes(config) == 3
    traced = ours[5]
    assert traced and len(traced) % 2 == 0 and traced == [2, 1] * (len(traced) // 2)
    theirs = _theirs(ltx2_checkpoint, num_inference_steps=2)
    assert theirs[4] == [2, 1, 1] * 2  # diffusers: 4 samples a step, ours 3
    _assert_same(ours, theirs)
    assert "STG pass skipped" in ltx2.recipe_line(config)


def test_stg_blocks_follow_the_version_in_the_config():
    """Lightricks' recipe: block 29 for LTX-2.0, 28 for LTX-2.3 (read from the config's 2.3
    fields, not the name); 2.3's perturbed_attn true runs the pass."""
    real = ltx2.configs("Lightricks/LTX-2")[0]
    later = dict(real, gated_attn=True, cross_attn_mod=True, perturbed_attn=True)
    assert ltx2.stg_blocks(real) == (29,) and ltx2.stg_blocks(later) == (28,)
    assert not ltx2.stg_perturbs(real) and ltx2.stg_perturbs(later)


def test_recipe_defaults_and_flags(distilled_checkpoint):
    """The distilled recipe comes from the files (the shipped distilled config too); a flag
    the user gives wins; a step count other than the recipe's drops its sigmas."""
    def config(*argv, model=distilled_checkpoint):
        return generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", model, *argv]))

    shipped = config("--dry_run", "--topology", "v6e:2x4",
                     model="rootonchair/LTX-2-19b-distilled")
    assert shipped.video.num_inference_steps == 8 and ltx2.sample_passes(shipped) == 1
    assert config("--guidance_scale", "3").video.guidance_scale == 3.0
    four = config("--num_inference_steps", "4")
    assert four.video.num_inference_steps == 4 and four.video.sigmas is None
    assert "sigmas" not in four.video.default_sources
    named = config("--sigmas", "distilled", "--num_inference_steps", "8")
    assert list(named.video.sigmas) == DISTILLED
    base = config("--dry_run", "--topology", "v6e:2x4", model="Lightricks/LTX-2")
    assert base.video.num_inference_steps == 30 and base.video.sigmas is None
    assert base.video.recipe["name"] == "pipeline defaults"


BAD = [
    (["--sigmas", "0.9,abc"], "--sigmas='0.9,abc'", "comma-separated floats"),
    (["--sigmas", ""], "--sigmas=''", "comma-separated floats"),
    (["--sigmas", "0.5,0.9"], "--sigmas='0.5,0.9'", "strictly decreasing"),
    (["--sigmas", "1.5,0.5"], "--sigmas='1.5,0.5'", "in (0, 1]"),
    (["--sigmas", "0.9,0"], "--sigmas='0.9,0'", "in (0, 1]"),
    (["--sigmas", "nan"], "--sigmas='nan'", "in (0, 1]"),
    (["--sigmas", "0.9,0.5", "--num_inference_steps", "3"], "--num_inference_steps=3",
     "conflicts with --sigmas' 2 values"),
]


@pytest.mark.parametrize("flags,flag,rule", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_sigmas_are_one_line_before_loading(ltx2_checkpoint, tmp_path, capsys,
                                                monkeypatch, flags, flag, rule):
    """One line on stderr naming the flag, the value and the rule, exit 2, nothing written,
    and no model loaded (loading raises here)."""
    import diffusers

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(diffusers.LTX2Pipeline, "from_pretrained", no_load)
    out = tmp_path / "out"
    code = generate_flax.cli(["--model_id", ltx2_checkpoint, "--output_dir", str(out), *flags])
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in stderr, stderr
    assert flag in lines[0] and rule in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_other_families_refuse_sigmas(tiny_checkpoint, capsys):
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--sigmas", "0.9,0.5"])
    line = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in line
    assert "--sigmas='0.9,0.5': Wan's pipeline takes no sigmas" in line


def test_dry_run_estimate_takes_the_recipe(distilled_checkpoint, tmp_path):
    """--dry_run --estimate on the distilled tiny checkpoint (v5e:2x2, one block compiled,
    as tests/test_ltx2_dry_run.py): 8 steps of the distilled sigmas (the sigma table the
    step takes has 8 columns), and one batch-1 pass per step, as ``sample_passes`` says."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id",
         distilled_checkpoint, "--dry_run", "--estimate", "--topology", "v5e:2x2",
         "--dry_run_layers", "1", "--dry_run_skip_vae", "--height", str(SHAPE["height"]),
         "--width", str(SHAPE["width"]), "--frames", str(SHAPE["frames"]),
         "--output_dir", str(tmp_path), "--no_plots"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    report = json.loads(open(path).read())
    settings = report["settings"]
    assert settings["num_inference_steps"] == 8 and settings["sigmas"] == DISTILLED
    assert settings["recipe"]["name"] == "distilled"
    est = report["estimate"]
    assert [(p["batch"], p["count"]) for p in est["passes"]] == [(1, 1)]
    assert est["samples_per_step"] == 1
