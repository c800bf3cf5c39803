"""Helios (diffusers ``HeliosPipeline`` and ``HeliosPyramidPipeline``): the family module.

Helios (``BestWishYsh/Helios-Base``, ``-Mid``, ``-Distilled``; arXiv 2603.04379) is Wan 2.1's
14B trunk (``HeliosTransformer3DModel``: 40 blocks of 40 x 128 heads) with Wan 2.1's VAE and
UMT5, generating a video autoregressively in chunks of 33 frames, each seeing the past
through a compressed multi-scale history (``families.helios_chunks`` runs the chunk loop on
the engine's compiled programs). Text encoding, the VAE decode and the transformer's sharding
are Wan's (``families.wan``).

Checkpoints (diffusers' ``docs/source/en/api/pipelines/helios.md`` and the model cards):
    Helios-Base       ``HeliosPipeline``, ``HeliosScheduler``, 50 steps, CFG 5.0.
    Helios-Mid        ``HeliosPyramidPipeline`` with CFG-Zero*: refused (not ported yet).
    Helios-Distilled  ``HeliosPyramidPipeline``, ``is_distilled``, ``HeliosDMDScheduler``:
                      ``DISTILLED_DEFAULTS``.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import torch

from engine.files.checkpoint import read_model_index
from engine.files.video_input import probe_video
from engine.run.errors import GenerationError, UsageError, fail, first_line
from engine.weights.scan_layers import BlockStack
from families import helios_chunks, helios_condition, wan, wan_vae
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
)

SHIPPED = "BestWishYsh/Helios-Base"
PYRAMID = "HeliosPyramidPipeline"
PIPELINES = ("HeliosPipeline", PYRAMID)

# HeliosPipeline.__call__'s defaults (diffusers 0.42.1 pipeline_helios.py:447-486) and its
# example (384 x 640, 132 frames, CFG 5.0, exported at 24 fps; the Wan negative prompt).
DEFAULTS = dict(wan.DEFAULTS, prompt=wan.DEFAULTS["prompt"], height=384, width=640, frames=132,
                fps=24, num_inference_steps=50, guidance_scale=5.0, max_sequence_length=512,
                scan_layers=False, overlap_compile="off")
_CARD = "huggingface.co/BestWishYsh/Helios-Distilled model card"
# Helios-Distilled's recipe (its model card's example, also diffusers' helios.md):
# pyramid_num_inference_steps_list [2, 2, 2], guidance_scale 1.0, is_amplify_first_chunk,
# num_frames 240; HeliosPyramidPipeline.__call__'s own defaults are [10, 10, 10] and 5.0.
DISTILLED_DEFAULTS = dict(
    guidance_scale=1.0, frames=240, num_inference_steps=6,
    sources=dict(guidance_scale=f"{_CARD}: guidance_scale=1.0",
                 frames=f"{_CARD}: num_frames=240",
                 num_inference_steps=f"{_CARD}: pyramid_num_inference_steps_list=[2, 2, 2] "
                                     "(6 steps per chunk, 12 on the amplified first)"))
DISTILLED_PYRAMID = (2, 2, 2)
PYRAMID_DEFAULT = (10, 10, 10)  # HeliosPyramidPipeline.__call__ (pipeline_helios_pyramid.py)


def model_index(model_id: str) -> dict:
    return read_model_index(model_id)


def is_pyramid(model_id: str) -> bool:
    return model_index(model_id).get("_class_name") == PYRAMID


def is_distilled(model_id: str) -> bool:
    index = model_index(model_id)
    return index.get("_class_name") == PYRAMID and bool(index.get("is_distilled"))


def checkpoint_defaults(model_id: str) -> dict:
    """Helios-Distilled's recipe (``DISTILLED_DEFAULTS``, with sources), else {}."""
    return dict(DISTILLED_DEFAULTS) if is_distilled(model_id) else {}


def frame_step(model_id: str) -> int:
    """Any --frames: the pipelines round up to whole chunks and trim to 4k + 1 themselves
    (``helios_chunks.Settings.frames_made``)."""
    return 1


def patch(model_id: str | None) -> tuple[int, int, int]:
    """The transformer's (t, h, w) ``patch_size`` (the class default where absent)."""
    from diffusers import HeliosTransformer3DModel as Model

    cfg = checkpoint_config(model_id, "transformer", SHIPPED)
    return tuple(init_value(Model, cfg, "patch_size"))


