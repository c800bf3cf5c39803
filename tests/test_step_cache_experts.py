"""Step caching for two-expert models (Wan 2.2 A14B) and image-to-video
(engine/programs/step_cache.py, engine/programs/transformer_step.py).

References, none sharing code with the JAX path:
- MagCache, two experts: diffusers' own ``MagCacheConfig`` hook attached to ``transformer``
  and to ``transformer_2`` separately, each configured with the steps it runs and its own
  ratios, on diffusers' eager ``WanPipeline`` (the semantics of issue 34: each expert is its
  own MagCache).
- DeepCache, two experts: an eager torch reference written here with diffusers'
  ``ModelHook`` on both experts' blocks: the seed's rule over the global step index, and the
  first step of each expert full (the recorded input is reset at the switch).
- Image-to-video: diffusers' hook on its eager ``WanImageToVideoPipeline`` (Wan 2.1 I2V with
  CLIP, and TI2V-5B with its first frame at t = 0). The image conditioning is part of the
  step's input (the condition channels through the patch embedding, the CLIP tokens through
  each block's image cross-attention); a cached MagCache step embeds the current input afresh
  and adds the residual its expert recorded, so the image enters it only through that
  embedding and the residual: equal frames to the hook show that this is what it reuses.
"""

import json

import jax
import numpy as np
import pytest
import torch
from parity import assert_frames_close, latents_of

import generate_flax
from engine.pipeline import generate
from engine.programs import mag_ratios, step_cache_settings
from engine.run.errors import UsageError
from families import FAMILIES, wan

SHAPE = dict(height=48, width=64, frames=5)
STEPS, SHIFT, SEED = 10, 5.0, 11
# UniPC's 10 timesteps at flow_shift 5.0 start [999, 978, 952, 921, 882, ...]: with
# boundary_ratio 0.9 (t >= 900) steps 0-3 run transformer and steps 4-9 transformer_2.
BOUNDARY, SPLIT = 0.9, (4, 6)
# Per-expert ratios that make diffusers' defaults (0.06, 3 skips, retention 0.2) skip in both:
# transformer (4 steps, retention 1): full 0, 2; cached 1, 3.
# transformer_2 (6 steps, retention 1): full 4, 8; cached 5, 6, 7, 9.
RATIOS = [[1.0, 1.0, 0.9, 1.0], [1.0, 0.99, 1.01, 1.0, 0.98, 1.0]]
MAG_CACHED = [1, 3, 5, 6, 7, 9]
# DeepCache 1 / 9 / 4 over 10 steps: full 0, 1, 5, 9 by the seed's rule, and step 4 full as
# transformer_2's first step.
DEEPCACHE = ("--cache", "deepcache", "--cache_start_step", "1", "--cache_end_step", "9",
             "--cache_step_interval", "4")
DEEP_CACHED = [2, 3, 6, 7, 8]
SCALES = (5.0, 2.0)
# The two-expert parity tests compare final latents (tests/parity.py says why): ours and
# diffusers' agree to 4e-6 on latents up to 3.7 (measured: MagCache 3.9e-6, on dp2 x tp2 x sp2
# 4.3e-6, DeepCache 3.5e-6); skipping moves them from the uncached run by 0.043 (MagCache) and
# 0.12 (DeepCache), so FAR, 100 times ATOL, still sees a cache that skipped nothing.
ATOL, FAR = 1e-4, 1e-2


@pytest.fixture(scope="module")
def experts_checkpoint(tmp_path_factory):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-cache",
                  "--experts", "2", "--boundary_ratio", str(BOUNDARY))


def _args(checkpoint, *extra, steps=STEPS, shape=SHAPE):
    return generate_flax.parse_args([
        "--model_id", checkpoint, "--dtype", "float32", "--seed", str(SEED),
        "--flow_shift", str(SHIFT), "--num_inference_steps", str(steps),
        "--num_iterations", "1", "--warmup_steps", "0", "--height", str(shape["height"]),
        "--width", str(shape["width"]), "--frames", str(shape["frames"]),
        "--attention", "xla", "--compilation_cache_dir", "none", *extra])


