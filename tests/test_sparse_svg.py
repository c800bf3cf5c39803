"""``--sparse svg`` end to end on the tiny Wan checkpoint (CPU, 8 devices, our kernel in
Pallas interpret mode), against the dense run and against an independent eager float32
reference.

The reference is diffusers' own ``WanPipeline`` with a test-only attention processor: each
block's self-attention, on the plan's sparse steps and layers, applies SVG's routing as a
torch port of ``sample_mse`` + ``torch.argmin`` (svg-project/Sparse-VideoGen @ 5ce7b01,
``svg/models/wan/attention.py``; 64 rows, the MSE over rows and head_dim to full attention,
a tie picks spatial) and then the chosen pattern as a dense boolean mask in frame-major
order: the band |i - j| <= w plus the first frame's keys for a spatial head, and for a
temporal head the same mask on position-major order mapped back as SVG's
``get_attention_mask`` maps it (svg/models/wan/utils.py @ 5ce7b01: reshape (P, F, P, F),
permute (1, 0, 3, 2)). No permutation, no kernel, no code of ours but the width rule
(``svg.band_tokens``, checked against SVG's formula in tests/test_splash_svg.py) and the
fixed row draw (``svg.sample_rows``: our documented stand-in for SVG's per-call
``torch.randint``).

The checkpoint is the 8-head one (``tiny_checkpoint_8h``), whose heads route both ways.
Shapes: 128 x 128 x 17 frames -> 5 latent frames of 8 x 8 = 64 tokens, N = 320; s = 0.3
gives SVG's w = 52, rounded up to 128: a band narrower than the sequence, so the masks
drop scores and a wrong routing or mask changes the result (checked below).

Every comparison is on the final latents (the VAE decode's input; diffusers'
``output_type="latent"``), not the frames: the tiny VAE's one-channel RMS norm is a sign
step that turns a rounding difference into a 0.07 jump of a pixel patch (tests/parity.py
says how that was found; it failed this test once in CI).
"""

from unittest import mock

import numpy as np
import pytest
import torch
from parity import our_latents

import generate_flax
from engine.pipeline import generate
from families import FAMILIES, wan
from splash import svg

SHAPE = dict(height=128, width=128, frames=17)
STEPS = 4
F, P = 5, 64  # post-patch frames x tokens per frame for SHAPE
N = F * P


def _ours(checkpoint, extra=(), shape=SHAPE):
    """Our run: (final latents (1, 16, F, H/8, W/8) float32, report)."""
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--dtype", "float32", "--seed", "7", "--flow_shift", "5.0",
        "--num_inference_steps", str(STEPS), "--num_iterations", "1", "--warmup_steps", "0",
        "--height", str(shape["height"]), "--width", str(shape["width"]),
        "--frames", str(shape["frames"]), "--attention", "splash",
        "--compilation_cache_dir", "none", *extra]))
    with our_latents() as latents:
        _, report = generate(config, FAMILIES[config.model.family])
    return latents[-1], report


def _masks(window, f=F, p=P):
    """(spatial, temporal) allowed-key masks in frame-major order, SVG's construction."""
    n = f * p
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    spatial = (np.abs(i - j) <= window) | (j < p)
    temporal = spatial.reshape(p, f, p, f).transpose(1, 0, 3, 2).reshape(n, n)
    return torch.from_numpy(spatial), torch.from_numpy(temporal)


