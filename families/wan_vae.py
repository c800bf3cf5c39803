"""Wan's VAE programs on the engine's chunked decoder: the decode and the image-to-video encode.

diffusers' ``AutoencoderKLWan`` keeps each causal conv's last input frames in a list
(``feat_cache``) whose entries are None, the string "Rep" or a tensor; ``feat_cache`` and
``split_feat_cache`` turn that list into a program's static "kinds" and its tensors and back,
so ``engine.programs.vae_decode.ChunkedDecoder`` can run one compiled program per chunk with
the cache as explicit arrays (``families/hunyuan_vae.py`` is the other family's example).

Decode: ``vae_decoder`` (one latent frame per program, or diffusers' tiled decode).

Encode: ``ChunkedEncoder`` / ``DeviceEncode``, the chunked, width-sharded encode on device
(image-to-video conditioning).

Wan 2.1 I2V and Wan 2.2 I2V-A14B condition on the VAE encode of a whole video at output size
(the image, then ``frames - 1`` zero frames): about 3.8e14 FLOPs at 720p x 81, minutes on a
CPU. diffusers' ``AutoencoderKLWan._encode`` runs its causal encoder on frame 0, then on
chunks of 4 frames, keeping each causal conv's last input frames in ``feat_cache``; jitting
that loop whole would unroll it, as for the decode. ``ChunkedEncoder`` runs one compiled
program per chunk with the cache as explicit arrays in and out (``engine.programs.vae_decode``'s
machinery: the cache's None/tensor pattern is static per program), so the encode compiles to
a few programs (the first frame, the first 4-frame chunk, every later chunk) and each chip
encodes 1/n of the width (GSPMD partitions the convs spatially and exchanges halos).

The zero frames cannot be skipped: the caches carry frame-1 features into them
(``autoencoder_kl_wan.py`` ``_encode``; see ../shared/notes/wan-2.2-and-i2v.md).

Wan 2.2 TI2V-5B encodes the image alone (one frame, one program) with the Wan 2.2 VAE. It
runs here too: on this project's 2-core CPU host a 704x1280 frame took 33.9 s in float32
(``AutoencoderKLWan.encode`` with the TI2V-5B VAE config, random weights), not seconds.
"""

from __future__ import annotations

import functools
import time
import types

import jax
import jax.numpy as jnp
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from engine.programs.vae_decode import ChunkedDecoder
from engine.run import runtime
from engine.run.mesh import spatial_mesh
from engine.weights import placement
from engine.weights.sharding import place_module


def feat_cache(kinds: tuple, cache) -> list:
    """The ``feat_cache`` list a causal VAE's convolutions take (diffusers' Wan VAE), from a
    program's static cache ``kinds`` and its cache tensors in order: None for "none", the
    placeholder string "Rep" for "rep", the next tensor for "tensor"."""
    tensors = iter(cache)
    return [None if k == "none" else "Rep" if k == "rep" else next(tensors) for k in kinds]


def split_feat_cache(feat: list) -> tuple[tuple, list]:
    """``feat_cache``'s inverse, after a chunk ran: (its kinds, its tensors in order)."""
    kinds = tuple("none" if f is None else "rep" if isinstance(f, str) else "tensor"
                  for f in feat)
    return kinds, [f for f in feat if f is not None and not isinstance(f, str)]


# The VAE decode reads only these weights; the encoder (~0.2 GB float32) stays on the host.
VAE_DECODE_PREFIXES = ("decoder.", "post_quant_conv.")


def is_vae_decode_weight(name: str) -> bool:
    return name.startswith(VAE_DECODE_PREFIXES)


def _vae_full_fn(jm):
    """Torch function: normalised latents (1, z_dim, F', H/s, W/s) -> video (1, 3, F, H, W)
    in [-1, 1], float32, through diffusers' own ``decode`` (used with ``--vae_tiling``)."""
    def decode(params, buffers, latents, mean, inv_std):
        z = latents.to(torch.float32) / inv_std + mean
        return jm.functional_call("decode", params, buffers, z, return_dict=False)[0]

    return decode


