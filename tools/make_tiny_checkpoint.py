"""Build a tiny, randomly initialised Wan 2.1 text-to-video checkpoint in diffusers format.

No model hub is reachable from CI or the developers' machines, so demos and tests run on this
checkpoint. Every component is real: a ``WanTransformer3DModel``, an ``AutoencoderKLWan``, a
``UMT5EncoderModel``, a T5 Unigram tokenizer over a committed vocabulary
(``tools/tiny_t5_vocab.json``, trained once with the ``tokenizers`` library), and the
``UniPCMultistepScheduler`` config that Wan 2.1 ships. A build is byte-identical to the
last (``tests/test_tiny_checkpoint_determinism.py``). They are written with
``WanPipeline.save_pretrained`` (safetensors), so ``generate_flax.py`` loads them through the
same ``from_pretrained`` path as the real ``Wan-AI/Wan2.1-T2V-*-Diffusers`` weights.

The default architecture is the one diffusers' own Wan pipeline tests use (transformer with
patch (1, 2, 2), 2 heads x 12 dims, 2 layers; VAE with base_dim 3, z_dim 16). ``--heads``,
``--head_dim``, ``--layers`` and ``--ffn_dim`` widen it for benchmarks; ``--rope_max_seq_len``
(default 32, diffusers' value) lets it run frames wider or taller than 512 pixels.

Wan 2.2 layouts, both run by the same ``WanPipeline``:
    --experts 2 --boundary_ratio R   T2V-A14B style: a second, differently initialised
                                     transformer (``transformer_2``, the low-noise expert)
                                     and ``boundary_ratio`` in model_index.json.
    --ti2v                           TI2V-5B style: 48 latent channels, the Wan 2.2 VAE
                                     (z_dim 48, 2x2 patchify, is_residual, 16x spatial) and
                                     ``expand_timesteps`` true in model_index.json.

Image-to-video layouts (``WanImageToVideoPipeline``):
    --i2v                            Wan 2.1 I2V style: 36 input channels (16 noisy, 4 mask,
                                     16 condition), image cross-attention (``image_dim``,
                                     ``added_kv_proj_dim``) and a tiny CLIP vision encoder
                                     with its ``CLIPImageProcessor``.
    --i2v --experts 2                Wan 2.2 I2V-A14B style: two experts, no CLIP.
    --i2v --flf2v                    Wan 2.1 FLF2V-14B style: as --i2v, with the image
                                     embedding's learned positions for two images
                                     (``pos_embed_seq_len`` = 2 x the CLIP tokens, 2 x 257 in
                                     Wan2.1-FLF2V-14B-720P-diffusers; diffusers' conversion
                                     script), drawn at random here (diffusers initialises them
                                     to zeros, which would hide a missing position add).

The Wan 2.1 I2V transformer file also carries ``attn2.norm_added_q`` tensors the model does
not have (some published Wan I2V checkpoints do; diffusers skips them through
``_keys_to_ignore_on_load_unexpected``), so the loaders are tested on skipping them.

Usage:
    python tools/make_tiny_checkpoint.py --output checkpoints/tiny-wan
    python tools/make_tiny_checkpoint.py --output checkpoints/tiny-wan22-a14b --experts 2 \
        --boundary_ratio 0.9
    python tools/make_tiny_checkpoint.py --output checkpoints/tiny-wan22-ti2v --ti2v
    python tools/make_tiny_checkpoint.py --train_vocab tools/tiny_t5_vocab.json  # after
        # changing _CORPUS: retrain the committed vocabulary (and rebuild the checkpoints)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from tiny_checkpoint import write_pipeline  # tools/, beside this script

# The T5 tokenizer's (piece, log-probability) list, committed: the Unigram trainer's EM runs
# in parallel threads, and two trainings gave scores differing in the last digit for 40 of
# 175 pieces, so a trained vocabulary made every build's tokenizer.json differ.
VOCAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_t5_vocab.json")

# The corpus the committed vocabulary was trained on (``--train_vocab``); Wan prompts are
# English or Chinese prose.
_CORPUS = """
A cat walks on the grass, realistic style. A dog runs along the beach at sunset.
Two anthropomorphic cats in comfy boxing gear and bright gloves fight intensely on a
spotlighted stage. A red panda eats bamboo in a misty forest, cinematic lighting, 4k.
A drone shot over snowy mountains at dawn, slow motion, high detail, film grain.
Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings,
images, static, overall gray, worst quality, low quality, JPEG compression residue, ugly,
incomplete, extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured,
misshapen limbs, fused fingers, still picture, messy background, three legs, many people
in the background, walking backwards. The quick brown fox jumps over the lazy dog.
A city street at night with neon lights and rain, people walking with umbrellas.
An astronaut rides a horse on the moon, photorealistic, wide angle lens.
"""


# Hidden size of the tiny CLIP vision encoder (ViT-H/14's is 1280), and its tokens per image:
# (image_size 32 / patch_size 8)^2 patches and the class token (ViT-H/14 at 224 px: 257).
CLIP_DIM = 24
CLIP_TOKENS = (32 // 8) ** 2 + 1


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-wan", help="output folder")
    p.add_argument("--heads", type=int, default=2, help="transformer attention heads")
    p.add_argument("--head_dim", type=int, default=12, help="transformer head dimension")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks")
    p.add_argument("--ffn_dim", type=int, default=32, help="transformer FFN hidden size")
    p.add_argument("--text_dim", type=int, default=32, help="UMT5 hidden size (d_model)")
    p.add_argument("--rope_max_seq_len", type=int, default=32,
                   help="longest patch grid side the rotary embedding covers (diffusers' tests: "
                        "32, i.e. up to 512 pixels; 480 x 832 needs 52, Wan ships 1024)")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--experts", type=int, choices=(1, 2), default=1,
                   help="2: Wan 2.2 A14B layout with transformer_2 (the low-noise expert)")
    p.add_argument("--boundary_ratio", type=float, default=0.875,
                   help="with --experts 2: model_index.json's boundary_ratio (A14B: 0.875)")
    p.add_argument("--ti2v", action="store_true",
                   help="Wan 2.2 TI2V-5B layout: 48 channels, Wan 2.2 VAE, expand_timesteps")
    p.add_argument("--i2v", action="store_true",
                   help="image-to-video layout (WanImageToVideoPipeline): Wan 2.1 I2V with "
                        "CLIP, or with --experts 2 Wan 2.2 I2V-A14B")
    p.add_argument("--flf2v", action="store_true",
                   help="with --i2v: Wan 2.1 FLF2V-14B layout (pos_embed_seq_len for a first "
                        "and a last image)")
    p.add_argument("--force", action="store_true", help="rebuild even if --output exists")
    p.add_argument("--train_vocab", metavar="FILE",
                   help="instead of a checkpoint, train the T5 Unigram vocabulary on the "
                        "built-in corpus and write it to FILE (the committed one is "
                        "tools/tiny_t5_vocab.json; scores may differ in the last digit "
                        "between trainings) (default: none, build a checkpoint)")
    args = p.parse_args(argv)
    if args.flf2v and not (args.i2v and args.experts == 1):
        p.error("--flf2v is a Wan 2.1 image-to-video layout: needs --i2v without --experts 2")
    return args


def build_tokenizer(vocab_path: str = VOCAB):
    """A T5-style ``T5Tokenizer`` over the committed Unigram vocabulary ``vocab_path``: a
    JSON list of [piece, log-probability] pairs in id order, ids 0, 1, 2 = <pad>, </s>, <unk>
    (T5/UMT5 reserve them). Reading it, not training, makes builds byte-identical."""
    from transformers import T5Tokenizer

    with open(vocab_path, encoding="utf-8") as f:
        vocab = [(piece, float(score)) for piece, score in json.load(f)]
    return T5Tokenizer(vocab=vocab, extra_ids=0)


def train_vocab(vocab_size: int = 400) -> list[tuple[str, float]]:
    """Train a T5-style Unigram model on ``_CORPUS`` with the ``tokenizers`` library (0.23.3
    made the committed file); returns its (piece, log-prob) list in id order. The special
    tokens <pad>, </s>, <unk> take ids 0, 1, 2, as T5/UMT5 reserve them. Scores may differ in
    the last digit between runs (parallel EM), hence the committed file."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "</s>", "<unk>"],
        unk_token="<unk>",
        shrinking_factor=0.75,
    )
    tok.train_from_iterator(_CORPUS.split("\n"), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    return [(piece, float(score)) for piece, score in model["vocab"]]


def write_vocab(vocab: list[tuple[str, float]], path: str) -> None:
    """``vocab`` as a JSON list of [piece, score] pairs, one per line, UTF-8."""
    lines = ",\n".join(json.dumps([piece, score], ensure_ascii=False) for piece, score in vocab)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"[\n{lines}\n]\n")