def _ours(checkpoint, *extra, devices=None, steps=STEPS, shape=SHAPE):
    config = generate_flax.validate_args(_args(checkpoint, *extra, steps=steps, shape=shape))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def _ours_latents(checkpoint, *extra, devices=None):
    """Our run's (final latents (1, 16, 2, 6, 8) float32, report): the two-expert parity
    tests compare latents, which the tiny VAE's sign step cannot flip (tests/parity.py)."""
    return latents_of(_ours, checkpoint, *extra, devices=devices)


def _two_expert_pipe(checkpoint):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe):
    """diffusers' two-expert run: its final latents (``output_type="latent"``), float32."""
    with torch.no_grad():
        return pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                    num_inference_steps=STEPS, guidance_scale=SCALES[0],
                    guidance_scale_2=SCALES[1], generator=torch.Generator("cpu").manual_seed(SEED),
                    output_type="latent", num_frames=SHAPE["frames"], height=SHAPE["height"],
                    width=SHAPE["width"]).frames.float().numpy()


def _block_runs(transformer) -> list:
    """Counts the real runs of a transformer's first block (a skipped block never reaches
    its FFN)."""
    calls = [0]
    transformer.blocks[0].ffn.register_forward_hook(
        lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def _scale_flags():
    return ("--guidance_scale", str(SCALES[0]), "--guidance_scale_2", str(SCALES[1]))


# ---------------------------------------------------------------------------------------------
# Host: schedules, ratio forms, shipped ratios
# ---------------------------------------------------------------------------------------------


def test_expert_schedule_replays_two_diffusers_hooks(tiny_checkpoint):
    """Our per-expert replay against two diffusers MagCache hooks, one per expert model, each
    with its own step count and ratios, the experts called in the two-expert order; random
    splits, ratios and settings: the same skipped steps."""
    from diffusers import WanTransformer3DModel
    from diffusers.hooks import MagCacheConfig

    rng = np.random.default_rng(1)
    models = [WanTransformer3DModel.from_pretrained(tiny_checkpoint, subfolder="transformer")
              for _ in range(2)]
    x = torch.zeros(1, 16, 1, 4, 4)
    text = torch.zeros(1, 4, models[0].config.text_dim)
    calls = [_block_runs(m) for m in models]
    for trial in range(4):
        split = (int(rng.integers(1, 12)), int(rng.integers(1, 20)))
        ratios = [(1 + rng.normal(0, 0.03, int(rng.integers(3, 30)))).tolist() for _ in split]
        kw = dict(threshold=float(rng.choice([0.02, 0.06, 0.2])),
                  max_skip_steps=int(rng.integers(1, 4)),
                  retention_ratio=float(rng.choice([0.0, 0.2, 0.5])))
        theirs = []
        for model, n, r, count in zip(models, split, ratios, calls, strict=True):
            model.enable_cache(MagCacheConfig(num_inference_steps=n, mag_ratios=r, **kw))
            with torch.no_grad(), model.cache_context("cond"):
                for _ in range(n):
                    before = count[0]
                    model(hidden_states=x, timestep=torch.tensor([500]),
                          encoder_hidden_states=text)
                    theirs.append(count[0] == before)
            model.disable_cache()
        settings = step_cache_settings.CacheSettings(
            "magcache", mag_ratios=mag_ratios.interpolated(ratios, sum(split), split),
            expert_steps=split, **kw)
        assert list(settings.schedule(sum(split))) == theirs, (trial, split, kw)


def test_mag_ratios_forms(experts_checkpoint, tiny_checkpoint, tmp_path):
    """One list for one expert; for two: a list per expert, or one list over all steps split
    at the switch; a JSON file holding either, or a --cache_calibrate report."""

    def resolve(checkpoint, value):
        config = generate_flax.validate_args(_args(checkpoint, "--cache", "magcache",
                                                   "--mag_ratios", value))
        return config.step_cache

    per_expert = resolve(experts_checkpoint, json.dumps(RATIOS))
    assert per_expert.expert_steps == SPLIT
    assert per_expert.mag_ratios == (tuple(RATIOS[0]), tuple(RATIOS[1]))
    assert [i for i, c in enumerate(per_expert.schedule(STEPS)) if c] == MAG_CACHED
    # One list over all 10 steps: split at the switch into the same two lists.
    flat = resolve(experts_checkpoint, json.dumps(RATIOS[0] + RATIOS[1]))
    assert flat.mag_ratios == per_expert.mag_ratios
    # One list over 20 steps: interpolated to 10 first (every other value), then split.
    twice = [r for r in RATIOS[0] + RATIOS[1] for _ in range(2)]
    assert resolve(experts_checkpoint, json.dumps(twice)).mag_ratios == per_expert.mag_ratios
    # A list per expert of another length: each interpolated to its own step count.
    longer = resolve(experts_checkpoint, json.dumps([[1.0, 0.9], [1.0, 0.98, 0.97]]))
    assert longer.mag_ratios == ((1.0, 1.0, 0.9, 0.9), (1.0, 1.0, 0.98, 0.98, 0.97, 0.97))
    # Files: a bare list, and a report --cache_calibrate wrote.
    bare = tmp_path / "ratios.json"
    bare.write_text(json.dumps(RATIOS))
    assert resolve(experts_checkpoint, str(bare)).mag_ratios == per_expert.mag_ratios
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"cache": {"calibration": {"mag_ratios": RATIOS,
                                                            "mag_ratios_uncond": RATIOS}}}))
    from_report = resolve(experts_checkpoint, str(report))
    assert from_report.mag_ratios == per_expert.mag_ratios
    assert from_report.mag_ratios_source == str(report)
    with pytest.raises(UsageError, match=r"--mag_ratios=.*one expert: give one list"):
        resolve(tiny_checkpoint, json.dumps(RATIOS))
    with pytest.raises(UsageError, match=r"--mag_ratios=.*list of two such lists"):
        resolve(experts_checkpoint, json.dumps([[1.0], [1.0], [1.0]]))
    with pytest.raises(UsageError, match=r"--mag_ratios=.*list of positive numbers"):
        resolve(tiny_checkpoint, str(tmp_path / "missing.json"))
    # Without ratios the tiny checkpoint matches no shipped entry: refused in one line.
    with pytest.raises(UsageError, match=r"--cache='magcache': no calibrated ratios"):
        generate_flax.validate_args(_args(experts_checkpoint, "--cache", "magcache"))


