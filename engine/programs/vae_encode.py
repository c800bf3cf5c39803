"""The chunked, width-sharded Wan VAE encode on device (image-to-video conditioning).

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

import types

from engine.programs.vae_decode import ChunkedDecoder, feat_cache, split_feat_cache
from engine.run import runtime
from engine.run.mesh import MeshShape, make_mesh
from engine.weights import placement
from engine.weights.sharding import place_module

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
    import jax
    from diffusers.models.autoencoders.autoencoder_kl_wan import patchify
    from torchax import interop

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
        import functools

        super().__init__(placed, mesh, chunk_fn=functools.partial(
                             _encode_chunk_fn, patch_size=vae.config.patch_size),
                         initial_kinds=("none",) * vae._cached_conv_counts["encoder"],
                         latents_mean=vae.config.latents_mean,
                         latents_std=vae.config.latents_std, abstract=abstract)

    def _chunk(self, video, start: int, length: int):
        import jax

        sharding = self.spatial(video.shape) or self.replicated
        key = (sharding, length)
        if key not in self._slicers:
            self._slicers[key] = jax.jit(
                lambda v, i: jax.lax.dynamic_slice_in_dim(v, i, length, axis=2),
                out_shardings=sharding)
        return self._slicers[key](video, start)

    def compile(self, video) -> float:
        import time

        import jax

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
        import jax.numpy as jnp

        kinds, cache, out = self.initial_kinds, [], []
        for i, (start, length) in enumerate(chunks(video.shape[2])):
            x = self._chunk(video, start, length)
            compiled, _ = self._program(kinds, i == 0, x, cache)
            mode, cache = compiled(*self._args(x, cache))
            kinds = self.kinds_out[(kinds, i == 0)]
            out.append(mode)
        return jnp.concatenate(out, axis=2)


def mesh_for(devices):
    """A mesh over ``devices`` for the encode alone (the transformer's mesh comes later): all
    devices on "sp", so the width splits over every one of them."""
    return make_mesh(MeshShape(dp=1, tp=1, sp=len(devices)), devices)


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
        self.vae, self.mesh = vae, mesh_for(devices)
        self.placed, self.encoders, self.seconds = None, {}, {}

    def __call__(self, x, return_dict: bool = True):
        import time

        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

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
