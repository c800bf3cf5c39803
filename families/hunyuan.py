"""HunyuanVideo-1.5 text-to-video (diffusers ``HunyuanVideo15Pipeline``): the family module.

Sources: diffusers 0.42.1's ``HunyuanVideo15Pipeline``, ``HunyuanVideo15Transformer3DModel``
and ``AutoencoderKLHunyuanVideo15``, which run unmodified, and diffusers'
``scripts/convert_hunyuan_video1_5_to_diffusers.py``, which wrote the public checkpoints
(720p T2V: flow shift 9.0, CFG 6.0; 480p T2V: 5.0 and 6.0). 121 frames are the model
card's 5 s at 24 fps.

What differs from diffusers, and why (none of it changes a real token's output):

* **Static T2V, fixed token order.** diffusers' ``forward`` tests ``torch.all(image_embeds ==
  0)`` with a Python ``if`` and reorders each sample's text tokens by boolean indexing
  (valid first). Neither traces under ``jax.jit``. Text-to-video is a static fact here, and
  the text tokens keep a fixed order, [ByT5 (256), Qwen (1000)], with their masks. Attention
  does not depend on the order of keys, and text tokens carry no RoPE. The 729 image
  tokens, all of them padding in T2V, are left out: no real token may attend them.
* **Exact key masking without a dense mask.** diffusers builds a (B, 1, S, S) boolean mask in
  every block (about 12.9 GB per sample at 720p x 121) and in the token refiner. Here the
  joint attention and the refiner pass a (B, 1, 1, S) key-padding mask, which our SDPA
  override turns into segment ids (real = 1, padding = 0) for the Splash kernels. Padded
  queries attend only padding, so they stay finite; no output reads them. (diffusers'
  padded rows come out zero; torchax's stock SDPA gives NaN there.)
* **RoPE without the pair split** (``families.rope``): diffusers' ``apply_rotary_emb``
  values, computed on the whole head_dim after the permute to (B, H, N, D), so TPU keeps
  no (2, 128)-tiled copies of q and k (``KeyPaddingAttnProcessor``).
* **CFG in one batch-2 call.** diffusers' guider makes two batch-1 transformer calls; here
  [cond, uncond] run as one call with the batch over "dp", combined with the checkpoint's
  guidance formula.
* **Latents stay float32 between steps** (diffusers keeps them in the transformer dtype,
  bf16); the model input and the timestep are cast to the transformer dtype as diffusers
  casts them, and the initial noise is drawn in that dtype as diffusers draws it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

import custom_splash_attention as csa
from engine.files.checkpoint import read_component_config, read_model_index
from engine.files.image import read_image
from engine.run.errors import GenerationError, UsageError, first_line
from engine.weights.scan_layers import BlockStack
from families import hunyuan_lora, hunyuan_vae
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
from families.rope import apply_rope

# The VAE's compression ratios and the transformer's patch sizes are read from the
# checkpoint (``vae_compression``, ``token_count``), as the pipeline reads them from its VAE
# (pipeline_hunyuan_video1_5.py:218-219); a dry run without config files reads these.
SHIPPED = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v"
# The pipeline hard-codes its text lengths in __init__, not in any config.
QWEN_TOKENS = 1000
BYT5_TOKENS = 256
# SigLIP so400m-patch14-384: 27 x 27 patches (the image-to-video checkpoints' image tokens),
# for a checkpoint without an image_encoder config (configs/ ships none); ``image_tokens``.
SIGLIP_TOKENS = 729
I2V_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
# The step-distilled (MeanFlow) checkpoint's steps: the official default for it
# (Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7, hyvideo/commons/__init__.py PIPELINE_CONFIGS;
# its README recommends 8 or 12). Its shift (7) and guidance (1): its scheduler, guider.
MEANFLOW_STEPS = 12

DEFAULTS = dict(
    prompt="A cat walks on the grass, realistic style.",
    negative_prompt="",  # HunyuanVideo15Pipeline encodes "" when no negative prompt is given
    height=720,
    width=1280,
    frames=121,
    fps=24,
    num_inference_steps=50,
    guidance_scale=6.0,
    max_sequence_length=QWEN_TOKENS,
)

DOWNLOAD_HINT = ("hf download hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v "
                 "--local-dir PATH")

# token_tile 16: sequence parallelism pads each shard to whole 16-row bf16 tiles. With 1,
# libtpu's compiler stopped on the image-to-video step whenever a shard had an odd row count
# ("INTERNAL: ... bitcast ... Bitcast cannot have different shape", bf16[1,12323,2048]: the
# 480p I2V checkpoints at their dp2 x sp4 default on v6e:2x4; also at 42 tokens, the test).
# The padded keys are masked by segment ids (joint attention: text follows the video).
BLOCKS = BlockStack(attr="transformer_blocks", carry=2,
                    # hidden, encoder, temb, text mask, RoPE (cos, sin) each (N, head_dim)
                    token_axes=(1, None, None, None, 0), self_attention="attn",
                    sublayers=(),  # joint attention over both streams: no Megatron SP yet
                    token_tile=16)


def checkpoint_defaults(model_id: str) -> dict:
    """Flag defaults the checkpoint sets: its guider's CFG scale, its scheduler's shift, and
    the size ``HunyuanVideo15Pipeline`` gives a call without height and width
    (``default_size``: 480 x 848 for the 480p checkpoints, 720 x 1280 for 720p). An
    image-to-video run takes its image's bucket instead (``image_size``, unless --height /
    --width are given); the 16:9 size stands where no image is given: the dry run, and the
    server's sizes (a 480p image-to-video dry run compiled 720 x 1280 before).

    Raises:
        UsageError: the guider uses an option this port does not implement.
    """
    out = {}
    target = (read_component_config(model_id, "transformer") or {}).get("target_size")
    if target:
        out["height"], out["width"] = default_size(target, vae_compression(
            vae_config(model_id))[1])
    guider = read_component_config(model_id, "guider", filename="guider_config.json") or {}
    unsupported = {k: guider[k] for k, default in (
        ("guidance_rescale", 0.0), ("use_original_formulation", False), ("start", 0.0),
        ("stop", 1.0), ("enabled", True)) if k in guider and guider[k] != default}
    if unsupported:
        raise UsageError(f"--model_id={model_id!r}: guider options {unsupported} are not "
                         "supported (plain CFG only)")
    if "guidance_scale" in guider:
        out["guidance_scale"] = float(guider["guidance_scale"])
    scheduler = read_component_config(model_id, "scheduler",
                                      filename="scheduler_config.json") or {}
    if "shift" in scheduler:
        out["flow_shift"] = float(scheduler["shift"])
    if is_meanflow(model_id):  # no file records the step count: the official default
        out["num_inference_steps"] = MEANFLOW_STEPS
    return out


def is_meanflow(model_id: str) -> bool:
    """The transformer config sets ``use_meanflow`` (the step-distilled 480p I2V model)."""
    return bool((read_component_config(model_id, "transformer") or {}).get("use_meanflow"))


def check_flags(values: dict) -> tuple[str, str] | None:
    """(flag, rule) a value breaks, or None."""
    if values["max_sequence_length"] != QWEN_TOKENS:
        return ("--max_sequence_length", f"is fixed at {QWEN_TOKENS} for HunyuanVideo-1.5 "
                "(HunyuanVideo15Pipeline hard-codes its text length)")
    return None


def default_flow_shift(height: int, width: int) -> float:
    """The public checkpoints' shifts: 9.0 for 720p T2V, 5.0 for 480p (read from the
    checkpoint's scheduler whenever it has one)."""
    return 9.0 if min(height, width) >= 720 else 5.0