def test_deepcache_two_expert_schedule():
    settings = step_cache_settings.CacheSettings("deepcache", start=1, end=9, interval=4,
                                                 expert_steps=SPLIT)
    assert [i for i, c in enumerate(settings.schedule(STEPS)) if c] == DEEP_CACHED
    one = step_cache_settings.CacheSettings("deepcache", start=1, end=9, interval=4)
    assert [i for i, c in enumerate(one.schedule(STEPS)) if c] == [2, 3, 4, 6, 7, 8]


def test_parity_schedule_has_a_margin():
    """The MagCache parity test's skips come from the ratios alone (diffusers' rule replayed
    on the host, ``magcache_schedule``), never from computed values, and no decision sits near
    the threshold: half or 1.5 times diffusers' 0.06 skips the same steps, so rounding in
    either run cannot flip one (a flipped decision would fail here, not as a flaky frame)."""
    for threshold in (0.03, 0.06, 0.09):
        settings = step_cache_settings.CacheSettings(
            "magcache", mag_ratios=(tuple(RATIOS[0]), tuple(RATIOS[1])), expert_steps=SPLIT,
            threshold=threshold)
        assert [i for i, c in enumerate(settings.schedule(STEPS)) if c] == MAG_CACHED


def test_shipped_wan22_ratios():
    """The MagCache authors' Wan 2.2 ratios are chosen by checkpoint (TI2V-5B by --image), and
    the published A14B schedules at maxdiffusion's settings: T2V (shift 12, 0.04, K 2, 0.2)
    skips 17 of 40 here (maxdiffusion reports 18 of 40 with its own rule: strict '<', cond
    and uncond both checked, retention int(n * r) per phase); I2V (shift 5, 0.06, K 2, 0.2)
    skips 17 of 40 (maxdiffusion: 17)."""
    from engine.files.checkpoint import read_component_config, read_model_index
    from engine.programs import experts

    def settings_for(model_id, image, **kw):
        index = read_model_index(model_id)
        cfg = read_component_config(model_id, "transformer")
        name = mag_ratios.builtin_for_checkpoint(cfg, index, image)
        ratios = mag_ratios.per_step_ratios(mag_ratios.load_builtin_ratios()[name])
        split = experts.expert_steps(index, read_component_config(
            model_id, "scheduler", filename="scheduler_config.json"), wan.make_scheduler,
            "unipc", kw.pop("shift", 5.0), kw.pop("steps", 40))
        steps = sum(split) if split else 50
        return name, split, step_cache_settings.CacheSettings(
            "magcache", mag_ratios=mag_ratios.interpolated(ratios, steps, split),
            expert_steps=split, **kw)

    name, split, t2v = settings_for("Wan-AI/Wan2.2-T2V-A14B-Diffusers", False, shift=12.0,
                                    threshold=0.04, max_skip_steps=2)
    assert (name, split) == ("wan2.2-t2v-a14b", (26, 14))
    cached = t2v.report(40)
    assert len(cached["cached_steps"]) == 17
    assert cached["experts"]["transformer_2"]["steps"][0] == 26
    assert 26 not in cached["cached_steps"]  # the switch: the low-noise expert starts full
    name, split, i2v = settings_for("Wan-AI/Wan2.2-I2V-A14B-Diffusers", True, threshold=0.06,
                                    max_skip_steps=2)
    assert (name, split) == ("wan2.2-i2v-a14b", (15, 25))
    assert len(i2v.report(40)["cached_steps"]) == 17
    for image, want in ((False, "wan2.2-ti2v-5b-t2v"), (True, "wan2.2-ti2v-5b-i2v")):
        model_id = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
        cfg = read_component_config(model_id, "transformer")
        assert mag_ratios.builtin_for_checkpoint(cfg, read_model_index(model_id), image) == want
        entry = mag_ratios.load_builtin_ratios()[want]
        assert len(entry["published"]) == 98 and len(mag_ratios.per_step_ratios(entry)) == 50


