"""families/wan_attention.py: our Wan attention processor against diffusers' ``WanAttnProcessor``
(float32, eager and through torchax), its RoPE (families/rope.py) against complex
multiplication in float64, and its lowering (no size-2 minor dimension, no scatter)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanRotaryPosEmbed,
)
from torchax import interop

from custom_splash_attention import install_sdpa_override
from engine.run import lowering
from families import wan
from families.rope import apply_rope, rotate_pairs
from families.wan_attention import WanRopeAttnProcessor

HEADS, HEAD_DIM = 4, 16


def _attention(kind: str):
    """A small WanAttention, RoPE tables of a 3 x 3 x 5 latent grid (45 tokens), its inputs.

    kind: "self" (RoPE), "cross" (512 text tokens, no RoPE), "i2v" (cross-attention with
    added image keys: 7 image + 512 text tokens)."""
    torch.manual_seed(0)
    dim = HEADS * HEAD_DIM
    attn = WanAttention(dim=dim, heads=HEADS, dim_head=HEAD_DIM, eps=1e-6,
                        added_kv_proj_dim=dim if kind == "i2v" else None,
                        cross_attention_dim_head=HEAD_DIM if kind != "self" else None,
                        processor=WanAttnProcessor()).eval()
    rope = WanRotaryPosEmbed(attention_head_dim=HEAD_DIM, patch_size=(1, 2, 2), max_seq_len=32)
    cos, sin = rope(torch.randn(1, 4, 3, 6, 10))  # (B, C, F, H, W) -> (1, 45, 1, 16) each
    hidden = torch.randn(2, 45, dim)
    if kind == "self":
        return attn, hidden, dict(rotary_emb=(cos.float(), sin.float()))
    text = torch.randn(2, 512 + (7 if kind == "i2v" else 0), dim)
    return attn, hidden, dict(encoder_hidden_states=text)


def _call(attn, processor, hidden, kw):
    attn.set_processor(processor)
    with torch.no_grad():
        return attn(hidden, **kw)


@pytest.mark.parametrize("kind", ["self", "cross", "i2v"])
def test_processor_equals_diffusers_in_float32_eager(kind):
    attn, hidden, kw = _attention(kind)
    want = _call(attn, WanAttnProcessor(), hidden, kw)
    got = _call(attn, WanRopeAttnProcessor(), hidden, kw)
    # Same products, summed in the same pairs (a - b is a + (-b) in IEEE arithmetic).
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_processor_under_torchax_matches_diffusers_in_float32(torchax_env):
    """Ours, jitted through torchax with the engine's lowerings, against diffusers' eager
    float32; its HLO has no scatter and no size-2 minor dimension."""
    attn, hidden, kw = _attention("self")
    want = _call(attn, WanAttnProcessor(), hidden, kw).numpy()
    attn.set_processor(WanRopeAttnProcessor())
    install_sdpa_override(torchax_env, attention="xla")
    lowering.install(torchax_env)
    jm = interop.JittableModule(attn)
    params, buffers = torchax_env.t2j_copy(jm.params), torchax_env.t2j_copy(jm.buffers)

    def run(params, buffers, hidden, cos, sin):
        return jm.functional_call("forward", params, buffers, hidden, rotary_emb=(cos, sin))

    jitted = jax.jit(interop.jax_view(run))
    cos, sin = kw["rotary_emb"]
    args = (params, buffers, *(jnp.asarray(a.numpy()) for a in (hidden, cos, sin)))
    np.testing.assert_allclose(np.asarray(jitted(*args)), want, rtol=1e-5, atol=1e-5)
    text = jitted.lower(*args).as_text()
    assert "scatter" not in text
    assert "x2xf32>" not in text and "x2xbf16>" not in text


def _complex_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Independent reference: lanes (2i, 2i + 1) as x_2i + j x_2i+1, times e^(j theta_i), in
    complex128; cos/sin of pair i read at lane 2i."""
    z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2].astype(np.float64)
    z = z * (cos[..., 0::2].astype(np.float64) + 1j * sin[..., 0::2].astype(np.float64))
    return np.stack([z.real, z.imag], axis=-1).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_matches_complex_rotation(dtype, torchax_env):
    """Both swap paths (bf16: the permutation matmul; float32: rolls and a select), eager and
    through torchax, against complex multiplication; the swap itself exactly."""
    _, _, kw = _attention("self")
    cos, sin = kw["rotary_emb"]
    x = torch.randn(2, 45, HEADS, HEAD_DIM).to(dtype)
    swapped = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    assert torch.equal(rotate_pairs(x), swapped)
    want = _complex_rope(x.float().numpy(), cos.numpy(), sin.numpy())
    eager = apply_rope(x, cos, sin)
    jitted = jax.jit(interop.jax_view(apply_rope))
    args = [torchax_env.t2j_copy(t) for t in (x, cos, sin)]
    with torchax_env:
        lowered = jitted(*args)
        text = jitted.lower(*args).as_text()
    # No pair split: no array with a size-2 last dimension, no scatter; bf16 swaps by a dot.
    assert "x2xf32>" not in text and "x2xbf16>" not in text and "scatter" not in text
    assert ("dot_general" in text) == (dtype == torch.bfloat16)
    tol = 1e-6 if dtype == torch.float32 else 2.0 ** -8  # one rounding to x's dtype
    for got in (eager.float().numpy(), np.asarray(lowered.astype(jnp.float32))):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    assert eager.dtype == dtype


def test_empty_transformer_has_our_processor():
    cfg = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12,
               in_channels=4, out_channels=4, text_dim=16, freq_dim=8, ffn_dim=32,
               num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
               eps=1e-6, rope_max_seq_len=32)
    transformer = wan.empty_transformer(cfg, torch.float32)
    for block in transformer.blocks:
        assert isinstance(block.attn1.processor, WanRopeAttnProcessor)
        assert isinstance(block.attn2.processor, WanRopeAttnProcessor)
