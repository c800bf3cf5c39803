"""HunyuanVideo-1.5 VAE decode (interim): diffusers' own ``decode`` of the whole latent
tensor in one program. Exact, but its memory grows with the whole video."""

from __future__ import annotations


def is_vae_decode_weight(name: str) -> bool:
    """The decode reads only the decoder; the encoder stays on the host."""
    return name.startswith("decoder.")


def _full_fn(jm):
    """Torch function: latents (1, 32, F', h, w) -> video (1, 3, F, H, W) float32 in
    [-1, 1], as ``HunyuanVideo15Pipeline`` decodes (latents / scaling_factor)."""
    import torch

    def decode(params, buffers, latents, mean, inv_std):
        z = latents.to(torch.float32) / inv_std + mean
        video = jm.functional_call("decode", params, buffers, z, return_dict=False)[0]
        return torch.clamp(video, min=-1.0, max=1.0)

    return decode


def vae_decoder(placed: dict, vae, mesh, *, tiling: bool = False, abstract: bool = False,
                fallbacks=None):
    from engine.vae_decode import ChunkedDecoder

    c = vae.config.latent_channels
    return ChunkedDecoder(placed, mesh, chunk_fn=None, initial_kinds=(),
                          latents_mean=[0.0] * c,
                          latents_std=[1.0 / vae.config.scaling_factor] * c,
                          full_fn=_full_fn, abstract=abstract, fallbacks=fallbacks)
