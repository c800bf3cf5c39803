"""HunyuanVideo-1.5's VAE decode as a few compiled programs whose memory is one latent frame's.

diffusers' ``AutoencoderKLHunyuanVideo15.decode`` runs the whole time axis at once. At 720p x
121 frames that is 121 full-resolution frames of 128-1024 channels per activation, and its
mid-block attention builds a (S, S) causal mask over S = 111,600 latent positions with a
Python loop (about 50 GB). Here the decode is split where the decoder's structure allows it,
exactly:

* **Mid program (latent resolution, whole video, one program).** ``conv_in`` and the mid
  block (resnet, attention, resnet) at 31 x 45 x 80 x 1024: under 0.5 GB per activation.
  The mid-block attention is block-causal over latent frames (a position attends every
  position of its own and earlier frames). It runs as a loop over query frames with a mask
  from frame indices (``block_causal_attention``): no (S, S) array, one frame's scores at a
  time.
* **Frame programs (everything after the mid block, one latent frame per call).** The up
  blocks, ``norm_out`` and ``conv_out`` use only causal 3-D convolutions (kernel 3 in time,
  replicate padding at the start), per-position RMS norms and upsamplers. So a latent frame
  decodes from the previous two input frames of every causal conv: carried as explicit
  arrays (``engine.programs.vae_decode.ChunkedDecoder``), as the Wan decode carries its conv cache.
  The first latent frame runs diffusers' own modules unchanged (replicate padding = a cache
  of two copies of the first frame; the temporal upsamplers make one frame of it); every
  later frame feeds each conv its cached frames and takes the upsamplers' "later frames"
  branch. Two programs: first frame, every later frame. The frame's width is sharded over
  every mesh device (GSPMD partitions the convs and exchanges halos), caches included.

Nothing in diffusers' files changes: the causal convs and attention block get run-time
forwards from this module that fall back to diffusers' code outside these programs.
"""

from __future__ import annotations

import contextvars
import functools
import time

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
import torchax.tensor
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from engine.programs.vae_decode import ChunkedDecoder
from engine.run.errors import GenerationError

# The cache of the frame program being traced: a list of arrays in conv-call order.
_CONV_CACHE: contextvars.ContextVar = contextvars.ContextVar("hunyuan_vae_cache",
                                                            default=None)


def is_vae_decode_weight(name: str) -> bool:
    """The decode reads only the decoder; the encoder stays on the host."""
    return name.startswith("decoder.")


class _Cache:
    """Conv-call-ordered cache state of one frame program: ``previous`` (the arrays carried
    in, or None for the first frame) and ``new`` (what the next frame needs)."""

    def __init__(self, previous):
        self.previous, self.new = previous, []

    def take(self):
        return None if self.previous is None else self.previous[len(self.new)]


def _cached_conv_forward(conv, original, x):
    """``HunyuanVideo15CausalConv3d.forward`` with the time padding from the carried cache.

    Outside a frame program: diffusers' forward. Inside: the first frame pads as diffusers
    does (replicate: two copies of its first frame in front); a later frame puts the
    previous two input frames in front instead. Either way the last two input frames (after
    the time padding) are kept for the next frame. x (B, C, T, H, W) -> (B, C', T, H, W).
    """
    cache = _CONV_CACHE.get()
    if cache is None:
        return original(x)
    pw0, pw1, ph0, ph1, pt0, pt1 = conv.time_causal_padding
    previous = cache.take()
    if previous is None:  # replicate padding in time = the first frame, pt0 times
        previous = x[:, :, :1].expand(-1, -1, pt0, -1, -1)
    else:  # carried with its width padded to whole shards (``_frame_fn``): the real columns
        previous = previous[..., :x.shape[-1]]
    x = torch.cat([previous, x], dim=2)
    cache.new.append(x[:, :, -pt0:])
    x = F.pad(x, (pw0, pw1, ph0, ph1, 0, pt1), mode=conv.pad_mode)
    return conv.conv(x)