def make_scheduler(scheduler_config, kind: str, flow_shift: float):
    """The run's scheduler: ``FlowMatchEulerDiscreteScheduler`` from the checkpoint's config
    with ``shift`` = flow_shift (HunyuanVideo-1.5 runs euler only; ``kind`` is always it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config(scheduler_config, shift=flow_shift)


def scheduler_sigmas(num_inference_steps: int) -> list:
    """``HunyuanVideo15Pipeline``'s sigmas: linspace(1, 0, n + 1)[:-1] (the scheduler's shift
    is applied to them in ``set_timesteps``)."""
    return list(np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1])


def vae_config(model_id: str | None) -> dict:
    """``model_id``'s VAE config (a local folder or a shipped Hub id), else the shipped one."""
    return checkpoint_config(model_id, "vae", SHIPPED)


def vae_compression(vae_cfg: dict) -> tuple[int, int]:
    """(temporal, spatial) compression of an ``AutoencoderKLHunyuanVideo15`` config: its
    ``temporal_compression_ratio`` / ``spatial_compression_ratio`` (config fields,
    autoencoder_kl_hunyuanvideo15.py:653-654, 681-682; the class defaults where absent)."""
    from diffusers import AutoencoderKLHunyuanVideo15 as Vae

    return (int(init_value(Vae, vae_cfg, "temporal_compression_ratio")),
            int(init_value(Vae, vae_cfg, "spatial_compression_ratio")))


def latent_grid(vae_cfg: dict, height: int, width: int, frames: int) -> tuple[int, int, int]:
    """(latent frames, h, w) of a video, as the pipeline's ``prepare_latents`` sizes them
    (pipeline_hunyuan_video1_5.py:492-498)."""
    temporal, spatial = vae_compression(vae_cfg)
    return (frames - 1) // temporal + 1, height // spatial, width // spatial


def frame_step(model_id: str) -> int:
    """Frames are ``frame_step * n + 1``: the VAE's temporal compression."""
    return vae_compression(vae_config(model_id))[0]


def pixel_multiple(model_id: str) -> int:
    """Height and width are multiples of the VAE's spatial compression x the patch."""
    from diffusers import HunyuanVideo15Transformer3DModel as Model

    cfg = checkpoint_config(model_id, "transformer", SHIPPED)
    return vae_compression(vae_config(model_id))[1] * init_value(Model, cfg, "patch_size")


def latent_shape(vae_cfg: dict, height: int, width: int, frames: int,
                 model_id: str | None = None) -> tuple:
    """(1, C, F', h, w) from the VAE config alone (``model_id`` unused)."""
    from diffusers import AutoencoderKLHunyuanVideo15 as Vae

    return (1, init_value(Vae, vae_cfg, "latent_channels"),
            *latent_grid(vae_cfg, height, width, frames))


