"""Build a tiny, randomly initialised LTX-2 (video + audio) checkpoint in diffusers format.

No model hub is reachable from CI or the developers' machines, so tests of the LTX-2 port run
on this checkpoint. Every component is the real class that ``LTX2Pipeline`` registers, built
from the LTX-2.0 configs in ``configs/Lightricks/LTX-2/`` (diffusers'
``scripts/convert_ltx2_to_diffusers.py``, version "2.0") with the widths and depths scaled down
and everything else (flags, RoPE type, compression ratios, sample rates) kept; float32, seeded:

- ``transformer``: ``LTX2VideoTransformer3DModel``, 2 blocks, video 2 heads x 16, audio 2 heads
  x 8 (the real 32 x 128 and 32 x 64), ``rope_type`` "split", ``perturbed_attn`` false (as
  LTX-2.0), video/audio input channels = the VAEs' latent layouts (8, and 2 x 16 mel = 32).
- ``vae``: ``AutoencoderKLLTX2Video`` with the real 32x spatial / 8x temporal compression
  (patch 4 and the same four down-sample types) but block widths (8, 16, 32, 32), one resnet
  per block and 8 latent channels (real: 128). ``--vae_spatial`` / ``--vae_temporal`` give
  another compression (e.g. 16 / 4: ``vae_scaling`` turns blocks' scaling off), and the
  transformer's ``vae_scale_factors`` follow.
- ``audio_vae``: ``AutoencoderKLLTX2Audio`` with the real audio layout (16 kHz, hop 160, 64
  mel bins, 4x time and mel compression, stereo) but 2 latent channels (real: 8) and base
  width 32 (real: 128; it must equal the packed token width, see ``tiny_overrides``) and
  1 resnet per level (real: 2).
- ``vocoder``: ``LTX2Vocoder`` with the real upsampling (6 x 5 x 2 x 2 x 2 = 240 samples per
  mel frame: 16 kHz mel hop 160 -> 24 kHz stereo waveform), hidden width 64 (real: 1024).
- ``connectors``: ``LTX2TextConnectors``, 1 layer per modality, 2 heads x 16 = the text width,
  128 learnable registers (the real count; the prompt length must be a multiple of it).
- ``text_encoder`` + ``tokenizer``: a 2-layer ``Gemma3ForConditionalGeneration`` (text hidden
  32, a 1-layer SigLIP vision tower that the pipeline never calls) and a ``GemmaTokenizer``
  whose BPE (byte fallback, "▁" for spaces, as Gemma's) is trained offline with the
  ``tokenizers`` library on a small English corpus. The pipeline stacks every hidden state, so
  ``text_proj_in_factor`` is layers + 1 = 3 (real: 48 + 1 = 49).
- ``scheduler``: the real ``scheduler_config.json`` (``FlowMatchEulerDiscreteScheduler``,
  dynamic shifting, base/max shift 0.95/2.05, shift_terminal 0.1); ``--distilled`` takes the
  distilled checkpoint's (no dynamic shifting, no terminal shift).

Each model's config is the real file with only the size keys of ``tiny_overrides`` changed.

The prompt is padded to ``max_sequence_length`` (1024 by default); with these encoders that
takes milliseconds. The pipeline is written with ``LTX2Pipeline.save_pretrained``
(safetensors), so it loads through the same ``from_pretrained`` path as ``Lightricks/LTX-2``.
Building and saving takes 12-17 s on the 2-core CPU host (most of it imports). Its
components also build ``LTX2ImageToVideoPipeline`` (tests/test_ltx2_foundation.py).

Usage:
    python tools/make_tiny_ltx2_checkpoint.py --output checkpoints/tiny-ltx2
"""

from __future__ import annotations

import argparse
import os
import sys

from tiny_checkpoint import write_pipeline  # tools/, beside this script

_CORPUS = """
A cat walks on the grass, realistic style. A dog runs along the beach at sunset.
A woman with long brown hair smiles at the camera while the waves crash behind her.
Two anthropomorphic cats in comfy boxing gear and bright gloves fight intensely on a
spotlighted stage. A red panda eats bamboo in a misty forest, cinematic lighting, 4k.
A drone shot over snowy mountains at dawn, slow motion, high detail, film grain.
Rain falls on a neon street at night; people talk and a car horn sounds in the distance.
worst quality, inconsistent motion, blurry, jittery, distorted
The quick brown fox jumps over the lazy dog. The camera pans slowly to the left.
"""

