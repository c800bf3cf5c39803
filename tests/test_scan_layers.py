"""scan_layers: the scanned transformer equals the unrolled one, unsharded and on a mesh.

A tiny random Wan transformer (8 heads x 12 dims, FFN 64, 3 blocks) in float32. Tolerance
1e-5: the scanned and unrolled programs run the same ops on the same values; only XLA's
fusion and, on a mesh, the order of partial sums across devices differ (observed ~1e-6).
"""

import copy
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from engine.run.mesh import MeshShape, make_mesh  # noqa: E402
from engine.weights import scan_layers as sl  # noqa: E402
from engine.weights import sharding  # noqa: E402
from families import wan  # noqa: E402

LAYERS = 3
ATOL = 1e-5


def _stacked_name(name: str) -> str | None:
    """"blocks.7.attn1.to_q.weight" -> "blocks.stacked.attn1.to_q.weight"; else None."""
    parts = name.split(".", 2)
    return sl.STACKED_PREFIX + parts[2] if parts[0] == "blocks" and parts[1].isdigit() else None


def _model():
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=12, in_channels=16,
        out_channels=16, text_dim=32, freq_dim=256, ffn_dim=64, num_layers=LAYERS,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()


@pytest.fixture(scope="module")
def models():
    """(unrolled, scanned) copies of one random model."""
    import torchax

    from custom_splash_attention import install_sdpa_override

    # Other test modules install a mesh-bound kernel in the shared env; pin plain XLA here.
    install_sdpa_override(torchax.default_env(), attention="xla")
    unrolled = _model()
    scanned = copy.deepcopy(unrolled)
    sl.scan_blocks(scanned)
    return unrolled, scanned


@pytest.fixture(scope="module")
def inputs():
    """latents (2, 16, 3, 8, 12) -> 3 x 4 x 6 = 72 tokens; timesteps (2,); text (2, 7, 32)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 3, 8, 12, generator=g)
    t = torch.tensor([999, 500], dtype=torch.int32)
    e = torch.randn(2, 7, 32, generator=g)
    return x, t, e


def _specs(model, shapes, rules, mesh, fsdp):
    """generate_flax's specs; for a scanned model, through stacked_sharding_specs."""
    if isinstance(model.blocks, sl.ScannedBlocks):
        return sl.stacked_sharding_specs(sharding.sharding_specs, shapes, rules, mesh,
                                         num_layers=LAYERS, fsdp=fsdp)[0]
    return sharding.sharding_specs(shapes, rules, mesh, fsdp=fsdp)[0]


def _run(model, inputs, mesh=None, rules=(), sp_hooks=False, fsdp=None):
    """Jit the model's forward the way generate_flax.compile_transformer_step does.

    ``fsdp`` None: specs from ``rules`` as given; True/False: specs from the unstacked
    ``rules`` (via stacked_sharding_specs for a scanned model) with that fsdp setting."""
    import torchax
    from torchax import interop

    env = torchax.default_env()
    jm = interop.JittableModule(model)
    params, buffers = env.t2j_copy(jm.params), env.t2j_copy(jm.buffers)
    x, t, e = (jnp.asarray(a.numpy()) for a in inputs)
    kwargs = {}
    hooks = []
    if mesh is not None:
        shapes = {k: v.shape for k, v in params.items()}
        if fsdp is None:
            specs, _, _ = sharding.sharding_specs(shapes, rules, mesh)
        else:
            specs = _specs(model, shapes, rules, mesh, fsdp)
        param_sh = {k: NamedSharding(mesh, s) for k, s in specs.items()}
        params = {k: jax.device_put(v, param_sh[k]) for k, v in params.items()}
        rep = NamedSharding(mesh, P())
        kwargs = dict(in_shardings=(param_sh, rep, NamedSharding(mesh, P("dp")), rep,
                                    NamedSharding(mesh, P("dp"))), out_shardings=rep)
        if sp_hooks:
            hooks = sharding.add_sequence_parallel_hooks(model, mesh)

    def fwd(params, buffers, x, t, e):
        return jm.functional_call("forward", params, buffers, hidden_states=x, timestep=t,
                                  encoder_hidden_states=e, return_dict=False)[0]

    try:
        jitted = jax.jit(interop.jax_view(fwd), **kwargs)
        lowered = jitted.lower(params, buffers, x, t, e)
        out = np.asarray(lowered.compile()(params, buffers, x, t, e))
    finally:
        for h in hooks:
            h.remove()
    return out, lowered.as_text(), params


@pytest.fixture(scope="module")
def unrolled_run(models, inputs):
    """(output, StableHLO text) of the unrolled model, unsharded."""
    out, hlo, _ = _run(models[0], inputs)
    return out, hlo