def pixel_multiple(model_id: str) -> int:
    """The VAE's spatial compression (8) times the patch side (2), and for the pyramid 4x
    more: its coarsest stage runs the latents at a quarter of the size, which the patch must
    still divide (64 pixels)."""
    base = wan.vae_compression(wan.vae_config(model_id))[1] * max(patch(model_id)[1:])
    return base * 4 if is_pyramid(model_id) else base


def latent_shape(vae_cfg: dict, height: int, width: int, frames: int,
                 model_id: str | None = None) -> tuple:
    """(1, 16, 9, h, w): one chunk's latents, what every step and every decode takes."""
    return wan.latent_shape(vae_cfg, height, width, helios_chunks.Settings().window_frames())


def token_count(cfg: dict, height: int, width: int, frames: int, model_id: str) -> int:
    """Tokens of one pass at the default settings: the chunk's, then the history's (short:
    the first frame's and the newest, 1x; mid: 2x2x... patches (2, 4, 4), 8x fewer per frame;
    long: (4, 8, 8), 64x fewer), each padded as ``pad_for_3d_conv`` pads (384 x 640: 8,640 +
    1,920 + 240 + 240 = 11,040)."""
    s = helios_chunks.Settings()
    spatial = wan.vae_compression(wan.vae_config(model_id))[1]
    h, w = height // spatial, width // spatial

    def grid(frames: int, k: int) -> int:  # tokens of ``frames`` latent frames, patch x k
        return -(-frames // k) * -(-h // (2 * k)) * -(-w // (2 * k))

    return (grid(s.num_latent_frames_per_chunk + 1 + s.history_sizes[2], 1)
            + grid(s.history_sizes[1], 2) + grid(s.history_sizes[0], 4))


# -- flags -----------------------------------------------------------------------------------
def _ints(text: str, flag: str, count: int | None = None) -> tuple[int, ...]:
    """A comma-separated list of positive integers (``count`` of them when given).

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    try:
        values = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        values = ()
    if not values or min(values) < 1 or (count is not None and len(values) != count):
        n = f"{count} " if count else ""
        raise UsageError(f"--{flag}={text!r}: must be {n}comma-separated positive integers "
                         "(e.g. 16,2,1)")
    return values


INPUTS = {
    "history_sizes": dict(metavar="LONG,MID,SHORT",
                          help="Helios: latent frames of the long, mid and 1x history "
                               "(HeliosPipeline's history_sizes; default 16,2,1)"),
    "num_latent_frames_per_chunk": dict(type=int, metavar="N",
                                        help="Helios: latent frames per chunk (default 9: 33 "
                                             "frames)"),
    # --video's spec is every family's (families.wan.INPUTS says so): PATH, a str, None.
    "video": dict(metavar="PATH", help="Helios: the video to continue (its last whole chunks "
                  "of 33 frames seed the history; the output is the continuation)"),
    "pyramid_num_inference_steps_list": dict(
        metavar="N1,N2,N3", help="Helios pyramid checkpoints: steps per stage, coarse to fine "
                                 "(default: Helios-Distilled 2,2,2, else 10,10,10)"),
}


def check_inputs(inputs: dict, values: dict, model_id: str,
                 args=None) -> tuple[dict, dict]:
    """``Flags.check_inputs``: the lists parsed, ``--video`` probed (a ``VideoInfo``; at
    least one chunk of frames; not with ``--image``), the pyramid's steps resolved (its
    default by checkpoint), ``values["num_inference_steps"]`` set to a chunk's steps for the
    pyramid (their sum, as the pipeline counts them)."""
    out = dict(inputs)
    out["video"] = _check_video(inputs, args)
    out["history_sizes"] = tuple(sorted(_ints(inputs.get("history_sizes") or "16,2,1",
                                              "history_sizes", 3), reverse=True))
    n = inputs.get("num_latent_frames_per_chunk")
    if n is not None and n < 1:
        raise UsageError(f"--num_latent_frames_per_chunk={n}: must be a positive integer")
    out["num_latent_frames_per_chunk"] = n or 9
    given = inputs.get("pyramid_num_inference_steps_list")
    if not is_pyramid(model_id):
        if given is not None:
            raise UsageError(f"--pyramid_num_inference_steps_list={given!r}: only pyramid "
                             "checkpoints (HeliosPyramidPipeline) take it")
        out["pyramid_num_inference_steps_list"] = None
        return out, values
    steps = _ints(given, "pyramid_num_inference_steps_list") if given else (
        DISTILLED_PYRAMID if is_distilled(model_id) else PYRAMID_DEFAULT)
    out["pyramid_num_inference_steps_list"] = steps
    return out, dict(values, num_inference_steps=sum(steps))


def _check_video(inputs: dict, args):
    """``--video`` probed, or None.

    Raises:
        UsageError: with ``--image``, an unreadable file, fewer frames than one chunk.
    """
    path = inputs.get("video")
    if path is None:
        return None
    if args is not None and getattr(args, "image", None):
        fail("--video", path, "continues a video; --image starts from an image: give one")
    info = probe_video(path, "--video")
    window = helios_chunks.Settings(num_latent_frames_per_chunk=inputs.get(
        "num_latent_frames_per_chunk") or 9).window_frames()
    if info.frames < window:
        fail("--video", path, f"has {info.frames} frames; continuing needs at least one "
             f"chunk's {window}")
    return info


def check_flags(values: dict) -> tuple[str, str] | None:
    """Helios-Mid (CFG-Zero*, ``is_cfg_zero_star``) is not ported: refused."""
    if model_index(values["model_id"]).get("is_cfg_zero_star"):
        return ("--model_id", "is_cfg_zero_star (Helios-Mid's CFG-Zero*) is not supported yet")
    return None


def settings(config) -> helios_chunks.Settings:
    """The run's ``helios_chunks.Settings`` from its resolved inputs and checkpoint."""
    inputs = config.video.inputs or {}
    model_id = config.model.model_id
    pyramid = inputs.get("pyramid_num_inference_steps_list")
    return helios_chunks.Settings(
        history_sizes=tuple(inputs.get("history_sizes") or (16, 2, 1)),
        num_latent_frames_per_chunk=inputs.get("num_latent_frames_per_chunk") or 9,
        pyramid_steps=tuple(pyramid) if pyramid else None,
        is_distilled=is_distilled(model_id),
        # Helios-Distilled's card runs is_amplify_first_chunk=True (DISTILLED_DEFAULTS).
        is_amplify_first_chunk=is_distilled(model_id))