_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
REAL_CONFIGS = os.path.join(_CONFIGS, "Lightricks", "LTX-2")
DISTILLED_CONFIGS = os.path.join(_CONFIGS, "rootonchair", "LTX-2-19b-distilled")

# Gemma's special tokens, at Gemma's ids (pad 0, eos 1, bos 2, unk 3, mask 4).
GEMMA_SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-ltx2", help="output folder")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--heads", type=int, default=2, help="attention heads (video and audio)")
    p.add_argument("--head_dim", type=int, default=16, help="video head dimension")
    p.add_argument("--audio_head_dim", type=int, default=8, help="audio head dimension")
    p.add_argument("--latent_channels", type=int, default=8, help="video VAE latent channels")
    p.add_argument("--text_dim", type=int, default=32, help="Gemma text hidden size")
    p.add_argument("--text_layers", type=int, default=2, help="Gemma text layers")
    p.add_argument("--vae_spatial", type=int, default=32, choices=(8, 16, 32, 64),
                   help="video VAE spatial compression (real: 32; patch 4 x 2^k)")
    p.add_argument("--vae_temporal", type=int, default=8, choices=(1, 2, 4, 8),
                   help="video VAE temporal compression (real: 8)")
    p.add_argument("--distilled", action="store_true",
                   help="the distilled checkpoint's scheduler (no dynamic shifting)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    return p.parse_args(argv)


def build_gemma_tokenizer(vocab_size: int = 1024):
    """A ``GemmaTokenizer`` over a BPE trained on ``_CORPUS``: Gemma's special tokens at its
    ids, then the 256 byte-fallback tokens ``<0x00>``..``<0xFF>``, then the learned merges."""
    import json

    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import GemmaTokenizer

    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")  # as GemmaTokenizer
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=GEMMA_SPECIAL_TOKENS + byte_tokens,
                                  show_progress=False)
    tok.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return GemmaTokenizer(vocab=model["vocab"], merges=[tuple(m) for m in model["merges"]],
                          model_max_length=1024, add_bos_token=True, add_eos_token=False)