def test_few_step_lora_with_a_cache_warns(experts_checkpoint, tmp_path, caplog):
    """A cache with a few-step LoRA (<= 8 steps) is allowed, with a warning; at 10 steps no
    warning (validation only: nothing loads)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    from tiny_lora import write_lora

    cfg = json.loads(open(os.path.join(experts_checkpoint, "transformer_2",
                                       "config.json")).read())
    lora = str(tmp_path / "low.safetensors")
    write_lora(lora, cfg, fmt="peft", rank=4, seed=1)
    flags = ("--lora_2", lora, "--cache", "deepcache", "--cache_start_step", "1",
             "--cache_end_step", "3", "--cache_step_interval", "2")
    with caplog.at_level("WARNING", logger="generate_flax"):
        generate_flax.validate_args(_args(experts_checkpoint, *flags, steps=4))
    assert "--cache deepcache with --lora_2 at 4 steps" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="generate_flax"):
        generate_flax.validate_args(_args(experts_checkpoint, *flags, steps=STEPS))
    assert "few-step LoRA" not in caplog.text


# ---------------------------------------------------------------------------------------------
# Frames against the references
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def experts_uncached(experts_checkpoint):
    """Our uncached run's final latents."""
    return _ours_latents(experts_checkpoint, *_scale_flags(), devices=jax.devices()[:1])[0]


def _magcache_reference(checkpoint):
    """diffusers' MagCache hook on each expert (its own steps and ratios), eager: (latents, per
    transformer call (cond, uncond per step) whether its blocks ran)."""
    from diffusers.hooks import MagCacheConfig

    pipe = _two_expert_pipe(checkpoint)
    calls = []
    for model, n, r in zip((pipe.transformer, pipe.transformer_2), SPLIT, RATIOS, strict=True):
        model.enable_cache(MagCacheConfig(num_inference_steps=n, mag_ratios=r))
        runs = _block_runs(model)
        model.register_forward_pre_hook(lambda *a, c=runs: calls.append(c[0]))
        model.register_forward_hook(lambda *a, c=runs: calls.append(calls.pop() != c[0]))
    return _run(pipe), calls


