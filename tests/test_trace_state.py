"""Trace-time state survives no raise: a forward that raises mid-trace (a bad request, an
out-of-memory while tracing) leaves no forced attention backend, declared key padding or
self-attention flag set, and the next trace lowers to the same program as one traced before
the raise (i.e. as a fresh process would).

Sites, each under the code path a run takes:
- ``engine.weights.sharding.add_sequence_parallel_hooks``: sequence parallelism's token
  padding (its ``splash.sdpa`` declaration and the hooks' own record), set at the first
  block and dropped after the last;
- ``splash.sdpa.mark_self_attention``: ``IN_SELF_ATTENTION``, set around a self-attention;
- ``families.ltx2.route_short_attentions``: ``forced_attention("xla")`` around the short
  attentions.
(The ``with``-block sites, ``forced_attention``, ``real_keys_before``, ``svg.sparse_scope``,
``kernel.describe_calls``, the Hunyuan VAE's conv cache and ``wan_ti2v``'s ``active``,
reset in a ``finally`` already.)
"""

import jax
import jax.numpy as jnp
import pytest
import torch
from torchax import interop

import custom_splash_attention as csa
import generate_flax as gf
from engine.programs.step import step_shardings
from engine.run.mesh import MeshShape, make_mesh
from engine.weights import sharding
from families import ltx2, wan
from splash import sdpa

FLAGS = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--dtype", "float32", "--attention", "xla", "--compilation_cache_dir", "none"]
ODD = (1, 16, 3, 6, 10)  # 3 x 3 x 5 = 45 video tokens: sp=2 pads them to 46
EVEN = (1, 16, 3, 8, 12)  # 72 tokens: no padding


class Boom(RuntimeError):
    pass


def _raise(*_args, **_kwargs):
    raise Boom("raised mid-trace")


def _defaults() -> dict:
    """Every trace-time ContextVar of the SDPA adapter, as the code being traced sees it."""
    return dict(padding=sdpa.declared_key_padding(), self_attention=sdpa.IN_SELF_ATTENTION.get(),
                forced=sdpa.forced_backend())


FRESH = dict(padding=None, self_attention=False, forced=None)


@pytest.fixture
def wan_sp(tiny_checkpoint_8h, torchax_env):
    """A 2-layer tiny Wan transformer placed on a dp1 x tp1 x sp2 mesh with the run's
    sequence-parallel hooks and XLA attention; yields (model, lower) where ``lower(shape)``
    is the StableHLO text of the run's step program for latents of ``shape``."""
    from diffusers import WanTransformer3DModel

    config = gf.validate_args(gf.parse_args(["--model_id", tiny_checkpoint_8h, *FLAGS]))
    cfg = {k: v for k, v in WanTransformer3DModel.load_config(
        tiny_checkpoint_8h, subfolder="transformer").items() if not k.startswith("_")}
    torch.manual_seed(0)
    model = WanTransformer3DModel(**{**cfg, "num_layers": 2}).eval()
    mesh = make_mesh(MeshShape(1, 1, 2), jax.devices()[:2])
    csa.install_sdpa_override(torchax_env, attention="xla", mesh=mesh)
    placed = sharding.place_module(model, mesh, wan.transformer_sharding_rules())
    hooks = sharding.add_sequence_parallel_hooks(model, mesh)
    in_sh, out_sh = step_shardings(placed, mesh)
    text = jax.ShapeDtypeStruct((2, 512, cfg["text_dim"]), jnp.float32)

    def lower(shape) -> str:
        fn = jax.jit(interop.jax_view(wan.step_fn(placed["module"], config)),
                     in_shardings=in_sh, out_shardings=out_sh)
        return fn.lower(placed["params"], placed["buffers"],
                        jax.ShapeDtypeStruct(shape, jnp.float32),
                        jax.ShapeDtypeStruct((1,), jnp.int32),
                        {"encoder_hidden_states": text}).as_text()

    yield model, lower
    for h in hooks:
        h.remove()


def test_sequence_parallel_padding_is_dropped_when_a_block_raises(wan_sp, monkeypatch):
    """A raise in the second block's FFN, after the first block declared the padding: the
    declaration is gone, and the next traces (45 tokens, padded; 72, not) equal the ones
    before the raise."""
    model, lower = wan_sp
    fresh = {shape: lower(shape) for shape in (ODD, EVEN)}
    assert _defaults() == FRESH
    with monkeypatch.context() as m:
        m.setattr(model.blocks[1].ffn, "forward", _raise)
        with pytest.raises(Boom):
            lower(ODD)
    assert _defaults() == FRESH
    assert lower(EVEN) == fresh[EVEN]
    assert lower(ODD) == fresh[ODD]
    assert _defaults() == FRESH


def test_self_attention_flag_is_reset_when_the_attention_raises(wan_sp, monkeypatch):
    """A raise inside the first block's self-attention (its output projection, after the
    SDPA call): ``IN_SELF_ATTENTION`` is back to False, so the next padded trace's
    cross-attention (512 text keys) is not masked as if it were self-attention."""
    model, lower = wan_sp
    fresh = lower(ODD)
    with monkeypatch.context() as m:
        m.setattr(model.blocks[0].attn1.to_out[0], "forward", _raise)
        with pytest.raises(Boom):
            lower(ODD)
    assert _defaults() == FRESH
    assert lower(ODD) == fresh


class _Attention(torch.nn.Module):
    """Self-attention of x (B, S, 2 x 128) over 2 heads, through torch SDPA; ``inner`` runs
    on its output (a place to raise from inside the hooked module)."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Identity()

    def forward(self, x):
        q = x.unflatten(-1, (2, 128)).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return self.inner(out.transpose(1, 2).flatten(2))


class _Block(torch.nn.Module):
    """An LTX-2 block's attention modules by name (what ``route_short_attentions`` hooks):
    the video self-attention ``attn1`` and the short ones (``ltx2.XLA_ATTENTIONS``)."""

    def __init__(self):
        super().__init__()
        for name in ("attn1", *ltx2.XLA_ATTENTIONS):
            setattr(self, name, _Attention())

    def forward(self, x):
        return self.attn1(self.attn2(x))


def test_forced_xla_is_lifted_when_a_short_attention_raises(torchax_env, monkeypatch):
    """LTX-2's cross-attention (forced to XLA) raises: the next trace's video
    self-attention goes to the Splash kernel again (Pallas, interpret mode on CPU), not to
    XLA, and its program equals the one before the raise."""
    transformer = torch.nn.Module()
    transformer.transformer_blocks = torch.nn.ModuleList([_Block()])
    ltx2.route_short_attentions(transformer)
    block = transformer.transformer_blocks[0]
    csa.install_sdpa_override(torchax_env, attention="splash", interpret=True)
    x = jax.ShapeDtypeStruct((1, 256, 256), jnp.float32)

    def lower() -> str:
        return jax.jit(interop.jax_view(lambda t: block(t))).lower(x).as_text()

    with torchax_env:
        fresh = lower()
        with csa.forced_attention("xla"):
            assert lower() != fresh  # what a leaked forced backend would trace
        with monkeypatch.context() as m:
            m.setattr(block.attn2.inner, "forward", _raise)
            with pytest.raises(Boom):
                lower()
        assert _defaults() == FRESH
        assert lower() == fresh