def _vae_chunk_fn(jm, kinds: tuple, first: bool, record: dict, spatial=None,
                  patch_size: int | None = None):
    """Torch function decoding ONE latent frame with the causal-conv cache as explicit state.

    diffusers' ``AutoencoderKLWan._decode`` loops over latent frames in Python, keeping each
    causal conv's last input frames in a list (``feat_cache``) whose entries are None, the
    string "Rep" (an upsampler's first chunk) or a tensor. Jitting that whole loop unrolls it:
    at 720p x 81 frames XLA then needs 88 GB of temporaries per v6e chip. Here one call decodes
    one latent frame; the tensor entries go in and out as arrays and the None/"Rep" pattern
    (``kinds``) is static, so the decode compiles to three programs (first frame, second
    frame, every later frame) whose memory is one frame's worth.

    ``record[(kinds, first)]`` receives the kinds of the cache this call returns. ``spatial``
    (a ``NamedSharding``) splits the frame's width over the mesh: GSPMD then partitions every
    conv spatially, exchanging halos, so each chip decodes 1/n of the width instead of all chips
    decoding the same frame.
    The Wan 2.2 VAE (``patch_size`` 2) runs the same decoder loop (its residual up blocks
    carry their own ``first_chunk`` slicing and cache entries) and then ``unpatchify``s the
    whole output once (``AutoencoderKLWan._decode``); ``unpatchify`` only moves channels into
    2x2 pixel blocks of the same frame, so applying it to each frame's chunk is the same, and
    so is clamping before or after it.
    Signature of the returned function:
        (params, buffers, z (1, z_dim, 1, h, w), mean, inv_std, cache list)
        -> (video chunk (1, 3, 1 or 4, s*h, s*w) float32 in [-1, 1] with s the VAE's spatial
        scale (8, or 16 with patch_size 2), new cache list)
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify
    def run(model, z, feat):
        x = model.post_quant_conv(z)
        return model.decoder(x, feat_cache=feat, feat_idx=[0], first_chunk=first)

    def chunk(params, buffers, z, mean, inv_std, cache):
        if spatial is not None:
            z = interop.call_jax(jax.lax.with_sharding_constraint, z, spatial)
        z = z.to(torch.float32) / inv_std + mean
        feat = feat_cache(kinds, cache)
        out = jm.functional_call(run, params, buffers, z, feat)
        record[(kinds, first)], new_cache = split_feat_cache(feat)
        if patch_size is not None:
            out = unpatchify(out, patch_size=patch_size)
        out = torch.clamp(out, min=-1.0, max=1.0)
        if spatial is not None:
            # Keep the carried cache and the frames width-sharded too, or they come back
            # replicated: at 720p the cache alone is ~8 GB per chip.
            out, *new_cache = (interop.call_jax(jax.lax.with_sharding_constraint, t, spatial)
                               for t in (out, *new_cache))
        return out, list(new_cache)

    return chunk


def vae_decoder(placed: dict, vae, mesh, *, tiling: bool = False, abstract: bool = False,
                fallbacks=None):
    """The Wan VAE decode (Wan 2.1's, or Wan 2.2's with ``patch_size``) as an
    ``engine.programs.vae_decode.ChunkedDecoder``: frame-chunked with the causal-conv cache as
    explicit state (default) or, with ``tiling``, diffusers' spatially tiled ``decode`` in one
    program."""
    if tiling:
        vae.enable_tiling()
    return ChunkedDecoder(
        placed, mesh, chunk_fn=functools.partial(_vae_chunk_fn,
                                                 patch_size=vae.config.patch_size),
        initial_kinds=("none",) * vae._cached_conv_counts["decoder"],
        latents_mean=vae.config.latents_mean, latents_std=vae.config.latents_std,
        full_fn=_vae_full_fn if tiling else None, abstract=abstract, fallbacks=fallbacks)


# Wan's VAE: frame 0 alone, then 4 frames per chunk (one latent frame each).
TEMPORAL_CHUNK = 4
ENCODER_PREFIXES = ("encoder.", "quant_conv.")


def is_encode_weight(name: str) -> bool:
    return name.startswith(ENCODER_PREFIXES)


def chunks(frames: int) -> list[tuple[int, int]]:
    """(start, length) of each encoder call for ``frames`` (= 4n + 1) pixel frames."""
    return [(0, 1)] + [(1 + TEMPORAL_CHUNK * i, TEMPORAL_CHUNK)
                       for i in range((frames - 1) // TEMPORAL_CHUNK)]


def _encode_chunk_fn(jm, kinds: tuple, first: bool, record: dict, spatial=None,
                     patch_size: int | None = None):
    """Torch function encoding one chunk with the causal-conv cache as explicit state:
    (params, buffers, x (1, 3, 1 or 4, H, W) float32 in [-1, 1], mean, inv_std, cache list)
    -> (posterior mode (1, z_dim, 1, H/s, W/s) float32, new cache list), s the VAE's spatial
    scale (8; 16 for Wan 2.2's). ``quant_conv`` is a 1x1x1 conv, so applying it per chunk
    equals applying it to the concatenated output; the mode is the mean half of its channels
    (``DiagonalGaussianDistribution``). The Wan 2.2 VAE (``patch_size`` 2) ``patchify``s the
    whole video first (``AutoencoderKLWan._encode``); it moves each frame's 2x2 pixel blocks
    into channels, so patchifying each chunk is the same."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify
    def run(model, x, feat):
        return model.quant_conv(model.encoder(x, feat_cache=feat, feat_idx=[0]))

    def constrain(t):
        return interop.call_jax(jax.lax.with_sharding_constraint, t, spatial)

    def chunk(params, buffers, x, mean, inv_std, cache):
        del mean, inv_std  # the encode returns the raw posterior mode, as diffusers' encode
        if spatial is not None:
            x = constrain(x)
        if patch_size is not None:
            x = patchify(x, patch_size=patch_size)
        feat = feat_cache(kinds, cache)
        out = jm.functional_call(run, params, buffers, x, feat)
        record[(kinds, first)], new_cache = split_feat_cache(feat)
        mode = out[:, : out.shape[1] // 2]
        if spatial is not None:  # keep the carried cache width-sharded, as the decode does
            mode, *new_cache = (constrain(t) for t in (mode, *new_cache))
        return mode, list(new_cache)

    return chunk


class ChunkedEncoder(ChunkedDecoder):
    """Video (1, 3, F, H, W) float32 in [-1, 1] -> posterior mode (1, z_dim, (F-1)/4+1, H/s,
    W/s) float32 (s = 8, or 16 for the Wan 2.2 VAE), on device:
    ``AutoencoderKLWan.encode(x).latent_dist.mode()``.

    Args:
        placed: the VAE's encoder weights (``sharding.place_module`` with
            ``include=is_encode_weight``; replicated: a conv net's weights are small).
        mesh: any mesh; the width splits over all its devices when it divides.
        vae: the diffusers ``AutoencoderKLWan`` (Wan 2.1's, or Wan 2.2's with patchify).
        abstract: deviceless AOT compile (dry run): shapes only.

    ``compile(video)`` (array or ShapeDtypeStruct) AOT-compiles every program and returns
    seconds; ``memory()`` gives the per-device HBM of the largest; call to encode.
    """

    def __init__(self, placed: dict, mesh, vae, *, abstract: bool = False):
        super().__init__(placed, mesh, chunk_fn=functools.partial(
                             _encode_chunk_fn, patch_size=vae.config.patch_size),
                         initial_kinds=("none",) * vae._cached_conv_counts["encoder"],
                         latents_mean=vae.config.latents_mean,
                         latents_std=vae.config.latents_std, abstract=abstract)

    def _chunk(self, video, start: int, length: int):
        sharding = self.spatial(video.shape) or self.replicated
        key = (sharding, length)
        if key not in self._slicers:
            self._slicers[key] = jax.jit(
                lambda v, i: jax.lax.dynamic_slice_in_dim(v, i, length, axis=2),
                out_shardings=sharding)
        return self._slicers[key](video, start)

    def compile(self, video) -> float:
        t0 = time.perf_counter()
        b, c, f, h, w = video.shape
        kinds, cache = self.initial_kinds, []
        for i, (_, length) in enumerate(chunks(f)[:3]):  # later chunks reuse the third
            x = jax.ShapeDtypeStruct((b, c, length, h, w), video.dtype,
                                     sharding=self.spatial(video.shape) or self.replicated)
            _, cache = self._program(kinds, i == 0, x, cache)
            kinds = self.kinds_out[(kinds, i == 0)]
        return time.perf_counter() - t0

    def __call__(self, video):
        kinds, cache, out = self.initial_kinds, [], []
        for i, (start, length) in enumerate(chunks(video.shape[2])):
            x = self._chunk(video, start, length)
            compiled, _ = self._program(kinds, i == 0, x, cache)
            mode, cache = compiled(*self._args(x, cache))
            kinds = self.kinds_out[(kinds, i == 0)]
            out.append(mode)
        return jnp.concatenate(out, axis=2)


class DeviceEncode:
    """Stands in for ``vae.encode`` inside a diffusers pipeline call (``prepare_latents``):
    runs ``ChunkedEncoder`` on ``devices`` and returns what ``retrieve_latents(...,
    sample_mode="argmax")`` reads, ``.latent_dist.mode()``, as a CPU float32 tensor.

    The encoder weights are placed (replicated on every device) on first use, which frees
    their host copies (``place_module``), and stay placed as long as this object lives; each
    video shape gets its own ``ChunkedEncoder`` on those weights, compiled on first use. A
    CLI run makes one for its one encode and drops it; the server keeps one for its life
    (the families' ``encode_image(..., resident=...)``), so a job's encode runs programs
    compiled at start on weights placed once. ``seconds`` records the last call's
    placement, compile (0 when its shape was compiled before) and encode times.
    """

    def __init__(self, vae, devices):
        self.vae, self.mesh = vae, spatial_mesh(devices)
        self.placed, self.encoders, self.seconds = None, {}, {}

    def __call__(self, x, return_dict: bool = True):
        t0 = time.perf_counter()
        if self.placed is None:
            self.placed = place_module(self.vae, self.mesh, include=is_encode_weight,
                                       desc="VAE encoder")
        host = placement.host_array(x.float().contiguous())
        encoder = self.encoders.get(host.shape)
        fresh = encoder is None
        if fresh:
            encoder = self.encoders[host.shape] = ChunkedEncoder(self.placed, self.mesh,
                                                                 self.vae)
        spatial = encoder.spatial(host.shape) or NamedSharding(self.mesh, P())
        video = placement.place_array(host, spatial)
        t1 = time.perf_counter()
        self.seconds["compile_s"] = encoder.compile(video) if fresh else 0.0
        t2 = time.perf_counter()
        mode = runtime.torch_from_jax(encoder(video))
        self.seconds.update(place_s=t1 - t0, encode_s=time.perf_counter() - t2)
        dist = types.SimpleNamespace(mode=lambda: mode)
        return types.SimpleNamespace(latent_dist=dist) if return_dict else (dist,)