def token_count(cfg: dict, height: int, width: int, frames: int, model_id: str) -> int:
    """Video tokens per sample: the latent grid of ``model_id``'s VAE over the patch."""
    from diffusers import HunyuanVideo15Transformer3DModel as Model

    p, pt = init_value(Model, cfg, "patch_size"), init_value(Model, cfg, "patch_size_t")
    f, h, w = latent_grid(vae_config(model_id), height, width, frames)
    return (f // pt) * (h // p) * (w // p)


def num_heads(cfg: dict) -> int:
    return cfg["num_attention_heads"]


def text_tokens(model_id: str | None = None) -> int:
    """Text-stream tokens in the joint sequence: ByT5 then Qwen, and for an image-to-video
    checkpoint the SigLIP image tokens before them (in text-to-video they are all padding
    and left out). Told apart by the pipeline class, not the transformer's ``task_type``:
    the public 480p T2V transformer says "i2v" (a slip of the conversion script)."""
    image = image_tokens(model_id) if model_id is not None and is_image_to_video(
        model_id) else 0
    return image + BYT5_TOKENS + QWEN_TOKENS


def image_tokens(model_id: str) -> int:
    """SigLIP's ``last_hidden_state`` tokens, (image_size / patch_size)^2 from the
    checkpoint's image_encoder config; ``SIGLIP_TOKENS`` where it has none (the shipped
    configs)."""
    cfg = read_component_config(model_id, "image_encoder")
    return (cfg["image_size"] // cfg["patch_size"]) ** 2 if cfg else SIGLIP_TOKENS


def transformer_flops(cfg: dict, config) -> float:
    """Analytic FLOPs of one step's model call(s), 2 per multiply-add (nanoGPT's MFU count).

    Per dual-stream block, with L = S video + T text tokens in one joint sequence,
    D = heads*head_dim and r = mlp_ratio (each stream has its own weights, same sizes):
        q, k, v, o projections: 8*L*D^2;  scores and P.V: 4*L^2*D;  MLP: 4*r*L*D^2.
    The 2-block token refiner on 1000 text tokens and the embedders are < 0.1% at 720p and
    are left out.
    """
    s = token_count(cfg, config.video.height, config.video.width, config.video.frames,
                    config.model.model_id)
    seq = s + text_tokens(config.model.model_id)
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    per_block = 8 * seq * d * d + 4 * seq * seq * d + 4 * cfg["mlp_ratio"] * seq * d * d
    return float(per_block * cfg["num_layers"] * config.video.batch)


def self_attention_flops(cfg: dict, config) -> float:
    """The 4*L^2*D joint-attention term of ``transformer_flops``, all blocks and passes."""
    video = config.video
    seq = token_count(cfg, video.height, video.width, video.frames,
                      config.model.model_id) + text_tokens(config.model.model_id)
    return float(4 * seq * seq * cfg["attention_head_dim"] * cfg["num_attention_heads"]
                 * cfg["num_layers"] * config.video.batch)


def empty_transformer(cfg: dict, dtype):
    """``HunyuanVideo15Transformer3DModel`` of config ``cfg`` with meta parameters in
    ``dtype`` (see ``families.base.empty_model``), with ``install_attention_processors`` applied.

    Raises:
        UsageError: the transformer's task_type is neither "t2v" nor "i2v".
    """
    from diffusers import HunyuanVideo15Transformer3DModel

    if cfg.get("task_type", "t2v") not in ("t2v", "i2v"):
        raise UsageError(f"transformer task_type={cfg.get('task_type')!r}: only text- and "
                         "image-to-video (t2v, i2v) are supported")
    transformer = empty_model(HunyuanVideo15Transformer3DModel, cfg, dtype)
    install_attention_processors(transformer)
    return transformer


def empty_vae(folder: str, config=None):
    """``AutoencoderKLHunyuanVideo15`` of ``folder``'s config with meta weights (dry run)."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLHunyuanVideo15

    with init_empty_weights():
        return AutoencoderKLHunyuanVideo15.from_config(
            AutoencoderKLHunyuanVideo15.load_config(folder, subfolder="vae")).eval()


TEXT_COMPONENTS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


def load_pipeline(config, components):
    """Load diffusers' ``HunyuanVideo15Pipeline`` on CPU from safetensors only, with only
    ``components`` (of "text_encoder" (both encoders and tokenizers), "transformer", "vae");
    the others are None.

    The transformer comes with meta weights (``empty_transformer``), streamed later into
    its device shards. Text encoders use ``config.model.dtype``; the VAE stays float32.

    Raises:
        GenerationError: the weights could not be found or read.
    """
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )

    dtype = getattr(torch, config.model.dtype)
    i2v = is_image_to_video(config.model.model_id)
    if i2v and "text_encoder" in components:  # the encode stage also encodes the image
        components = (*components, "vae")
    skip = {"transformer": None} if "transformer" not in components else {}
    if i2v and "text_encoder" not in components:
        skip.update(image_encoder=None, feature_extractor=None)
    if "vae" not in components:
        # The pipeline's __init__ reads vae.config (it cannot be None): meta weights, no RAM.
        skip["vae"] = empty_vae(config.model.model_id)
    if "text_encoder" not in components:
        skip.update({name: None for name in TEXT_COMPONENTS})
    try:
        if "transformer" in components:
            skip["transformer"] = empty_transformer(dict(
                HunyuanVideo15Transformer3DModel.load_config(config.model.model_id,
                                                             subfolder="transformer")), dtype)
        if "vae" in components:
            skip["vae"] = AutoencoderKLHunyuanVideo15.from_pretrained(
                config.model.model_id, subfolder="vae", dtype=torch.float32, use_safetensors=True)
        if i2v:  # imported only then: it pulls in transformers' SigLIP processor
            from diffusers import HunyuanVideo15ImageToVideoPipeline as cls
        else:
            cls = HunyuanVideo15Pipeline
        pipe = cls.from_pretrained(config.model.model_id, dtype=dtype, use_safetensors=True, **skip)
    except (OSError, ValueError) as e:
        raise GenerationError(
            f"--model_id={config.model.model_id!r}: could not load weights: {first_line(e)}") \
            from None
    pipe.scheduler = make_scheduler(pipe.scheduler.config, "euler", config.video.flow_shift)
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2,
              getattr(pipe, "image_encoder", None)):
        if m is not None:
            m.eval()
    return pipe


EMBEDDING_NAMES = tuple(f"{side}{name}" for side in ("", "negative_") for name in (
    "prompt_embeds", "prompt_embeds_mask", "prompt_embeds_2", "prompt_embeds_mask_2"))


def encode_prompts(pipe, config) -> dict:
    """Encode prompt and negative prompt with Qwen2.5-VL and ByT5 on CPU (diffusers'
    ``encode_prompt``), then free both encoders.

    Returns:
        {"prompt_embeds": (1, 1000, text_embed_dim), "prompt_embeds_mask": (1, 1000),
        "prompt_embeds_2": (1, 256, text_embed_2_dim), "prompt_embeds_mask_2": (1, 256)},
        and the same with a "negative_" prefix unless CFG is off (``--stage encode`` always
        writes both). Embeddings and masks in the transformer dtype, as diffusers casts them;
        the ByT5 pair is zeros when the prompt has no quoted text.
    """
    dtype = getattr(torch, config.model.dtype)
    out = {}
    sides = [("", config.video.prompt)]
    if config.video.use_cfg or config.run.stage == "encode":
        sides.append(("negative_", config.video.negative_prompt or ""))
    with torch.no_grad():
        for side, prompt in sides:
            tensors = pipe.encode_prompt(prompt=prompt, device=torch.device("cpu"),
                                         dtype=dtype)
            for name, t in zip(EMBEDDING_NAMES[:4], tensors, strict=True):
                out[side + name] = t
    # Qwen2.5-VL-7B is ~15 GB in bf16; nothing needs the encoders after this.
    pipe.text_encoder = pipe.text_encoder_2 = None
    return out


def prompt_sides(config) -> tuple:
    """The texts a video's embeddings hold: (("", prompt), ("negative_", negative or "")),
    the negative only with CFG or ``--stage encode`` (as ``encode_prompts``)."""
    v = config.video
    if v.use_cfg or config.run.stage == "encode":
        return ("", v.prompt), ("negative_", v.negative_prompt or "")
    return (("", v.prompt),)


def encode_text(pipe, config, text: str) -> dict:
    """One text's four tensors (``encode_prompts``' names without the "negative_" prefix):
    the pipeline's ``encode_prompt`` on that text alone (Qwen2.5-VL, then ByT5 on its quoted
    glyph text), as ``encode_prompts`` runs it per side; keeps the encoders."""
    with torch.no_grad():
        tensors = pipe.encode_prompt(prompt=text, device=torch.device("cpu"),
                                     dtype=getattr(torch, config.model.dtype))
    return dict(zip(EMBEDDING_NAMES[:4], tensors, strict=True))


def check_embeddings(embeds: dict, settings: dict, cfg: dict | None) -> str | None:
    want = {"prompt_embeds": (1, QWEN_TOKENS), "prompt_embeds_mask": (1, QWEN_TOKENS),
            "prompt_embeds_2": (1, BYT5_TOKENS), "prompt_embeds_mask_2": (1, BYT5_TOKENS)}
    for side in ("", "negative_"):
        for name, lead in want.items():
            got = tuple(embeds[side + name].shape)
            if got[:2] != lead or len(got) != (2 if "mask" in name else 3):
                return f"{side + name}: expected shape {lead} + (dim,) or {lead}, got {got}"
    if cfg:
        for name, key in (("prompt_embeds", "text_embed_dim"),
                          ("prompt_embeds_2", "text_embed_2_dim")):
            if embeds[name].shape[2] != cfg[key]:
                return (f"{name} has width {embeds[name].shape[2]}, the transformer of "
                        f"--model_id={settings.get('model_id')!r} expects {cfg[key]}")
    return None


def prepare_latents(pipe, config):
    """Initial noise as ``HunyuanVideo15Pipeline.prepare_latents`` draws it: a CPU
    ``torch.Generator`` seeded with ``config.video.seed``, in the transformer dtype. Returns a
    float32 CPU tensor (1, 32, (frames-1)/4+1, height/16, width/16)."""
    generator = torch.Generator("cpu").manual_seed(config.video.seed)
    return pipe.prepare_latents(1, pipe.num_channels_latents, config.video.height,
                                config.video.width,
                                config.video.frames, getattr(torch, config.model.dtype),
                                torch.device("cpu"), generator).float()


def model_inputs(embeds: dict, config) -> dict:
    """The text inputs of the model call, batch [cond, uncond] with CFG:
    encoder_hidden_states (B, 1000, 3584) and encoder_hidden_states_2 (B, 256, 1472) in the
    model dtype, their masks (B, 1000) and (B, 256) bool. Image-to-video adds, the same for
    both passes as the pipeline passes them: "image_embeds" (B, 729, 1152) and "condition"
    (B, 33, F', h, w) = [image latents on frame 0, first-frame mask], model dtype."""
    dtype = getattr(torch, config.model.dtype)
    sides = ("", "negative_") if config.video.use_cfg else ("",)

    def batch(name):
        return torch.cat([embeds[side + name] for side in sides])

    out = {"encoder_hidden_states": batch("prompt_embeds").to(dtype),
           "encoder_attention_mask": batch("prompt_embeds_mask").bool(),
           "encoder_hidden_states_2": batch("prompt_embeds_2").to(dtype),
           "encoder_attention_mask_2": batch("prompt_embeds_mask_2").bool()}
    for name in IMAGE_NAMES:
        if name in embeds:
            x = embeds[name].to(dtype)
            out[name] = x.repeat(len(sides), *(1,) * (x.ndim - 1))
    if is_meanflow(config.model.model_id):
        out[MEANFLOW_TABLE] = meanflow_table(config).expand(len(sides), -1, -1)
    return out


# MeanFlow's (timestep, timestep_r) pairs, an input of the step: (B, 2, steps) float32.
MEANFLOW_TABLE = "meanflow_timesteps"


def meanflow_table(config) -> torch.Tensor:
    """(1, 2, steps) float32: row 0 the run's timesteps, row 1 each one's ``timestep_r``, the
    next timestep and 0 after the last, as ``HunyuanVideo15ImageToVideoPipeline.__call__``
    gives a ``use_meanflow`` transformer (diffusers 0.42.1). The step looks its timestep up
    in row 0: the engine passes it only the current timestep, the same float32 values."""
    scheduler = make_scheduler(read_component_config(
        config.model.model_id, "scheduler", filename="scheduler_config.json"), "euler",
        config.video.flow_shift)
    scheduler.set_timesteps(sigmas=scheduler_sigmas(config.video.num_inference_steps))
    t = scheduler.timesteps.float()
    return torch.stack([t, torch.cat([t[1:], t.new_zeros(1)])])[None]


IMAGE_NAMES = ("image_embeds", "condition")


def is_image_to_video(model_id: str) -> bool:
    """``model_index.json`` names ``HunyuanVideo15ImageToVideoPipeline``."""
    return read_model_index(model_id).get("_class_name") == I2V_PIPELINE


def image_mode(model_id: str) -> str:
    return "required" if is_image_to_video(model_id) else "none"


def default_size(target_size: int, spatial: int) -> tuple[int, int]:
    """(height, width) of ``HunyuanVideo15Pipeline`` with neither given: the 16:9 bucket at
    the transformer's ``target_size`` (its ``default_aspect_ratio`` and
    ``HunyuanVideo15ImageProcessor.calculate_default_height_width``, whose bucket step is the
    VAE's ``spatial`` compression)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import (
        HunyuanVideo15ImageProcessor,
    )

    return tuple(HunyuanVideo15ImageProcessor(vae_scale_factor=spatial)
                 .calculate_default_height_width(9, 16, target_size))


def image_size(model_id: str, info) -> tuple[int, int]:
    """The (height, width) ``HunyuanVideo15ImageToVideoPipeline`` gives a video of this
    image: the aspect-ratio bucket nearest the image's, at the transformer's
    ``target_size`` (``HunyuanVideo15ImageProcessor.calculate_default_height_width``)."""
    from diffusers.pipelines.hunyuan_video1_5.image_processor import (
        HunyuanVideo15ImageProcessor,
    )

    target = read_component_config(model_id, "transformer")["target_size"]
    width, height = read_image(info).size  # after the EXIF orientation, as the pipeline
    spatial = vae_compression(vae_config(model_id))[1]
    return HunyuanVideo15ImageProcessor(vae_scale_factor=spatial) \
        .calculate_default_height_width(height=height, width=width, target_size=target)


def encode_image(pipe, config, image, devices, resident: dict | None = None) -> dict:
    """The image conditioning of ``HunyuanVideo15ImageToVideoPipeline``, by its own
    functions: the image resized and cropped to the video size, its SigLIP
    ``last_hidden_state`` ("image_embeds", (1, 729, 1152)) and its one-frame VAE encode on
    the host, scaled, on latent frame 0 beside a first-frame mask ("condition", (1, 33, F',
    h, w)), both in the model dtype as the pipeline casts them. One frame at 720p is about
    5e12 FLOPs: seconds on a host CPU (``devices`` unused). With ``--sr`` the same two at the
    SR size too, named with ``SR_PREFIX`` (``families.hunyuan_sr_stage``). Frees the image
    encoder after the call unless ``resident`` is given (a dict the caller keeps across
    calls: the server; nothing is placed, so nothing goes in it)."""
    del devices
    out = _image_conditioning(pipe, config, image)
    if config.upscale is not None:  # --sr: the same conditioning at the SR size
        sr = config.replace(height=config.upscale.height, width=config.upscale.width)
        out.update({SR_PREFIX + k: v for k, v in _image_conditioning(pipe, sr, image).items()})
    if resident is None:
        pipe.image_encoder = None  # SigLIP so400m: 1.7 GB in float32; done with it
    return out


# The SR stage's image conditioning, at its size, beside the first stage's (--sr after I2V).
SR_PREFIX = "sr_"


def _image_conditioning(pipe, config, image) -> dict:
    """``encode_image``'s two tensors at ``config``'s video size."""
    cpu, dtype = torch.device("cpu"), getattr(torch, config.model.dtype)
    image = pipe.video_processor.resize(image, height=config.video.height, width=config.video.width,
                                        resize_mode="crop")
    s, t = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    shape = (1, pipe.num_channels_latents, (config.video.frames - 1) // t + 1,
             config.video.height // s, config.video.width // s)
    with torch.no_grad():
        embeds = pipe.encode_image(image=image, batch_size=1, device=cpu, dtype=dtype)
        cond, mask = pipe.prepare_cond_latents_and_mask(
            torch.zeros(shape, dtype=dtype), image, 1, config.video.height, config.video.width,
            dtype, cpu)
    return {"image_embeds": embeds, "condition": torch.cat([cond, mask], dim=1)}


def abstract_model_inputs(cfg: dict, config) -> dict:
    b, dtype, video = config.video.batch, getattr(jnp, config.model.dtype), config.video
    grid = latent_grid(vae_config(config.model.model_id), video.height, video.width,
                       video.frames)
    return {
        "encoder_hidden_states": jax.ShapeDtypeStruct((b, QWEN_TOKENS, cfg["text_embed_dim"]),
                                                      dtype),
        "encoder_attention_mask": jax.ShapeDtypeStruct((b, QWEN_TOKENS), jnp.bool_),
        "encoder_hidden_states_2": jax.ShapeDtypeStruct(
            (b, BYT5_TOKENS, cfg["text_embed_2_dim"]), dtype),
        "encoder_attention_mask_2": jax.ShapeDtypeStruct((b, BYT5_TOKENS), jnp.bool_),
    } | ({} if not is_image_to_video(config.model.model_id) else {  # model_inputs' image inputs
        "image_embeds": jax.ShapeDtypeStruct(
            (b, image_tokens(config.model.model_id), cfg["image_embed_dim"]), dtype),
        "condition": jax.ShapeDtypeStruct((b, cfg["out_channels"] + 1, *grid), dtype)}) | (
            {} if not cfg.get(
                 "use_meanflow") else {MEANFLOW_TABLE: jax.ShapeDtypeStruct(
                     (b, 2, config.video.num_inference_steps), jnp.float32)})


class KeyPaddingAttnProcessor:
    """``HunyuanVideo15AttnProcessor2_0`` with the text padding passed to SDPA as a
    (B, 1, 1, S) key-padding mask instead of a dense (B, 1, S, S) one, and the video
    stream's RoPE as ``families.rope.apply_rope`` on (B, H, N, D).

    The projections, QK norms, joint [video, text] sequence and output projections are
    diffusers' own modules, called in diffusers' order. RoPE gives diffusers' values (its
    tables repeat each frequency over its lane pair, the case ``apply_rope`` is exact for)
    without the pair split that TPU stores as (2, 128) tiles; it runs after the (B, N, H, D)
    -> (B, H, N, D) permute, where XLA fuses QK norm, permute and rotation into one pass
    (static estimate, 720p x 121 on v6e:2x4: 3.314 -> 3.202 s/step; see ``families.rope``
    and benchmarks/dry_run_results.md, "A RoPE of our own for HunyuanVideo-1.5"). The SDPA
    override (``custom_splash_attention``) turns the mask into segment ids.

    Call: (attn, hidden (B, N, dim), encoder_hidden_states (B, T, dim), attention_mask (B, T)
    bool text mask, image_rotary_emb (cos, sin) each float32 (N, head_dim), or None) ->
    (video (B, N, dim), text (B, T, dim)), hidden's dtype.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        def heads(x):  # (B, N, H*D) -> (B, N, H, D)
            return x.unflatten(2, (attn.heads, -1))

        def permuted(x):  # (B, N, H, D) -> (B, H, N, D), the layout SDPA takes
            return x.transpose(1, 2)

        query = permuted(attn.norm_q(heads(attn.to_q(hidden_states))))
        key = permuted(attn.norm_k(heads(attn.to_k(hidden_states))))
        value = permuted(heads(attn.to_v(hidden_states)))
        if image_rotary_emb is not None:
            # On the permuted q and k, as Wan's processor: one fusion with the norm and the
            # permute (here XLA fuses it before the permute too: same estimate).
            cos, sin = image_rotary_emb  # (N, D), broadcast over (B, H, N, D)
            query, key = apply_rope(query, cos, sin), apply_rope(key, cos, sin)
        n_text = encoder_hidden_states.shape[1]
        text_q = permuted(attn.norm_added_q(heads(attn.add_q_proj(encoder_hidden_states))))
        text_k = permuted(attn.norm_added_k(heads(attn.add_k_proj(encoder_hidden_states))))
        text_v = permuted(heads(attn.add_v_proj(encoder_hidden_states)))
        # (B, H, N + T, D): video then text along the sequence.
        query, key, value = (torch.cat(pair, dim=2) for pair in (
            (query, text_q), (key, text_k), (value, text_v)))
        # Video tokens are always real: the mask is [ones(N), text mask], (B, 1, 1, N + T).
        real = F.pad(attention_mask.bool(), (query.shape[2] - n_text, 0), value=True)
        # Static: padding can only sit in the text, so the kernel skips the segment-id
        # compare in kv blocks wholly inside the video tokens.
        with csa.real_keys_before(query.shape[2] - n_text):
            out = F.scaled_dot_product_attention(query, key, value,
                                                 attn_mask=real[:, None, None, :])
        out = out.transpose(1, 2).flatten(2, 3).to(query.dtype)  # (B, N + T, H*D)
        video, text = out[:, :-n_text], out[:, -n_text:]
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text)


