"""Build a tiny, randomly initialised LTX-2 latent upsampler (``LTX2LatentUpsamplerModel``).

The two-stage LTX-2 run (``--sr 2x``, ``families/ltx2_upscale.py``) upsamples stage 1's video
latents 2x in space with diffusers' ``LTX2LatentUpsamplePipeline``, whose model lives in the
checkpoint's ``latent_upsampler/`` folder. The real LTX-2.0 config is diffusers'
``get_ltx2_spatial_latent_upsampler_config("2.0")`` (``scripts/convert_ltx2_to_diffusers.py``,
huggingface/diffusers; summarised in /work/shared/notes/ltx2-recipes.md): ``in_channels`` 128,
``mid_channels`` 1024, ``num_blocks_per_stage`` 4, ``dims`` 3, ``spatial_upsample`` true,
``temporal_upsample`` false, ``rational_spatial_scale`` 2.0 (``use_rational_resampler`` left
at its default, true). This keeps every flag and scales the sizes down: ``in_channels`` the
tiny VAE's latent channels (8, ``tools/make_tiny_ltx2_checkpoint.py``), ``mid_channels`` 32
(the GroupNorms take 32 groups), 1 residual block per stage.

Every parameter is drawn away from its init (the GroupNorm gains around 1, biases small), so a
loader that misses one fails the parity tests. Written with ``save_pretrained`` (safetensors),
float32, seeded: ``config.json`` + ``diffusion_pytorch_model.safetensors``.

Usage:
    python tools/make_tiny_ltx2_upsampler.py --output checkpoints/tiny-ltx2/latent_upsampler
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_checkpoint import write_atomically  # noqa: E402  (tools/, beside this script)

# diffusers' get_ltx2_spatial_latent_upsampler_config("2.0") (see the module docstring).
REAL_CONFIG = dict(in_channels=128, mid_channels=1024, num_blocks_per_stage=4, dims=3,
                   spatial_upsample=True, temporal_upsample=False, rational_spatial_scale=2.0)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-ltx2/latent_upsampler",
                   help="output folder (config.json + diffusion_pytorch_model.safetensors)")
    p.add_argument("--latent_channels", type=int, default=8,
                   help="the video VAE's latent channels (the tiny LTX-2 checkpoint's: 8)")
    p.add_argument("--mid_channels", type=int, default=32, help="hidden width (multiple of 32)")
    p.add_argument("--blocks", type=int, default=1, help="residual blocks per stage")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    return p.parse_args(argv)


def build(args: argparse.Namespace):
    """The tiny ``LTX2LatentUpsamplerModel``: ``REAL_CONFIG`` with the sizes of ``args``,
    every parameter drawn (weights ~ N(0, 1 / fan_in), norm gains 1 + N(0, 0.1^2), biases
    N(0, 0.05^2))."""
    import torch
    from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

    torch.manual_seed(args.seed)
    model = LTX2LatentUpsamplerModel(**{
        **REAL_CONFIG, "in_channels": args.latent_channels, "mid_channels": args.mid_channels,
        "num_blocks_per_stage": args.blocks}).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape))
            elif p.ndim >= 2:
                p.copy_(torch.randn(p.shape) * (1.0 / p[0].numel()) ** 0.5)
            else:
                p.copy_(0.05 * torch.randn(p.shape))
    return model


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.output)
    built = []

    def save(folder):
        built.append(build(args))
        built[0].save_pretrained(folder, safe_serialization=True)

    if not write_atomically(save, out, force=args.force, prefix=".tiny-ltx2-upsampler-",
                            marker="config.json"):
        print(f"tiny upsampler already at {out}")
        return 0
    n = sum(p.numel() for p in built[0].parameters())
    print(f"wrote tiny LTX-2 latent upsampler to {out} ({n:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
