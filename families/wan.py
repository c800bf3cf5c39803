"""Wan 2.1 and Wan 2.2 text-to-video (diffusers ``WanPipeline``): the family module.

Sources: the Wan 2.1 model card and ``generate.py`` (720p samples with flow_shift 5.0 and
480p with 3.0; 50 UniPC steps; CFG 5.0; 16 fps; 512 UMT5 text tokens) and diffusers 0.42.1's
``WanPipeline``, ``WanTransformer3DModel`` and ``AutoencoderKLWan``, which run unmodified.

Wan 2.2 runs through the same ``WanPipeline``, told apart by ``model_index.json``:
    T2V-A14B: ``transformer_2`` and ``boundary_ratio`` (two experts; ``engine/programs/experts.py``
        picks the expert per step on the host, one compiled step serves both).
    TI2V-5B: ``expand_timesteps`` true, 48 latent channels, the Wan 2.2 VAE (z_dim 48,
        2x2 patchify, 16x spatial). Its per-token timesteps are all equal in text-to-video,
        so the scalar timestep path is used (see ``step_fn``).
Image-to-video (``WanImageToVideoPipeline``, ``--image``): Wan 2.1 I2V-14B (CLIP image
embeddings into an image cross-attention; 36 input channels = 16 noisy + 4 mask + 16
condition) and Wan 2.2 I2V-A14B (the same without CLIP, two experts). The condition is
diffusers' own: ``video_processor.preprocess``, ``prepare_latents`` (the [image, zeros]
video VAE-encoded, posterior mode, normalised, with the first-frame mask), computed once per
run by ``encode_image``; each step feeds cat(latents, condition) as the pipeline does.
Their official defaults and where each comes from are ``WAN22_A14B_DEFAULTS`` and
``WAN22_TI2V_DEFAULTS`` (``checkpoint_defaults`` applies them; the JSON report records the
sources under ``settings.default_sources``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from custom_splash_attention import LocalMask
from engine.files.checkpoint import expert_count, read_component_config, read_model_index
from engine.files.image import read_image
from engine.run.errors import GenerationError, fail, first_line
from engine.weights.scan_layers import BlockStack
from families import wan_attention, wan_flf2v, wan_sparse, wan_ti2v, wan_v2v, wan_vae
from families.base import (
    Checkpoint,
    Flags,
    ImageConditioning,
    ModelFamily,
    Scheduling,
    Sizes,
    TextEncoding,
    Transformer,
    VaePrograms,
    checkpoint_config,
    empty_model,
    init_value,
    pipeline_modules,
)

# The VAE's compression (4x in time; 8x in space for Wan 2.1's VAE, 16x for Wan 2.2's) and
# the transformer's patch (1 x 2 x 2) are read from the checkpoint, as ``WanPipeline`` reads
# its VAE's ``scale_factor_temporal`` / ``scale_factor_spatial`` (pipeline_wan.py:154-155):
# ``vae_compression``, ``token_count``; a dry run reads the config files.
SHIPPED = "Wan-AI/Wan2.1-T2V-14B-Diffusers"


def vae_config(model_id: str | None) -> dict:
    """``model_id``'s VAE config (a local folder or a shipped Hub id), else the shipped one."""
    return checkpoint_config(model_id, "vae", SHIPPED)


def vae_compression(vae_cfg: dict) -> tuple[int, int]:
    """(temporal, spatial) compression of an ``AutoencoderKLWan`` config: its
    ``scale_factor_temporal`` / ``scale_factor_spatial`` (the class defaults, 4 and 8, where
    the config leaves them out, as every Wan 2.1 config does)."""
    from diffusers import AutoencoderKLWan as Vae

    return (int(init_value(Vae, vae_cfg, "scale_factor_temporal")),
            int(init_value(Vae, vae_cfg, "scale_factor_spatial")))


def latent_grid(vae_cfg: dict, height: int, width: int, frames: int) -> tuple[int, int, int]:
    """(latent frames, h, w) of a video, as ``WanPipeline.prepare_latents`` sizes them
    (pipeline_wan.py:341-348)."""
    temporal, spatial = vae_compression(vae_cfg)
    return (frames - 1) // temporal + 1, height // spatial, width // spatial


def patch(cfg: dict) -> tuple[int, int, int]:
    """The transformer's (t, h, w) ``patch_size`` (the class default where absent)."""
    from diffusers import WanTransformer3DModel as Model

    return tuple(init_value(Model, cfg, "patch_size"))


def frame_step(model_id: str) -> int:
    """Frames are ``frame_step * n + 1``: the VAE's temporal compression."""
    return vae_compression(vae_config(model_id))[0]


def pixel_multiple(model_id: str) -> int:
    """Height and width are multiples of the VAE's spatial compression x the patch side (16
    for Wan 2.1, 32 for Wan 2.2 TI2V-5B's 16x VAE)."""
    cfg = checkpoint_config(model_id, "transformer", SHIPPED)
    return vae_compression(vae_config(model_id))[1] * max(patch(cfg)[1:])


DEFAULTS = dict(
    prompt="A cat walks on the grass, realistic style.",
    negative_prompt=(
        "Bright tones, overexposed, static, blurred details, subtitles, style, works, paintings, "
        "images, static, overall gray, worst quality, low quality, JPEG compression residue, ugly, "
        "incomplete, extra fingers, poorly drawn hands, poorly drawn faces, deformed, disfigured, "
        "misshapen limbs, fused fingers, still picture, messy background, three legs, many people "
        "in the background, walking backwards"
    ),
    height=720,
    width=1280,
    frames=81,
    fps=16,
    num_inference_steps=50,
    guidance_scale=5.0,
    max_sequence_length=512,
)

