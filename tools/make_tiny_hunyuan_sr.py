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
these are the code's shapes at toy widths.

With ``--transformer`` it also writes ``transformer/<version>/`` in the official layout
(``config.json`` of ``HunyuanVideo_1_5_DiffusionTransformer`` + its Tencent-named
``diffusion_pytorch_model.safetensors``), the input of ``tools/convert_hunyuan_sr.py``: a tiny
random diffusers ``HunyuanVideo15Transformer3DModel`` (98 input channels, 32 output; 2 heads
x 16, 2 dual-stream and 2 refiner blocks; every parameter, norms included, drawn away from
its init) renamed by ``official_state_dict``. That inverse is written out here on its own
from diffusers' conversion script (huggingface/diffusers @ 9cc3601,
``scripts/convert_hunyuan_video1_5_to_diffusers.py``) read backwards, not through
``families.hunyuan_keys``, so a wrong entry in that table fails the round trip. The official
SR ``config.json`` could not be read here: ``official_config`` states 98 channels as
``in_channels=98, concat_condition=false, out_channels=32``, one of the layouts the converter
accepts (it reads the width from the weight).

Usage:
    python tools/make_tiny_hunyuan_sr.py --output checkpoints/tiny-hunyuan15-sr [--transformer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from tiny_checkpoint import write_atomically  # noqa: E402  (tools/, beside this script)

SR_VERSIONS = ("720p_sr_distilled", "1080p_sr_distilled")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", default="checkpoints/tiny-hunyuan15-sr",
                   help="output folder (gets upsampler/<version>/)")
    p.add_argument("--latent_channels", type=int, default=32, help="VAE latent channels")
    p.add_argument("--seed", type=int, default=0, help="torch seed for the random init")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    p.add_argument("--transformer", action="store_true",
                   help="also write transformer/<version>/ in the official (Tencent) layout")
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


# diffusers module -> official module, the conversion script read backwards. Not here: the
# refiner's attn.to_q/to_k/to_v (one official self_attn_qkv, rows q, k, v concatenated) and
# norm_out.linear (final_layer.adaLN_modulation.1, row halves exchanged back).
_TOP = {
    "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "time_embed.timestep_embedder_r.linear_1": "time_r_in.mlp.0",
    "time_embed.timestep_embedder_r.linear_2": "time_r_in.mlp.2",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder_2.norm": "byt5_in.layernorm",
    "context_embedder_2.linear_1": "byt5_in.fc1",
    "context_embedder_2.linear_2": "byt5_in.fc2",
    "context_embedder_2.linear_3": "byt5_in.fc3",
    "image_embedder.norm_in": "vision_in.proj.0",
    "image_embedder.linear_1": "vision_in.proj.1",
    "image_embedder.linear_2": "vision_in.proj.3",
    "image_embedder.norm_out": "vision_in.proj.4",
    "x_embedder.proj": "img_in.proj",
    "cond_type_embed": "cond_type_embedding",
    "proj_out": "final_layer.linear",
}
# Under transformer_blocks.N -> under double_blocks.N.
_DOUBLE = {
    "norm1.linear": "img_mod.linear", "norm1_context.linear": "txt_mod.linear",
    "attn.to_q": "img_attn_q", "attn.to_k": "img_attn_k", "attn.to_v": "img_attn_v",
    "attn.norm_q": "img_attn_q_norm", "attn.norm_k": "img_attn_k_norm",
    "attn.to_out.0": "img_attn_proj",
    "attn.add_q_proj": "txt_attn_q", "attn.add_k_proj": "txt_attn_k",
    "attn.add_v_proj": "txt_attn_v",
    "attn.norm_added_q": "txt_attn_q_norm", "attn.norm_added_k": "txt_attn_k_norm",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp.fc1", "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1", "ff_context.net.2": "txt_mlp.fc2",
}
# Under context_embedder.token_refiner.refiner_blocks.N -> txt_in.individual_token_refiner.blocks.N.
_REFINER = {"norm1": "norm1", "attn.to_out.0": "self_attn_proj", "norm2": "norm2",
            "ff.net.0.proj": "mlp.fc1", "ff.net.2": "mlp.fc2",
            "norm_out.linear": "adaLN_modulation.1"}
_DOUBLE_RE = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
_REFINER_RE = re.compile(r"^context_embedder\.token_refiner\.refiner_blocks\.(\d+)\.(.+)$")