def test_magcache_two_experts_match_diffusers_hooks(experts_checkpoint, experts_uncached):
    """Each expert its own MagCache: equal latents to diffusers' hooks on transformer and
    transformer_2 (4 and 6 steps, their own ratios), on 1 device and dp2 x tp2 x sp2; the
    cached steps in the report are the ones diffusers skipped."""
    want, calls = _magcache_reference(experts_checkpoint)
    assert len(calls) == 2 * STEPS
    # diffusers' cond and uncond states decide alike (our batch-2 call makes one decision).
    assert calls[0::2] == calls[1::2]
    skipped = [i for i in range(STEPS) if not calls[2 * i]]
    flags = (*_scale_flags(), "--cache", "magcache", "--mag_ratios", json.dumps(RATIOS))
    ours, report = _ours_latents(experts_checkpoint, *flags, devices=jax.devices()[:1])
    assert_frames_close(ours, want, atol=ATOL, what="latents", again=lambda: (
        _ours_latents(experts_checkpoint, *flags, devices=jax.devices()[:1])[0],
        _magcache_reference(experts_checkpoint)[0]))
    cache = report["cache"]
    assert cache["cached_steps"] == skipped == MAG_CACHED  # the steps diffusers skipped
    assert cache["experts"]["transformer"]["cached_steps"] == [1, 3]
    assert cache["experts"]["transformer_2"]["cached_steps"] == [5, 6, 7, 9]
    assert cache["experts"]["transformer_2"]["num_inference_steps"] == 6
    assert report["experts"]["steps"] == {"transformer": [0, 1, 2, 3],
                                          "transformer_2": [4, 5, 6, 7, 8, 9]}
    run = report["timings"]["runs"][0]
    assert run["step_kinds"] == ["cached" if i in MAG_CACHED else "full" for i in range(STEPS)]
    assert np.abs(ours - experts_uncached).max() > FAR  # far more than the tolerance
    mesh = ("--dp", "2", "--tp", "2", "--sp", "2")
    mesh8, report8 = _ours_latents(experts_checkpoint, *flags, *mesh)
    assert_frames_close(mesh8, want, atol=ATOL, what="latents", again=lambda: (
        _ours_latents(experts_checkpoint, *flags, *mesh)[0],
        _magcache_reference(experts_checkpoint)[0]))
    assert report8["cache"]["cached_steps"] == MAG_CACHED and report8["fallbacks"] == []


def _deepcache_two_expert_reference(pipe, *, cached: set):
    """Eager DeepCache over both experts' blocks: a cached step skips blocks 0..L-2 and feeds
    block L-1 the input its CFG branch recorded at the last full step; ``cached`` is the
    schedule (the test states it). Returns (frames, per step the expert that ran it)."""
    from diffusers.hooks import HookRegistry, ModelHook

    state = dict(calls=0, recorded={}, experts=[])

    def step_and_branch():
        return state["calls"] // 2, state["calls"] % 2  # CFG: cond then uncond per step

    class Skip(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            if step_and_branch()[0] in cached:
                return args[0]
            return self.fn_ref.original_forward(*args, **kwargs)

    class Record(ModelHook):
        def __init__(self, expert):
            super().__init__()
            self.expert = expert

        def new_forward(self, module, *args, **kwargs):
            step, branch = step_and_branch()
            if step in cached:
                owner, recorded = state["recorded"][branch]
                assert owner == self.expert  # never the other expert's input
                args = (recorded, *args[1:])
            else:
                state["recorded"][branch] = (self.expert, args[0].clone())
            return self.fn_ref.original_forward(*args, **kwargs)

    for k, model in enumerate((pipe.transformer, pipe.transformer_2)):
        blocks = model.blocks
        for i, block in enumerate(blocks):
            hook = Record(k) if i == len(blocks) - 1 else Skip()
            HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, "deepcache")

        def count(*a, k=k):
            if state["calls"] % 2 == 0:
                state["experts"].append(k)
            state["calls"] += 1

        model.register_forward_hook(count)
    latents = _run(pipe)
    assert state["calls"] == 2 * STEPS
    return latents, state["experts"]


def test_deepcache_two_experts_match_eager_reference(experts_checkpoint, experts_uncached):
    pipe = _two_expert_pipe(experts_checkpoint)
    want, which = _deepcache_two_expert_reference(pipe, cached=set(DEEP_CACHED))
    assert which == [0] * SPLIT[0] + [1] * SPLIT[1]
    # With a warmup: a full and a cached step, each with the expert of its step.
    ours, report = _ours_latents(experts_checkpoint, *_scale_flags(), *DEEPCACHE,
                                 "--warmup_steps", "1", devices=jax.devices()[:1])
    assert report["timings"]["warmup_steps"] == 2
    np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)
    assert report["cache"]["cached_steps"] == DEEP_CACHED
    assert report["cache"]["experts"]["transformer_2"]["cached_steps"] == [6, 7, 8]
    assert np.abs(ours - experts_uncached).max() > FAR