# Wan 2.2 T2V-A14B's official sampling settings (Wan2.2 repo wan/configs/wan_t2v_A14B.py:
# sample_steps 40, sample_shift 12.0, sample_guide_scale (3.0, 4.0) as (low, high noise),
# frame_num 81, sample_fps 16; the model card's 720x1280 example). The Hub's
# scheduler_config.json builds UniPC with flow_shift 3.0; the official 12.0 overrides it
# (at 40 steps: 26 high-noise steps with 12.0, 13 with 3.0).
_A14B_REPO = "Wan2.2 repo wan/configs/wan_t2v_A14B.py"
WAN22_A14B_DEFAULTS = dict(
    height=720, width=1280, frames=81, fps=16, num_inference_steps=40,
    guidance_scale=4.0, guidance_scale_2=3.0, flow_shift=12.0,
    sources=dict(
        height="Wan2.2 model card (720P: 1280x720)", width="Wan2.2 model card (720P: 1280x720)",
        frames=f"{_A14B_REPO} frame_num 81", fps=f"{_A14B_REPO} sample_fps 16",
        num_inference_steps=f"{_A14B_REPO} sample_steps 40",
        guidance_scale=f"{_A14B_REPO} sample_guide_scale high-noise 4.0; maxdiffusion "
                       "base_wan_27b.yml",
        guidance_scale_2=f"{_A14B_REPO} sample_guide_scale low-noise 3.0; maxdiffusion "
                         "base_wan_27b.yml",
        flow_shift=f"{_A14B_REPO} sample_shift 12.0 (overrides the Hub scheduler_config's "
                   "3.0)"))
# Wan 2.2 TI2V-5B (Wan2.2 repo wan/configs/wan_ti2v_5B.py: sample_steps 50, sample_shift
# 5.0, sample_guide_scale 5.0, frame_num 121, sample_fps 24; size 704x1280 or 1280x704).
_TI2V_REPO = "Wan2.2 repo wan/configs/wan_ti2v_5B.py"
WAN22_TI2V_DEFAULTS = dict(
    height=704, width=1280, frames=121, fps=24, num_inference_steps=50, guidance_scale=5.0,
    flow_shift=5.0,
    sources=dict(
        height="Wan2.2 model card (TI2V-5B: 1280x704 or 704x1280)",
        width="Wan2.2 model card (TI2V-5B: 1280x704 or 704x1280)",
        frames=f"{_TI2V_REPO} frame_num 121", fps=f"{_TI2V_REPO} sample_fps 24",
        num_inference_steps=f"{_TI2V_REPO} sample_steps 50",
        guidance_scale=f"{_TI2V_REPO} sample_guide_scale 5.0",
        flow_shift=f"{_TI2V_REPO} sample_shift 5.0"))

# Wan 2.2 I2V-A14B (Wan2.2 repo wan/configs/wan_i2v_A14B.py: sample_steps 40, sample_shift
# 5.0, sample_guide_scale (3.5, 3.5), frame_num 81, sample_fps 16; maxdiffusion's I2V config
# uses 4.0 / 3.0 instead).
_I2V_A14B_REPO = "Wan2.2 repo wan/configs/wan_i2v_A14B.py"
WAN22_I2V_A14B_DEFAULTS = dict(
    height=720, width=1280, frames=81, fps=16, num_inference_steps=40,
    guidance_scale=3.5, guidance_scale_2=3.5, flow_shift=5.0,
    sources=dict(
        height="Wan2.2 model card (720P: 1280x720)", width="Wan2.2 model card (720P: 1280x720)",
        frames=f"{_I2V_A14B_REPO} frame_num 81", fps=f"{_I2V_A14B_REPO} sample_fps 16",
        num_inference_steps=f"{_I2V_A14B_REPO} sample_steps 40",
        guidance_scale=f"{_I2V_A14B_REPO} sample_guide_scale high-noise 3.5",
        guidance_scale_2=f"{_I2V_A14B_REPO} sample_guide_scale low-noise 3.5",
        flow_shift=f"{_I2V_A14B_REPO} sample_shift 5.0"))

# The pinned huggingface_hub (2.4.0) installs only the `hf` command; `huggingface-cli` is gone.
DOWNLOAD_HINT = "hf download Wan-AI/Wan2.1-T2V-14B-Diffusers --local-dir PATH"
DOWNLOAD_HINTS = {
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": DOWNLOAD_HINT,
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers":
        "hf download Wan-AI/Wan2.1-T2V-1.3B-Diffusers --local-dir PATH",
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers":
        "hf download Wan-AI/Wan2.2-T2V-A14B-Diffusers --local-dir PATH",
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers":
        "hf download Wan-AI/Wan2.2-TI2V-5B-Diffusers --local-dir PATH",
    "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers":
        "hf download Wan-AI/Wan2.1-I2V-14B-720P-Diffusers --local-dir PATH",
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers":
        "hf download Wan-AI/Wan2.2-I2V-A14B-Diffusers --local-dir PATH",
}


def is_two_expert(model_index: dict) -> bool:
    """A Wan 2.2 A14B layout: ``transformer_2`` names a model and ``boundary_ratio`` is set
    (diffusers' ``WanPipeline`` switches experts only then)."""
    return expert_count(model_index) == 2


def lora_state_dict(tensors: dict) -> dict:
    """diffusers' Wan LoRA key conversion (``WanLoraLoaderMixin.lora_state_dict``: PEFT,
    original, ComfyUI and lightx2v keys), the ``Transformer.lora_state_dict`` of Wan."""
    from diffusers.loaders.lora_pipeline import WanLoraLoaderMixin

    return WanLoraLoaderMixin.lora_state_dict(tensors)


# The transformer's block list: "blocks", each block called (hidden, encoder, temb, rotary)
# with the hidden states carried; tokens on axis 1 of hidden and rotary. Self-attention's keys
# are the tokens alone, so sequence-parallel shards can be padded to whole 16-row tiles.
WAN_BLOCKS = BlockStack(attr="blocks", carry=1, token_axes=(1, None, None, 1),
                        self_attention="attn1", sublayers=("attn1", "attn2", "ffn"),
                        token_tile=16)
I2V_PIPELINE = "WanImageToVideoPipeline"


def is_image_to_video(model_id: str) -> bool:
    """``model_index.json`` names ``WanImageToVideoPipeline`` (Wan 2.1 I2V, Wan 2.2
    I2V-A14B)."""
    return read_model_index(model_id).get("_class_name") == I2V_PIPELINE


