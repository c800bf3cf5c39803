"""Build a tiny, randomly initialised Wan VACE checkpoint (``WanVACEPipeline``) in diffusers
format, for tests and demos without a model hub.

The transformer is ``WanVACETransformer3DModel`` with the real checkpoints' structure scaled
down: Wan2.1-VACE-1.3B (diffusers' ``scripts/convert_wan_to_diffusers.py``, its
"Wan-VACE-1.3B" config: 30 layers x 1536 wide, VACE blocks after every other layer,
``vace_layers`` 0, 2, ..., 28, ``vace_in_channels`` 96) becomes ``--layers`` (default 4)
layers with VACE blocks at 0, 2, ... (every other layer, as 1.3B; ``--vace_every 5`` gives
14B's spacing). ``vace_in_channels`` stays 96: 16 inactive + 16 reactive latent channels of
the VAE (z_dim 16) and the 8 x 8-folded mask (the VAE's 8x spatial compression, squared),
which the pipeline builds whatever the model's size. Text encoder, tokenizer, VAE and
scheduler are ``tools/make_tiny_checkpoint.py``'s (Wan 2.1's shrunk).

``--experts 2`` builds the Wan 2.2 VACE-Fun A14B layout: a second, differently initialised
transformer (``transformer_2``) and ``boundary_ratio`` in model_index.json (the conversion
script builds VACE-Fun with 0.875).

Usage:
    python tools/make_tiny_vace_checkpoint.py --output checkpoints/tiny-wan-vace
"""

from __future__ import annotations

import argparse
import sys

from make_tiny_checkpoint import build_text_encoder, build_tokenizer, build_vae  # tools/
from tiny_checkpoint import write_pipeline


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-wan-vace", help="output folder")
    p.add_argument("--heads", type=int, default=2, help="transformer attention heads")
    p.add_argument("--head_dim", type=int, default=12, help="transformer head dimension")
    p.add_argument("--layers", type=int, default=4, help="main transformer blocks")
    p.add_argument("--vace_every", type=int, default=2,
                   help="a VACE block after every N-th main block, from block 0 (1.3B: 2, "
                        "14B: 5)")
    p.add_argument("--ffn_dim", type=int, default=32, help="transformer FFN hidden size")
    p.add_argument("--text_dim", type=int, default=32, help="UMT5 hidden size (d_model)")
    p.add_argument("--rope_max_seq_len", type=int, default=32,
                   help="longest patch grid side the rotary embedding covers")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--experts", type=int, choices=(1, 2), default=1,
                   help="2: Wan 2.2 VACE-Fun A14B layout with transformer_2")
    p.add_argument("--boundary_ratio", type=float, default=0.875,
                   help="with --experts 2: model_index.json's boundary_ratio (0.875)")
    p.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    return p.parse_args(argv)


def build_pipeline(args: argparse.Namespace):
    """Every component with random weights drawn from torch's global generator in a fixed
    order (text encoder, transformer(s), VAE); returns a ``WanVACEPipeline``."""
    import torch
    from diffusers import UniPCMultistepScheduler, WanVACEPipeline, WanVACETransformer3DModel

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(args, tokenizer)

    def new_transformer():
        return WanVACETransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=args.heads,
            attention_head_dim=args.head_dim, in_channels=16, out_channels=16,
            text_dim=args.text_dim, freq_dim=256, ffn_dim=args.ffn_dim,
            num_layers=args.layers, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
            rope_max_seq_len=args.rope_max_seq_len,
            vace_layers=list(range(0, args.layers, args.vace_every)), vace_in_channels=96,
        ).eval()

    transformer = new_transformer()
    transformer_2 = new_transformer() if args.experts == 2 else None
    vae = build_vae(argparse.Namespace(ti2v=False, seed=args.seed))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        num_train_timesteps=1000, flow_shift=3.0)
    return WanVACEPipeline(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                           scheduler=scheduler, transformer=transformer,
                           transformer_2=transformer_2,
                           boundary_ratio=args.boundary_ratio if args.experts == 2 else None)


def main(argv=None) -> int:
    args = parse_args(argv)
    pipe, out = write_pipeline(lambda: build_pipeline(args), args.output, force=args.force,
                               prefix=".tiny-wan-vace-")
    if pipe is None:
        return 0
    n = sum(p.numel() for p in pipe.transformer.parameters())
    print(f"wrote tiny Wan VACE checkpoint to {out} (transformer: {n:,} parameters, VACE "
          f"layers {pipe.transformer.config.vace_layers}"
          + (", two experts" if args.experts == 2 else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