def test_two_expert_schedule_without_cached_steps_is_exactly_uncached(experts_checkpoint,
                                                                     experts_uncached):
    latents, report = _ours_latents(experts_checkpoint, *_scale_flags(), "--cache", "magcache",
                                    "--mag_ratios", json.dumps(RATIOS),
                                    "--mag_retention_ratio", "1", devices=jax.devices()[:1])
    assert report["cache"]["cached_steps"] == []
    np.testing.assert_array_equal(latents, experts_uncached)


def test_two_expert_calibration_matches_diffusers(experts_checkpoint, capsys):
    """--cache_calibrate writes one list per expert, each as diffusers' calibrating hook on
    that expert alone prints it (cond and uncond)."""
    from diffusers.hooks import MagCacheConfig

    pipe = _two_expert_pipe(experts_checkpoint)
    for model, n in zip((pipe.transformer, pipe.transformer_2), SPLIT, strict=True):
        model.enable_cache(MagCacheConfig(num_inference_steps=n, calibrate=True))
    _run(pipe)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("[") and line.endswith("]")]
    # Per expert, one list per CFG context (cond, uncond), as each expert's run ends.
    assert [len(p) for p in printed] == [4, 4, 6, 6]
    _, report = _ours(experts_checkpoint, *_scale_flags(), "--cache", "magcache",
                      "--cache_calibrate", devices=jax.devices()[:1])
    got = report["cache"]["calibration"]
    for k in range(2):
        np.testing.assert_allclose(got["mag_ratios"][k], printed[2 * k], atol=2e-5)
        np.testing.assert_allclose(got["mag_ratios_uncond"][k], printed[2 * k + 1], atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Image-to-video
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def i2v_checkpoint(tmp_path_factory):
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan-i2v-cache", "--i2v")


I2V_STEPS = 6
# diffusers' defaults over 6 steps (retention 1): full 0, 1, 5; cached 2, 3, 4. TI2V-5B's
# tiny Wan 2.2 VAE passes less of a change through, so there every step after the first is
# skipped (5 skips allowed), for a difference far above the tolerance.
I2V_CASES = {"wan21_i2v": dict(ratios=[1.0, 0.9, 1.0, 0.99, 1.01, 1.0], max_skip_steps=3,
                               cached=[2, 3, 4]),
             "ti2v": dict(ratios=[1.0] * 6, max_skip_steps=5, cached=[1, 2, 3, 4, 5])}


def _i2v_reference(checkpoint, image_path, shape, case):
    """diffusers' eager image-to-video run with its MagCache hook: the final latents
    (``output_type="latent"``, float32), which the tiny Wan 2.1 VAE's sign step cannot
    flip (tests/parity.py)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanImageToVideoPipeline
    from diffusers.hooks import MagCacheConfig
    from diffusers.utils import load_image

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanImageToVideoPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.enable_cache(MagCacheConfig(
        num_inference_steps=I2V_STEPS, mag_ratios=case["ratios"],
        max_skip_steps=case["max_skip_steps"]))
    runs = _block_runs(pipe.transformer)
    with torch.no_grad():
        out = pipe(image=load_image(image_path), prompt=wan.DEFAULTS["prompt"],
                   negative_prompt=wan.DEFAULTS["negative_prompt"],
                   num_inference_steps=I2V_STEPS, guidance_scale=5.0,
                   generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent",
                   num_frames=shape["frames"], height=shape["height"],
                   width=shape["width"]).frames.float().numpy()
    assert runs[0] == 2 * (I2V_STEPS - len(case["cached"]))
    return out


@pytest.mark.parametrize("which", ["wan21_i2v", "ti2v"])
def test_i2v_magcache_matches_diffusers_hook(which, i2v_checkpoint, ti2v_checkpoint):
    """Wan 2.1 I2V (condition channels, CLIP image cross-attention) and TI2V-5B (the image's
    latents on frame 0 at t = 0) with MagCache equal the eager image-to-video pipeline with
    diffusers' hook; the cached video differs from the uncached by far more than the
    tolerance."""
    import os

    checkpoint = i2v_checkpoint if which == "wan21_i2v" else ti2v_checkpoint
    # TI2V-5B: multiples of 32 (Wan 2.2 VAE x16, patch 2).
    shape = SHAPE if which == "wan21_i2v" else dict(SHAPE, height=64)
    image = os.path.join(os.path.dirname(__file__), "data", "first_frame.png")
    case = I2V_CASES[which]
    want = _i2v_reference(checkpoint, image, shape, case)
    flags = ("--image", image, "--guidance_scale", "5")
    cache = ("--cache", "magcache", "--mag_ratios", json.dumps(case["ratios"]),
             "--mag_max_skip_steps", str(case["max_skip_steps"]))
    run = dict(devices=jax.devices()[:1], steps=I2V_STEPS, shape=shape)
    ours, report = latents_of(_ours, checkpoint, *flags, *cache, **run)
    print(which, "latents: max |ours - diffusers|", np.abs(ours - want).max())
    assert_frames_close(ours, want, atol=ATOL, what="latents", again=lambda: (
        latents_of(_ours, checkpoint, *flags, *cache, **run)[0],
        _i2v_reference(checkpoint, image, shape, case)))
    assert report["cache"]["cached_steps"] == case["cached"]
    uncached = latents_of(_ours, checkpoint, *flags, **run)[0]
    # Measured on the latents: cached vs uncached 0.059 (Wan 2.1 I2V) and 0.20 (TI2V-5B),
    # against 2.9e-6 and 4.3e-6 between ours and the reference.
    print(which, "cached vs uncached: latents max |d|", np.abs(ours - uncached).max())
    assert np.abs(ours - uncached).max() > FAR


def test_hunyuan_i2v_deepcache_matches_eager_reference(tmp_path_factory):
    """HunyuanVideo-1.5 image-to-video with DeepCache: the cached step runs the last block on
    the recorded input of both streams with the current step's timestep, image tokens and
    65-channel input (the image latents and mask) embedded afresh; equal frames to the eager
    DeepCache reference on diffusers' I2V pipeline."""
    import os

    from conftest import _build
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from diffusers.utils import load_image
    from test_step_cache import DEEP_CACHED, DEEPCACHE, _deepcache_reference
    from test_step_cache import STEPS as HY_STEPS

    checkpoint = _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py",
                        "tiny-hunyuan15-i2v-cache", "--i2v")
    image = os.path.join(os.path.dirname(__file__), "data", "first_frame.png")
    prompt = "A house under the sun"

    def run(pipe):
        with torch.no_grad():
            return pipe(image=load_image(image), prompt=prompt, num_frames=5,
                        num_inference_steps=HY_STEPS,
                        generator=torch.Generator("cpu").manual_seed(SEED),
                        output_type="np").frames[0]

    def pipe():
        p = HunyuanVideo15ImageToVideoPipeline.from_pretrained(checkpoint, use_safetensors=True)
        p.set_progress_bar_config(disable=True)
        return p

    cached_pipe = pipe()
    want, cached = _deepcache_reference(cached_pipe, cached_pipe.transformer.transformer_blocks,
                                        run, start=1, end=7, interval=3)
    assert cached == DEEP_CACHED and want.shape == (5, 48, 80, 3)
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--image", image, "--prompt", prompt, "--dtype", "float32",
        "--seed", str(SEED), "--num_inference_steps", str(HY_STEPS), "--num_iterations", "1",
        "--warmup_steps", "0", "--frames", "5", "--attention", "xla",
        "--compilation_cache_dir", "none", *DEEPCACHE]))
    ours, report = generate(config, FAMILIES[config.model.family], devices=jax.devices()[:1])
    np.testing.assert_allclose(ours, want, atol=1e-3, rtol=0)
    assert report["cache"]["cached_steps"] == DEEP_CACHED
    # Against the eager uncached video: measured 0.015 (the tiny model's 2 blocks, 1 of them
    # recomputed on a cached step), 15x the tolerance; ours against the reference: 9e-7.
    assert np.abs(ours - run(pipe())).max() > 0.01
