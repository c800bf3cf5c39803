"""Mesh layouts: sharded runs equal the unsharded run; rules really shard; collectives pinned.

The runs are compared on their final latents (the VAE decode's input, ``parity.our_latents``),
not the frames: the tiny Wan 2.1 VAE's one-channel RMS norm is a sign step, and a float32
reduction-order difference (partial sums across devices, sp padding, scanned vs unrolled)
can flip it and move a patch of pixels by ~0.07 while the latents agree to ~1e-6 of their
scale (tests/parity.py, docs/testing.md).
"""

import re

import jax
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from parity import latents_of

import generate_flax as gf
from engine.pipeline import generate
from engine.programs.step import compile_step
from engine.run.mesh import MeshShape, make_mesh
from engine.weights import sharding
from families import FAMILIES, wan

FLAGS = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--num_iterations", "1", "--warmup_steps", "0", "--dtype", "float32", "--attention", "xla",
         "--compilation_cache_dir", "none"]
# Final latents (1, 16, 3, 8, 12) and (1, 16, 3, 6, 10) for ODD, float32, up to 4.6: sharded
# and unsharded runs agree to 3.0e-6..5.8e-6 (measured over every layout below); the bound is
# 17 times the largest. FAR, 100 times it: another seed moved them by 6.5.
ATOL, FAR = 1e-4, 1e-2


def _latents(checkpoint, mesh, extra=()):
    """The final latents of one float32 run on a dp x tp x sp mesh (``mesh``)."""
    dp, tp, sp = mesh
    args = gf.validate_args(gf.parse_args(["--model_id", checkpoint, *FLAGS, "--dp", str(dp),
                                           "--tp", str(tp), "--sp", str(sp), *extra]))
    latents, report = latents_of(generate, args, FAMILIES[args.model.family],
                                 devices=jax.devices()[: dp * tp * sp])
    assert report["mesh"] == dict(dp=dp, tp=tp, sp=sp)
    return latents


def _assert_close(latents, want):
    print(f"latents: max |d| {np.abs(latents - want).max():.3g} of max |latent| "
          f"{np.abs(want).max():.3g}")
    np.testing.assert_allclose(latents, want, atol=ATOL, rtol=0)


@pytest.fixture(scope="module")
def unsharded(tiny_checkpoint_8h):
    return _latents(tiny_checkpoint_8h, (1, 1, 1))


@pytest.mark.parametrize("mesh", [(2, 4, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)],
                         ids=lambda m: "dp{}-tp{}-sp{}".format(*m))
def test_sharded_frames_equal_unsharded(tiny_checkpoint_8h, unsharded, mesh):
    # (The name, kept for tests/conftest.py's slow-tier list, predates the latents.)
    latents = _latents(tiny_checkpoint_8h, mesh)
    # float32 end to end; only the order of partial sums across devices changes.
    _assert_close(latents, unsharded)


@pytest.mark.parametrize("mesh", [(2, 2, 2), (1, 2, 4)], ids=lambda m: "dp{}-tp{}-sp{}".format(*m))
def test_sequence_parallel_splash_equals_unsharded(tiny_checkpoint_8h, unsharded, mesh):
    # 8 heads split over tp*sp: self-attention takes the Ulysses all-to-all layout,
    # cross-attention the q-sequence layout (Pallas interpret mode on CPU devices).
    _assert_close(_latents(tiny_checkpoint_8h, mesh, ["--attention", "splash"]), unsharded)


ODD = ["--height", "48", "--width", "80"]  # 3 x 3 x 5 = 45 video tokens: no sp divides it


@pytest.fixture(scope="module")
def odd_unsharded(tiny_checkpoint_8h):
    return _latents(tiny_checkpoint_8h, (1, 1, 1), ODD)


@pytest.mark.parametrize("mesh,attention,extra", [
    ((2, 2, 2), "xla", ["--no_scan_layers"]), ((1, 2, 4), "splash", []),
    ((1, 1, 8), "stock_splash", [])],
    ids=["dp2-tp2-sp2-xla-unrolled", "tp2-sp4-splash", "sp8-stock_splash"])