def install_attention_processors(transformer) -> None:
    """Give every dual-stream block's attention a ``KeyPaddingAttnProcessor`` (at run time;
    diffusers' files are untouched). The token refiner keeps diffusers' own processor: it
    is called with a key-padding mask (``forward_t2v``)."""
    for block in transformer.transformer_blocks:
        block.attn.set_processor(KeyPaddingAttnProcessor())


def refine_text(refiner, text, timestep, mask):
    """``HunyuanVideo15TokenRefiner.forward`` with a (B, 1, 1, T) key-padding mask instead of
    its dense (B, 1, T, T) one.

    text (B, T, text_dim), timestep (B,), mask (B, T) bool -> (B, T, D)."""
    weights = mask.float().unsqueeze(-1)  # mask-weighted mean, as diffusers pools
    pooled = ((text * weights).sum(dim=1) / weights.sum(dim=1)).to(text.dtype)
    temb = refiner.time_text_embed(timestep, pooled)
    hidden = refiner.proj_in(text)
    key_mask = mask[:, None, None, :]
    for block in refiner.token_refiner.refiner_blocks:
        hidden = block(hidden, temb, key_mask)
    return hidden


def forward_t2v(model, hidden_states, timestep, encoder_hidden_states, encoder_attention_mask,
                encoder_hidden_states_2, encoder_attention_mask_2, image_embeds=None,
                timestep_r=None):
    """``HunyuanVideo15Transformer3DModel.forward`` for text-to-video, traceable by ``jit``.

    Same modules and math as diffusers' forward; what differs is listed in the module
    docstring (static T2V, fixed token order [ByT5, Qwen] with masks, image tokens left
    out, key-padding masks).

    Args:
        hidden_states: (B, 65, F, h, w) noisy latents + condition latents + mask.
        timestep: (B,) in the model dtype.
        timestep_r: (B,) in the model dtype, MeanFlow's second timestep (``use_meanflow``
            checkpoints), or None.
        encoder_hidden_states: (B, 1000, 3584) Qwen; encoder_attention_mask (B, 1000) bool.
        encoder_hidden_states_2: (B, 256, 1472) ByT5; encoder_attention_mask_2 (B, 256) bool.

    Returns:
        (B, 32, F, h, w) noise prediction in the model dtype.
    """
    b, _, f, h, w = hidden_states.shape
    cfg = model.config
    pt, p = cfg.patch_size_t, cfg.patch_size
    rotary = model.rope(hidden_states)
    temb = model.time_embed(timestep, timestep_r=timestep_r)
    video = model.x_embedder(hidden_states)  # (B, N, D)

    def typed(x, kind):  # + cond_type_embed: 0 = Qwen text, 1 = ByT5
        return x + model.cond_type_embed(torch.full_like(x[:, :, 0], kind, dtype=torch.long))

    qwen = typed(refine_text(model.context_embedder, encoder_hidden_states, timestep,
                             encoder_attention_mask), 0)
    byt5 = typed(model.context_embedder_2(encoder_hidden_states_2), 1)
    streams, masks = [byt5, qwen], [encoder_attention_mask_2, encoder_attention_mask]
    if image_embeds is not None:  # image-to-video: 729 SigLIP tokens, all real, first
        image = typed(model.image_embedder(image_embeds), 2)
        streams.insert(0, image)
        masks.insert(0, torch.ones_like(image[:, :, 0], dtype=torch.bool))
    mask = torch.cat(masks, dim=1)  # (B, T)
    # diffusers zeroes padded text tokens; they only ever meet other padding here.
    text = torch.cat(streams, dim=1) * mask.unsqueeze(-1).to(byt5.dtype)
    for block in model.transformer_blocks:
        video, text = block(video, text, temb, mask, rotary)
    out = model.proj_out(model.norm_out(video, temb))
    # (B, N, C*pt*p*p) -> (B, C, F*pt, h*p, w*p), as diffusers unpatchifies.
    out = out.reshape(b, f // pt, h // p, w // p, -1, pt, p, p)
    out = out.permute(0, 4, 1, 5, 2, 6, 3, 7)
    return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def step_fn(jm, config):
    """The torch function of one denoising step's model call, to be viewed as JAX and jitted.

    latents (1, 32, F, h, w) float32 -> noise prediction (1, 32, F, h, w) float32.
    The input is [latents, zero condition latents, zero mask] (T2V), cast to the model dtype
    with the timestep, as diffusers casts both. With CFG, cond and uncond run as one batch-2
    call, combined in the model dtype as ``ClassifierFreeGuidance``: uncond + scale * (cond -
    uncond). The prediction is returned as float32 because the flow-matching Euler step
    casts the new latents to the prediction's dtype: so they stay float32 between steps
    (diffusers' bf16 run rounds them to bf16 every step).
    """
    dtype = getattr(torch, config.model.dtype)
    cfg, scale = config.video.use_cfg, config.video.guidance_scale

    def step(params, buffers, latents, timestep, inputs):
        inputs = dict(inputs)
        condition = inputs.pop("condition", None)  # image-to-video: (B, 33, F, h, w)
        table = inputs.pop(MEANFLOW_TABLE, None)  # MeanFlow: (B, 2, steps)
        x = latents.to(dtype)
        if cfg:
            x = torch.cat([x, x])  # [cond, uncond]
        if condition is None:  # text-to-video: zero condition latents and mask
            condition = x.new_zeros((x.shape[0], x.shape[1] + 1, *x.shape[2:]))
        x = torch.cat([x, condition], dim=1)  # (B, 65, F, h, w)
        t = timestep.expand(x.shape[0]).to(dtype)
        if table is not None:  # timestep_r: the entry beside this timestep in row 0
            at = torch.argmin((table[0, 0] - timestep.float()).abs())
            inputs["timestep_r"] = table[:, 1, at].to(dtype)
        out = jm.functional_call(forward_t2v, params, buffers, x, t, **inputs)
        if cfg:
            cond, uncond = out.chunk(2)
            out = uncond + scale * (cond - uncond)
        return out.float()

    return step


# Megatron tensor parallelism for the dual-stream blocks (torch Linear weights are (out, in)):
# each stream's q/k/v and MLP-up are column-parallel, its attention-out and MLP-down
# row-parallel, so attention and MLP each need one all-reduce per stream. The per-head RMS
# norms act on head_dim (replicated). Each block's two AdaLayerNormZero modulation linears
# (D -> 6D, 50M parameters per block, 2.7B of the 8.3B) are split over their outputs too:
# replicated they would hold 5.4 GB per chip in bf16, while gathering their (B, 6D) output
# moves kilobytes. Embedders, refiner and proj_out are small and replicated. First match wins.
COLUMN_PARALLEL_RULES = (
    (r"transformer_blocks\.\d+\.norm1(_context)?\.linear\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.norm1(_context)?\.linear\.bias$", ("tp",)),
    (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)"
     r"\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|add_q_proj|add_k_proj|add_v_proj)"
     r"\.bias$", ("tp",)),
    (r"transformer_blocks\.\d+\.ff(_context)?\.net\.0\.proj\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.ff(_context)?\.net\.0\.proj\.bias$", ("tp",)),
)
ROW_PARALLEL_RULES = (
    (r"transformer_blocks\.\d+\.attn\.(to_out\.0|to_add_out)\.weight$", (None, "tp")),
    (r"transformer_blocks\.\d+\.ff(_context)?\.net\.2\.weight$", (None, "tp")),
)