# -- the transformer -------------------------------------------------------------------------
def history_shapes(config, batch: int) -> dict:
    """{history input: (batch, C, frames, h, w)} of one chunk at the run's settings."""
    s, v = settings(config), config.video
    _, c, _, h, w = latent_shape(wan.vae_config(config.model.model_id), v.height, v.width, 1)
    long, mid, short = s.history_sizes
    frames = (1 + short if s.keep_first_frame else short + 1, mid, long)
    return {name: (batch, c, f, h, w)
            for name, f in zip(helios_chunks.HISTORY_NAMES, frames, strict=True)}


def model_inputs(embeds: dict, config) -> dict:
    """Wan's text inputs ({"encoder_hidden_states": (B, T, text_dim), "guidance_scale": (B,)},
    B = 2 with CFG) and zero history terms of one chunk's shapes (the chunk loop places each
    chunk's own, ``helios_chunks.ChunkLoop._inputs``)."""
    out = wan.model_inputs({k: v for k, v in embeds.items() if "prompt" in k}, config)
    batch = out["encoder_hidden_states"].shape[0]
    dtype = getattr(torch, config.model.dtype)
    return {**out, **{k: torch.zeros(shape, dtype=dtype)
                      for k, shape in history_shapes(config, batch).items()}}


def abstract_model_inputs(cfg: dict, config) -> dict:
    dtype = getattr(jnp, config.model.dtype)
    out = {"encoder_hidden_states": jax.ShapeDtypeStruct(
        (config.video.batch, config.video.max_sequence_length, cfg["text_dim"]), dtype),
        "guidance_scale": jax.ShapeDtypeStruct((config.video.batch,), jnp.float32)}
    return {**out, **{k: jax.ShapeDtypeStruct(shape, dtype)
                      for k, shape in history_shapes(config, config.video.batch).items()}}


def step_fn(jm, config):
    """The torch function of one model call: latents (1, C, F, h, w) float32, the (1,)
    float32 timestep (``HeliosPipeline``'s float t; the pyramid's int64 t as a float: the
    time embedding casts it to float32 either way) and the inputs (text, the chunk's history
    terms) -> prediction (1, C, F, h, w) in the model dtype, CFG combined in the model dtype
    as the pipelines combine it. Cond and uncond run as one batch-2 call; the history terms
    and every frame index are the same for both, as the pipelines pass them."""
    dtype = getattr(torch, config.model.dtype)
    cfg, constant = config.video.use_cfg, config.video.guidance_scale
    s = settings(config)

    def step(params, buffers, latents, timestep, inputs):
        inputs = dict(inputs)
        scale = inputs.pop("guidance_scale", None)
        scale = constant if scale is None else scale[0]
        x = latents.to(dtype)
        if cfg:
            x = torch.cat([x, x])
        history = {k: inputs.pop(k).to(dtype) for k in helios_chunks.HISTORY_NAMES}
        out = jm.functional_call(
            "forward", params, buffers, hidden_states=x, timestep=timestep.expand(x.shape[0]),
            encoder_hidden_states=inputs["encoder_hidden_states"], **s.indices(), **history,
            return_dict=False)[0]
        if not cfg:
            return out
        cond, uncond = out.chunk(2)
        return uncond + scale * (cond - uncond)

    return step