@pytest.fixture(scope="module")
def reference(unrolled_run):
    return unrolled_run[0]


def test_scan_blocks_stacks_every_block_weight(models):
    unrolled, scanned = models
    ref, new = unrolled.state_dict(), scanned.state_dict()
    per_block = [k for k in ref if k.startswith("blocks.0.")]
    assert len(new) == len(ref) - (LAYERS - 1) * len(per_block)
    for k in per_block:
        name = _stacked_name(k)
        assert new[name].shape == (LAYERS, *ref[k].shape) and new[name].dtype == ref[k].dtype
        for i in range(LAYERS):
            assert torch.equal(new[name][i], ref[k.replace("blocks.0.", f"blocks.{i}.", 1)])
    # torchax treats parameters without requires_grad as buffers: keep them parameters.
    assert all(p.requires_grad for p in scanned.parameters())
    assert len(list(scanned.blocks)) == 1


def test_eager_torch_fallback_equals_unrolled(models, inputs):
    unrolled, scanned = models
    with torch.no_grad():
        a = unrolled(*inputs, return_dict=False)[0]
        b = scanned(*inputs, return_dict=False)[0]
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_scanned_equals_unrolled_one_device(models, inputs, unrolled_run):
    reference, unrolled_hlo = unrolled_run
    out, hlo, _ = _run(models[1], inputs)
    np.testing.assert_allclose(out, reference, atol=ATOL, rtol=0)
    # The compiled program holds the block once, inside a loop.
    assert "stablehlo.while" in hlo
    assert "stablehlo.while" not in unrolled_hlo
    assert len(hlo) < len(unrolled_hlo)


def test_stacked_specs_keep_megatron_layout_on_the_layer_axis(models):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    _, scanned = models
    mesh = make_mesh(MeshShape(1, 4, 1), jax.devices()[:4])
    shapes = {k: tuple(v.shape) for k, v in scanned.named_parameters()}
    specs = _specs(scanned, shapes, wan.transformer_sharding_rules(), mesh, fsdp=False)
    assert specs["blocks.stacked.attn1.to_q.weight"] == P(None, "tp", None)
    assert specs["blocks.stacked.attn2.to_out.0.weight"] == P(None, None, "tp")
    assert specs["blocks.stacked.ffn.net.0.proj.bias"] == P(None, "tp")
    # Non-block weights keep their own rules.
    assert specs["condition_embedder.text_embedder.linear_1.weight"] == P("tp", None)


@pytest.mark.parametrize("mesh_shape", [(2, 4, 1), (1, 2, 4)], ids=["dp2-tp4", "tp2-sp4"])
def test_scanned_equals_unrolled_on_mesh(models, inputs, reference, mesh_shape):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = make_mesh(MeshShape(*mesh_shape), jax.devices()[:8])
    rules = wan.transformer_sharding_rules()
    sp = mesh_shape[2] > 1
    out, _, params = _run(models[1], inputs, mesh, rules, sp_hooks=sp, fsdp=False)
    np.testing.assert_allclose(out, reference, atol=ATOL, rtol=0)
    tp = mesh_shape[1]
    q = params["blocks.stacked.attn1.to_q.weight"]
    assert q.sharding.spec == P(None, "tp", None)
    # Each device holds every layer's rows 1/tp of the way: the layer axis is not split.
    assert q.addressable_shards[0].data.shape == (LAYERS, 96 // tp, 96)


def test_stacked_sharding_specs_equal_unrolled_specs_with_fsdp(models, inputs, reference):
    """FSDP decides on the unstacked view, so it never shards the layer axis; the sharded
    scanned run (dp2 tp2 sp2 + FSDP) still equals the unsharded unrolled run."""
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    unrolled, scanned = models
    mesh = make_mesh(MeshShape(2, 2, 2), jax.devices()[:8])
    rules = wan.transformer_sharding_rules()
    shape = lambda m: {k: tuple(v.shape) for k, v in m.named_parameters()}  # noqa: E731
    want, want_counts, _ = sharding.sharding_specs(shape(unrolled), rules, mesh, fsdp=True)
    got, counts, _ = sl.stacked_sharding_specs(sharding.sharding_specs, shape(scanned), rules, mesh,
                                               num_layers=LAYERS, fsdp=True)
    assert counts == want_counts
    for name, spec in want.items():
        stacked = _stacked_name(name)
        assert got[stacked or name] == (P(None, *spec) if stacked else spec), name
    out, _, _ = _run(scanned, inputs, mesh, rules, sp_hooks=True, fsdp=True)
    np.testing.assert_allclose(out, reference, atol=ATOL, rtol=0)
