"""Build a tiny, randomly initialised HunyuanVideo-1.5 text-to-video checkpoint (diffusers format).

No model hub is reachable from CI or the developers' machines, so tests and demos of the
HunyuanVideo-1.5 port run on this checkpoint. Every component is the real class that
``HunyuanVideo15Pipeline`` registers, with tiny random weights (float32, seeded):

- ``transformer``: ``HunyuanVideo15Transformer3DModel`` with 2 dual-stream blocks and a 2-block
  token refiner, 2 heads x 16 dims, RoPE axes (4, 6, 6) (same 1:3.5:3.5 split as the public
  (16, 56, 56)), and the public model's latent interface: 65 input channels (32 noisy latent +
  32 condition latent + 1 mask) and 32 output channels. ``task_type="t2v"``.
  Its ByT5 projection has a hidden size of 2048 fixed in diffusers (about 4.3M of its ~4.5M
  parameters); it is not configurable.
- ``vae``: ``AutoencoderKLHunyuanVideo15`` with the real 16x spatial / 4x temporal compression
  and 32 latent channels, but block channels (16, 32, 64, 64, 64) instead of
  (128, 256, 512, 1024, 1024) and 1 resnet per block. (The last block width must be a
  multiple of 2 x latent_channels, and each width a multiple of 8.) ``--vae_spatial`` /
  ``--vae_temporal`` set other compressions (the class places its down- and up-samplers
  from the two config ratios), e.g. 2x in time.
- ``text_encoder`` + ``tokenizer``: a 3-layer ``Qwen2_5_VLTextModel`` (hidden 32, 2 heads x 16,
  mrope_section (2, 3, 3)) and a ``Qwen2Tokenizer`` whose byte-level BPE is trained offline with
  the ``tokenizers`` library on the pipeline's own system message plus a small English corpus,
  with ``<|im_start|>``/``<|im_end|>`` special tokens and a Qwen-style chat template. Trained to
  saturation, it splits the chat prefix (system message + ``<|im_start|>user\\n``) into exactly
  108 tokens, the pipeline's hard-coded ``prompt_template_encode_start_idx``, so the crop
  removes the template and keeps the prompt, as with the real Qwen2.5-VL tokenizer. The
  pipeline takes ``hidden_states[-3]``: with 3 layers that is the output of layer 1.
- ``text_encoder_2`` + ``tokenizer_2``: a 2-layer ByT5-style ``T5EncoderModel`` (d_model 32)
  and ``ByT5Tokenizer()`` (needs no files). Only text in quotes in the prompt reaches it.
- ``scheduler``: ``FlowMatchEulerDiscreteScheduler(shift=9.0)``, ``guider``:
  ``ClassifierFreeGuidance(guidance_scale=6.0)``: the public 720p T2V values.

Variants: ``--i2v`` (image-to-video), ``--meanflow`` (``use_meanflow``, as the step-distilled
480p I2V checkpoint; give it ``--shift 7 --guidance_scale 1``, that checkpoint's values) and
``--guidance_scale 1`` alone (a CFG-distilled checkpoint).

Text lengths: the pipeline pads Qwen input to 1000 + 108 tokens and ByT5 input to 256 tokens,
and it hard-codes these in ``__init__`` (not in any config), so a checkpoint cannot change them.
They are kept: with these tiny encoders a 1108-token pass takes milliseconds, and a port meets
the real sequence layout (729 image + 256 ByT5 + 1000 Qwen text tokens, most of them padding).
``target_size`` is 64, so a call without height/width gives a 48 x 80 video (16:9 bucket).

The pipeline is written with ``HunyuanVideo15Pipeline.save_pretrained`` (safetensors), so it
loads through the same ``from_pretrained`` path as ``hunyuanvideo-community/HunyuanVideo-1.5-*``.
Building and saving takes a few seconds on CPU.

Usage:
    python tools/make_tiny_hunyuan_checkpoint.py --output checkpoints/tiny-hunyuan15
"""

from __future__ import annotations

import argparse
import sys

from tiny_checkpoint import write_pipeline  # tools/, beside this script