def transformer_flops(cfg: dict, config) -> float:
    """Analytic FLOPs of one step's model call(s), Wan's count (``wan.transformer_flops``)
    over every token of a pass (chunk and history), the text cross-attention over the
    chunk's tokens only (``guidance_cross_attn``)."""
    v = config.video
    s = token_count(cfg, v.height, v.width, v.frames, config.model.model_id)
    chunk = helios_chunks.Settings().num_latent_frames_per_chunk * (v.height // 16) * (
        v.width // 16)
    t, d = v.max_sequence_length, cfg["num_attention_heads"] * cfg["attention_head_dim"]
    per_block = (8 * s * d * d + 4 * s * s * d + 4 * chunk * d * d + 4 * t * d * d
                 + 4 * chunk * t * d + 4 * s * d * cfg["ffn_dim"])
    return float(per_block * cfg["num_layers"] * v.batch)


def self_attention_flops(cfg: dict, config) -> float:
    v = config.video
    s = token_count(cfg, v.height, v.width, v.frames, config.model.model_id)
    return float(4 * s * s * cfg["attention_head_dim"] * cfg["num_attention_heads"]
                 * cfg["num_layers"] * v.batch)


def empty_transformer(cfg: dict, dtype):
    """``HeliosTransformer3DModel`` of ``cfg`` with meta parameters (``empty_model``)."""
    from diffusers import HeliosTransformer3DModel

    transformer = empty_model(HeliosTransformer3DModel, cfg, dtype)
    transformer.norm_out.forward = types.MethodType(_output_norm, transformer.norm_out)
    return transformer


def _output_norm(self, hidden_states, temb, original_context_length: int):
    """``HeliosOutputNorm.forward`` (transformer_helios.py:90-96) with ``.to(dtype)`` for its
    ``type_as``: torchax's ``type_as`` fails on a sliced tensor (a torchax ``View`` has no
    ``_elem``). The same operations in the same order and dtypes."""
    temb = temb[:, -original_context_length:, :]
    shift, scale = (self.scale_shift_table.unsqueeze(0) + temb.unsqueeze(2)).chunk(2, dim=2)
    shift, scale = shift.squeeze(2), scale.squeeze(2)
    hidden_states = hidden_states[:, -original_context_length:, :]
    dtype = hidden_states.dtype
    return (self.norm(hidden_states.float()) * (1 + scale) + shift).to(dtype)


def load_pipeline(config, components):
    """The diffusers ``HeliosPipeline`` / ``HeliosPyramidPipeline`` on the CPU, safetensors
    only, with only ``components``; the transformer with meta weights (streamed into its
    shards later), the VAE in float32 (as ``wan.load_pipeline``).

    Raises:
        GenerationError: the weights could not be found or read.
    """
    import diffusers
    from diffusers import AutoencoderKLWan, HeliosTransformer3DModel

    dtype = getattr(torch, config.model.dtype)
    skip = {name: None for name in ("text_encoder", "transformer", "vae")
            if name not in components}
    if "text_encoder" not in components:
        skip["tokenizer"] = None
    cls = getattr(diffusers, model_index(config.model.model_id)["_class_name"])
    try:
        if "transformer" in components:
            skip["transformer"] = empty_transformer(dict(HeliosTransformer3DModel.load_config(
                config.model.model_id, subfolder="transformer")), dtype)
        if "vae" in components:
            skip["vae"] = AutoencoderKLWan.from_pretrained(
                config.model.model_id, subfolder="vae", dtype=torch.float32,
                use_safetensors=True)
        pipe = cls.from_pretrained(config.model.model_id, dtype=dtype, use_safetensors=True,
                                   **skip)
    except (OSError, ValueError) as e:
        raise GenerationError(
            f"--model_id={config.model.model_id!r}: could not load weights: {first_line(e)}") \
            from None
    for m in (pipe.transformer, pipe.vae, pipe.text_encoder):
        if m is not None:
            m.eval()
    return pipe


def prepare_latents(pipe, config):
    """The first chunk's noise, (1, 16, 9, h, w) float32 from ``config.video.seed``: the step
    and decode programs' example (the chunk loop draws every chunk's own, in order)."""
    from diffusers.utils.torch_utils import randn_tensor

    v = config.video
    shape = latent_shape(wan.vae_config(config.model.model_id), v.height, v.width, v.frames)
    return randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(v.seed),
                        device=torch.device("cpu"), dtype=torch.float32)