def is_ti2v(model_id: str) -> bool:
    """TI2V-5B: ``model_index.json``'s ``expand_timesteps`` (text- or image-to-video)."""
    return bool(read_model_index(model_id).get("expand_timesteps"))


def image_mode(model_id: str) -> str:
    """"required" for an image-to-video checkpoint, "optional" for TI2V-5B (its index names
    ``WanPipeline``; with ``--image`` it runs as diffusers' ``WanImageToVideoPipeline``
    with ``expand_timesteps``), else "none"."""
    if is_image_to_video(model_id):
        return "required"
    return "optional" if is_ti2v(model_id) else "none"


def checkpoint_defaults(model_id: str) -> dict:
    """The official Wan 2.2 defaults for an A14B or TI2V layout (with ``sources``), {} for
    Wan 2.1 (its flow_shift is by resolution, ``default_flow_shift``)."""
    index = read_model_index(model_id)
    if is_two_expert(index):
        i2v = index.get("_class_name") == I2V_PIPELINE
        return dict(WAN22_I2V_A14B_DEFAULTS if i2v else WAN22_A14B_DEFAULTS)
    if index.get("expand_timesteps"):
        return dict(WAN22_TI2V_DEFAULTS)
    return {}


def sparse_policy(model_id: str, values: dict):
    """``Transformer.sparse_policy``: the checkpoint's published SVG setting
    (``families.wan_sparse``) on the run's post-patch grid (latent frames / patch_t frames of
    (h / patch_h) x (w / patch_w) tokens), or why it has none."""
    index = read_model_index(model_id)
    kind = ("a14b" if is_two_expert(index) else "ti2v" if index.get("expand_timesteps")
            else "i2v" if index.get("_class_name") == I2V_PIPELINE else "t2v")
    pt, ph, pw = patch(checkpoint_config(model_id, "transformer", SHIPPED))
    f, h, w = latent_grid(vae_config(model_id), values["height"], values["width"],
                          values["frames"])
    return wan_sparse.policy(kind, f // pt, (h // ph) * (w // pw))


def checkpoint_kind(model_id: str) -> str:
    """"a14b" / "i2v-a14b" (Wan 2.2 two experts), "ti2v" (TI2V-5B), "i2v" (Wan 2.1 I2V or
    FLF2V) or "t2v", from ``model_index.json``."""
    index = read_model_index(model_id)
    i2v = index.get("_class_name") == I2V_PIPELINE
    if is_two_expert(index):
        return "i2v-a14b" if i2v else "a14b"
    return "ti2v" if index.get("expand_timesteps") else "i2v" if i2v else "t2v"


# The Wan family's conditioning inputs besides --image (``Flags.inputs``). --video's spec is
# the one every family declaring --video uses (VACE, Helios): metavar PATH, a str, None.
INPUTS = {
    "last_image": dict(metavar="PATH", help="first-and-last-frame video: the last frame (PNG, "
                       "JPEG or WebP), with --image the first, on Wan 2.1 FLF2V-14B or Wan 2.2 "
                       "I2V-A14B (diffusers' WanImageToVideoPipeline last_image; default: "
                       "none, image-to-video)"),
    "video": dict(metavar="PATH", help="the source video (any file PyAV opens; frames in "
                  "order at its own rate): video-to-video on a Wan 2.1 T2V checkpoint "
                  "(WanVideoToVideoPipeline); --frames defaults to its length rounded down "
                  "to 4n+1 (default: none, text-to-video)"),
    "strength": dict(type=float, metavar="S", help="video-to-video: the fraction of the "
                     f"steps run from the noised source video, in (0, 1] (default "
                     f"{wan_v2v.DEFAULT_STRENGTH}, the pipeline's)"),
}


def check_inputs(inputs: dict, values: dict, model_id: str, args=None) -> tuple[dict, dict]:
    """``Flags.check_inputs``: ``--last_image`` (``families.wan_flf2v``), ``--video`` and
    ``--strength`` (``families.wan_v2v``), each refused in one line before any model loads;
    returns the inputs resolved (an ``ImageInfo``, a ``VideoInfo``, the strength) and
    ``values`` with ``frames`` from the video when ``--frames`` is not given."""
    kind = checkpoint_kind(model_id)
    if inputs.get("video") is not None and inputs.get("last_image") is not None:
        fail("--last_image", inputs["last_image"], "is image-to-video; --video is "
             "video-to-video: give one")
    cfg = read_component_config(model_id, "transformer") or {}
    inputs = {**inputs, "last_image": wan_flf2v.check(inputs.get("last_image"), kind, cfg,
                                                      args)}
    return wan_v2v.check(inputs, values, kind, frame_step(model_id), args)


def check_flags(values: dict) -> tuple[str, str] | None:
    """(flag, rule) a value breaks, or None. Wan 2.1 I2V's image cross-attention splits the
    257 CLIP keys off the text at ``encoder_hidden_states.shape[1] - 512`` (diffusers 0.42.1
    ``transformer_wan.py:89``, "hardcoded for now"): any other text length silently mixes
    text and image keys."""
    text = values["max_sequence_length"]
    cfg = read_component_config(values["model_id"], "transformer") or {}
    if text != 512 and cfg.get("image_dim"):
        return ("--max_sequence_length", "must be 512 for a checkpoint with CLIP image "
                "embeddings (Wan 2.1 I2V: diffusers splits the image keys off at 512 text "
                "tokens)")
    return None


def default_flow_shift(height: int, width: int) -> float:
    """Wan 2.1's model card samples 720p with flow_shift 5.0 and 480p with 3.0. The class is
    read from the shorter side, so portrait and landscape agree: >= 720 px is 720p class."""
    return 5.0 if min(height, width) >= 720 else 3.0


def latent_shape(vae_cfg: dict, height: int, width: int, frames: int,
                 model_id: str | None = None) -> tuple:
    """(1, C, F', h, w) from the VAE config alone (``model_id`` unused)."""
    from diffusers import AutoencoderKLWan as Vae

    return (1, init_value(Vae, vae_cfg, "z_dim"), *latent_grid(vae_cfg, height, width, frames))


def token_count(cfg: dict, height: int, width: int, frames: int, model_id: str) -> int:
    """Video tokens per sample: the latent grid of ``model_id``'s VAE over the patch."""
    pt, ph, pw = patch(cfg)
    f, h, w = latent_grid(vae_config(model_id), height, width, frames)
    return (f // pt) * (h // ph) * (w // pw)


def num_heads(cfg: dict) -> int:
    return cfg["num_attention_heads"]


def transformer_flops(cfg: dict, config) -> float:
    """Analytic FLOPs of one denoising step's model call (all CFG passes), counting
    2 FLOPs per multiply-add, as nanoGPT's MFU estimate does.

    Per block, with S video tokens, T text tokens, D = heads*head_dim, Fd = ffn_dim:
        self-attention projections q,k,v,o: 8*S*D^2;  scores and P.V: 4*S^2*D
        cross-attention q,o: 4*S*D^2;  k,v on text: 4*T*D^2;  scores and P.V: 4*S*T*D
        FFN: 4*S*D*Fd
    Embeddings and the output projection are < 0.1% at Wan sizes and are left out.
    """
    s = token_count(cfg, config.video.height, config.video.width, config.video.frames,
                    config.model.model_id)
    t = config.video.max_sequence_length
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    per_block = (8 * s * d * d + 4 * s * s * d + 4 * s * d * d + 4 * t * d * d
                 + 4 * s * t * d + 4 * s * d * cfg["ffn_dim"])
    return float(per_block * cfg["num_layers"] * config.video.batch)


def self_attention_flops(cfg: dict, config) -> float:
    """The 4*S^2*D scores-and-P.V term of ``transformer_flops``, all blocks and passes."""
    s = token_count(cfg, config.video.height, config.video.width, config.video.frames,
                    config.model.model_id)
    return float(4 * s * s * cfg["attention_head_dim"] * cfg["num_attention_heads"]
                 * cfg["num_layers"] * config.video.batch)


def empty_transformer(cfg: dict, dtype):
    """``WanTransformer3DModel`` of config ``cfg`` with meta parameters in ``dtype`` (see
    ``families.base.empty_model``), its attention processors ``wan_attention``'s (the RoPE
    without a size-2 minor dimension; diffusers' own values in float32)."""
    from diffusers import WanTransformer3DModel

    transformer = empty_model(WanTransformer3DModel, cfg, dtype)
    wan_attention.install(transformer)
    return transformer


def empty_vae(folder: str, config=None):
    """``AutoencoderKLWan`` of ``folder``'s config with meta weights (dry run)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLWan

    with init_empty_weights():
        return AutoencoderKLWan.from_config(
            AutoencoderKLWan.load_config(folder, subfolder="vae")).eval()


def load_pipeline(config, components):
    """Load the diffusers ``WanPipeline`` on CPU from safetensors only, with only
    ``components`` (of "text_encoder", "transformer", "vae"); the others are None.

    The transformer (and a Wan 2.2 A14B's ``transformer_2``, loaded with it) comes with meta
    weights (``empty_transformer``): the engine streams its values from the checkpoint's
    safetensors straight into their device shards, so no host holds the whole 14B checkpoint.
    The text encoder uses ``config.model.dtype``; the VAE stays float32 as in diffusers' Wan
    examples (a bf16 Wan VAE under torchax fails with a conv2d input/bias dtype mismatch).

    Raises:
        GenerationError: the weights could not be found or read.
    """
    from diffusers import AutoencoderKLWan, WanPipeline, WanTransformer3DModel

    dtype = getattr(torch, config.model.dtype)
    # TI2V-5B with --image runs as diffusers does it: WanImageToVideoPipeline on its folder.
    i2v = is_image_to_video(config.model.model_id) or (config.video.image is not None
                                                 and is_ti2v(config.model.model_id))
    # Image-to-video: the encode stage also runs the image encoder and the VAE encode.
    if i2v and "text_encoder" in components:
        components = (*components, "vae")
    skip = {name: None for name in ("text_encoder", "transformer", "vae")
            if name not in components}
    if "text_encoder" not in components:
        skip["tokenizer"] = None
        if i2v:
            skip.update(image_encoder=None, image_processor=None)
    experts = ("transformer", "transformer_2") if is_two_expert(
        read_model_index(config.model.model_id)) else ("transformer",)
    if len(experts) == 2 and "transformer" not in components:
        skip["transformer_2"] = None
    try:
        if "transformer" in components:
            for name in experts:
                skip[name] = empty_transformer(dict(WanTransformer3DModel.load_config(
                    config.model.model_id, subfolder=name)), dtype)
        if "vae" in components:
            skip["vae"] = AutoencoderKLWan.from_pretrained(
                config.model.model_id, subfolder="vae", dtype=torch.float32, use_safetensors=True)
        if i2v:  # imported only then: it pulls in transformers' CLIP processor (a warning)
            from diffusers import WanImageToVideoPipeline as cls
        else:
            cls = WanPipeline
        pipe = cls.from_pretrained(config.model.model_id, dtype=dtype, use_safetensors=True, **skip)
    except (OSError, ValueError) as e:
        raise GenerationError(
            f"--model_id={config.model.model_id!r}: could not load weights: {first_line(e)}") \
            from None
    pipe.scheduler = make_scheduler(pipe.scheduler.config, config.video.scheduler,
                                    config.video.flow_shift)
    # eval() only: torchax treats parameters with requires_grad=False as buffers, which would
    # hide them from the sharding rules.
    for m in (pipe.transformer, getattr(pipe, "transformer_2", None), pipe.vae,
              pipe.text_encoder, getattr(pipe, "image_encoder", None)):
        if m is not None:
            m.eval()
    return pipe


def make_scheduler(scheduler_config, kind: str, flow_shift: float):
    """``--scheduler``: "unipc" is ``WanPipeline``'s UniPCMultistepScheduler, "euler" is
    ``FlowMatchEulerDiscreteScheduler`` (the sampler of the 4-step distill LoRAs' recipes),
    each built from the checkpoint's scheduler config. flow_shift is a sampling choice (5.0
    at 720p, 3.0 at 480p), not part of the checkpoint: UniPC takes it as ``flow_shift``,
    Euler as ``shift``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if kind == "euler":
        return FlowMatchEulerDiscreteScheduler.from_config(scheduler_config, shift=flow_shift)
    return UniPCMultistepScheduler.from_config(scheduler_config, flow_shift=flow_shift)


EMBEDDING_NAMES = ("prompt_embeds", "negative_prompt_embeds")


def encode_prompts(pipe, config) -> dict:
    """Encode prompt and negative prompt with UMT5 on CPU, then free the text encoder.

    Runs before any SDPA override or JAX placement, so the text encoder is plain PyTorch.

    Returns:
        {"prompt_embeds", "negative_prompt_embeds"}: (1, max_sequence_length, text_dim) in
        the transformer dtype, zero-padded past the prompt as ``WanPipeline`` pads them (Wan
        takes no mask); the negative is absent without CFG (``--stage encode`` always
        writes it, so later stages may use either).
    """
    with torch.no_grad():
        pos, neg = pipe.encode_prompt(
            prompt=config.video.prompt,
            negative_prompt=config.video.negative_prompt,
            do_classifier_free_guidance=config.video.use_cfg or config.run.stage == "encode",
            max_sequence_length=config.video.max_sequence_length,
            device=torch.device("cpu"),
            # the transformer's dtype, as WanPipeline casts
            dtype=getattr(torch, config.model.dtype),
        )
    pipe.text_encoder = None  # UMT5-XXL is ~11 GB in bf16; nothing needs it after this.
    return {"prompt_embeds": pos} if neg is None else {"prompt_embeds": pos,
                                                       "negative_prompt_embeds": neg}


def prompt_sides(config) -> tuple:
    """The texts a video's embeddings hold: (("", prompt), ("negative_", negative or "")),
    the negative only with CFG or ``--stage encode`` (as ``encode_prompts``; diffusers
    encodes a missing negative as "")."""
    v = config.video
    if v.use_cfg or config.run.stage == "encode":
        return ("", v.prompt), ("negative_", v.negative_prompt or "")
    return (("", v.prompt),)


def encode_text(pipe, config, text: str) -> dict:
    """One text's {"prompt_embeds": (1, max_sequence_length, text_dim)}, the transformer
    dtype, zero-padded as ``encode_prompts``; keeps the encoder. ``WanPipeline.encode_prompt``
    encodes prompt and negative by separate ``_get_t5_prompt_embeds`` calls (batch 1 each),
    so one text's embedding never depends on the other text."""
    with torch.no_grad():
        pos, _ = pipe.encode_prompt(
            prompt=text, do_classifier_free_guidance=False,
            max_sequence_length=config.video.max_sequence_length,
            device=torch.device("cpu"), dtype=getattr(torch, config.model.dtype))
    return {"prompt_embeds": pos}


def check_embeddings(embeds: dict, settings: dict, cfg: dict | None) -> str | None:
    pos, neg = embeds["prompt_embeds"], embeds["negative_prompt_embeds"]
    seq = settings.get("max_sequence_length")
    if pos.ndim != 3 or pos.shape[0] != 1 or pos.shape != neg.shape or pos.shape[1] != seq:
        return (f"expected two (1, {seq}, text_dim) tensors, got {tuple(pos.shape)} and "
                f"{tuple(neg.shape)}")
    if cfg and cfg["in_channels"] != cfg["out_channels"] and "condition" not in embeds:
        return ("no image conditioning: --model_id is an image-to-video checkpoint; run "
                "--stage encode with --image first")
    if cfg and pos.shape[2] != cfg["text_dim"]:
        return (f"embeddings have text_dim {pos.shape[2]}, the transformer of --model_id="
                f"{settings.get('model_id')!r} expects {cfg['text_dim']}")
    return None


def prepare_latents(pipe, config):
    """Initial noise exactly as ``WanPipeline.prepare_latents`` and
    ``WanImageToVideoPipeline.prepare_latents`` draw it: ``randn_tensor`` of the latent shape
    with a CPU ``torch.Generator`` seeded with ``config.video.seed``, before anything else. Returns
    a float32 CPU tensor (1, z_dim, (frames-1)/t+1, height/s, width/s), t and s the VAE's
    temporal and spatial compression (4 and 8; 16 for the Wan 2.2 VAE).

    z_dim is the transformer's ``out_channels`` (its ``in_channels``, 36 for Wan I2V, also
    count the mask and condition), as the pipelines read it; t and s come from the
    checkpoint's VAE config (``vae_compression``), also in a staged denoise, which loads no
    VAE (the pipelines fall back to 4 and 8 there, wrong for Wan 2.2's VAE).
    """
    from diffusers.utils.torch_utils import randn_tensor

    generator = torch.Generator("cpu").manual_seed(config.video.seed)
    cfg = dict(pipe.transformer.config)
    v = config.video
    shape = (1, cfg["out_channels"],
             *latent_grid(vae_config(config.model.model_id), v.height, v.width, v.frames))
    return randn_tensor(shape, generator=generator, device=torch.device("cpu"),
                        dtype=torch.float32)


IMAGE_NAMES = ("image_embeds", "condition", wan_ti2v.NAME, wan_v2v.NAME)


def encode_image(pipe, config, image, devices, resident: dict | None = None) -> dict:
    """The image conditioning of ``WanImageToVideoPipeline``, by its own functions; frees the
    image encoder and the placed VAE encoder after the call, unless ``resident`` (a dict the
    caller keeps across calls: the server) keeps them for the next call.

    Returns:
        "condition": (1, 4 + z_dim, F', h, w) float32: the first-frame mask (4 channels) and
            the normalised posterior mode of the VAE-encoded [image, zeros x (frames - 1)]
            video at output size (``prepare_latents``).
        "image_embeds" (Wan 2.1 I2V only, ``image_encoder`` present): (n, 257, 1280) CLIP
            penultimate hidden states in the model dtype (``encode_image``), n = 2 with a
            last image (FLF2V: first and last, which the transformer views as one row of
            514 tokens), else 1.
        "first_frame" (TI2V-5B only, in place of "condition"): (1, 48, 1, h, w) float32, the
            normalised posterior mode of the image alone (``families.wan_ti2v``).
        "video_latents" (video-to-video, ``image`` None, only): ``families.wan_v2v.encode``.
    With ``config.video.inputs["last_image"]`` (``--last_image``, ``families.wan_flf2v``) the
    condition video is [image, zeros x (frames - 2), last image] with the mask on both ends,
    as the pipeline's ``prepare_latents(..., last_image=...)`` builds it.
    The VAE encode of the whole conditioning video (TI2V-5B: of the image) runs on
    ``devices`` (``families.wan_vae.DeviceEncode``: chunked, width-sharded; about 3.8e14 FLOPs at
    720p x 81, minutes on a CPU; 34 s for TI2V-5B's one 704x1280 frame on a 2-core host), standing
    in for ``vae.encode`` inside diffusers' own ``prepare_latents``; with ``resident`` its
    ``DeviceEncode`` (weights placed once, one compiled program set per video shape) is
    ``resident["vae_encode"]``.
    """
    cpu = torch.device("cpu")
    encode = (resident or {}).get("vae_encode") or wan_vae.DeviceEncode(pipe.vae, devices)
    if resident is not None:
        resident["vae_encode"] = encode
    if image is None:  # video-to-video: the source video's latents
        return wan_v2v.encode(pipe, config, encode)
    out, last = {}, (config.video.inputs or {}).get("last_image")
    last = None if last is None else read_image(last)
    with torch.no_grad():
        if getattr(pipe, "image_encoder", None) is not None:
            out["image_embeds"] = pipe.encode_image(image if last is None else [image, last],
                                                    cpu).to(getattr(torch, config.model.dtype))
            if resident is None:  # CLIP ViT-H is 1.3 GB in float32; done with it
                pipe.image_encoder = None
        video = pipe.video_processor.preprocess(image, height=config.video.height,
                                                width=config.video.width).to(cpu, torch.float32)
        # prepare_latents also draws noise; its generator only feeds that (the encode takes
        # the posterior mode), so any seed gives the same condition.
        args = (video, 1, pipe.vae.config.z_dim, config.video.height, config.video.width,
                config.video.frames, torch.float32, cpu, torch.Generator("cpu").manual_seed(0))
        if last is not None:  # prepare_latents' latents=None, last_image
            args += (None, pipe.video_processor.preprocess(
                last, height=config.video.height, width=config.video.width).to(cpu,
                                                                               torch.float32))
        pipe.vae.encode = encode
        try:
            if pipe.config.expand_timesteps:  # TI2V-5B: the image alone (one frame)
                out[wan_ti2v.NAME] = pipe.prepare_latents(*args)[1]
            else:
                _, out["condition"] = pipe.prepare_latents(*args)
        finally:
            del pipe.vae.encode  # the class's own method again
    return out


def model_inputs(embeds: dict, config) -> dict:
    """{"encoder_hidden_states": (B, T, text_dim)} in the model dtype, B = 2 with CFG
    ([cond, uncond], as ``WanPipeline`` orders its two calls), and "guidance_scale": (B,)
    float32, every entry ``config.video.guidance_scale``: the CFG scale is an argument of the step
    program, not a constant compiled into it, so a two-expert model's second scale
    (``--guidance_scale_2``) runs the same program (``engine.programs.experts``)."""
    dtype = getattr(torch, config.model.dtype)
    pos = embeds["prompt_embeds"]
    x = torch.cat([pos, embeds["negative_prompt_embeds"]]) if config.video.use_cfg else pos
    out = {"encoder_hidden_states": x.to(dtype),
           "guidance_scale": torch.full((x.shape[0],), config.video.guidance_scale,
                                        dtype=torch.float32)}
    # Image-to-video: the same condition and image embeddings for both CFG passes, as
    # WanImageToVideoPipeline passes them; one row per pass so they split over dp too.
    if "condition" in embeds:  # (B, 4 + z_dim, F', h, w)
        out["condition"] = embeds["condition"].to(dtype).repeat(x.shape[0], 1, 1, 1, 1)
    # (B x n, 257, image_dim): n images per pass (FLF2V: 2, first and last, adjacent rows,
    # which the transformer views as (B, 514, image_dim); a dp shard holds whole pairs).
    if "image_embeds" in embeds:
        out["encoder_hidden_states_image"] = embeds["image_embeds"].to(dtype).repeat(
            x.shape[0], 1, 1)
    if wan_ti2v.NAME in embeds:  # TI2V-5B: (B, z_dim, 1, h, w) float32, mixed in float32
        out[wan_ti2v.NAME] = embeds[wan_ti2v.NAME].float().repeat(x.shape[0], 1, 1, 1, 1)
    return out


# CLIP ViT-H/14 at 224 px: 16 x 16 patches and the class token (Wan 2.1 I2V's image keys),
# for a checkpoint without an image_encoder config (configs/ ships none); ``image_tokens``.
CLIP_TOKENS = 257


def image_tokens(model_id: str) -> int:
    """The image keys the pipeline takes from CLIP (``hidden_states[-2]``): (image_size /
    patch_size)^2 patches and the class token, from the checkpoint's image_encoder config;
    ``CLIP_TOKENS`` where it has none."""
    cfg = read_component_config(model_id, "image_encoder")
    return (cfg["image_size"] // cfg["patch_size"]) ** 2 + 1 if cfg else CLIP_TOKENS


def abstract_model_inputs(cfg: dict, config) -> dict:
    dtype = getattr(jnp, config.model.dtype)
    out = {"encoder_hidden_states": jax.ShapeDtypeStruct(
        (config.video.batch, config.video.max_sequence_length, cfg["text_dim"]), dtype),
        "guidance_scale": jax.ShapeDtypeStruct((config.video.batch,), jnp.float32)}
    extra = cfg["in_channels"] - cfg["out_channels"]
    v = config.video
    f, h, w = latent_grid(vae_config(config.model.model_id), v.height, v.width, v.frames)
    if extra:  # image-to-video: mask + condition channels (model_inputs)
        out["condition"] = jax.ShapeDtypeStruct((config.video.batch, extra, f, h, w), dtype)
    if cfg.get("image_dim"):  # FLF2V: two images per pass (model_inputs)
        out["encoder_hidden_states_image"] = jax.ShapeDtypeStruct(
            (config.video.batch * wan_flf2v.images_per_row(cfg),
             image_tokens(config.model.model_id), cfg["image_dim"]), dtype)
    if not extra and config.video.image is not None:  # TI2V-5B with --image
        out[wan_ti2v.NAME] = jax.ShapeDtypeStruct(
            (config.video.batch, cfg["out_channels"], 1, h, w), jnp.float32)
    return out


def step_fn(jm, config):
    """The torch function of one denoising step's model call, to be viewed as JAX and jitted.

    latents (1, C, F, H, W) float32 -> noise prediction (1, C, F, H, W) in the model dtype.
    With CFG, cond and uncond run as one batch-2 call; the guidance combination is done in the
    model dtype, exactly as ``WanPipeline`` does it. The scale is ``inputs["guidance_scale"]``
    (traced; see ``model_inputs``); callers passing only the embeddings get
    ``config.video.guidance_scale`` as a constant.

    The timestep is the scalar ``t`` of the step, expanded over the batch, also for a
    ``expand_timesteps`` checkpoint (TI2V-5B): in text-to-video ``WanPipeline`` builds the
    per-token timesteps as ``ones_mask * t``, every token the same ``t``, and the
    transformer's (B, S) path computes per token exactly what the (B,) path computes once and
    broadcasts (the time embedding is row-wise; the modulation is an elementwise add). The
    scalar path skips a (B, S, 6, D) float32 modulation tensor per block (4.0 GB for the CFG
    pair at 704x1280x121). tests/test_wan22.py checks it against diffusers' per-token path.
    TI2V-5B image-to-video (a "first_frame" input) has two values of t per step, t and 0:
    the scalar path runs at t and ``families.wan_ti2v`` recomputes frame 0's rows at t = 0.
    """
    dtype = getattr(torch, config.model.dtype)
    cfg, constant = config.video.use_cfg, config.video.guidance_scale

    def step(params, buffers, latents, timestep, inputs):
        inputs = dict(inputs)
        scale = inputs.pop("guidance_scale", None)
        # A 0-d tensor does not promote the bf16 predictions: the combination stays in the
        # model dtype, as diffusers' Python-float scale keeps it.
        scale = constant if scale is None else scale[0]
        condition = inputs.pop("condition", None)
        first_frame = inputs.pop(wan_ti2v.NAME, None)
        if first_frame is not None:  # TI2V-5B image-to-video: frame 0 is the image's
            x = wan_ti2v.model_input(latents, first_frame).to(dtype)  # (B, C, F, H, W)
        else:
            x = latents.to(dtype)  # diffusers: latent_model_input = latents.to(dtype)
            if cfg:
                x = torch.cat([x, x])  # (2, C, F, H, W): [cond, uncond]
        if condition is not None:  # image-to-video: (B, C + 4 + C, F, H, W)
            x = torch.cat([x, condition], dim=1)
        t = timestep.expand(x.shape[0])
        # TI2V-5B image-to-video: t = 0 on frame 0's tokens, without a (B, S) timestep.
        with wan_ti2v.timesteps_scope(jm._model, latents, first_frame):
            out = jm.functional_call("forward", params, buffers, hidden_states=x, timestep=t,
                                     return_dict=False, **inputs)[0]
        if not cfg:
            return out
        cond, uncond = out.chunk(2)
        return uncond + scale * (cond - uncond)

    return step


# Megatron tensor parallelism for WanTransformer3DModel (torch Linear weights are (out, in)):
# column-parallel layers split output features, row-parallel layers split input features, so
# each attention/FFN block needs one all-reduce. Norms, patch embedding, modulation tables and
# proj_out are small and replicated. First match wins. The per-head RMSNorm weights follow q/k.
COLUMN_PARALLEL_RULES = (
    (r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v)\.weight$", ("tp", None)),
    (r"blocks\.\d+\.attn[12]\.(to_q|to_k|to_v)\.bias$", ("tp",)),
    (r"blocks\.\d+\.attn[12]\.norm_[qk]\.weight$", ("tp",)),
    (r"blocks\.\d+\.ffn\.net\.0\.proj\.weight$", ("tp", None)),
    (r"blocks\.\d+\.ffn\.net\.0\.proj\.bias$", ("tp",)),
    # Wan 2.1 I2V's image cross-attention (257 CLIP keys): 2.1 B parameters at 14B (3.9 GiB
    # in bf16). Split over tp and sp together: their work is 257 rows, so the all-gather of
    # the image keys and values over sp costs ~2.6 MB per block, while replicated over sp
    # (Ulysses: tp 1) they would keep Wan 2.1 I2V 14B off Ulysses on v6e-8 (30.59 GiB of
    # replicated weights; 27.66 with these over sp4, engine.weights.layout). norm_added_k is
    # an RMSNorm across heads, like norm_k: split with its projection.
    (r"blocks\.\d+\.attn2\.(add_k_proj|add_v_proj)\.weight$", (("tp", "sp"), None)),
    (r"blocks\.\d+\.attn2\.(add_k_proj|add_v_proj)\.bias$", (("tp", "sp"),)),
    (r"blocks\.\d+\.attn2\.norm_added_k\.weight$", (("tp", "sp"),)),
    (r"condition_embedder\.(time_embedder|text_embedder)\.linear_1\.weight$", ("tp", None)),
    (r"condition_embedder\.(time_embedder|text_embedder)\.linear_1\.bias$", ("tp",)),
)
ROW_PARALLEL_RULES = (
    (r"blocks\.\d+\.attn[12]\.to_out\.0\.weight$", (None, "tp")),
    (r"blocks\.\d+\.ffn\.net\.2\.weight$", (None, "tp")),
)


# --quantize: every block's attention projections (self, text cross, and I2V's image k/v) and
# its MLP: nearly all of a step's linear FLOPs. Kept in --dtype: the condition embedder (time,
# text and image embedders, time_proj: the modulation, once per step), the patch embedding
# (a Conv3d), the norms and scale_shift_table, proj_out (the output head), as LightX2V's
# int8/fp8 Wan checkpoints keep them.
QUANTIZED_LINEARS = (r"^blocks\.\d+\.(attn[12]\.(to_q|to_k|to_v|to_out\.0|add_k_proj|"
                     r"add_v_proj)|ffn\.net\.(0\.proj|2))$")


def transformer_sharding_rules(*, replicate_row_parallel: bool = False) -> tuple:
    """The regex table for the Wan transformer's state dict.

    With ``replicate_row_parallel`` the attention-out and FFN-down weights are replicated: their
    all-reduce disappears at the cost of gathering the column-parallel activations first (an
    earlier TPU port of a similar video DiT measured +11% on v6e-8 for this trade).
    """
    if replicate_row_parallel:
        return COLUMN_PARALLEL_RULES
    return COLUMN_PARALLEL_RULES + ROW_PARALLEL_RULES


def sharding_rules(config) -> tuple:
    return transformer_sharding_rules(replicate_row_parallel=config.layout.replicate_row_parallel)


FAMILY = ModelFamily(
    name="Wan",
    checkpoint=Checkpoint(
        pipeline_classes=("WanPipeline", I2V_PIPELINE),
        shipped_configs=("Wan-AI/Wan2.1-T2V-14B-Diffusers", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                         "Wan-AI/Wan2.2-T2V-A14B-Diffusers", "Wan-AI/Wan2.2-TI2V-5B-Diffusers",
                         "Wan-AI/Wan2.1-I2V-14B-720P-Diffusers",
                         "Wan-AI/Wan2.2-I2V-A14B-Diffusers"),
        download_hint=DOWNLOAD_HINT,
        required_files=("model_index.json", "transformer/config.json", "vae/config.json"),
        components={"all": ("text_encoder", "transformer", "vae"), "encode": ("text_encoder",),
                    "denoise": ("transformer",), "decode": ("vae",)},
        weight_folders={"text_encoder": ("text_encoder", "image_encoder"),
                        "transformer": ("transformer", "transformer_2"), "vae": ("vae",)},
        optional_folders=("transformer_2", "image_encoder"),
    ),
    flags=Flags(defaults=DEFAULTS, checkpoint_defaults=checkpoint_defaults, check=check_flags,
                inputs=INPUTS, check_inputs=check_inputs),
    sizes=Sizes(
        frame_step=frame_step,
        pixel_multiple=pixel_multiple,
        latent_shape=latent_shape,
        token_count=token_count,
    ),
    text=TextEncoding(
        load_pipeline=load_pipeline,
        encode_prompts=encode_prompts,
        prompt_sides=prompt_sides,
        encode_text=encode_text,
        embedding_names=EMBEDDING_NAMES,
        check_embeddings=check_embeddings,
        prepare_latents=prepare_latents,
        encoder_modules=pipeline_modules("text_encoder", "image_encoder"),  # UMT5, CLIP
    ),
    transformer=Transformer(
        empty=empty_transformer,
        num_heads=num_heads,
        flops=transformer_flops,
        self_attention_flops=self_attention_flops,
        model_inputs=model_inputs,
        abstract_model_inputs=abstract_model_inputs,
        step_fn=step_fn,
        timestep_dtype="int32",
        sharding_rules=sharding_rules,
        block_stack=WAN_BLOCKS,
        # v6e, for a run whose weights are too large for Ulysses (chips.ULYSSES_WEIGHT_FRACTION;
        # by default no shipped checkpoint on v6e-8 since the A14B pairs park their idle expert
        # in host memory and I2V 14B splits its image cross-attention over sp; still the A14B
        # pairs with --park_memory device): dp2 x tp2 x sp2 on v6e-8 (tp2 x sp2 for any v6e
        # slice whose tp stays >= 2). By the static estimate it beats dp2 x tp4 (14B 720p
        # 3.46 -> 3.21 s/step); docs/dry_run.md.
        default_sp={"v6e": 2},
        # Self-attention over video tokens only (text enters by cross-attention), in the
        # flattened frames x height x width order: --window_size applies.
        masks=(LocalMask,),
        lora_state_dict=lora_state_dict,
        quantized_linears=QUANTIZED_LINEARS,
        sparse_policy=sparse_policy,
    ),
    vae=VaePrograms(
        empty=empty_vae,
        is_decode_weight=wan_vae.is_vae_decode_weight,
        decoder=wan_vae.vae_decoder,
        encoder=wan_vae.ChunkedEncoder,
        is_encode_weight=wan_vae.is_encode_weight,
    ),
    image=ImageConditioning(
        mode=image_mode,
        encode=encode_image,
        names=IMAGE_NAMES,
        size=lambda model_id, info: None,  # the flags' (or family default) size
        finish_latents=wan_ti2v.finish,
        # --video (video-to-video): the source video's encode, then its noised latents.
        wanted=lambda config: config.video.image is not None or wan_v2v.is_wanted(config),
        start_latents=wan_v2v.start_latents,
    ),
    scheduler=Scheduling(
        default_flow_shift=default_flow_shift,
        sigmas=lambda num_inference_steps: None,  # UniPC's own spacing, as WanPipeline
        # WanPipeline's default is UniPC; Euler serves the few-step distilled LoRAs.
        names=("unipc", "euler"),
        make=make_scheduler,
        first_step=wan_v2v.first_step,  # --strength's cut (video-to-video)
    ),
)