def official_state_dict(model) -> dict:
    """The Tencent-named tensors of a diffusers ``HunyuanVideo15Transformer3DModel``.

    Raises:
        KeyError: a diffusers module with no official name here.
    """
    import torch

    state, out = model.state_dict(), {}
    for key, value in state.items():
        module, param = key.rsplit(".", 1)
        double, refiner = _DOUBLE_RE.match(module), _REFINER_RE.match(module)
        if double:
            out[f"double_blocks.{double[1]}.{_DOUBLE[double[2]]}.{param}"] = value
        elif refiner and refiner[2] in ("attn.to_q", "attn.to_k", "attn.to_v"):
            if refiner[2] == "attn.to_q":  # once per block: q, k, v rows stacked
                base = f"context_embedder.token_refiner.refiner_blocks.{refiner[1]}.attn.to_"
                out[f"txt_in.individual_token_refiner.blocks.{refiner[1]}.self_attn_qkv."
                    f"{param}"] = torch.cat([state[f"{base}{x}.{param}"] for x in "qkv"])
        elif refiner:
            out[f"txt_in.individual_token_refiner.blocks.{refiner[1]}."
                f"{_REFINER[refiner[2]]}.{param}"] = value
        elif module == "norm_out.linear":  # diffusers (scale, shift) -> official (shift, scale)
            half = value.shape[0] // 2
            out[f"final_layer.adaLN_modulation.1.{param}"] = torch.cat([value[half:],
                                                                         value[:half]])
        else:
            out[f"{_TOP[module]}.{param}"] = value
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def official_config(cfg, version: str) -> dict:
    """The official ``config.json`` (``HunyuanVideo_1_5_DiffusionTransformer``'s constructor
    arguments, hunyuanvideo_1_5_transformer.py:350-384) of a diffusers config ``cfg``."""
    from families.hunyuan_sr import SR_CONFIGS

    return {
        "_class_name": "HunyuanVideo_1_5_DiffusionTransformer",
        "patch_size": [cfg.patch_size_t, cfg.patch_size, cfg.patch_size],
        "in_channels": cfg.in_channels, "concat_condition": False,
        "out_channels": cfg.out_channels,
        "hidden_size": cfg.num_attention_heads * cfg.attention_head_dim,
        "heads_num": cfg.num_attention_heads, "mlp_width_ratio": cfg.mlp_ratio,
        "mlp_act_type": "gelu_tanh", "mm_double_blocks_depth": cfg.num_layers,
        "mm_single_blocks_depth": 0, "rope_dim_list": list(cfg.rope_axes_dim),
        "rope_theta": cfg.rope_theta, "qkv_bias": True, "qk_norm": True, "qk_norm_type": "rms",
        "guidance_embed": False, "use_meanflow": cfg.use_meanflow,
        "text_projection": "single_refiner", "use_attention_mask": True,
        "text_states_dim": cfg.text_embed_dim, "text_states_dim_2": None,
        "text_pool_type": None, "attn_mode": "flash", "attn_param": None,
        "glyph_byT5_v2": True, "vision_projection": "linear",
        "vision_states_dim": cfg.image_embed_dim, "is_reshape_temporal_channels": False,
        "use_cond_type_embedding": True, "ideal_resolution": SR_CONFIGS[version].target,
        "ideal_task": None,
    }


def tiny_transformer(seed: int, version: str = "720p_sr_distilled", use_meanflow: bool = False,
                     **config):
    """A tiny random diffusers ``HunyuanVideo15Transformer3DModel`` with the SR DiT's channels
    (98 in, 32 out), float32, eval mode; every parameter moved off its init. Its
    ``target_size`` is the SR pipeline's SizeMap entry of the version's target resolution
    (hunyuan_video_sr_pipeline.py:74-78). ``config`` overrides constructor arguments (e.g. the
    text widths of a tiny first-stage checkpoint whose prompt embeddings it takes)."""
    import torch
    from diffusers import HunyuanVideo15Transformer3DModel

    from families.hunyuan_sr import SR_CONFIGS

    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(**{**dict(
        in_channels=98, out_channels=32, num_attention_heads=2, attention_head_dim=16,
        num_layers=2, num_refiner_layers=2, mlp_ratio=4.0, text_embed_dim=16,
        text_embed_2_dim=1472, image_embed_dim=16, rope_axes_dim=(4, 6, 6),
        target_size={"720p": 960, "1080p": 1440}[SR_CONFIGS[version].target], task_type="i2v",
        use_meanflow=use_meanflow), **config})
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def write_official_transformer(model, folder: str, version: str) -> None:
    """``config.json`` + ``diffusion_pytorch_model.safetensors`` in the official layout."""
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(official_config(model.config, version), f, indent=2)
    save_file(official_state_dict(model), os.path.join(folder,
              "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})


def main(argv=None) -> int:
    args = parse_args(argv)
    out = os.path.abspath(args.output)

    def save(folder):
        for version, model in build(args).items():
            model.save_pretrained(os.path.join(folder, "upsampler", version),
                                  safe_serialization=True)
        if args.transformer:
            for i, version in enumerate(sorted(SR_VERSIONS)):
                write_official_transformer(tiny_transformer(args.seed + 1 + i, version),
                                           os.path.join(folder, "transformer", version), version)

    if not write_atomically(save, out, force=args.force, prefix=".tiny-hunyuan15-sr-",
                            marker="upsampler"):
        print(f"tiny SR upsamplers already at {out}")
        return 0
    print(f"tiny SR upsamplers written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
