"""Wan VACE (diffusers ``WanVACEPipeline``): video editing and control on the Wan family.

One model for reference-to-video, masked inpainting / outpainting and pose, depth or edge
control: ``WanVACETransformer3DModel`` is the Wan transformer plus VACE blocks (one per entry
of ``vace_layers``) whose hints are added into the main blocks, fed by a 96-channel control
input (the VAE latents of the video's inactive and reactive parts, 16 + 16 channels, and the
8 x 8-folded mask, 64). Checkpoints: ``Wan-AI/Wan2.1-VACE-1.3B-diffusers``,
``Wan-AI/Wan2.1-VACE-14B-diffusers`` and Wan 2.2 VACE-Fun A14B (two experts through
``transformer_2`` and ``boundary_ratio``, as Wan 2.2 T2V-A14B). Source: diffusers 0.42.1
``pipelines/wan/pipeline_wan_vace.py`` and ``models/transformers/transformer_wan_vace.py``;
facts in ../shared/notes/wan-editing.md.

Inputs, in diffusers' names (``Flags.inputs``), checked before any model loads
(``check_inputs``): ``--video`` (the control or source video; without it the pipeline's zero
video), ``--mask`` (a video or one image, white = generate; needs ``--video``),
``--reference_image`` (repeatable) and ``--conditioning_scale`` (one value or one per VACE
layer). The conditioning is the pipeline's own: ``preprocess_conditions``,
``prepare_video_latents`` and ``prepare_masks`` run unmodified on the host, with ``vae.encode``
standing in as ``families.wan_vae.DeviceEncode`` (the control video's inactive and reactive
encodes, and each reference image's, compiled and chunked on the mesh).

The VACE blocks run inside the same compiled step as the main blocks, their attention through
the same SDPA route (our kernel). Reference images add one latent frame each at the front of
the noise (``num_frames + 4 * refs`` pixel frames, as the pipeline draws it); the decode gets
the latents without them (``finish``), as the pipeline cuts them before its decode.
"""

from __future__ import annotations

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import torch

from engine.files.checkpoint import read_model_index
from engine.files.image import check_image, read_image
from engine.files.video_input import probe_video, read_video
from engine.run.errors import GenerationError, fail, first_line
from families import wan, wan_attention, wan_v2v, wan_vae
from families.base import (
    Checkpoint,
    Flags,
    ImageConditioning,
    Scheduling,
    checkpoint_config,
    empty_model,
    init_value,
)

PIPELINE = "WanVACEPipeline"
SHIPPED = "Wan-AI/Wan2.1-VACE-14B-diffusers"
# The model inputs the step takes besides Wan's.
CONTROL = "control_hidden_states"  # (B, vace_in_channels, F' + refs, h, w), model dtype
SCALE = "control_hidden_states_scale"  # (B, len(vace_layers)), model dtype
# (B, 1 + refs) zeros: the reference-frame count as a static shape (``finish``).
REFS = "vace_reference_frames"
CONDITION = "vace_condition"  # the encoded conditioning: (1, vace_in_channels, F' + refs, h, w)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")

INPUTS = {
    "video": dict(metavar="PATH",  # the spec of every family's --video
                  help="the input video (any file PyAV opens): Wan video-to-video's source, "
                       "Wan VACE's control video (default: the pipeline's zero video)"),
    "mask": dict(metavar="PATH", type=str,
                 help="Wan VACE's mask, a video or one image at --video's size: white = "
                      "generate, black = keep (default: all white)"),
    "reference_image": dict(metavar="PATH", action="append",
                            help="Wan VACE's reference image (PNG, JPEG or WebP), repeatable; "
                                 "placed on a white canvas at the video's size (default: "
                                 "none)"),
    "conditioning_scale": dict(metavar="S|S1,S2,...", type=str,
                               help="Wan VACE's hint scale: one value, or one per VACE layer "
                                    "(default 1)"),
}


def transformer_config(model_id: str | None) -> dict:
    return checkpoint_config(model_id, "transformer", SHIPPED)


