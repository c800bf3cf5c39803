"""families/hunyuan.py's ``KeyPaddingAttnProcessor`` against diffusers'
``HunyuanVideo15AttnProcessor2_0`` (float32, eager and through torchax), and the lowering of
its RoPE (families/rope.py): no size-2 minor dimension, no scatter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video15 import (
    HunyuanVideo15AttnProcessor2_0,
    HunyuanVideo15RotaryPosEmbed,
    HunyuanVideo15TransformerBlock,
)
from torchax import interop

from custom_splash_attention import install_sdpa_override
from engine.run import lowering
from families import hunyuan
from families.rope import apply_rope

# The tiny checkpoint's head_dim and RoPE axes (tools/make_tiny_hunyuan_checkpoint.py), but 3
# heads (2 would give the QK norm's statistics a legitimate size-2 minor dimension); a
# 3 x 3 x 5 latent grid (45 video tokens) and 7 text tokens.
HEADS, HEAD_DIM, ROPE_AXES = 3, 16, (4, 6, 6)
VIDEO, TEXT = 45, 7
# Text mask of the two samples: the first with 3 padded tokens, the second all real.
TEXT_MASK = torch.tensor([[True] * 4 + [False] * 3, [True] * TEXT])


def _attention():
    """A block's joint attention (diffusers' processor), its RoPE tables (cos, sin) each
    float32 (45, 16), and its inputs: video (2, 45, 48), text (2, 7, 48)."""
    torch.manual_seed(0)
    block = HunyuanVideo15TransformerBlock(HEADS, HEAD_DIM, mlp_ratio=1.0)
    attn = block.attn.eval()
    rope = HunyuanVideo15RotaryPosEmbed(patch_size=1, patch_size_t=1, rope_dim=list(ROPE_AXES))
    rotary = rope(torch.zeros(1, 1, 3, 3, 5))  # (B, C, F, H, W)
    dim = HEADS * HEAD_DIM
    return attn, rotary, torch.randn(2, VIDEO, dim), torch.randn(2, TEXT, dim)


def _call(attn, processor, video, text, rotary):
    attn.set_processor(processor)
    with torch.no_grad():
        return attn(hidden_states=video, encoder_hidden_states=text, attention_mask=TEXT_MASK,
                    image_rotary_emb=rotary)


def _real_rows(video, text):
    """The outputs a real token reads: every video row, the unpadded text rows (padded query
    rows differ by design: diffusers' dense mask gives them no keys)."""
    return np.concatenate([np.asarray(video).reshape(-1),
                           np.asarray(text)[TEXT_MASK.numpy()].reshape(-1)])


def test_tables_repeat_each_frequency_over_its_lane_pair():
    """The case ``apply_rope`` is exact for: cos and sin at lanes 2i and 2i + 1 equal."""
    _, (cos, sin), _, _ = _attention()
    assert cos.shape == sin.shape == (VIDEO, HEAD_DIM) and cos.dtype == torch.float32
    for table in (cos, sin):
        assert torch.equal(table[:, 0::2], table[:, 1::2])


def test_processor_equals_diffusers_in_float32_eager():
    attn, rotary, video, text = _attention()
    want = _call(attn, HunyuanVideo15AttnProcessor2_0(), video, text, rotary)
    got = _call(attn, hunyuan.KeyPaddingAttnProcessor(), video, text, rotary)
    assert [g.shape for g in got] == [w.shape for w in want] == [video.shape, text.shape]
    np.testing.assert_allclose(_real_rows(*got), _real_rows(*want), rtol=1e-6, atol=1e-6)


def test_processor_under_torchax_matches_diffusers_in_float32(torchax_env):
    """Ours, jitted through torchax with the engine's lowerings and XLA attention, against
    diffusers' eager float32; its HLO has no scatter and no size-2 minor dimension."""
    attn, rotary, video, text = _attention()
    want = _real_rows(*_call(attn, HunyuanVideo15AttnProcessor2_0(), video, text, rotary))
    attn.set_processor(hunyuan.KeyPaddingAttnProcessor())
    install_sdpa_override(torchax_env, attention="xla")
    lowering.install(torchax_env)
    jm = interop.JittableModule(attn)
    params, buffers = torchax_env.t2j_copy(jm.params), torchax_env.t2j_copy(jm.buffers)

    def run(params, buffers, video, text, mask, cos, sin):
        return jm.functional_call("forward", params, buffers, hidden_states=video,
                                  encoder_hidden_states=text, attention_mask=mask,
                                  image_rotary_emb=(cos, sin))

    jitted = jax.jit(interop.jax_view(run))
    args = (params, buffers,
            *(jnp.asarray(a.numpy()) for a in (video, text, TEXT_MASK, *rotary)))
    np.testing.assert_allclose(_real_rows(*jitted(*args)), want, rtol=1e-5, atol=1e-5)
    text_hlo = jitted.lower(*args).as_text()
    assert "scatter" not in text_hlo
    assert "x2xf32>" not in text_hlo and "x2xbf16>" not in text_hlo


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_diffusers_and_lowers_without_pairs(dtype, torchax_env):
    """``apply_rope`` on (B, H, N, D) equals diffusers' ``apply_rotary_emb`` on (B, N, H, D)
    with HunyuanVideo-1.5's tables, bitwise; lowered, diffusers' has a size-2 minor dimension
    (the check can fail) and ours has none."""
    _, (cos, sin), _, _ = _attention()
    x = torch.randn(2, VIDEO, HEADS, HEAD_DIM).to(dtype)
    want = apply_rotary_emb(x, (cos, sin), sequence_dim=1).transpose(1, 2)
    got = apply_rope(x.transpose(1, 2), cos, sin)
    assert got.dtype == dtype and torch.equal(got, want)

    def lowered(fn, *tensors):
        with torchax_env:
            return jax.jit(interop.jax_view(fn)).lower(
                *(torchax_env.t2j_copy(t) for t in tensors)).as_text()

    minor2 = ("x2xf32>", "x2xbf16>")
    theirs = lowered(lambda x, c, s: apply_rotary_emb(x, (c, s), sequence_dim=1), x, cos, sin)
    ours = lowered(apply_rope, x.transpose(1, 2).contiguous(), cos, sin)
    assert any(m in theirs for m in minor2)
    assert not any(m in ours for m in minor2) and "scatter" not in ours
    assert ("dot_general" in ours) == (dtype == torch.bfloat16)


def test_empty_transformer_has_our_processor():
    cfg = dict(in_channels=4, out_channels=2, num_attention_heads=HEADS,
               attention_head_dim=HEAD_DIM, num_layers=2, num_refiner_layers=1, mlp_ratio=1.0,
               patch_size=1, patch_size_t=1, text_embed_dim=8, text_embed_2_dim=8,
               image_embed_dim=8, rope_axes_dim=ROPE_AXES)
    transformer = hunyuan.empty_transformer(cfg, torch.float32)
    for block in transformer.transformer_blocks:
        assert isinstance(block.attn.processor, hunyuan.KeyPaddingAttnProcessor)