# Qwen-style byte-level BPE training text, besides the pipeline's system message.
_CORPUS = """
system
user
assistant
A cat walks on the grass, realistic style. A dog runs along the beach at sunset.
A sign that says "hello" hangs above the door of a small bakery on a rainy street.
Two anthropomorphic cats in comfy boxing gear and bright gloves fight intensely on a
spotlighted stage. A red panda eats bamboo in a misty forest, cinematic lighting, 4k.
A drone shot over snowy mountains at dawn, slow motion, high detail, film grain.
A neon sign reads "OPEN" in a city street at night with rain, people walking with umbrellas.
An astronaut rides a horse on the moon, photorealistic, wide angle lens.
The quick brown fox jumps over the lazy dog. The camera pans slowly to the left.
"""

# Qwen2.5-VL's chat template, restricted to text content (string or text parts).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-hunyuan15", help="output folder")
    p.add_argument("--heads", type=int, default=2, help="transformer attention heads")
    p.add_argument("--head_dim", type=int, default=16, help="transformer head dimension")
    p.add_argument("--layers", type=int, default=2, help="dual-stream transformer blocks")
    p.add_argument("--refiner_layers", type=int, default=2, help="token refiner blocks")
    p.add_argument("--mlp_ratio", type=float, default=4.0, help="transformer FFN ratio")
    p.add_argument("--rope_axes", type=_int_list, default=None,
                   help="RoPE (t,h,w) dims, summing to head_dim (default: derived from it)")
    p.add_argument("--image_embed_dim", type=int, default=16,
                   help="image (SigLIP) embedding width; zeros in T2V")
    p.add_argument("--target_size", type=int, default=64,
                   help="pixel size of the default resolution bucket")
    p.add_argument("--latent_channels", type=int, default=32, help="VAE latent channels")
    p.add_argument("--vae_channels", type=_int_list, default=[16, 32, 64, 64, 64],
                   help="VAE encoder block widths (5 entries give 16x spatial compression)")
    p.add_argument("--vae_layers", type=int, default=1, help="VAE resnets per block")
    p.add_argument("--vae_spatial", type=int, default=16, choices=(4, 8, 16),
                   help="VAE spatial compression (real: 16; at most 2^(VAE blocks - 1))")
    p.add_argument("--vae_temporal", type=int, default=4, choices=(1, 2, 4),
                   help="VAE temporal compression (real: 4; at most the spatial one)")
    p.add_argument("--text_dim", type=int, default=32, help="Qwen2.5-VL text hidden size")
    p.add_argument("--text_layers", type=int, default=3, help="Qwen2.5-VL text layers (>= 3)")
    p.add_argument("--byt5_dim", type=int, default=32, help="ByT5 encoder d_model")
    p.add_argument("--shift", type=float, default=9.0, help="flow-matching sigma shift")
    p.add_argument("--guidance_scale", type=float, default=6.0, help="CFG guidance scale")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--i2v", action="store_true",
                   help="image-to-video layout (HunyuanVideo15ImageToVideoPipeline): "
                        "task_type i2v and a tiny SigLIP vision encoder with its processor")
    p.add_argument("--meanflow", action="store_true",
                   help="use_meanflow=True, the step-distilled 480p I2V transformer's second "
                        "timestep embedder (time_embed.timestep_embedder_r)")
    p.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    args = p.parse_args(argv)
    if args.rope_axes is None:
        hw = 2 * (7 * args.head_dim // 32)  # 128 -> (16, 56, 56), 16 -> (4, 6, 6)
        args.rope_axes = [args.head_dim - 2 * hw, hw, hw]
    if sum(args.rope_axes) != args.head_dim or any(d <= 0 or d % 2 for d in args.rope_axes):
        p.error(f"--rope_axes {args.rope_axes} must be positive even dims summing to head_dim")
    if args.vae_channels[-1] % (2 * args.latent_channels) or any(
        c % 8 for c in args.vae_channels
    ):
        p.error("--vae_channels must be multiples of 8, the last a multiple of 2*latent_channels")
    if args.text_layers < 3:
        p.error("--text_layers must be >= 3 (the pipeline reads hidden_states[-3])")
    return args


def system_message() -> str:
    """The system message the pipeline puts in front of every prompt."""
    import inspect

    from diffusers import HunyuanVideo15Pipeline

    sig = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds)
    return sig.parameters["system_message"].default