# --quantize: each dual-stream block's attention projections (both streams) and both MLPs.
# Kept in --dtype: the blocks' AdaLayerNormZero modulation linears (norm1, norm1_context: the
# time/modulation projections), the token refiner, every embedder, norm_out and proj_out.
QUANTIZED_LINEARS = (r"^transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|add_q_proj|"
                     r"add_k_proj|add_v_proj|to_out\.0|to_add_out)"
                     r"|ff(_context)?\.net\.(0\.proj|2))$")


def sharding_rules(config) -> tuple:
    """The regex table for the transformer's state dict; ``--replicate_row_parallel`` drops
    the row-parallel rules (see ``families.wan.transformer_sharding_rules``)."""
    if config.layout.replicate_row_parallel:
        return COLUMN_PARALLEL_RULES
    return COLUMN_PARALLEL_RULES + ROW_PARALLEL_RULES


def is_vae_decode_weight(name: str) -> bool:
    return hunyuan_vae.is_vae_decode_weight(name)


def vae_decoder(placed: dict, vae, mesh, *, tiling: bool = False, abstract: bool = False,
                fallbacks=None):
    """The HunyuanVideo-1.5 VAE decode (``families.hunyuan_vae``)."""
    return hunyuan_vae.vae_decoder(placed, vae, mesh, tiling=tiling, abstract=abstract,
                                   fallbacks=fallbacks)