def test_sequence_parallel_pads_a_token_count_sp_does_not_divide(tiny_checkpoint_8h,
                                                                  odd_unsharded, mesh,
                                                                  attention, extra):
    # The token axis is zero-padded to 16 rows per sp shard (Wan's token_tile) inside the
    # model call and the padded keys are masked exactly (by length in our kernel, segment
    # ids in stock splash): latents equal the unsharded, unpadded run's. Unrolled,
    # every block gets forward's unpadded RoPE tables and pads them again.
    latents = _latents(tiny_checkpoint_8h, mesh, [*ODD, "--attention", attention, *extra])
    _assert_close(latents, odd_unsharded)


@pytest.mark.parametrize("mesh,attention", [((2, 4, 1), "xla"), ((1, 2, 4), "splash")],
                         ids=["dp2-tp4-xla", "tp2-sp4-splash"])
def test_megatron_sequence_parallel_equals_unsharded(tiny_checkpoint_8h, odd_unsharded, mesh,
                                                     attention):
    # Residual stream's 45 tokens over tp (x sp): padded to 16 rows per shard (64 or 128),
    # gathered into each sublayer, scattered out of it; the padded keys are masked exactly.
    latents = _latents(tiny_checkpoint_8h, mesh, [*ODD, "--attention", attention,
                                                  "--megatron_sp"])
    _assert_close(latents, odd_unsharded)


def test_unrolled_layers_equal_scanned_unsharded(tiny_checkpoint_8h, unsharded):
    # The default is --scan_layers (so `unsharded` is scanned); diffusers' own block loop on a
    # mesh must give the same latents.
    _assert_close(_latents(tiny_checkpoint_8h, (2, 2, 2), ["--no_scan_layers"]), unsharded)


def test_fsdp_and_replicated_row_parallel_equal_unsharded(tiny_checkpoint_8h, unsharded):
    latents = _latents(tiny_checkpoint_8h, (2, 2, 2), ["--fsdp", "--replicate_row_parallel"])
    _assert_close(latents, unsharded)


def test_another_seed_moves_the_latents_far_beyond_the_tolerance(tiny_checkpoint_8h,
                                                                 unsharded):
    """The tolerance above can fail: another seed's latents differ by far more than it."""
    other = _latents(tiny_checkpoint_8h, (1, 1, 1), ["--seed", "7"])
    print("seed 7 vs the default seed: latents max |d|", np.abs(other - unsharded).max())
    assert np.abs(other - unsharded).max() > FAR


def _tiny_transformer(checkpoint, num_layers=None):
    from diffusers import WanTransformer3DModel

    if num_layers is None:
        return WanTransformer3DModel.from_pretrained(checkpoint, subfolder="transformer").eval()
    cfg = {k: v for k, v in WanTransformer3DModel.load_config(checkpoint, subfolder="transformer")
           .items() if not k.startswith("_")}
    torch.manual_seed(0)
    return WanTransformer3DModel(**{**cfg, "num_layers": num_layers}).eval()


def test_every_rule_matches_and_weights_are_really_sharded(tiny_checkpoint_8h):
    mesh = make_mesh(MeshShape(2, 4, 1), jax.devices())
    placed = sharding.place_module(_tiny_transformer(tiny_checkpoint_8h), mesh,
                             wan.transformer_sharding_rules())
    for rx, n in placed["rule_counts"].items():
        if "add_" in rx or "norm_added" in rx:  # Wan 2.1 I2V's image cross-attention only
            continue                             # (tests/test_wan_i2v.py, test_dry_run.py)
        assert n > 0, f"rule {rx} matched nothing"
    q = placed["params"]["blocks.0.attn1.to_q.weight"]  # (out=96, in=96), column-parallel
    assert q.sharding.spec == P("tp", None)
    assert {s.data.shape for s in q.addressable_shards} == {(24, 96)}
    o = placed["params"]["blocks.1.ffn.net.2.weight"]  # (out=96, in=64), row-parallel
    assert {s.data.shape for s in o.addressable_shards} == {(96, 16)}
    assert placed["params"]["proj_out.weight"].sharding.is_fully_replicated
    assert "proj_out.weight" in placed["unmatched"]
    # Nothing that should be a parameter hid among the buffers (torchax files parameters
    # with requires_grad=False as buffers, where no rule sees them).
    assert not any(k.endswith(".weight") for k in placed["buffers"])