def build_text_encoder(args: argparse.Namespace, tokenizer):
    """A tiny ``Gemma3ForConditionalGeneration`` (random weights, eval mode)."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=args.text_dim, intermediate_size=2 * args.text_dim,
        num_hidden_layers=args.text_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, max_position_embeddings=2048, sliding_window=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=32, patch_size=8)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          image_token_index=len(tokenizer) - 1)
    return Gemma3ForConditionalGeneration(config).eval()


def vae_scaling(spatial: int, temporal: int) -> dict:
    """The video VAE config keys that give ``spatial`` x ``temporal`` compression.

    ``AutoencoderKLLTX2Video`` compresses by its patch (4 x 4 pixels, 1 frame), then 2x per
    encoder block whose ``spatio_temporal_scaling`` is on, in that block's ``downsample_type``
    axes (LTX-2.0: spatial, temporal, spatiotemporal, spatiotemporal: 32 x 8); its decoder
    undoes it per up block (``decoder_spatio_temporal_scaling`` and ``upsample_type``, listed
    from the full-resolution end and reversed by the decoder; a block that does not upsample
    takes ``upsample_factor`` 1 so its channels pass through). The ratios are also written as
    ``spatial_compression_ratio`` / ``temporal_compression_ratio``, as the real config does
    (diffusers' fallback formula, patch x 2^(blocks on), counts a one-axis block on both).
    """
    from itertools import product

    s, t = (spatial // 4).bit_length() - 1, temporal.bit_length() - 1
    kinds = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
    on = next((c for c in product((True, False), repeat=4)
               if sum(k != "temporal" for k, o in zip(kinds, c, strict=True) if o) == s
               and sum(k != "spatial" for k, o in zip(kinds, c, strict=True) if o) == t), None)
    ups = ["spatiotemporal"] * min(s, t) + ["spatial" if s > t else "temporal"] * abs(s - t)
    if on is None or len(ups) > 3:
        raise SystemExit(f"--vae_spatial {spatial} --vae_temporal {temporal}: no LTX-2.0 "
                         "block layout gives it (4 encoder blocks, 3 decoder blocks)")
    # The decoder reverses these two lists but not upsample_type; the idle blocks go at the
    # full-resolution end, where an unchanged width needs no channel change.
    up_on = [False] * (3 - len(ups)) + [True] * len(ups)
    ups += ["spatiotemporal"] * (3 - len(ups))
    return dict(spatio_temporal_scaling=list(on), decoder_spatio_temporal_scaling=up_on,
                upsample_type=ups, upsample_factor=[2 if o else 1 for o in up_on],
                spatial_compression_ratio=spatial, temporal_compression_ratio=temporal)


def tiny_overrides(args: argparse.Namespace) -> dict:
    """Per component, the config keys the tiny checkpoint changes (sizes only); every other
    key keeps the real LTX-2.0 value from ``configs/Lightricks/LTX-2``."""
    # diffusers sizes the audio VAE's latents_mean/std by base_channels
    # (autoencoder_kl_ltx2_audio.py:745), so base_channels must equal the packed audio token
    # width, latent channels x mel_bins / 4 (real: 8 x 16 = 128 = base_channels).
    audio_latent, mel_bins = 2, 64
    audio_tokens = audio_latent * mel_bins // 4
    video_inner, audio_inner = args.heads * args.head_dim, args.heads * args.audio_head_dim
    connector = dict(num_attention_heads=2, attention_head_dim=args.text_dim // 2,
                     num_layers=1)
    return {
        "transformer": dict(
            in_channels=args.latent_channels, out_channels=args.latent_channels,
            num_attention_heads=args.heads, attention_head_dim=args.head_dim,
            cross_attention_dim=video_inner, audio_in_channels=audio_tokens,
            audio_out_channels=audio_tokens, audio_num_attention_heads=args.heads,
            audio_attention_head_dim=args.audio_head_dim, audio_cross_attention_dim=audio_inner,
            num_layers=args.layers, caption_channels=args.text_dim,
            # The RoPE's latent-to-pixel scale: the video VAE's (temporal, spatial, spatial).
            vae_scale_factors=[args.vae_temporal, args.vae_spatial, args.vae_spatial]),
        "connectors": dict(
            caption_channels=args.text_dim, text_proj_in_factor=args.text_layers + 1,
            **{f"{m}_connector_{k}": v for m in ("video", "audio") for k, v in connector.items()}),
        "vae": dict(latent_channels=args.latent_channels, block_out_channels=[8, 16, 32, 32],
                    decoder_block_out_channels=[8, 16, 32], layers_per_block=[1, 1, 1, 1, 1],
                    decoder_layers_per_block=[1, 1, 1, 1],
                    **vae_scaling(args.vae_spatial, args.vae_temporal)),
        "audio_vae": dict(base_channels=audio_tokens, latent_channels=audio_latent,
                          num_res_blocks=1),
        "vocoder": dict(hidden_channels=64),
    }


def build_models(args: argparse.Namespace) -> dict:
    """The transformer, connectors, two VAEs and vocoder: the real configs with
    ``tiny_overrides``."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers import LTX2VideoTransformer3DModel as Transformer
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder

    classes = dict(transformer=Transformer, connectors=LTX2TextConnectors,
                   vae=AutoencoderKLLTX2Video, audio_vae=AutoencoderKLLTX2Audio,
                   vocoder=LTX2Vocoder)
    models = {}
    for name, changes in tiny_overrides(args).items():
        config = classes[name].load_config(REAL_CONFIGS, subfolder=name)
        models[name] = classes[name].from_config({**config, **changes}).eval()
    return models


def build_pipeline(args: argparse.Namespace):
    """Instantiate every LTX2Pipeline component with random weights."""
    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    torch.manual_seed(args.seed)
    tokenizer = build_gemma_tokenizer()
    text_encoder = build_text_encoder(args, tokenizer)
    real = REAL_CONFIGS if not args.distilled else DISTILLED_CONFIGS
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(real, subfolder="scheduler")
    return LTX2Pipeline(scheduler=scheduler, text_encoder=text_encoder, tokenizer=tokenizer,
                        **build_models(args))


def main(argv=None) -> int:
    args = parse_args(argv)
    pipe, out = write_pipeline(lambda: build_pipeline(args), args.output, force=args.force,
                               prefix=".tiny-ltx2-")
    if pipe is None:
        return 0
    sizes = ", ".join(
        f"{name}: {sum(p.numel() for p in getattr(pipe, name).parameters()):,}"
        for name in ("transformer", "connectors", "vae", "audio_vae", "vocoder", "text_encoder"))
    print(f"wrote tiny LTX-2 checkpoint to {out} ({sizes} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
