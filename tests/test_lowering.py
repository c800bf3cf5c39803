"""engine/run/lowering.py: strided slice assignment without a scatter, and small minor-dim
unbind as strided slices. References: JAX's own ``.at[].set`` and ``select`` (bit-equal), and
diffusers' Wan attention run eagerly in torch float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torchax

from engine.run import lowering

KEYS = [
    (Ellipsis, slice(0, None, 2)),  # Wan RoPE: out[..., 0::2]
    (Ellipsis, slice(1, None, 2)),  # and out[..., 1::2]
    (slice(1, None, 3), slice(None), slice(2, 7, 2)),  # several strided dims
    (slice(-5, None, 2),),  # negative start
    (slice(None), slice(1, 100, 4)),  # stop past the end
    (slice(None, None, 2), Ellipsis, slice(3, 4, 5)),  # a single index by a step
]


def _x(dtype, shape=(6, 5, 9)):
    return jnp.asarray(np.random.default_rng(0).normal(size=shape) * 8).astype(dtype)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("dtype,val_dtype", [(jnp.bfloat16, jnp.float32),
                                             (jnp.float32, jnp.float32),
                                             (jnp.int32, jnp.float32)])
def test_strided_set_equals_at_set(key, dtype, val_dtype):
    x = _x(dtype)
    shape = x[key].shape
    val = jnp.asarray(np.random.default_rng(1).normal(size=shape) * 100).astype(val_dtype)
    got = lowering.strided_set(x, key, val)
    want = x.at[key].set(val)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_strided_set_broadcasts_and_leaves_empty_ranges():
    x = _x(jnp.float32)
    key = (slice(None), slice(0, None, 2), slice(None))
    row = jnp.arange(9, dtype=jnp.float32)  # broadcast over the first two dims
    np.testing.assert_array_equal(lowering.strided_set(x, key, row), x.at[key].set(row))
    np.testing.assert_array_equal(lowering.strided_set(x, key, 3.5), x.at[key].set(3.5))
    empty = (slice(4, 4, 2),)
    np.testing.assert_array_equal(lowering.strided_set(x, empty, 1.0), x)


@pytest.mark.parametrize("key", [
    (Ellipsis, 0),  # an int
    (slice(None, None, -2),),  # a negative step
    (slice(1, 3),),  # every step 1: .at[].set is a dynamic-update-slice already
    (None, slice(None, None, 2)),  # a new axis
    (jnp.array([0, 2]),),  # an index array
    (Ellipsis, Ellipsis),
])
def test_strided_set_declines_other_keys(key):
    assert lowering.strided_set(_x(jnp.float32), key, 0.0) is None


def test_strided_set_has_no_scatter():
    x = jax.ShapeDtypeStruct((1, 16, 4, 8), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 16, 4, 4), jnp.float32)
    text = jax.jit(lambda x, v: lowering.strided_set(x, (Ellipsis, slice(1, None, 2)), v)
                   ).lower(x, v).as_text()
    assert "scatter" not in text
    assert "scatter" in jax.jit(lambda x, v: x.at[..., 1::2].set(v)).lower(x, v).as_text()


@pytest.mark.parametrize("shape", [(3, 5, 2), (2, 4, 7, 3), (6, 1)])
def test_unbind_minor_equals_select(shape):
    x = _x(jnp.bfloat16, shape)
    parts = lowering.unbind_minor(x)
    assert len(parts) == shape[-1]
    for i, part in enumerate(parts):
        np.testing.assert_array_equal(np.asarray(part), np.asarray(x[..., i]))


def _wan_attention():
    from diffusers.models.transformers.transformer_wan import (
        WanAttention,
        WanAttnProcessor,
        WanRotaryPosEmbed,
    )

    torch.manual_seed(0)
    attn = WanAttention(dim=64, heads=4, dim_head=16, eps=1e-6, processor=WanAttnProcessor()).eval()
    rope = WanRotaryPosEmbed(attention_head_dim=16, patch_size=(1, 2, 2), max_seq_len=32)
    latents = torch.randn(1, 4, 3, 6, 10)  # (B, C, F, H, W): 3 x 3 x 5 = 45 tokens
    hidden = torch.randn(1, 45, 64)
    return attn, rope(latents), hidden


def test_wan_attention_under_torchax_matches_torch_and_lowers_without_scatter():
    """diffusers' own Wan self-attention (its RoPE does unflatten/unbind and strided
    assignment) through torchax with the lowerings installed: equal to torch's eager float32
    run, and its HLO holds no scatter."""
    attn, (cos, sin), hidden = _wan_attention()
    with torch.no_grad():
        want = attn(hidden, rotary_emb=(cos, sin)).numpy()
    from torchax import interop

    from custom_splash_attention import install_sdpa_override

    env = torchax.default_env()
    install_sdpa_override(env, attention="xla")  # other modules may leave a mesh-bound kernel
    lowering.install(env)
    lowering.install(env)  # idempotent
    jm = interop.JittableModule(attn)
    params, buffers = env.t2j_copy(jm.params), env.t2j_copy(jm.buffers)

    def run(params, buffers, hidden, cos, sin):
        return jm.functional_call("forward", params, buffers, hidden, rotary_emb=(cos, sin))

    jitted = jax.jit(interop.jax_view(run))
    args = (params, buffers, *(jnp.asarray(a.numpy()) for a in (hidden, cos, sin)))
    np.testing.assert_allclose(np.asarray(jitted(*args)), want, rtol=1e-5, atol=1e-5)
    assert "scatter" not in jitted.lower(*args).as_text()


@pytest.mark.parametrize("op", ["addcmul_", "addcdiv_"])
def test_inplace_op_on_a_view_writes_back_to_its_base(op):
    """``out[:, :4].addcmul_(a, b)`` under torchax with the engine's lowerings updates
    ``out`` as torch does (torchax 0.0.13 alone drops the update: the slice keeps its old
    values, which this test sees as a difference of about |0.5 * a * b|)."""
    from torchax import interop

    env = torchax.default_env()
    lowering.install(env)
    torch.manual_seed(0)
    x, a, b = torch.randn(2, 8), torch.randn(2, 4), torch.rand(2, 4) + 0.5

    def f(x, a, b):
        out = x.clone()
        getattr(out[:, :4], op)(a, b, value=0.5)
        return out

    want = f(x, a, b).numpy()
    got = jax.jit(interop.jax_view(f))(*(jnp.asarray(t.numpy()) for t in (x, a, b)))
    assert np.abs(want - x.numpy()).max() > 0.1  # the update is not negligible
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)
