"""Step caching (engine/programs/step_cache.py): DeepCache and MagCache as two AOT programs.

References, none sharing code with the JAX path:
- MagCache: diffusers' own ``MagCacheConfig`` hook on its eager ``WanPipeline`` (its code is
  the spec), and the hook's own decisions for the schedule replay.
- DeepCache: an eager torch reference written here with diffusers' ``ModelHook`` on its own
  blocks (Wan and HunyuanVideo-1.5), following the seed's semantics: a step is full when
  ``step < start``, ``step >= end`` or ``(step - start) % interval == 0``; a full step records
  each CFG branch's input of block L-k; a cached step skips blocks 0..L-k-1 and feeds block
  L-k the recorded input.
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
from families import FAMILIES, wan

SHAPE = dict(height=64, width=96, frames=9)
STEPS = 8
SEED = 7
# Ratios that make diffusers' defaults (threshold 0.06, 3 skips, retention 0.2) skip 5 of 8.
RATIOS = [1.0, 1.0, 0.99, 1.01, 1.0, 0.98, 1.0, 1.0]
MAGCACHE = ("--cache", "magcache", "--mag_ratios", json.dumps(RATIOS))
# DeepCache over 8 steps: full 0, 1, 4, 7; cached 2, 3, 5, 6.
DEEPCACHE = ("--cache", "deepcache", "--cache_start_step", "1", "--cache_end_step", "7",
             "--cache_step_interval", "3")
DEEP_CACHED = [2, 3, 5, 6]
# The Wan parity tests compare final latents (tests/parity.py says why): ours and diffusers'
# agree to 1.4e-5 on latents up to 4.6 over 8 steps (measured: MagCache 1.35e-5, DeepCache
# 1.1e-5, sharded DeepCache 1.2e-5), ATOL 15 times that; skipping moves them from the
# uncached run by 0.065 (MagCache) and 0.15 (DeepCache), so FAR, 50 times ATOL, still sees a
# cache that skipped nothing.
ATOL, FAR = 2e-4, 1e-2


def _wan_pipe(checkpoint):
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=5.0)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run_wan(pipe, shape=SHAPE):
    """diffusers' Wan run: its final latents (``output_type="latent"``), float32. The Wan
    parity tests compare latents, which the tiny VAE's sign step cannot flip
    (tests/parity.py)."""
    with torch.no_grad():
        return pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                    num_inference_steps=STEPS, guidance_scale=5.0,
                    generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent",
                    num_frames=shape["frames"], height=shape["height"],
                    width=shape["width"]).frames.float().numpy()


def _block_calls(blocks) -> list:
    """Counts the real forward runs of each block (a skipped block never reaches its FFN)."""
    calls = [0] * len(blocks)
    for i, block in enumerate(blocks):
        inner = block.ffn if hasattr(block, "ffn") else block.ff
        inner.register_forward_hook(lambda *a, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


def _ours(checkpoint, extra=(), devices=None, shape=SHAPE, steps=STEPS, flow_shift="5.0"):
    """Our run in-process (Wan: the reference's flow_shift; HunyuanVideo: None, the
    checkpoint's)."""
    shift = () if flow_shift is None else ("--flow_shift", flow_shift)
    config = generate_flax.validate_args(generate_flax.parse_args([*shift,
        "--model_id", checkpoint, "--dtype", "float32", "--seed", str(SEED),
        "--num_inference_steps", str(steps), "--num_iterations", "1", "--warmup_steps", "1",
        "--height", str(shape["height"]), "--width", str(shape["width"]),
        "--frames", str(shape["frames"]), "--attention", "xla", "--compilation_cache_dir",
        "none", *extra]))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def _ours_latents(*args, **kw):
    """``_ours``' (final latents, report)."""
    return latents_of(_ours, *args, **kw)


def _deepcache_reference(pipe, blocks, run, *, start, end, interval, recompute=1):
    """Eager DeepCache on diffusers' blocks through diffusers' ``ModelHook``: returns what
    ``run(pipe)`` returns and the cached steps it saw."""
    from diffusers.hooks import HookRegistry, ModelHook

    n = len(blocks)
    split = n - recompute
    state = dict(calls=0, recorded={}, cached=set())

    def step_and_branch():
        return state["calls"] // 2, state["calls"] % 2  # CFG: cond then uncond per step

    def cached_now():
        step, _ = step_and_branch()
        return not (step < start or step >= end or (step - start) % interval == 0)

    class Skip(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            if cached_now():
                return args[0] if n_carry == 1 else (args[0], args[1])
            return self.fn_ref.original_forward(*args, **kwargs)

    class Record(ModelHook):
        def new_forward(self, module, *args, **kwargs):
            step, branch = step_and_branch()
            if cached_now():
                state["cached"].add(step)
                args = (*state["recorded"][branch], *args[n_carry:])
            else:
                state["recorded"][branch] = tuple(a.clone() for a in args[:n_carry])
            return self.fn_ref.original_forward(*args, **kwargs)

    n_carry = 2 if type(blocks[0]).__name__.startswith("HunyuanVideo15") else 1
    for i, block in enumerate(blocks[:split + 1]):
        hook = Record() if i == split else Skip()
        HookRegistry.check_if_exists_or_initialize(block).register_hook(hook, "deepcache")
    pipe.transformer.register_forward_hook(
        lambda *a: state.__setitem__("calls", state["calls"] + 1))
    frames = run(pipe)
    assert state["calls"] == 2 * STEPS  # one call per CFG branch and step
    return frames, sorted(state["cached"])


# ---------------------------------------------------------------------------------------------
# Schedules on the host
# ---------------------------------------------------------------------------------------------


def test_deepcache_seed_schedule():
    cached = step_cache_settings.deepcache_schedule(50, 11, 45, 4)
    full = [i for i, c in enumerate(cached) if not c]
    assert full == [*range(11), *range(11, 45, 4), *range(45, 50)]
    assert sum(cached) == 25


@pytest.mark.parametrize("length,target", [(100, 50), (50, 50), (28, 8), (7, 20), (5, 1)])
def test_nearest_interp_is_diffusers(length, target):
    from diffusers.hooks.mag_cache import nearest_interp

    src = torch.linspace(0.8, 1.2, length)
    want = nearest_interp(src, target).tolist()
    assert list(step_cache_settings.nearest_interp(src.tolist(), target)) == pytest.approx(want)


def test_magcache_schedule_replays_diffusers_hook(tiny_checkpoint):
    """Our host replay against diffusers' MagCacheHeadHook deciding on a real (tiny) Wan
    transformer, over random ratio lists and settings: the same skipped steps."""
    from diffusers import WanTransformer3DModel
    from diffusers.hooks import MagCacheConfig

    rng = np.random.default_rng(0)
    model = WanTransformer3DModel.from_pretrained(tiny_checkpoint, subfolder="transformer")
    x = torch.zeros(1, 16, 1, 4, 4)
    text = torch.zeros(1, 4, model.config.text_dim)
    for trial in range(6):
        steps = int(rng.integers(6, 30))
        ratios = (1 + rng.normal(0, 0.03, steps)).tolist()
        kw = dict(threshold=float(rng.choice([0.02, 0.06, 0.2])),
                  max_skip_steps=int(rng.integers(1, 4)),
                  retention_ratio=float(rng.choice([0.0, 0.2, 0.5])))
        model.enable_cache(MagCacheConfig(num_inference_steps=steps, mag_ratios=ratios, **kw))
        calls = _block_calls(model.blocks)
        theirs = []
        with torch.no_grad(), model.cache_context("cond"):
            for _ in range(steps):
                before = calls[0]
                model(hidden_states=x, timestep=torch.tensor([500]), encoder_hidden_states=text)
                theirs.append(calls[0] == before)
        model.disable_cache()
        ours = step_cache_settings.magcache_schedule(
            steps, step_cache_settings.nearest_interp(ratios, steps), kw["threshold"],
            kw["max_skip_steps"], kw["retention_ratio"])
        assert list(ours) == theirs, (trial, kw)
        for block in model.blocks:
            block.ffn._forward_hooks.clear()


def test_shipped_wan_ratios_are_chosen_by_checkpoint():
    from engine.files.checkpoint import read_component_config, read_model_index

    for model_id, name in (("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2.1-t2v-14b"),
                           ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan2.1-t2v-1.3b")):
        cfg = read_component_config(model_id, "transformer")
        assert mag_ratios.builtin_for_checkpoint(cfg, read_model_index(model_id)) == name
        entry = mag_ratios.load_builtin_ratios()[name]
        assert len(entry["published"]) == 100  # 50 steps, cond and uncond interleaved
        assert len(mag_ratios.per_step_ratios(entry)) == 50
    # A two-expert (Wan 2.2) checkpoint of the same transformer shape gets Wan 2.2's, not
    # Wan 2.1's; another boundary gets none (tests/test_step_cache_experts.py).
    cfg = read_component_config("Wan-AI/Wan2.1-T2V-14B-Diffusers", "transformer")
    assert mag_ratios.builtin_for_checkpoint(cfg, {"boundary_ratio": 0.875}) == \
        "wan2.2-t2v-a14b"
    assert mag_ratios.builtin_for_checkpoint(cfg, {"boundary_ratio": 0.8}) is None


def test_parity_schedule_has_a_margin():
    """The MagCache parity test's skips come from the ratios alone (diffusers' rule replayed
    on the host), never from computed values, and no decision sits near the threshold: half
    or 1.5 times diffusers' 0.06 skips the same steps, so rounding cannot flip one."""
    for threshold in (0.03, 0.06, 0.09):
        assert [i for i, c in enumerate(step_cache_settings.magcache_schedule(
            STEPS, RATIOS, threshold, 3, 0.2)) if c] == [2, 3, 4, 6, 7]


def test_published_wan_14b_schedule_skips_steps():
    """The published Wan 14B ratios at the MagCache script's setting (0.12, K 2, 0.2) and at
    diffusers' defaults (0.06, K 3, 0.2): how many of 50 steps each skips (README figures)."""
    entry = mag_ratios.load_builtin_ratios()["wan2.1-t2v-14b"]
    ratios = mag_ratios.per_step_ratios(entry)
    script = step_cache_settings.magcache_schedule(50, ratios, 0.12, 2, 0.2)
    defaults = step_cache_settings.magcache_schedule(50, ratios, 0.06, 3, 0.2)
    assert not any(script[:10]) and not any(defaults[:10])  # retention: first 10 full
    assert sum(script) == 25 and sum(defaults) == 24, (sum(script), sum(defaults))


# ---------------------------------------------------------------------------------------------
# Frames against the references
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wan_uncached(tiny_checkpoint):
    """Our uncached Wan run's final latents."""
    return _ours_latents(tiny_checkpoint, devices=jax.devices()[:1])[0]


def test_magcache_matches_diffusers_hook(tiny_checkpoint, wan_uncached):
    from diffusers.hooks import MagCacheConfig

    pipe = _wan_pipe(tiny_checkpoint)
    pipe.transformer.enable_cache(MagCacheConfig(num_inference_steps=STEPS, mag_ratios=RATIOS))
    calls = _block_calls(pipe.transformer.blocks)
    want = _run_wan(pipe)
    ours, report = _ours_latents(tiny_checkpoint, MAGCACHE, devices=jax.devices()[:1])

    def again():
        pipe = _wan_pipe(tiny_checkpoint)
        pipe.transformer.enable_cache(MagCacheConfig(num_inference_steps=STEPS,
                                                     mag_ratios=RATIOS))
        return (_ours_latents(tiny_checkpoint, MAGCACHE, devices=jax.devices()[:1])[0],
                _run_wan(pipe))

    assert_frames_close(ours, want, atol=ATOL, what="latents", again=again)
    # At least a third of the steps skipped, and skipping really changed the video.
    cached = report["cache"]["cached_steps"]
    assert cached == [2, 3, 4, 6, 7]
    assert calls[0] == 2 * (STEPS - len(cached))  # diffusers ran the blocks on the others
    assert np.abs(ours - wan_uncached).max() > FAR
    run = report["timings"]["runs"][0]
    assert run["step_kinds"] == ["cached" if i in cached else "full" for i in range(STEPS)]


def test_schedule_without_cached_steps_is_exactly_uncached(tiny_checkpoint, wan_uncached):
    for flags in (("--cache", "deepcache", "--cache_start_step", "0", "--cache_end_step", "8",
                   "--cache_step_interval", "1"),
                  ("--cache", "magcache", "--mag_ratios", json.dumps(RATIOS),
                   "--mag_retention_ratio", "1")):
        latents, report = _ours_latents(tiny_checkpoint, flags, devices=jax.devices()[:1])
        assert report["cache"]["cached_steps"] == []
        np.testing.assert_array_equal(latents, wan_uncached, err_msg=str(flags))


def test_deepcache_wan_matches_eager_reference(tiny_checkpoint, wan_uncached):
    pipe = _wan_pipe(tiny_checkpoint)
    want, cached = _deepcache_reference(pipe, pipe.transformer.blocks, _run_wan, start=1, end=7,
                                        interval=3)
    assert cached == DEEP_CACHED
    ours, report = _ours_latents(tiny_checkpoint, DEEPCACHE, devices=jax.devices()[:1])
    np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)
    assert report["cache"]["cached_steps"] == DEEP_CACHED
    assert np.abs(ours - wan_uncached).max() > FAR


def test_sharded_cached_runs_equal_the_reference(tiny_checkpoint):
    """dp2 x tp2 x sp2 on 8 CPU devices, unrolled blocks and an odd token count (45 tokens:
    sp pads, and the recorded DeepCache input is the unpadded one), against the eager
    reference; the kept arrays' bytes per chip are the accounting of their sharding. (MagCache
    keeps its residual through the same code path, on the single-device test above.)"""
    shape = dict(height=48, width=80, frames=9)
    mesh = ("--dp", "2", "--tp", "2", "--sp", "2")
    pipe = _wan_pipe(tiny_checkpoint)
    want, _ = _deepcache_reference(pipe, pipe.transformer.blocks,
                                   lambda p: _run_wan(p, shape), start=1, end=7, interval=3)
    ours, report = _ours_latents(tiny_checkpoint, (*DEEPCACHE, *mesh, "--no_scan_layers"),
                                 shape=shape)
    np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)
    kept = report["cache"]
    assert kept["kept_shapes"] == [[2, 45, 24]]
    assert kept["kept_bytes_per_chip"] == kept["kept_bytes"] // 2  # over dp; 45 tokens: no tp/sp
    # Read off the live arrays: every device holds its half, none the whole.
    assert kept["kept_bytes_by_device"] == {d.id: kept["kept_bytes"] // 2 for d in jax.devices()}



def test_deepcache_hunyuan_matches_eager_reference(hunyuan_checkpoint):
    from diffusers import HunyuanVideo15Pipeline

    shape = dict(height=48, width=80, frames=9)
    pipe = HunyuanVideo15Pipeline.from_pretrained(hunyuan_checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)

    def run(p):
        with torch.no_grad():
            return p(prompt="A cat walks on the grass", num_frames=shape["frames"],
                     height=shape["height"], width=shape["width"], num_inference_steps=STEPS,
                     generator=torch.Generator("cpu").manual_seed(SEED),
                     output_type="np").frames[0]

    want, cached = _deepcache_reference(pipe, pipe.transformer.transformer_blocks, run, start=1,
                                        end=7, interval=3)
    assert cached == DEEP_CACHED
    ours, report = _ours(hunyuan_checkpoint, (*DEEPCACHE, "--prompt", "A cat walks on the grass"),
                         devices=jax.devices()[:1], shape=shape, flow_shift=None)
    np.testing.assert_allclose(ours, want, atol=1e-3, rtol=0)
    assert report["cache"]["cached_steps"] == DEEP_CACHED


def test_calibration_matches_diffusers(tiny_checkpoint, capsys):
    from diffusers.hooks import MagCacheConfig

    pipe = _wan_pipe(tiny_checkpoint)
    pipe.transformer.enable_cache(MagCacheConfig(num_inference_steps=STEPS, calibrate=True))
    _run_wan(pipe)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()
               if line.startswith("[") and line.endswith("]")]
    assert len(printed) == 2  # diffusers prints one list per CFG context: cond, then uncond
    _, report = _ours(tiny_checkpoint, ("--cache", "magcache", "--cache_calibrate"),
                      devices=jax.devices()[:1])
    got = report["cache"]["calibration"]
    assert report["cache"]["cached_steps"] == []
    np.testing.assert_allclose(got["mag_ratios"], printed[0], atol=2e-5)
    np.testing.assert_allclose(got["mag_ratios_uncond"], printed[1], atol=2e-5)
