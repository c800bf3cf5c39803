"""Wan 2.2 TI2V-5B image-to-video: the first latent frame held at the image, at t = 0.

diffusers 0.42.1 runs it through ``WanImageToVideoPipeline`` with ``expand_timesteps``
(``pipeline_wan_i2v.py:428-469, 763-770, 819-820``):
    the image alone is VAE-encoded (one frame): ``first_frame`` (1, 48, 1, h, w) float32;
    each step feeds ``(1 - m) * first_frame + m * latents`` with m = 0 on latent frame 0;
    the timestep is per token, (B, S): 0 on frame 0's tokens, t elsewhere;
    after the loop frame 0 of the latents is replaced by ``first_frame``.

The per-token timestep is what this module is about. Given a (B, S) timestep,
``WanTransformer3DModel`` runs its time embedding on every token and each block adds a
(B, S, 6, D) float32 modulation (``transformer_wan.py:469-480``): 4.0 GB for the CFG pair at
704x1280x121. t takes two values only, and the t = 0 tokens are the first n0 = (h/2)(w/2)
(frame 0 in the flattened (F', h/2, w/2) order; sequence parallelism pads at the end). So
``FirstFrameTimesteps`` lets the model run its scalar (B,) path, every token at t, and
recomputes only frame 0's n0 rows at t = 0, through hooks active during one traced call:

    condition_embedder: also run at t = 0 (its text half is the same computation on the
        same inputs, which XLA's CSE merges), giving frame 0's (B, 6, D) modulation and
        (B, D) output-norm embedding.
    each block and its attn1, attn2 and ffn: frame 0's rows of each sublayer's input are
        replaced by the block's own formula at t = 0 (``WanTransformerBlock.forward``, its
        per-token path restricted to those rows), and frame 0's rows of the block's output
        likewise; proj_out's input rows likewise for the output norm.

Every other row is the scalar path's, which per row is the per-token path's arithmetic, so
the model call equals diffusers' (B, S) call (tests/test_wan_i2v.py). What a step holds
extra is a few (B, n0, D) rows (1/31 of the tokens at 121 frames), not a (B, S, 6, D) tensor:
a first version that handed the blocks a per-token select let XLA materialise that tensor,
1.87 GiB more temp per v6e chip at dp2 x tp4; this one costs 0.31 GiB more than
text-to-video (deviceless compiles of the TI2V-5B step, 704x1280x121, README).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import torch

from engine.weights.scan_layers import slice_tokens

NAME = "first_frame"  # the model input and staged tensor: (B, z_dim, 1, h, w) float32


def frame_mask(latents: torch.Tensor) -> torch.Tensor:
    """(1, 1, F', 1, 1) float32: 0 on latent frame 0, 1 elsewhere (``first_frame_mask`` of
    ``WanImageToVideoPipeline.prepare_latents``, broadcast over height and width)."""
    frames = latents.shape[2]
    later = torch.arange(frames, device=latents.device) > 0
    return later.to(torch.float32).view(1, 1, frames, 1, 1)


def model_input(latents: torch.Tensor, first_frame: torch.Tensor) -> torch.Tensor:
    """``(1 - m) * first_frame + m * latents``, float32, as the pipeline computes it before
    casting to the model dtype: latents (1, C, F', h, w), first_frame (B, C, 1, h, w) ->
    (B, C, F', h, w)."""
    m = frame_mask(latents)
    return (1 - m) * first_frame + m * latents


def _with_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x with its first rows.shape[1] tokens replaced by ``rows`` (same dtype)."""
    if type(x).__module__.startswith("torchax"):
        from torchax import interop

        return interop.call_jax(lambda a, r: a.at[:, :r.shape[1]].set(r), x, rows)
    return torch.cat([rows, x[:, rows.shape[1]:]], dim=1)


@dataclasses.dataclass
class _Call:
    first: int  # n0: frame 0's tokens
    temb: torch.Tensor | None = None  # (B, D) at t = 0, the output norm's
    proj: torch.Tensor | None = None  # (B, 6, D) at t = 0, the blocks' modulation
    rows: dict = dataclasses.field(default_factory=dict)  # per block: frame 0's rows
    dtype: torch.dtype | None = None


class FirstFrameTimesteps:
    """Hooks on a ``WanTransformer3DModel`` (see the module docstring); inert outside
    ``with hooks.active(first):``. Install once per model with ``install``."""

    def __init__(self, transformer: torch.nn.Module):
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        self.call: _Call | None = None
        self.owner = t = transformer
        self.parent = {}  # id(attn1 / attn2 / ffn) -> its block (norm1..3 live there)
        self.handles = [
            t.condition_embedder.register_forward_hook(self._embedder, with_kwargs=True),
            t.norm_out.register_forward_pre_hook(self._norm_out_input),
            t.proj_out.register_forward_pre_hook(self._proj_out_input)]
        # Scanned: the template block of the stack (its hooks run inside the scan's body, on
        # the layer's weights); unrolled: every block.
        for block in (m for m in t.modules() if isinstance(m, WanTransformerBlock)):
            self.parent.update({id(block.attn1): block, id(block.attn2): block,
                                id(block.ffn): block})
            self.handles += [
                block.register_forward_pre_hook(self._block_input),
                block.attn1.register_forward_pre_hook(self._attn1_input),
                block.attn1.register_forward_hook(self._attn1_output),
                block.attn2.register_forward_pre_hook(self._attn2_input),
                block.attn2.register_forward_hook(self._attn2_output),
                block.ffn.register_forward_pre_hook(self._ffn_input),
                block.ffn.register_forward_hook(self._ffn_output),
                block.register_forward_hook(self._block_output)]

    @classmethod
    def install(cls, transformer: torch.nn.Module) -> FirstFrameTimesteps:
        hooks = transformer.__dict__.get("_first_frame_timesteps")
        if hooks is None:
            hooks = transformer.__dict__["_first_frame_timesteps"] = cls(transformer)
        return hooks

    @contextlib.contextmanager
    def active(self, first: int):
        """Context: in the next forward the first ``first`` tokens are at t = 0."""
        self.call = _Call(first)
        try:
            yield
        finally:
            self.call = None

    def _embedder(self, module, args, kwargs, output):
        if self.call is not None:
            timestep, *rest = args
            temb0, proj0 = module.forward(torch.zeros_like(timestep), *rest, **kwargs)[:2]
            self.call.temb, self.call.proj = temb0, proj0.unflatten(1, (6, -1))

    def block_of(self, sublayer: torch.nn.Module) -> torch.nn.Module:
        return self.parent[id(sublayer)]

    # The block, as WanTransformerBlock.forward computes its rows; r holds frame 0's.

    def _block_input(self, block, args):
        if self.call is not None:
            self.call.dtype = args[0].dtype  # the residual stream's (the model dtype)
            r = self.call.rows = {"x": slice_tokens(args[0], self.call.first)}  # (B, n0, D)
            r["mod"] = (block.scale_shift_table + self.call.proj.float()).chunk(6, dim=1)

    def _attn1_input(self, attn, args):
        if self.call is not None:
            r = self.call.rows
            x, (shift, scale) = r["x"], r["mod"][:2]
            norm = self.block_of(attn).norm1
            rows = (norm(x.float()) * (1 + scale) + shift).type_as(x)
            return (_with_rows(args[0], rows), *args[1:])

    def _attn1_output(self, attn, args, output):
        if self.call is not None:
            r = self.call.rows
            gate = r["mod"][2]
            attn = slice_tokens(output, self.call.first)
            r["x"] = (r["x"].float() + attn * gate).type_as(r["x"])

    def _attn2_input(self, attn, args):
        if self.call is not None:
            x = self.call.rows["x"]
            rows = self.block_of(attn).norm2(x.float()).type_as(x)
            return (_with_rows(args[0], rows), *args[1:])

    def _attn2_output(self, attn, args, output):
        if self.call is not None:
            r = self.call.rows
            r["x"] = r["x"] + slice_tokens(output, self.call.first)

    def _ffn_input(self, ffn, args):
        if self.call is not None:
            r = self.call.rows
            x, (shift, scale) = r["x"], r["mod"][3:5]
            rows = (self.block_of(ffn).norm3(x.float()) * (1 + scale) + shift).type_as(x)
            return (_with_rows(args[0], rows), *args[1:])

    def _ffn_output(self, ffn, args, output):
        if self.call is not None:
            r = self.call.rows
            gate = r["mod"][5]
            ff = slice_tokens(output, self.call.first).float()
            r["x"] = (r["x"].float() + ff * gate).type_as(r["x"])

    def _block_output(self, block, args, output):
        if self.call is not None:
            return _with_rows(output, self.call.rows.pop("x"))

    # The output norm and projection (WanTransformer3DModel.forward, step 5).

    def _norm_out_input(self, norm, args):
        if self.call is not None:
            # args[0] is hidden_states.float() of the blocks' output: rounded back to its own
            # dtype (exact) the slice reads the blocks' output, where slicing the float32
            # copy made XLA keep that copy for all tokens (320 MiB per v6e chip at dp2).
            x = args[0].to(self.call.dtype)
            self.call.rows = {"x": slice_tokens(x, self.call.first).float()}  # (B, n0, D)

    def _proj_out_input(self, proj, args):
        if self.call is not None:
            x = self.call.rows.pop("x")
            table = self.owner.scale_shift_table
            shift, scale = (table + self.call.temb.unsqueeze(1)).chunk(2, dim=1)
            rows = (self.owner.norm_out(x) * (1 + scale) + shift).type_as(args[0])
            return (_with_rows(args[0], rows), *args[1:])


def timesteps_scope(transformer: torch.nn.Module, latents: torch.Tensor, first_frame):
    """The context of one model call: ``FirstFrameTimesteps`` active for ``latents``
    (1, C, F', h, w) when ``first_frame`` is given, else nothing."""
    if first_frame is None:
        return contextlib.nullcontext()
    _, ph, pw = transformer.config.patch_size
    height, width = latents.shape[3:]
    return FirstFrameTimesteps.install(transformer).active((height // ph) * (width // pw))


def finish(latents, inputs: dict):
    """After the loop: latent frame 0 replaced by the image's latents, as the pipeline does
    (``(1 - m) * condition + m * latents``: exact, m is 0 or 1). ``latents`` (1, C, F', h, w)
    float32 ``jax.Array``; ``inputs`` the placed model inputs; returns the same shape and
    sharding. Other inputs (text-to-video) return ``latents`` unchanged."""
    if NAME not in inputs:
        return latents
    return _first_frame_setter(latents.sharding)(latents, inputs[NAME])


@functools.cache
def _first_frame_setter(sharding):
    """Jitted once per sharding: the decode's AOT programs take the latents as placed."""
    return jax.jit(lambda latents, first: latents.at[:, :, :1].set(
        first[:1].astype(latents.dtype)), out_shardings=sharding)