def build_qwen_tokenizer(vocab_size: int = 2048):
    """Train a Qwen2-style byte-level BPE on the system message and ``_CORPUS``.

    The trainer uses the same normaliser and pre-tokeniser as ``Qwen2Tokenizer`` and runs to
    saturation (the corpus is smaller than ``vocab_size``), so every word of the system message
    is one token, as in the real Qwen vocabulary.
    """
    import json

    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=QWEN_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([system_message()] + _CORPUS.split("\n"), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=model["vocab"],
        merges=[tuple(m) for m in model["merges"]],
        padding_side="right",
        model_max_length=32768,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_text_encoders(args: argparse.Namespace, tokenizer):
    """(Qwen2.5-VL text model, ByT5 tokenizer, T5 encoder) with random weights, drawn from
    torch's global generator in that order."""
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        T5Config,
        T5EncoderModel,
    )

    text_heads = 2
    text_head_dim = args.text_dim // text_heads
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=args.text_dim,
            intermediate_size=2 * args.text_dim,
            num_hidden_layers=args.text_layers,
            num_attention_heads=text_heads,
            num_key_value_heads=text_heads,
            max_position_embeddings=2048,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "mrope_section": _mrope_section(text_head_dim),
            },
            bos_token_id=None,
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    ).eval()
    tokenizer_2 = ByT5Tokenizer()
    text_encoder_2 = T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer_2),
            d_model=args.byt5_dim,
            d_kv=8,
            d_ff=2 * args.byt5_dim,
            num_layers=2,
            num_heads=args.byt5_dim // 8,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            pad_token_id=tokenizer_2.pad_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            decoder_start_token_id=0,
        )
    ).eval()
    return text_encoder, tokenizer_2, text_encoder_2


def build_pipeline(args: argparse.Namespace):
    """Instantiate every HunyuanVideo-1.5 T2V component with random weights."""
    import torch
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from diffusers.guiders import ClassifierFreeGuidance

    torch.manual_seed(args.seed)
    tokenizer = build_qwen_tokenizer()
    text_encoder, tokenizer_2, text_encoder_2 = build_text_encoders(args, tokenizer)
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=2 * args.latent_channels + 1,
        out_channels=args.latent_channels,
        num_attention_heads=args.heads,
        attention_head_dim=args.head_dim,
        num_layers=args.layers,
        num_refiner_layers=args.refiner_layers,
        mlp_ratio=args.mlp_ratio,
        patch_size=1,
        patch_size_t=1,
        qk_norm="rms_norm",
        text_embed_dim=args.text_dim,
        text_embed_2_dim=args.byt5_dim,
        image_embed_dim=args.image_embed_dim,
        rope_axes_dim=tuple(args.rope_axes),
        target_size=args.target_size,
        task_type="i2v" if args.i2v else "t2v",
        use_meanflow=args.meanflow,
    ).eval()
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3,
        out_channels=3,
        latent_channels=args.latent_channels,
        block_out_channels=tuple(args.vae_channels),
        layers_per_block=args.vae_layers,
        spatial_compression_ratio=args.vae_spatial,
        temporal_compression_ratio=args.vae_temporal,
    ).eval()
    components = dict(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=args.shift),
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=args.guidance_scale))
    if not args.i2v:
        return HunyuanVideo15Pipeline(**components)
    # SigLIP (so400m-patch14-384 in the real checkpoint: 729 tokens x 1152) shrunk to
    # 32 px / 8 px patches: 16 tokens of image_embed_dim.
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    image_encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=args.image_embed_dim, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, image_size=32, patch_size=8)).eval()
    return HunyuanVideo15ImageToVideoPipeline(
        **components, image_encoder=image_encoder,
        feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}))


def _mrope_section(head_dim: int) -> list[int]:
    """(t, h, w) rotary sections summing to head_dim / 2, in Qwen2.5-VL's 1:1.5:1.5 ratio."""
    half = head_dim // 2
    t = max(1, half // 4)
    h = (half - t) // 2
    return [t, h, half - t - h]


def main(argv=None) -> int:
    args = parse_args(argv)
    pipe, out = write_pipeline(lambda: build_pipeline(args), args.output, force=args.force,
                               prefix=".tiny-hunyuan15-")
    if pipe is None:
        return 0
    sizes = ", ".join(
        f"{name}: {sum(p.numel() for p in getattr(pipe, name).parameters()):,}"
        for name in ("transformer", "vae", "text_encoder", "text_encoder_2")
    )
    kind = "I2V" if args.i2v else "T2V"
    print(f"wrote tiny HunyuanVideo-1.5 {kind} checkpoint to {out} ({sizes} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