def add_ignored_keys(folder: str) -> None:
    """Add an ``attn2.norm_added_q.weight`` per block to the transformer's safetensors, as
    some published Wan I2V checkpoints carry (``WanTransformer3DModel`` has no such module;
    its ``_keys_to_ignore_on_load_unexpected`` makes ``from_pretrained`` skip them)."""
    import glob
    import os

    from safetensors.torch import load_file, save_file

    (path,) = glob.glob(os.path.join(folder, "transformer", "*.safetensors"))
    tensors = load_file(path)
    for name in [k for k in tensors if k.endswith("attn2.norm_added_k.weight")]:
        tensors[name.replace("norm_added_k", "norm_added_q")] = tensors[name].clone() + 1
    save_file(tensors, path, metadata={"format": "pt"})


def build_text_encoder(args: argparse.Namespace, tokenizer):
    """A 2-layer UMT5 encoder with random weights (drawn from torch's global generator)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=args.text_dim,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            pad_token_id=0,
            eos_token_id=1,
            decoder_start_token_id=0,
        )
    ).eval()


def build_vae(args: argparse.Namespace):
    """Wan 2.1's VAE shrunk, or with ``--ti2v`` Wan 2.2's."""
    import torch
    from diffusers import AutoencoderKLWan

    if not args.ti2v:
        return AutoencoderKLWan(
            base_dim=3,
            z_dim=16,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        ).eval()
    # Wan 2.2's VAE (Wan2.2-TI2V-5B-Diffusers/vae/config.json) shrunk: z_dim 48, 2x2
    # patchify of 3 -> 12 channels, residual up/down blocks, 8x from the blocks times 2x
    # from the patchify = 16x spatial. Non-trivial latent statistics, so a mean/std mix-up
    # cannot pass the parity tests.
    gen = torch.Generator().manual_seed(args.seed + 1)
    return AutoencoderKLWan(
        base_dim=8,
        decoder_base_dim=12,
        z_dim=48,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=(torch.randn(48, generator=gen) * 0.3).tolist(),
        latents_std=(torch.rand(48, generator=gen) + 0.5).tolist(),
    ).eval()


def build_i2v_pipeline(args: argparse.Namespace, clip: bool, **components):
    """``WanImageToVideoPipeline`` of ``components``, with a tiny CLIP image encoder and its
    processor when ``clip`` (Wan 2.1 I2V; Wan 2.2 I2V has none)."""
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    image_encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=CLIP_DIM, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, image_size=32, patch_size=8)).eval() if clip else None
    processor = CLIPImageProcessor(size={"shortest_edge": 32},
                                   crop_size={"height": 32, "width": 32}) if clip else None
    return WanImageToVideoPipeline(
        image_processor=processor, image_encoder=image_encoder, **components,
        boundary_ratio=args.boundary_ratio if args.experts == 2 else None)


def build_pipeline(args: argparse.Namespace):
    """Instantiate every Wan 2.1 component with random weights; returns a ``WanPipeline``.
    The components draw from torch's global generator in a fixed order (text encoder,
    transformer(s), VAE, image encoder), so a seed gives the same checkpoint."""
    import torch
    from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

    torch.manual_seed(args.seed)
    tokenizer = build_tokenizer()
    text_encoder = build_text_encoder(args, tokenizer)
    channels = 48 if args.ti2v else 16
    # Wan 2.1 I2V: CLIP penultimate states (CLIP_DIM wide) enter an image cross-attention.
    clip = args.i2v and args.experts == 1
    image_kw = dict(image_dim=CLIP_DIM, added_kv_proj_dim=args.heads * args.head_dim) \
        if clip else {}
    if clip and args.flf2v:  # two images of CLIP_TOKENS each (Wan2.1-FLF2V: 2 x 257 = 514)
        image_kw["pos_embed_seq_len"] = 2 * CLIP_TOKENS

    def new_transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=args.heads,
            attention_head_dim=args.head_dim,
            in_channels=channels + (4 + channels if args.i2v else 0),
            out_channels=channels,
            **image_kw,
            text_dim=args.text_dim,
            freq_dim=256,
            ffn_dim=args.ffn_dim,
            num_layers=args.layers,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=args.rope_max_seq_len,
        ).eval()

    transformer = new_transformer()
    if clip and args.flf2v:  # its own generator: the other layouts' weights stay as they were
        pos = transformer.condition_embedder.image_embedder.pos_embed
        pos.data = torch.randn(pos.shape, generator=torch.Generator().manual_seed(args.seed + 2))
    # The low-noise expert: same architecture, its own random weights (drawn after the first's).
    transformer_2 = new_transformer() if args.experts == 2 else None
    vae = build_vae(args)
    # Wan 2.1's shipped scheduler config: UniPC in flow-prediction mode with flow sigmas.
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=3.0,
    )
    components = dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae,
                      scheduler=scheduler, transformer=transformer, transformer_2=transformer_2)
    if args.i2v:
        return build_i2v_pipeline(args, clip, **components)
    return WanPipeline(**components,
                       boundary_ratio=args.boundary_ratio if args.experts == 2 else None,
                       expand_timesteps=args.ti2v)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.train_vocab:
        vocab = train_vocab()
        write_vocab(vocab, args.train_vocab)
        print(f"wrote a {len(vocab)}-piece T5 Unigram vocabulary to {args.train_vocab}")
        return 0
    pipe, out = write_pipeline(lambda: build_pipeline(args), args.output, force=args.force,
                               prefix=".tiny-wan-")
    if pipe is None:
        return 0
    if args.i2v and args.experts == 1:
        add_ignored_keys(out)
    n_params = sum(p.numel() for p in pipe.transformer.parameters())
    kind = ("Wan 2.2 two-expert" if args.experts == 2 else "Wan 2.2 TI2V-style" if args.ti2v
            else "Wan 2.1") + (" first-and-last-frame" if args.flf2v else
                               " image-to-video" if args.i2v else "")
    print(f"wrote tiny {kind} checkpoint to {out} (transformer: {n_params:,} parameters"
          + (", twice" if args.experts == 2 else "") + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