def vace_layers(cfg: dict) -> list[int]:
    """The main blocks after which a VACE hint is added (the class default where absent)."""
    from diffusers import WanVACETransformer3DModel as Model

    return list(init_value(Model, cfg, "vace_layers"))


def parse_scale(text: str | None, layers: int) -> list[float]:
    """``--conditioning_scale``: one value for every VACE layer, or ``layers`` values, as
    ``WanVACEPipeline.__call__`` broadcasts a float (pipeline_wan_vace.py:874-892).

    Raises:
        UsageError: not numbers, not finite, or a count other than 1 or ``layers``.
    """
    if text is None:
        return [1.0] * layers
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        fail("--conditioning_scale", text, "expected a number or comma-separated numbers")
    if not all(math.isfinite(v) for v in values):
        fail("--conditioning_scale", text, "must be finite")
    if len(values) not in (1, layers):
        fail("--conditioning_scale", text, f"expected 1 value or {layers} (one per VACE "
             f"layer of --model_id), got {len(values)}")
    return values * layers if len(values) == 1 else values


def fitted_size(height: int, width: int, run_height: int, run_width: int,
                base: int, scale: int = 8) -> tuple[int, int]:
    """The size ``WanVACEPipeline.preprocess_conditions`` resizes a ``height`` x ``width``
    video to for a ``run_height`` x ``run_width`` run (pipeline_wan_vace.py:427-449): rounded
    down to the video processor's multiple ``scale``, scaled down to fit the run's area
    keeping its aspect, then rounded down to multiples of ``base``."""
    h, w = height // scale * scale, width // scale * scale
    if h * w > run_height * run_width:
        s = min(run_width / w, run_height / h)
        h, w = int(h * s), int(w * s)
    return h // base * base, w // base * base


def _check_video(path: str, values: dict, model_id: str, args):
    """``--video`` probed: ``values`` with the run's frames (the video's length rounded down
    to 4n + 1 unless ``--frames`` is given, as video-to-video: ``wan_v2v``), at least that
    many frames (a longer video is cut, with a line saying so), and a size the pipeline
    brings to the run's exactly (else its control latents are smaller than the noise and the
    transformer zero-pads them at the end of the token sequence: a silent misalignment).
    Returns (info, values)."""
    info = probe_video(path, "--video")
    values = wan_v2v._frames(info, values, wan.frame_step(model_id), args)
    height, width = values["height"], values["width"]
    base = wan.pixel_multiple(model_id)
    got = fitted_size(info.height, info.width, height, width, base)
    if got != (height, width):
        fail("--video", path, f"its {info.width}x{info.height} frames become {got[1]}x{got[0]}"
             f" in WanVACEPipeline, not the run's {width}x{height}: give a video of the "
             "run's aspect ratio and at least its size, or set --width/--height to match")
    return info, values


def _check_mask(path: str, video, values: dict):
    """``--mask``: one image or a video of at least ``frames`` frames, at ``video``'s size
    (the pipeline stretches a mask of another size over the video)."""
    if video is None:
        fail("--mask", path, "needs --video (WanVACEPipeline takes a mask only with a video)")
    if path.lower().endswith(IMAGE_SUFFIXES):
        info, frames = check_image(path, "--mask"), None
    else:
        info = probe_video(path, "--mask")
        frames = info.frames
        if frames < values["frames"]:
            fail("--mask", path, f"has {frames} frames, the run needs --frames "
                 f"{values['frames']}")
    if (info.height, info.width) != (video.height, video.width):
        fail("--mask", path, f"is {info.width}x{info.height}, --video is "
             f"{video.width}x{video.height}: they must match")
    return info