FAMILY = ModelFamily(
    name="HunyuanVideo-1.5",
    checkpoint=Checkpoint(
        pipeline_classes=("HunyuanVideo15Pipeline", I2V_PIPELINE),
        shipped_configs=("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v",
                         "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v",
                         "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v"),
        download_hint=DOWNLOAD_HINT,
        required_files=("model_index.json", "transformer/config.json", "vae/config.json"),
        components={"all": ("text_encoder", "transformer", "vae"), "encode": ("text_encoder",),
                    "denoise": ("transformer",), "decode": ("vae",)},
        weight_folders={"text_encoder": ("text_encoder", "text_encoder_2", "image_encoder"),
                        "transformer": ("transformer",), "vae": ("vae",)},
        optional_folders=("image_encoder",),
    ),
    flags=Flags(defaults=DEFAULTS, checkpoint_defaults=checkpoint_defaults, check=check_flags,
                refused=(("vae_tiling", False, "not available for HunyuanVideo-1.5 (its decode "
                          "is already frame-chunked and width-sharded)"),)),
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
        # Qwen2.5-VL, ByT5, SigLIP (I2V)
        encoder_modules=pipeline_modules("text_encoder", "text_encoder_2", "image_encoder"),
    ),
    # No masks: its self-attention mixes text tokens into the video tokens. LoRA keys: official
    # (Tencent) or diffusers/PEFT, converted by families.hunyuan_lora.
    transformer=Transformer(
        empty=empty_transformer,
        num_heads=num_heads,
        flops=transformer_flops,
        self_attention_flops=self_attention_flops,
        model_inputs=model_inputs,
        abstract_model_inputs=abstract_model_inputs,
        step_fn=step_fn,
        timestep_dtype="float32",
        sharding_rules=sharding_rules,
        block_stack=BLOCKS,
        quantized_linears=QUANTIZED_LINEARS,
        lora_state_dict=hunyuan_lora.lora_state_dict,
    ),
    # The image condition is VAE-encoded on the host (no device encoder).
    vae=VaePrograms(empty=empty_vae, is_decode_weight=is_vae_decode_weight,
                    decoder=vae_decoder),
    image=ImageConditioning(
        mode=image_mode,
        encode=encode_image,
        names=IMAGE_NAMES,
        size=image_size,
    ),
    scheduler=Scheduling(
        default_flow_shift=default_flow_shift,
        sigmas=scheduler_sigmas,
        make=make_scheduler,
    ),
)
