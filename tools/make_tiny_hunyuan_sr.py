"""Build tiny, randomly initialised HunyuanVideo-1.5 SR latent upsamplers in the official layout.

The official checkpoint tree (Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7,
``hyvideo/pipelines/hunyuan_video_pipeline.py:1416-1424``) keeps each upsampler as a diffusers
``ModelMixin`` folder: ``upsampler/<version>/config.json`` and
``upsampler/<version>/diffusion_pytorch_model.safetensors``. This writes both versions with
``save_pretrained`` (safetensors), float32, seeded, through this project's classes
(``families.hunyuan_sr``), which carry the official class names and parameter names:

- ``upsampler/720p_sr_distilled``: ``SRTo720pUpsampler`` with 32 latent channels in and out
  (the VAE's), 8 hidden channels, 2 residual blocks, ``global_residual`` on;
- ``upsampler/1080p_sr_distilled``: ``SRTo1080pUpsampler`` with 32 latent channels in and out,
  ``block_out_channels`` (64, 32) (so the input is repeated twice channel-wise) and one
  ResNet block plus one per level (``num_res_blocks=1``).

The RMS-norm gains are drawn around 1 rather than left at 1, so a loader that misses them
fails the tests. The real upsamplers' widths are not published outside their config files;
these are the code's shapes at toy widths. No SR transformer is written (see docs/models.md).

Usage:
    python tools/make_tiny_hunyuan_sr.py --output checkpoints/tiny-hunyuan15-sr
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_checkpoint import write_atomically  # noqa: E402  (tools/, beside this script)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-hunyuan15-sr",
                   help="output folder (gets upsampler/<version>/)")
    p.add_argument("--latent_channels", type=int, default=32, help="VAE latent channels")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> dict:
    """{version: upsampler} with random weights, drawn from torch's global generator."""
    import torch

    sys.path.insert(0, ROOT)
    from families.hunyuan_sr import SRTo720pUpsampler, SRTo1080pUpsampler

    torch.manual_seed(args.seed)
    c = args.latent_channels
    models = {
        "720p_sr_distilled": SRTo720pUpsampler(in_channels=c, out_channels=c, hidden_channels=8,
                                               num_blocks=2, global_residual=True),
        "1080p_sr_distilled": SRTo1080pUpsampler(z_channels=c, out_channels=c,
                                                 block_out_channels=(2 * c, c),
                                                 num_res_blocks=1),
    }
    with torch.no_grad():
        for model in models.values():
            for name, param in model.named_parameters():
                if name.endswith("gamma"):
                    param.copy_(1 + 0.1 * torch.randn_like(param))
    return models


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.output)

    def save(folder):
        for version, model in build(args).items():
            model.save_pretrained(os.path.join(folder, "upsampler", version),
                                  safe_serialization=True)

    if not write_atomically(save, out, force=args.force, prefix=".tiny-hunyuan15-sr-",
                            marker="upsampler"):
        print(f"tiny SR upsamplers already at {out}")
        return 0
    print(f"tiny SR upsamplers written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