def check_inputs(inputs: dict, values: dict, model_id: str, args=None) -> tuple[dict, dict]:
    """``Flags.check_inputs``: every input file checked and probed before any model loads.

    Returns ({"video": VideoInfo or None, "mask": VideoInfo / ImageInfo or None,
    "reference_image": [ImageInfo] or None, "conditioning_scale": [float] per VACE layer},
    values): ``values["frames"]`` from ``--video`` when ``--frames`` is not given (``args``:
    the parsed command line; None counts as not given); ``values["guidance_scale_2"]`` the
    run's ``guidance_scale`` on a two-expert checkpoint without ``--guidance_scale_2``, as
    ``WanVACEPipeline.__call__`` defaults it (pipeline_wan_vace.py:847-848).

    Raises:
        UsageError: one line: an unreadable file, a video or mask shorter than ``--frames``
            or of another size than the run's, a mask without a video, a bad scale.
    """
    layers = len(vace_layers(transformer_config(model_id)))
    video = None
    if inputs.get("video"):
        video, values = _check_video(inputs["video"], values, model_id, args)
    mask = inputs.get("mask") and _check_mask(inputs["mask"], video, values)
    refs = [check_image(p, "--reference_image") for p in inputs.get("reference_image") or []]
    if "guidance_scale_2" in checkpoint_defaults(model_id) and values.get(
            "guidance_scale_2") is None:  # the checkpoint default (None): not given
        values["guidance_scale_2"] = values["guidance_scale"]
    return dict(video=video or None, mask=mask or None, reference_image=refs or None,
                conditioning_scale=parse_scale(inputs.get("conditioning_scale"), layers)), values


def checkpoint_defaults(model_id: str) -> dict:
    """``Flags.checkpoint_defaults``: {"guidance_scale_2": None} for a two-expert checkpoint
    (Wan 2.2 VACE-Fun A14B: the flag is taken; ``check_inputs`` fills it), else {}. The
    pipeline's own defaults hold otherwise (no official VACE sampling settings are wired)."""
    return {"guidance_scale_2": None} if wan.is_two_expert(read_model_index(model_id)) else {}


def reference_count(config) -> int:
    return len((config.video.inputs or {}).get("reference_image") or [])


def _read_mask(info, frames: int) -> list | None:
    """The mask as the pipeline takes it: ``frames`` RGB PIL frames (one image repeated)."""
    if info is None:
        return None
    if info.path.lower().endswith(IMAGE_SUFFIXES):
        return [read_image(info)] * frames
    return read_video(info.path, "--mask", frames)


def encode_conditioning(pipe, config, image, devices, resident: dict | None = None) -> dict:
    """``ImageConditioning.encode``: the control input of ``WanVACEPipeline.__call__``
    (pipeline_wan_vace.py:912-925) by the pipeline's own ``preprocess_conditions``,
    ``prepare_video_latents`` and ``prepare_masks``, with ``vae.encode`` on ``devices``
    (``wan_vae.DeviceEncode``: the inactive and reactive videos, then each reference image
    as one frame). ``image`` is unused (VACE takes no --image).

    Returns:
        {"vace_condition": (1, vace_in_channels, F' + refs, h, w) float32}: 32 channels of
        normalised latents (reference frames first, in the pipeline's reversed order) and
        the 64 folded mask channels.
    """
    del image
    v, inputs, cpu = config.video, config.video.inputs or {}, torch.device("cpu")
    video = read_video(inputs["video"].path, "--video", v.frames) if inputs.get("video") \
        else None
    mask = _read_mask(inputs.get("mask"), v.frames)
    refs = [read_image(i) for i in inputs.get("reference_image") or []] or None
    encode = (resident or {}).get("vae_encode") or wan_vae.DeviceEncode(pipe.vae, devices)
    if resident is not None:
        resident["vae_encode"] = encode
    pipe.vae.encode = encode
    try:
        with torch.no_grad():
            video, mask, refs = pipe.preprocess_conditions(
                video, mask, refs, 1, v.height, v.width, v.frames, torch.float32, cpu)
            latents = pipe.prepare_video_latents(video, mask, refs, None, cpu)
            masks = pipe.prepare_masks(mask, refs, None)
    finally:
        del pipe.vae.encode  # the class's own method again
    return {CONDITION: torch.cat([latents, masks], dim=1).float()}