def _upsample_forward(up, original, x):
    """``HunyuanVideo15Upsample.forward``: in a later frame's program, a temporal upsampler
    takes diffusers' branch for frames after the first for all its frames (every one of
    them has a predecessor); otherwise diffusers' forward."""
    cache = _CONV_CACHE.get()
    if cache is None or cache.previous is None or not up.add_temporal_upsample:
        return original(x)
    h = up._dcae_upsample_rearrange(up.conv(x), r1=2, r2=2, r3=2)
    shortcut = up._dcae_upsample_rearrange(x, r1=2, r2=2, r3=2)
    return h + shortcut.repeat_interleave(repeats=up.repeats, dim=1)


# Bytes of one query chunk's float32 scores in the mid-block attention. One whole query frame
# against every key is 7,973 x 247,163 x 4 B = 7.9 GB at 1080p x 121 (1.6 GB at 720p) in the
# mid program, whose activations are otherwise about 1 GB each there. Chunks of rows bound it.
# (The 1080p decode's peak on v6e was elsewhere: the frame programs' replicated conv caches,
# see _frame_fn; benchmarks/dry_run_results.md.)
SCORE_BYTES = 512 * 2**20


def block_causal_attention(q, k, v, frames: int, score_bytes: int = SCORE_BYTES):
    """Single-head attention where a position attends the positions of its own and earlier
    frames, as ``HunyuanVideo15AttnBlock.prepare_causal_attention_mask`` defines it.

    q, k, v: (B, S, C) JAX arrays, S = frames * positions per frame, frame-major.
    Returns (B, S, C) in q's dtype. Loops (``lax.map``) over chunks of query rows, each
    within one frame, sized so that a chunk's (B, rows, S) float32 scores take at most
    ``score_bytes`` (at least one row; a frame's last chunk is zero-padded, its rows dropped):
    no (S, S) mask is built. Each row's softmax is over all S keys as before, so the result
    does not depend on the chunking. Scores and softmax in float32 (highest matmul
    precision), scale 1/sqrt(C) as torch SDPA.
    """
    b, s, c = q.shape
    per_frame = s // frames
    rows = max(1, min(per_frame, score_bytes // (4 * b * s)))
    chunks = -(-per_frame // rows)  # per frame
    key_frame = jnp.arange(s) // per_frame
    qs = q.reshape(b, frames, per_frame, c)
    qs = jnp.pad(qs, ((0, 0), (0, 0), (0, chunks * rows - per_frame), (0, 0)))
    # (B, frames, chunks * rows, C) -> (frames * chunks, B, rows, C), frame-major
    qs = jnp.moveaxis(qs.reshape(b, frames * chunks, rows, c), 1, 0)
    query_frame = jnp.arange(frames * chunks) // chunks
    kf, vf = k.astype(jnp.float32), v.astype(jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    def one(args):
        f, qf = args
        scores = jnp.einsum("bqc,bkc->bqk", qf.astype(jnp.float32), kf,
                            precision=hi) / jnp.sqrt(jnp.float32(c))
        scores = jnp.where(key_frame[None, None, :] <= f, scores, -jnp.inf)
        p = jax.nn.softmax(scores, axis=-1)
        return jnp.einsum("bqk,bkc->bqc", p, vf, precision=hi)

    out = jax.lax.map(one, (query_frame, qs))  # (frames * chunks, B, rows, C)
    out = jnp.moveaxis(out, 0, 1).reshape(b, frames, chunks * rows, c)[:, :, :per_frame]
    return out.reshape(b, s, c).astype(q.dtype)


def _attention_forward(block, original, x):
    """``HunyuanVideo15AttnBlock.forward`` with ``block_causal_attention`` instead of the
    dense mask (under torchax; plain torch keeps diffusers' forward). Same norm, 1x1
    projections, layout and residual as diffusers. x (B, C, F, H, W)."""
    if not isinstance(x, torchax.tensor.Tensor):
        return original(x)
    identity = x
    x = block.norm(x)
    b, c, f, h, w = x.shape

    def tokens(t):  # (B, C, F, H, W) -> (B, F*H*W, C)
        return t.reshape(b, c, f * h * w).permute(0, 2, 1)

    q, k, v = (tokens(proj(x)) for proj in (block.to_q, block.to_k, block.to_v))
    out = interop.call_jax(functools.partial(block_causal_attention, frames=f), q, k, v)
    out = out.reshape(b, f, h, w, c).permute(0, 4, 1, 2, 3)
    return block.proj_out(out) + identity


def install_decode_overrides(vae) -> None:
    """Give the decoder's causal convs, upsamplers and attention blocks the forwards above
    (instance attributes; the classes and diffusers' files are untouched). Idempotent."""
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanvideo15 as hy

    overrides = ((hy.HunyuanVideo15CausalConv3d, _cached_conv_forward),
                 (hy.HunyuanVideo15Upsample, _upsample_forward),
                 (hy.HunyuanVideo15AttnBlock, _attention_forward))
    for module in vae.decoder.modules():
        for cls, fn in overrides:
            if type(module) is cls and not getattr(module, "_decode_override", False):
                module.forward = functools.partial(fn, module, module.forward)
                module._decode_override = True


def _mid_fn(jm):
    """Torch function: latents (1, C, F', h, w) -> mid-block features (1, 1024, F', h, w)
    float32, latents scaled as ``HunyuanVideo15Pipeline`` does (z / scaling_factor)."""
    def run(model, z):
        d = model.decoder
        x = d.conv_in(z) + z.repeat_interleave(repeats=d.repeat, dim=1)
        return d.mid_block(x)

    def mid(params, buffers, latents, mean, inv_std):
        z = latents.to(torch.float32) / inv_std + mean
        return jm.functional_call(run, params, buffers, z)

    return mid


def _frame_fn(jm, kinds: tuple, first: bool, record: dict, spatial=None, *, width=None):
    """Torch function decoding ONE latent frame of mid-block features with the conv cache as
    explicit state (the ``ChunkedDecoder`` chunk interface).

    (params, buffers, x (1, 1024, 1, h, w), mean, inv_std (unused: the mid program scaled
    the latents), cache list) -> (frames (1, 3, 1 or t, sh, sw) float32 in [-1, 1] (t, s:
    the VAE's temporal and spatial compression),
    new cache list: each causal conv's last two input frames).

    ``spatial``: the width sharding of the program's inputs and outputs (the latent width
    divides over the devices), or None. ``width``: the same sharding, used when ``spatial``
    is None (1080p's 119-wide latents over 8 chips): inside the program the activations are
    split over the devices unevenly (XLA pads the last shards), and a cache output whose
    width does not divide is zero-padded to whole shards, its real columns taken back where
    the next frame reads it (``_cached_conv_forward``). Replicated, those caches were 8 GiB
    per v6e chip at 1072 x 1904, and the next frame's program 34.6 GiB of temporaries."""
    inner = spatial or width

    def constrain(t, kind: str):  # "inside", "frames" (an output) or "cache" (an output)
        if inner is None:
            return t
        where, n = inner, inner.mesh.size
        if kind == "cache" and t.shape[-1] % n:
            t = F.pad(t, (0, -t.shape[-1] % n))
        elif kind == "frames" and t.shape[-1] % n:
            where = NamedSharding(inner.mesh, P())
        return interop.call_jax(jax.lax.with_sharding_constraint, t, where)

    def run(model, x):
        d = model.decoder
        for up_block in d.up_blocks:
            x = up_block(x)
        return d.conv_out(d.conv_act(d.norm_out(x)))

    def frame(params, buffers, x, mean, inv_std, cache):
        state = _Cache(None if first else list(cache))
        token = _CONV_CACHE.set(state)
        try:
            out = jm.functional_call(run, params, buffers, constrain(x, "inside"))
        finally:
            _CONV_CACHE.reset(token)
        record[(kinds, first)] = ("tensor",) * len(state.new)
        out = torch.clamp(out, min=-1.0, max=1.0)
        return constrain(out, "frames"), [constrain(t, "cache") for t in state.new]

    return frame


class HunyuanVaeDecoder:
    """Latents (1, 32, F', h, w) float32 -> video (1, 3, tF'-t+1, sh, sw) float32 in [-1, 1]
    (t, s: the VAE's temporal and spatial compression, 4 and 16 for the released VAE),
    on device: the mid program, then ``engine.programs.vae_decode.ChunkedDecoder`` over the latent
    frames of its output. Same interface as ``ChunkedDecoder`` (``compile``, ``memory``,
    call)."""

    def __init__(self, placed: dict, vae, mesh, *, abstract: bool = False, fallbacks=None):
        install_decode_overrides(placed["module"]._model)
        c = vae.config.latent_channels
        # No "vae_decode_replicated" fallback: an indivisible width is split unevenly inside.
        del fallbacks
        width = (NamedSharding(mesh, P(None, None, None, None, mesh.axis_names))
                 if mesh.size > 1 else None)
        self.frames = ChunkedDecoder(
            placed, mesh, chunk_fn=functools.partial(_frame_fn, width=width),
            initial_kinds=(), latents_mean=[0.0] * c,
            latents_std=[1.0 / vae.config.scaling_factor] * c, abstract=abstract)
        self.placed, self.mid = placed, None

    def spatial(self, shape):
        """The frame programs' width sharding for latents of ``shape``, or None."""
        return self.frames.spatial(shape)

    def _mid_args(self, latents):
        p, f = self.placed, self.frames
        return p["params"], p["buffers"], latents, f.mean, f.inv_std

    def compile(self, latents) -> float:
        """AOT-compile the mid program and every frame program; returns seconds."""
        t0 = time.perf_counter()
        lowered = jax.jit(interop.jax_view(_mid_fn(self.placed["module"])),
                          out_shardings=self.frames.replicated).lower(*self._mid_args(latents))
        self.mid = lowered.compile()
        out = lowered.out_info
        features = jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=self.frames.replicated)
        self.frames.compile(features)
        return time.perf_counter() - t0

    def memory(self) -> dict:
        """Peak per-device bytes over the programs (they run one at a time)."""
        m = self.mid.memory_analysis()
        mid = dict(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                   temp_bytes=m.temp_size_in_bytes,
                   peak_bytes=(m.argument_size_in_bytes + m.output_size_in_bytes
                               + m.temp_size_in_bytes - m.alias_size_in_bytes))
        frames = self.frames.memory()
        peak = max((mid, frames), key=lambda d: d["peak_bytes"])
        return {**peak, "programs": frames["programs"] + 1}

    def program_calls(self) -> list:
        """[(compiled program, calls per decode)]: the mid program once, then the frames'."""
        return [(self.mid, 1), *self.frames.program_calls()]

    def __call__(self, latents):
        return self.frames(self.mid(*self._mid_args(latents)))


def vae_decoder(placed: dict, vae, mesh, *, tiling: bool = False, abstract: bool = False,
                fallbacks=None):
    """The HunyuanVideo-1.5 decode program (see the module docstring).

    Raises:
        GenerationError: ``tiling`` (``--vae_tiling``): diffusers' tiled decode loops over
            about 28 tiles in Python; this family has no such option.
    """
    if tiling:
        raise GenerationError("--vae_tiling is not available for HunyuanVideo-1.5: its "
                              "decode is already frame-chunked and width-sharded")
    return HunyuanVaeDecoder(placed, vae, mesh, abstract=abstract, fallbacks=fallbacks)