def _svg_attention(q, k, v, masks, rule, seen: list):
    """(B, S, H, D) q, k, v -> (B, S, H, D): per (batch, head) SVG's sample_mse routing
    (``rule`` picks the index from the two MSEs; each pick is appended to ``seen``) and full
    attention under that mask."""
    q, k, v = (x.transpose(1, 2).double() for x in (q, k, v))
    n = q.shape[2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    rows = torch.from_numpy(svg.sample_rows(n).astype(np.int64))

    def attend(s, allowed, v):
        return torch.softmax(s.masked_fill(~allowed, -torch.inf), dim=-1) @ v

    golden = attend(scores[:, :, rows], torch.ones(n, dtype=torch.bool), v)
    mse = torch.stack([((attend(scores[:, :, rows], m[rows], v) - golden) ** 2).mean(
        dim=(2, 3)) for m in masks])  # (2, B, H)
    which = rule(mse)
    seen.extend(which.flatten().tolist())
    out = torch.stack([torch.stack([attend(scores[b, h], masks[int(which[b, h])], v[b, h])
                                    for h in range(q.shape[1])]) for b in range(q.shape[0])])
    return out.transpose(1, 2).float()


def _reference(checkpoint, settings, rule=lambda mse: torch.argmin(mse, dim=0), seen=None,
               shape=SHAPE, grid=(F, P), **kw):
    """diffusers' WanPipeline (float32, eager) with SVG on ``settings``' steps and layers,
    each expert at its own density (``seen``: receives every routing pick). Returns its
    final latents (``output_type="latent"``: no VAE decode), float32 (1, 16, F, H/8, W/8)."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from diffusers.models.transformers import transformer_wan

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config, flow_shift=5.0)
    pipe.set_progress_bar_config(disable=True)
    state = dict(step=0)

    class Processor(transformer_wan.WanAttnProcessor):
        def __init__(self, layer, expert):
            super().__init__()
            self.layer, self.expert = layer, expert

        def __call__(self, attn, hidden_states, encoder_hidden_states=None, *args, **kw):
            s = settings
            sparse = (s is not None and encoder_hidden_states is None
                      and s.steps[0] <= state["step"] < s.steps[1]
                      and s.layers[0] <= self.layer < s.layers[1])
            if not sparse:
                return super().__call__(attn, hidden_states, encoder_hidden_states, *args, **kw)
            masks = _masks(svg.band_tokens(s.densities[self.expert], *grid), *grid)

            def attention(q, k, v, **_):
                return _svg_attention(q, k, v, masks, rule, [] if seen is None else seen)

            with mock.patch.object(transformer_wan, "dispatch_attention_fn", attention):
                return super().__call__(attn, hidden_states, encoder_hidden_states, *args, **kw)

    for expert, model in enumerate((pipe.transformer, getattr(pipe, "transformer_2", None))):
        for i, block in enumerate(model.blocks if model is not None else ()):
            block.attn1.set_processor(Processor(i, expert))

    def next_step(_pipe, i, _t, kwargs):
        state["step"] = i + 1
        return kwargs

    with torch.no_grad():
        out = pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                   num_inference_steps=STEPS, guidance_scale=5.0,
                   generator=torch.Generator("cpu").manual_seed(7), output_type="latent",
                   num_frames=shape["frames"], height=shape["height"], width=shape["width"],
                   callback_on_step_end=next_step, **kw)
    return out.frames.float().numpy()


@pytest.fixture(scope="module")
def dense(tiny_checkpoint_8h):
    """Our dense run's final latents (--attention splash, no --sparse)."""
    latents, _ = _ours(tiny_checkpoint_8h)
    return latents


def test_density_one_equals_dense(tiny_checkpoint_8h, dense):
    """Every score kept (w >= N): routing, permutation and the sparse program change
    nothing but float32 rounding."""
    latents, report = _ours(tiny_checkpoint_8h, ("--sparse", "svg", "--sparse_density", "1"))
    plan = report["step_plan"]
    assert plan["programs"] == ["dense", "svg1", "svg1", "svg1"]
    assert np.abs(latents - dense).max() <= 1e-4


def test_default_density_equals_eager_svg_reference(tiny_checkpoint_8h, dense):
    """Wan 2.1 T2V's published setting at 4 steps: step 0 dense (round(10 * 4 / 50) = 1),
    layer 0 dense, s = 0.3 (w = 128 of N = 320) on layer 1 of steps 1-3."""
    # dp2 x tp2 x sp2: Ulysses, so the routing reads q scaled before the all-to-all (the
    # heads-only layout, q unscaled, is test_sequence_parallel_padding's baseline).
    latents, report = _ours(tiny_checkpoint_8h, ("--sparse", "svg", "--dp", "2", "--tp", "2",
                                                 "--sp", "2"))
    assert report["mesh"] == {"dp": 2, "tp": 2, "sp": 2}
    settings = report["settings"]["sparse"]
    assert [list(settings[k]) for k in ("steps", "layers", "densities")] == \
        [[1, 4], [1, 2], [0.3]]
    assert (settings["num_frames"], settings["frame_size"]) == (F, P)
    assert svg.band_tokens(0.3, F, P) == 128 < N

    class S:  # the run's settings as the reference reads them
        steps, layers, densities = settings["steps"], settings["layers"], settings["densities"]

    seen = []
    ref = _reference(tiny_checkpoint_8h, S, seen=seen)
    assert ref.shape == latents.shape and ref.std() > 0.1
    # 3 sparse steps x 1 layer x (cond, uncond) x 8 heads, both patterns among them (the
    # 2-head checkpoint routes every head spatial: its temporal path would go unchecked).
    assert len(seen) == 48 and set(seen) == {svg.SPATIAL, svg.TEMPORAL}, seen
    err = np.abs(latents - ref).max()
    assert err <= 1e-4, err  # measured 4.9e-6 (latents up to 5.1, std 1.17)
    # The test can fail: the dense run, and SVG with the routing inverted, are far from it
    # (measured 0.022 and 0.037; 37 spatial and 11 temporal picks).
    assert np.abs(dense - ref).max() > 10 * max(err, 1e-4)
    wrong = _reference(tiny_checkpoint_8h, S, rule=lambda mse: torch.argmax(mse, dim=0))
    assert np.abs(wrong - ref).max() > 10 * max(err, 1e-4)


def test_sequence_parallel_padding(tiny_checkpoint_8h):
    """Ulysses over sp 8: 320 tokens / 8 = 40 per shard, padded to 48 (Wan's 16-row token
    tile), kept in place through the sparse call (its keys left out by valid_kv_len); latents
    equal the default mesh's (dp2 x tp4, no padding) within float32 rounding (<= 1e-4)."""
    latents, report = _ours(tiny_checkpoint_8h, ("--sparse", "svg", "--sp", "8"))
    assert report["mesh"] == {"dp": 1, "tp": 1, "sp": 8}
    base, report = _ours(tiny_checkpoint_8h, ("--sparse", "svg"))
    assert report["mesh"]["sp"] == 1
    assert np.abs(latents - base).max() <= 1e-4


@pytest.mark.parametrize("extra, words", [
    (("--sparse", "svg", "--attention", "xla"), "needs --attention splash"),
    (("--sparse", "svg", "--sparse_density", "0"), "(0, 1]"),
    (("--sparse", "svg", "--sparse_density", "1.5"), "(0, 1]"),
    (("--sparse_density", "0.3"), "needs --sparse svg"),
    (("--sparse", "svg", "--cache", "deepcache"), "step cache"),
    (("--sparse", "svg", "--window_size", "16"), "--window_size"),
])
def test_refusals(tiny_checkpoint_8h, capsys, extra, words):
    """One line naming the flag, exit 2, before any model loads (validation only)."""
    assert generate_flax.cli(["--model_id", tiny_checkpoint_8h, "--attention", "splash",
                              *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err


def test_refused_families(hunyuan_checkpoint, ti2v_checkpoint, capsys):
    for checkpoint, words in ((hunyuan_checkpoint, "not supported for HunyuanVideo"),
                              (ti2v_checkpoint, "TI2V-5B")):
        assert generate_flax.cli(["--model_id", checkpoint, "--attention", "splash",
                                  "--sparse", "svg"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


# Wan 2.2 A14B: 33 frames -> 9 latent frames of 64 tokens, N = 576, where the two experts'
# published densities give different bands (s = 0.5: w = 169 -> 256; s = 0.2: 61 -> 128).
SHAPE22 = dict(height=128, width=128, frames=33)
GRID22 = (9, 64)


@pytest.fixture(scope="module")
def two_experts_8h(tmp_path_factory):
    from conftest import _build

    # UniPC's 4 timesteps at flow_shift 5.0 are [999, 937, 833, 625]: boundary 0.9 gives
    # steps 0-1 to transformer and 2-3 to transformer_2.
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-a14b-8h",
                  "--experts", "2", "--boundary_ratio", "0.9", "--heads", "8", "--head_dim",
                  "12", "--ffn_dim", "64")


def test_two_experts_per_expert_density(two_experts_8h):
    """maxdiffusion's moderate policy at 4 steps: steps [round(1.1), 4) = 1-3 sparse, layer
    0 dense; step 1 on the high-noise expert at s = 0.5, steps 2-3 on the low-noise one at
    s = 0.2; against the eager reference with each expert's own band."""
    assert (svg.band_tokens(0.5, *GRID22), svg.band_tokens(0.2, *GRID22)) == (256, 128)
    latents, report = _ours(two_experts_8h, ("--sparse", "svg", "--guidance_scale", "5.0",
                                            "--guidance_scale_2", "3.0"),
                           shape=SHAPE22)
    plan = report["step_plan"]
    assert plan["programs"] == ["dense", "svg0.5", "svg0.2", "svg0.2"]
    assert plan["experts"] == [0, 0, 1, 1] and plan["compiled_programs"] == 3
    assert report["experts"]["steps"] == {"transformer": [0, 1], "transformer_2": [2, 3]}
    settings = report["settings"]["sparse"]

    class S:
        steps, layers, densities = settings["steps"], settings["layers"], settings["densities"]

    assert list(S.densities) == [0.5, 0.2]
    ref = _reference(two_experts_8h, S, shape=SHAPE22, grid=GRID22, guidance_scale_2=3.0)
    err = np.abs(latents - ref).max()
    assert ref.std() > 0.1 and err <= 1e-4, err

    class Swapped(S):  # the experts' densities the other way round
        densities = S.densities[::-1]

    swapped = _reference(two_experts_8h, Swapped, shape=SHAPE22, grid=GRID22,
                         guidance_scale_2=3.0)
    assert np.abs(swapped - ref).max() > 10 * max(err, 1e-4)


def test_warmup_runs_every_program_of_the_plan_once():
    """A dense warmup prefix gets one more step per program it leaves out, so the timed runs
    never make a program's first call (Wan 2.1: 10 of 50 steps dense, warmup 2)."""
    from engine.programs.step_plan import PlannedStep, StepPlan

    calls = {k: (lambda k=k: k) for k in ("dense", "svg0.5", "svg0.2")}
    one = StepPlan((0,) * 6, ("dense",) * 3 + ("svg0.5",) * 3)
    step = PlannedStep(calls, one, [900.0, 800, 700, 600, 500, 400], sparse=None)
    warm, n = step.for_warmup(2)
    assert n == 3 and warm.plan.programs[:3] == ("dense", "dense", "svg0.5")
    assert warm.at_timestep(700.0)() == "svg0.5" and step.at_timestep(700.0)() == "dense"
    assert step.for_warmup(4)[1] == 4  # the prefix already holds both programs
    two = StepPlan((0, 0, 0, 1, 1, 1), ("dense", "dense", "svg0.5", "svg0.2", "svg0.2",
                                        "svg0.2"))
    warm, n = PlannedStep(calls, two, [900.0, 800, 700, 600, 500, 400], None).for_warmup(1)
    assert n == 3 and warm.plan.programs[:3] == ("dense", "svg0.5", "svg0.2")
    assert warm.plan.experts == two.experts