def model_inputs(embeds: dict, config) -> dict:
    """Wan's model inputs (text, CFG scale) and the VACE ones, one row per CFG pass as the
    pipeline passes the same control to both calls: ``control_hidden_states`` and
    ``control_hidden_states_scale`` in the model dtype (the pipeline casts both to the
    transformer's), and ``vace_reference_frames``."""
    out = wan.model_inputs(embeds, config)
    dtype, b = getattr(torch, config.model.dtype), out["encoder_hidden_states"].shape[0]
    out[CONTROL] = embeds[CONDITION].to(dtype).repeat(b, 1, 1, 1, 1)
    scale = config.video.inputs["conditioning_scale"]
    out[SCALE] = torch.tensor([scale] * b, dtype=dtype)
    out[REFS] = torch.zeros((b, 1 + reference_count(config)), dtype=torch.float32)
    return out


def abstract_model_inputs(cfg: dict, config) -> dict:
    """``model_inputs``' shapes and dtypes (the dry run: a zero control video, no
    references, as the pipeline without ``video`` and ``reference_images``)."""
    out = wan.abstract_model_inputs(cfg, config)
    dtype, b, v = getattr(jnp, config.model.dtype), config.video.batch, config.video
    refs = reference_count(config)
    f, h, w = wan.latent_grid(wan.vae_config(config.model.model_id), v.height, v.width,
                              v.frames)
    from diffusers import WanVACETransformer3DModel as Model

    out[CONTROL] = jax.ShapeDtypeStruct(
        (b, init_value(Model, cfg, "vace_in_channels"), f + refs, h, w), dtype)
    out[SCALE] = jax.ShapeDtypeStruct((b, len(vace_layers(cfg))), dtype)
    out[REFS] = jax.ShapeDtypeStruct((b, 1 + refs), jnp.float32)
    return out


def finish(latents, inputs):
    """``ImageConditioning.finish_latents``: the latents without the reference frames, as
    ``WanVACEPipeline`` cuts them before its decode (pipeline_wan_vace.py:1025)."""
    refs = inputs[REFS].shape[1] - 1
    return latents[:, :, refs:] if refs else latents


def step_fn(jm, config):
    """Wan's step (``wan.step_fn``: CFG as one batch-2 call) with the VACE inputs passed to
    the model: the control for every row, the per-layer scale as the (n,) vector the model
    takes (row 0: every row holds the same)."""
    inner = wan.step_fn(jm, config)

    def step(params, buffers, latents, timestep, inputs):
        inputs = dict(inputs)
        inputs.pop(REFS)
        inputs[SCALE] = inputs[SCALE][0]
        return inner(params, buffers, latents, timestep, inputs)

    return step


def prepare_latents(pipe, config):
    """Initial noise as ``WanVACEPipeline.prepare_latents`` draws it, first from the seeded
    CPU generator (the encodes take the posterior mode and draw nothing): ``frames + 4 *
    refs`` pixel frames, one more latent frame per reference image. Float32 (1, z_dim,
    F' + refs, h, w)."""
    from diffusers.utils.torch_utils import randn_tensor

    v, vae_cfg = config.video, wan.vae_config(config.model.model_id)
    temporal = wan.vae_compression(vae_cfg)[0]
    shape = (1, dict(pipe.transformer.config)["out_channels"],
             *wan.latent_grid(vae_cfg, v.height, v.width,
                              v.frames + temporal * reference_count(config)))
    return randn_tensor(shape, generator=torch.Generator("cpu").manual_seed(v.seed),
                        device=torch.device("cpu"), dtype=torch.float32)


def _pad_tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """(B, S, D) -> (B, n, D), zero rows appended (sequence parallelism's padded tokens)."""
    if x.shape[1] == n:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], n - x.shape[1], x.shape[2])], dim=1)