def chunk_loop(config, pipe, embeds: dict, step, compile_for):
    """``ModelFamily.chunks``: the run's ``helios_chunks.ChunkLoop``, its steps the engine's
    compiled ``step`` (the full-size chunk) and, for the pyramid's coarser stages, programs
    ``compile_for(latents example)`` compiles on the same weights and inputs."""
    s, v = settings(config), config.video
    _, c, f, h, w = latent_shape(wan.vae_config(config.model.model_id), v.height, v.width, 1)
    steps = {}
    for size in s.stage_sizes(h, w):
        steps[size] = step if size == (h, w) else compile_for(
            jax.ShapeDtypeStruct((1, c, s.num_latent_frames_per_chunk, *size), jnp.float32))
    return helios_chunks.ChunkLoop(config, pipe, s, steps,
                                   helios_condition.Condition.of(pipe, config, embeds))


# Wan's block list, without sequence parallelism: a Helios block slices the chunk's tokens
# off the end of the residual stream (``original_context_length``). Measured: tp2 x sp4 on
# 8 CPU devices (8 heads, 184 tokens, no padding) gave frames 0.042 off the one-device run,
# tp8 6e-7; so the mesh keeps sp at 1 for Helios (and Ulysses off).
HELIOS_BLOCKS = BlockStack(attr="blocks", carry=1, token_axes=(1, None, 1, 1, None),
                           self_attention="attn1", sublayers=(), sequence_parallel=False)

FAMILY = ModelFamily(
    name="Helios",
    checkpoint=Checkpoint(
        pipeline_classes=PIPELINES,
        shipped_configs=(SHIPPED, "BestWishYsh/Helios-Distilled"),
        download_hint="hf download BestWishYsh/Helios-Distilled --local-dir PATH",
        required_files=("model_index.json", "transformer/config.json", "vae/config.json"),
        components={"all": ("text_encoder", "transformer", "vae"),
                    "encode": ("text_encoder",), "denoise": ("transformer",),
                    "decode": ("vae",)},
        weight_folders={"text_encoder": ("text_encoder",), "transformer": ("transformer",),
                        "vae": ("vae",)},
    ),
    flags=Flags(defaults=DEFAULTS, checkpoint_defaults=checkpoint_defaults, check=check_flags,
                inputs=INPUTS, check_inputs=check_inputs,
                refused=(("stage", "all", "Helios decodes each chunk as it is made: no "
                                          "staged runs"),
                         ("overlap_compile", "off", "Helios compiles its chunk programs "
                                                    "after the load"),
                         ("cache", None, "no step cache for Helios' chunk loop yet"),
                         ("enable_cache", False, "no step cache for Helios' chunk loop yet"))),
    sizes=Sizes(frame_step=frame_step, pixel_multiple=pixel_multiple,
                latent_shape=latent_shape, token_count=token_count),
    text=TextEncoding(
        load_pipeline=load_pipeline, encode_prompts=wan.encode_prompts,
        prompt_sides=wan.prompt_sides, encode_text=wan.encode_text,
        embedding_names=wan.EMBEDDING_NAMES, check_embeddings=wan.check_embeddings,
        prepare_latents=prepare_latents),
    transformer=Transformer(
        empty=empty_transformer, num_heads=wan.num_heads, flops=transformer_flops,
        self_attention_flops=self_attention_flops, model_inputs=model_inputs,
        abstract_model_inputs=abstract_model_inputs, step_fn=step_fn,
        timestep_dtype="float32", sharding_rules=wan.sharding_rules,
        block_stack=HELIOS_BLOCKS),
    # --image: the pipelines' own conditioning, encoded on the host (helios_condition);
    # --video's is encoded when the chunk loop is built (chunk_loop).
    image=ImageConditioning(mode=lambda model_id: "optional",
                            encode=helios_condition.encode, names=helios_condition.NAMES),
    vae=VaePrograms(empty=wan.empty_vae, is_decode_weight=wan_vae.is_vae_decode_weight,
                    decoder=wan_vae.vae_decoder),
    scheduler=Scheduling(default_flow_shift=lambda height, width: 1.0,
                         sigmas=lambda num_inference_steps: None, names=("helios",)),
    chunks=chunk_loop,
)
