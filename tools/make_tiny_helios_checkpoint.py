"""Build a tiny, randomly initialised Helios checkpoint in diffusers format.

Helios (``BestWishYsh/Helios-Base``, ``-Mid``, ``-Distilled``) is Wan 2.1's 14B trunk with a
multi-term history (``HeliosTransformer3DModel``), Wan 2.1's VAE and UMT5. Every component
here is real and scaled down from the configs in ``configs/BestWishYsh/`` (same patch,
history patches, ``zero_history_timestep``, ``guidance_cross_attn``; 2 heads x 12 dims, 2
blocks), with the tokenizer, UMT5 and a Wan 2.1-style VAE of ``make_tiny_checkpoint.py``.
The VAE's base_dim is 8 rather than 3, so its last up block has more than one channel and
its RMS norm is no sign step (``tests/parity.py`` says why a one-channel norm flips).

Layouts:
    (default)     ``HeliosPipeline`` with ``HeliosScheduler`` (UniPC, one stage, dynamic
                  shifting), as Helios-Base.
    --distilled   ``HeliosPyramidPipeline`` with ``HeliosDMDScheduler`` (three stages,
                  gamma 1/3) and ``is_distilled`` true, as Helios-Distilled.

Usage:
    python tools/make_tiny_helios_checkpoint.py --output checkpoints/tiny-helios
    python tools/make_tiny_helios_checkpoint.py --output checkpoints/tiny-helios-distilled \
        --distilled
"""

from __future__ import annotations

import argparse
import sys

from make_tiny_checkpoint import build_text_encoder, build_tokenizer  # tools/, beside this
from tiny_checkpoint import write_pipeline


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-helios", help="output folder")
    p.add_argument("--heads", type=int, default=2, help="transformer attention heads")
    p.add_argument("--head_dim", type=int, default=12, help="transformer head dimension")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--ffn_dim", type=int, default=32, help="transformer FFN hidden size")
    p.add_argument("--text_dim", type=int, default=32, help="UMT5 hidden size (d_model)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--distilled", action="store_true",
                   help="Helios-Distilled layout: HeliosPyramidPipeline, HeliosDMDScheduler")
    p.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    return p.parse_args(argv)


def build_vae():
    """Wan 2.1's VAE (``AutoencoderKLWan``: z_dim 16, 8x spatial, 4x temporal) shrunk."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True]).eval()


def build_scheduler(distilled: bool):
    """The scheduler of ``configs/BestWishYsh/Helios-{Base,Distilled}/scheduler``."""
    from diffusers import HeliosDMDScheduler, HeliosScheduler

    if distilled:
        return HeliosDMDScheduler(num_train_timesteps=1000, shift=1.0, stages=3,
                                  stage_range=[0, 1 / 3, 2 / 3, 1], gamma=1 / 3,
                                  prediction_type="flow_prediction", use_flow_sigmas=True,
                                  use_dynamic_shifting=True, time_shift_type="linear")
    return HeliosScheduler(num_train_timesteps=1000, shift=1.0, stages=1,
                           prediction_type="flow_prediction", use_flow_sigmas=True,
                           scheduler_type="unipc", use_dynamic_shifting=True,
                           time_shift_type="exponential")


def build_pipeline(args: argparse.Namespace):
    """Every component with random weights from torch's global generator, in a fixed order
    (text encoder, transformer, VAE), so a seed gives the same checkpoint."""
    import torch
    from diffusers import HeliosPipeline, HeliosPyramidPipeline, HeliosTransformer3DModel

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(args, tokenizer)
    transformer = HeliosTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=args.head_dim,
        in_channels=16, out_channels=16, text_dim=args.text_dim, freq_dim=256,
        ffn_dim=args.ffn_dim, num_layers=args.layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_dim=(4, 4, 4), guidance_cross_attn=True,
        zero_history_timestep=True, has_multi_term_memory_patch=True,
        is_amplify_history=False).eval()
    vae = build_vae()
    parts = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                 scheduler=build_scheduler(args.distilled), transformer=transformer)
    if args.distilled:
        return HeliosPyramidPipeline(**parts, is_cfg_zero_star=False, is_distilled=True)
    return HeliosPipeline(**parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    pipe, out = write_pipeline(lambda: build_pipeline(args), args.output, force=args.force,
                               prefix=".tiny-helios-")
    if pipe is None:
        return 0
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"wrote tiny Helios{'-Distilled' if args.distilled else ''} checkpoint to {out} "
          f"(transformer: {n_params:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