def test_fsdp_shards_what_tensor_parallelism_leaves(tiny_checkpoint_8h):
    mesh = make_mesh(MeshShape(2, 2, 2), jax.devices())
    specs, _, _ = sharding.sharding_specs(
        {"blocks.0.attn1.to_q.weight": (96, 96), "proj_out.weight": (64, 96),
         "blocks.0.norm2.weight": (96,)},
        wan.transformer_sharding_rules(), mesh, fsdp=True)
    assert specs["blocks.0.attn1.to_q.weight"] == P("tp", ("dp", "sp"))
    assert specs["proj_out.weight"] == P(None, ("dp", "tp", "sp"))
    assert all(a is None for a in specs["blocks.0.norm2.weight"])  # vectors stay replicated


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


def _collectives(checkpoint, layers, mesh_shape, attention, megatron_sp=False):
    import torchax

    from custom_splash_attention import install_sdpa_override

    model = _tiny_transformer(checkpoint, layers)
    mesh = make_mesh(MeshShape(*mesh_shape), jax.devices())
    args = gf.validate_args(gf.parse_args(["--model_id", checkpoint, *FLAGS]))
    install_sdpa_override(torchax.default_env(), attention=attention, mesh=mesh, interpret=True)
    placed = sharding.place_module(model, mesh, wan.transformer_sharding_rules())
    axes = sharding.residual_token_axes(mesh, megatron_sp)
    hooks = sharding.add_sequence_parallel_hooks(model, mesh, axes=axes) if axes else []
    rep = NamedSharding(mesh, P())
    latents = jax.device_put(np.zeros((1, 16, 3, 8, 12), np.float32), rep)
    embeds = jax.device_put(np.zeros((2, 512, 32), np.float32), NamedSharding(mesh, P("dp")))
    t = jax.device_put(np.array([999], np.int32), rep)
    compiled, _ = compile_step(placed, mesh, wan.step_fn(placed["module"], args), latents, t,
                               {"encoder_hidden_states": embeds})
    for h in hooks:
        h.remove()
    hlo = compiled.as_text()
    return {op: len(re.findall(rf" {op}(-start)?\(", hlo)) for op in COLLECTIVES}


# Collectives per transformer block in the compiled CPU HLO (block count 2 minus block count 1).
# Megatron TP: three activation all-reduces (attention-out, cross-attention-out, FFN-down) and
# two tiny ones, the RMSNorm sums of q and k over tp-sharded features (self and cross).
# Sequence parallel with the Splash wrapper: the same five all-reduces on 1/sp of the tokens,
# plus four all-to-alls (q, k, v to head shards and the output back, Ulysses) and no gathers:
# cross-attention needs none, its K/V are whole on every sp device.
EXPECTED_PER_BLOCK = {
    ((2, 4, 1), "xla", False): {"all-reduce": 5},
    ((2, 2, 2), "splash", False): {"all-reduce": 5, "all-to-all": 4},
    # Megatron SP: the residual stream's tokens over tp; each sublayer (self-attention,
    # cross-attention, FFN) gathers them on entry and scatters its output. XLA:CPU writes the
    # scatter as an all-reduce (TPU forms a reduce-scatter from it), beside the two RMSNorm
    # sums. No weight is gathered (without the sublayer constraints GSPMD gathered 17).
    ((2, 4, 1), "xla", True): {"all-gather": 3, "all-reduce": 5},
}


@pytest.mark.parametrize("mesh_shape,attention,megatron_sp", list(EXPECTED_PER_BLOCK),
                         ids=["tp-xla", "sp-splash", "megatron-sp-xla"])
def test_collectives_per_block_are_pinned(tiny_checkpoint_8h, mesh_shape, attention,
                                          megatron_sp):
    one = _collectives(tiny_checkpoint_8h, 1, mesh_shape, attention, megatron_sp)
    two = _collectives(tiny_checkpoint_8h, 2, mesh_shape, attention, megatron_sp)
    per_block = {op: two[op] - one[op] for op in COLLECTIVES if two[op] - one[op]}
    assert per_block == EXPECTED_PER_BLOCK[(mesh_shape, attention, megatron_sp)]