def vace_forward(self, hidden_states, timestep, encoder_hidden_states,
                 encoder_hidden_states_image=None, control_hidden_states=None,
                 control_hidden_states_scale=None, return_dict=True, attention_kwargs=None):
    """``WanVACETransformer3DModel.forward`` (transformer_wan_vace.py:312-396, no gradient
    checkpointing) with one change: a hint is zero-padded to the main stream's token count
    before it is added. Sequence parallelism pads the main blocks' tokens to whole shards
    (``engine.weights.sharding.add_sequence_parallel_hooks``, from the first main block on);
    the VACE blocks run before it on the unpadded tokens, and the padded rows are sliced off
    after the last block, so the sum is diffusers' on every real token."""
    del attention_kwargs, return_dict  # no LoRA scale at run time: LoRAs are fused
    b, _, frames, height, width = hidden_states.shape
    p_t, p_h, p_w = self.config.patch_size
    scales = torch.unbind(control_hidden_states_scale)
    rotary_emb = self.rope(hidden_states)
    hidden_states = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2)
    control = self.vace_patch_embedding(control_hidden_states).flatten(2).transpose(1, 2)
    control = _pad_tokens(control, hidden_states.shape[1])  # diffusers pads a short control
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = \
        self.condition_embedder(timestep, encoder_hidden_states, encoder_hidden_states_image)
    timestep_proj = timestep_proj.unflatten(1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image,
                                              encoder_hidden_states], dim=1)
    hints = []
    for block in self.vace_blocks:
        hint, control = block(hidden_states, encoder_hidden_states, control, timestep_proj,
                              rotary_emb)
        hints.append(hint)
    layers = list(self.config.vace_layers)
    for i, block in enumerate(self.blocks):
        hidden_states = block(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
        if i in layers:
            k = layers.index(i)
            hidden_states = hidden_states + _pad_tokens(hints[k], hidden_states.shape[1]) \
                * scales[k]
    shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden_states = (self.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(
        hidden_states)
    hidden_states = self.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(b, frames // p_t, height // p_h, width // p_w,
                                          p_t, p_h, p_w, -1)
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return (hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3),)


def empty_transformer(cfg: dict, dtype):
    """``WanVACETransformer3DModel`` of ``cfg`` with meta parameters in ``dtype``, every
    block's attention (main and VACE) on ``wan_attention``'s processor, and ``vace_forward``
    as its forward."""
    from diffusers import WanVACETransformer3DModel

    # --dry_run_layers cuts num_layers: keep the VACE blocks that still have a main block.
    cfg = dict(cfg, vace_layers=[i for i in vace_layers(cfg) if i < cfg["num_layers"]])
    transformer = empty_model(WanVACETransformer3DModel, cfg, dtype)
    wan_attention.install(transformer)
    for block in transformer.vace_blocks:
        block.attn1.set_processor(wan_attention.WanRopeAttnProcessor())
        block.attn2.set_processor(wan_attention.WanRopeAttnProcessor())
    transformer.forward = types.MethodType(vace_forward, transformer)
    return transformer


def load_pipeline(config, components):
    """``WanVACEPipeline`` on the CPU from safetensors, with only ``components``; the
    transformer(s) with meta weights (``empty_transformer``), streamed to their shards later;
    the VAE in float32, also for the encode stage (the control encode runs there).

    Raises:
        GenerationError: the weights could not be found or read.
    """
    from diffusers import AutoencoderKLWan, WanVACEPipeline, WanVACETransformer3DModel

    dtype, model_id = getattr(torch, config.model.dtype), config.model.model_id
    if "text_encoder" in components:
        components = (*components, "vae")
    skip = {name: None for name in ("text_encoder", "transformer", "vae")
            if name not in components}
    if "text_encoder" not in components:
        skip["tokenizer"] = None
    experts = ("transformer", "transformer_2") if wan.is_two_expert(
        read_model_index(model_id)) else ("transformer",)
    if len(experts) == 2 and "transformer" not in components:
        skip["transformer_2"] = None
    try:
        if "transformer" in components:
            for name in experts:
                skip[name] = empty_transformer(dict(WanVACETransformer3DModel.load_config(
                    model_id, subfolder=name)), dtype)
        if "vae" in components:
            skip["vae"] = AutoencoderKLWan.from_pretrained(
                model_id, subfolder="vae", dtype=torch.float32, use_safetensors=True)
        pipe = WanVACEPipeline.from_pretrained(model_id, dtype=dtype, use_safetensors=True,
                                               **skip)
    except (OSError, ValueError) as e:
        raise GenerationError(f"--model_id={model_id!r}: could not load weights: "
                              f"{first_line(e)}") from None
    pipe.scheduler = wan.make_scheduler(pipe.scheduler.config, config.video.scheduler,
                                        config.video.flow_shift)
    for m in (pipe.transformer, getattr(pipe, "transformer_2", None), pipe.vae,
              pipe.text_encoder):
        if m is not None:
            m.eval()  # eval() only: see wan.load_pipeline
    return pipe


def _vace_factor(cfg: dict) -> float:
    """Block passes per step over the main blocks': a VACE block is a full Wan block (plus
    a D x D projection or two, < 1% at Wan widths, left out)."""
    return (cfg["num_layers"] + len(vace_layers(cfg))) / cfg["num_layers"]


def transformer_flops(cfg: dict, config) -> float:
    """``wan.transformer_flops`` with the VACE blocks' passes."""
    return wan.transformer_flops(cfg, config) * _vace_factor(cfg)


def self_attention_flops(cfg: dict, config) -> float:
    return wan.self_attention_flops(cfg, config) * _vace_factor(cfg)


def check_embeddings(embeds: dict, settings: dict, cfg: dict | None) -> str | None:
    return wan.check_embeddings(embeds, settings, cfg)


DEFAULTS = dict(wan.DEFAULTS, height=480, width=832,  # WanVACEPipeline.__call__'s size
                scan_layers=False, overlap_compile="off")
REFUSED = (
    ("scan_layers", False, "Wan VACE's blocks run unrolled: its forward adds the VACE hints "
                           "between main blocks"),
    ("stage", "all", "staged runs are not supported for Wan VACE yet"),
    ("serve", False, "serving is not supported for Wan VACE yet (the server takes no "
                     "--video/--mask/--reference_image uploads)"),
    ("image", None, "Wan VACE takes --video, --mask and --reference_image, not --image"),
    ("cache", None, "the step caches are not supported for Wan VACE yet"),
    ("enable_cache", False, "the step caches are not supported for Wan VACE yet"),
    ("overlap_compile", "off", "Wan VACE compiles after the load (its control input's "
                               "shape follows the reference images)"),
    ("quantize", "none", "not supported for Wan VACE yet"),
    ("sparse", "none", "not supported for Wan VACE yet (Sparse VideoGen needs --scan_layers, "
                       "which Wan VACE's forward cannot take)"),
)

FAMILY = dataclasses.replace(
    wan.FAMILY,
    name="Wan VACE",
    checkpoint=Checkpoint(
        pipeline_classes=(PIPELINE,),
        shipped_configs=(SHIPPED, "Wan-AI/Wan2.1-VACE-1.3B-diffusers"),
        download_hint="hf download Wan-AI/Wan2.1-VACE-14B-diffusers --local-dir PATH",
        required_files=("model_index.json", "transformer/config.json", "vae/config.json"),
        components=wan.FAMILY.checkpoint.components,
        weight_folders={"text_encoder": ("text_encoder",),
                        "transformer": ("transformer", "transformer_2"), "vae": ("vae",)},
        optional_folders=("transformer_2",),
    ),
    flags=Flags(defaults=DEFAULTS, checkpoint_defaults=checkpoint_defaults,
                check=wan.check_flags, refused=REFUSED, inputs=INPUTS,
                check_inputs=check_inputs),
    text=dataclasses.replace(wan.FAMILY.text, load_pipeline=load_pipeline,
                             prepare_latents=prepare_latents,
                             check_embeddings=check_embeddings),
    transformer=dataclasses.replace(
        wan.FAMILY.transformer, empty=empty_transformer, flops=transformer_flops,
        self_attention_flops=self_attention_flops, model_inputs=model_inputs,
        abstract_model_inputs=abstract_model_inputs, step_fn=step_fn,
        quantized_linears=None, sparse_policy=None),
    # WanVACEPipeline's sampling: UniPC (Euler for distilled LoRAs), as Wan's; from step 0.
    scheduler=Scheduling(default_flow_shift=wan.default_flow_shift,
                         sigmas=lambda num_inference_steps: None, names=("unipc", "euler"),
                         make=wan.make_scheduler),
    # Every run encodes its conditioning (without --video: the pipeline's zero video).
    image=ImageConditioning(encode=encode_conditioning, names=(CONDITION,),
                            finish_latents=finish, wanted=lambda config: True),
)
