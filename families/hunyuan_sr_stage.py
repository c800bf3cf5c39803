"""HunyuanVideo-1.5's super-resolution stage as a run: ``--sr 720p|1080p``.

The official ``generate.py --sr`` (on by default there) runs ``HunyuanVideoSRPipeline``
after the first stage (Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7,
``hyvideo/pipelines/hunyuan_video_sr_pipeline.py:__call__``). This module gives the engine's
upscale stage (``engine.pipeline.upscale``) what that call does, in the order it does it:

1. the SR video size: the first stage's size mapped by the bucket map (``sr_size``);
2. fresh noise on the SR latent grid, drawn as the official pipeline draws it: a CPU
   generator seeded with the run's seed (``prepare_latents(..., generator)``; ``seed`` is
   passed through, ``hunyuan_video_pipeline.py:_run_super_resolution``);
3. the hand-off, one compiled program: the first stage's final latents bilinearly resized to
   the SR grid, refined by the latent upsampler in float32 and rounded to the model dtype
   (:337-344), noised at strength 0.7 (:346), and packed with the I2V/T2V condition (the
   image's latents on frame 0 and mask 1 there at the SR size, or zeros) and a mask channel of
   ones into the 66 extra input channels (:348-353), beside the same condition with the
   low-res part zeroed (:355-358);
4. the SR transformer's steps, guidance 1 (one pass, no negative prompt), the same prompt
   embeddings as the first stage (the official stage re-encodes the same prompt with the same
   encoders), on its own flow-matching schedule (steps and shift of ``SR_CONFIGS``), the
   condition switched to the zeroed one once t < 700 (:373-375) inside the step.

One difference, stated: the official code draws the low-res noise with ``torch.randn_like``
from torch's global generator, which the run's seed does not set; here it comes from the
same seeded generator, right after the latents, so a run is reproducible.

Weights (``--sr_model_dir DIR``): ``DIR/transformer/`` is the SR DiT in diffusers format,
written once from the official ``transformer/<version>/`` by ``tools/convert_hunyuan_sr.py``;
``DIR/upsampler/<version>/`` is the official folder of that name as downloaded
(``config.json`` + ``diffusion_pytorch_model.safetensors``): copy the official ``upsampler/``.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import torch

from engine.files.checkpoint import read_component_config
from engine.run.errors import UsageError
from families import hunyuan
from families import hunyuan_sr as sr
from families.base import Upscale

SR_VERSIONS = {"720p": "720p_sr_distilled", "1080p": "1080p_sr_distilled"}
CONDITION, ZEROED = "condition", "sr_condition_zeroed"  # the step's two condition inputs
LQ_NOISE, BASE = "lq_noise", "base_condition"  # the hand-off's per-video inputs
CONVERT_HINT = ("convert it once: python tools/convert_hunyuan_sr.py --input "
                "<official>/transformer/{version} --output {dir}/transformer")


@dataclasses.dataclass(frozen=True)
class SrSettings:
    """The SR stage of a run: ``version`` (``SR_CONFIGS`` key), ``model_dir`` (see the module
    docstring), ``steps`` and ``flow_shift`` of its schedule, and the SR video's ``height`` and
    ``width`` in pixels; ``bases``: the bucket bases of the first and the SR transformer
    (their ``target_size``: ``hunyuan_sr.sr_size``), which map a first-stage size to these;
    ``stride``: the buckets' pixel step, the first stage VAE's spatial compression (None: the
    released checkpoints')."""

    version: str
    model_dir: str
    steps: int
    flow_shift: float
    height: int
    width: int
    bases: tuple = (None, None)
    stride: int | None = None


def _read_config(folder: str, flag_value: str, what: str) -> dict:
    path = os.path.join(folder, "config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"--sr_model_dir={flag_value!r}: {what} config {path} cannot be read "
                         f"({type(e).__name__})") from None


def check_folder(model_dir: str, version: str) -> dict:
    """The SR transformer's config from ``model_dir``, after checking the folder's layout.

    Raises:
        UsageError: a missing folder or config; an official-format transformer (not yet
            converted); a transformer that is not the SR DiT (98 input channels); an
            upsampler config of another class; weights missing or only in pickle format.
    """
    if not os.path.isdir(model_dir):
        raise UsageError(f"--sr_model_dir={model_dir!r}: not a folder")
    cfg = _read_config(os.path.join(model_dir, "transformer"), model_dir, "SR transformer")
    if cfg.get("_class_name") != "HunyuanVideo15Transformer3DModel":
        raise UsageError(f"--sr_model_dir={model_dir!r}: transformer/ holds "
                         f"{cfg.get('_class_name')!r}, expected diffusers' "
                         "HunyuanVideo15Transformer3DModel; "
                         + CONVERT_HINT.format(version=version, dir=model_dir))
    if cfg.get("in_channels") != 98:
        raise UsageError(f"--sr_model_dir={model_dir!r}: transformer in_channels="
                         f"{cfg.get('in_channels')}, expected 98 (an SR DiT: 32 latent + 66 "
                         "condition channels)")
    up = os.path.join(model_dir, "upsampler", version)
    sr.upsampler_class(version, _read_config(up, model_dir, "upsampler"))
    if not os.path.isfile(os.path.join(up, sr.WEIGHTS_NAME)):
        raise UsageError(f"--sr_model_dir={model_dir!r}: upsampler/{version}/{sr.WEIGHTS_NAME} "
                         "is missing (safetensors only)")
    return cfg


def validate(args, values: dict) -> SrSettings:
    """``--sr`` and its flags against the first stage's checkpoint and size, before any model
    loads. ``values``: the run's flag values with the family defaults filled in.

    Raises:
        UsageError: see ``check_folder``; a first-stage size that is not a bucket of the SR
            version's base resolution; ``--sr_steps`` < 1 or ``--sr_flow_shift`` <= 0.
    """
    version = SR_VERSIONS[args.sr]
    config = sr.SR_CONFIGS[version]
    if args.sr_model_dir is None and not args.dry_run:
        raise UsageError(f"--sr={args.sr}: needs --sr_model_dir (transformer/ from "
                         "tools/convert_hunyuan_sr.py, upsampler/{version}/ as in the official "
                         "download)")
    cfg = ({"target_size": sr.BUCKET_BASE[config.target]} if args.sr_model_dir is None
           else check_folder(args.sr_model_dir, version))
    steps = config.steps if args.sr_steps is None else args.sr_steps
    shift = config.flow_shift if args.sr_flow_shift is None else args.sr_flow_shift
    if steps < 1:
        raise UsageError(f"--sr_steps={steps}: must be >= 1")
    if not shift > 0:
        raise UsageError(f"--sr_flow_shift={shift}: must be > 0")
    first = read_component_config(args.model_id, "transformer") or {}
    settings = SrSettings(version, args.sr_model_dir, steps, float(shift), 0, 0,
                          (first.get("target_size"), cfg.get("target_size")),
                          hunyuan.vae_compression(hunyuan.vae_config(args.model_id))[1])
    return for_size(settings, values["height"], values["width"])


def for_size(settings: SrSettings, height: int, width: int) -> SrSettings:
    """``settings`` for a first stage of ``height`` x ``width`` pixels (the server's other
    buckets): the SR size by the bucket map.

    Raises:
        UsageError: the size is not a bucket of the SR version's base resolution.
    """
    h, w = sr.sr_size(height, width, settings.version, *settings.bases,
                      stride=settings.stride)
    return dataclasses.replace(settings, height=h, width=w)


def second_config(config, model_id: str):
    """The SR stage's ``RunConfig``: the SR size, steps and shift, guidance 1, no LoRA, no
    step cache, its own layout (dp/tp/sp left to the resolver), ``model_id`` for its
    transformer."""
    s = config.upscale
    return config.replace(
        model_id=model_id, height=s.height, width=s.width, num_inference_steps=s.steps,
        flow_shift=s.flow_shift, guidance_scale=1.0, lora=None, lora_2=None,
        dp=None, tp=None, sp=None, step_cache=None, upscale=None)


def sr_step_fn(jm, config):
    """The SR transformer's step: ``hunyuan.step_fn`` with its condition chosen per step
    (``hunyuan_sr.select_condition``) from the two the hand-off made (inputs ``CONDITION``,
    ``ZEROED``)."""
    inner = hunyuan.step_fn(jm, config)

    def step(params, buffers, latents, timestep, inputs):
        inputs = dict(inputs)
        full, zeroed = inputs.pop(CONDITION), inputs.pop(ZEROED)
        inputs[CONDITION] = sr.select_condition(timestep.float(), full, zeroed)
        return inner(params, buffers, latents, timestep, inputs)

    return step


def _condition_struct(cfg: dict, config, vae_cfg: dict):
    """(1, 2C + 2, F', H', W') in the model dtype: the shape of the hand-off's outputs;
    ``vae_cfg``: the first stage's VAE config (the SR stage decodes with that VAE)."""
    v = config.video
    return jax.ShapeDtypeStruct(
        (1, 2 * cfg["out_channels"] + 2,
         *hunyuan.latent_grid(vae_cfg, v.height, v.width, v.frames)),
        getattr(jnp, config.model.dtype))


class SrDryStage:
    """The SR stage for ``--dry_run`` (no weights): ``config``, ``transformer_config``,
    ``step_fn``, ``abstract_inputs(cfg)`` and ``estimate_config`` (see
    ``engine.dry_run.fit``). Without ``--sr_model_dir`` the SR DiT's config is the first
    stage's transformer config with 98 input channels and the SR ``target_size``
    (``assumed`` True): the same class; the official SR config.json was not read here
    (docs/models.md), and only the patch embedding's input width differs by code."""

    def __init__(self, config):
        s = config.upscale
        first_cfg = read_component_config(config.model.model_id, "transformer")
        self.first, self.assumed = config, s.model_dir is None
        self.config = second_config(config, s.model_dir or config.model.model_id)
        self.transformer_config = (
            read_component_config(s.model_dir, "transformer") if s.model_dir else
            {**first_cfg, "in_channels": 98,
             "target_size": sr.BUCKET_BASE[sr.SR_CONFIGS[s.version].target]})
        # The estimate compiles one block from the first stage's step at the SR size: its
        # inputs are the same shapes (the 98 channels stop at the patch embedding).
        self.estimate_config = second_config(config, config.model.model_id)
        self.step_fn = sr_step_fn

    def abstract_inputs(self, cfg: dict) -> dict:
        """The SR step's model inputs as ``jax.ShapeDtypeStruct``s (no sharding)."""
        text = hunyuan.abstract_model_inputs(cfg, self.estimate_config)
        cond = _condition_struct(cfg, self.config,
                                 hunyuan.vae_config(self.first.model.model_id))
        return {**text, CONDITION: cond, ZEROED: cond}


class SrStage:
    """What the engine's upscale stage places and compiles for one run (see
    ``engine.pipeline.upscale.prepare_upscale``): ``config`` (the second stage's
    ``RunConfig``), ``first`` (the first stage's), ``transformer`` (the SR DiT, meta
    weights), ``upsampler`` (float32, CPU), ``scheduler_config``, ``sigmas``, ``step_fn``,
    ``hand_off_fn``, ``noise`` and ``text_inputs``."""

    def __init__(self, config, pipe):
        s = config.upscale
        self.first, self.pipe = config, pipe
        self.config = second_config(config, s.model_dir)
        cfg = read_component_config(s.model_dir, "transformer")
        self.transformer = hunyuan.empty_transformer(cfg, getattr(torch, config.model.dtype))
        self.upsampler = sr.load_upsampler(s.model_dir, s.version)
        self.scheduler_config = dict(
            hunyuan.make_scheduler(pipe.scheduler.config, "euler", s.flow_shift).config)
        self.latent_channels = cfg["out_channels"]
        self.sigmas = hunyuan.scheduler_sigmas

    def step_fn(self, jm, config):
        return sr_step_fn(jm, config)

    def hand_off_fn(self, jm):
        """torch ``(params, buffers, lr_latents (1, C, F, h, w) float32, extras) -> {condition,
        zeroed condition}``, each (1, 2C + 2, F, H, W) in the model dtype (module docstring,
        step 3). ``extras``: ``LQ_NOISE`` (1, C, F, H, W) float32 and ``BASE`` (1, C + 1, F,
        H, W), the I2V/T2V condition."""
        dtype = getattr(torch, self.config.model.dtype)
        height, width = self.config.video.height, self.config.video.width
        grid = hunyuan.latent_grid(dict(self.pipe.vae.config), height, width, 1)[1:]
        c = self.latent_channels

        def hand_off(params, buffers, lr_latents, extras):
            lq = jm.functional_call(lambda m, x: m(x), params, buffers,
                                    sr.resize_to_grid(lr_latents, *grid).float())
            lq = sr.noise_lq(lq.to(dtype).float(), extras[LQ_NOISE])
            condition = sr.sr_condition(extras[BASE].float(), lq)
            return {CONDITION: condition.to(dtype),
                    ZEROED: sr.without_lq(condition, c).to(dtype)}

        return hand_off

    def noise(self, config, embeds: dict) -> tuple:
        """(initial SR latents (1, C, F, H, W) float32, the hand-off's extras) on the host for
        one video (``config``: the first stage's, with this video's seed): both drawn from one
        CPU generator seeded with the seed, the latents first (module docstring, step 2); the
        extras' base condition is the image's at the SR size after image-to-video, else
        zeros."""
        v = self.config.video
        dtype = getattr(torch, self.config.model.dtype)
        generator = torch.Generator("cpu").manual_seed(config.video.seed)
        latents = self.pipe.prepare_latents(1, self.latent_channels, v.height, v.width, v.frames,
                                            dtype, torch.device("cpu"), generator).float()
        lq_noise = torch.randn(latents.shape, generator=generator, dtype=dtype).float()
        base = embeds.get(hunyuan.SR_PREFIX + "condition")
        if base is None:
            base = torch.zeros((1, self.latent_channels + 1, *latents.shape[2:]), dtype=dtype)
        return latents, {LQ_NOISE: lq_noise, BASE: base.to(dtype)}

    def text_inputs(self, embeds: dict) -> dict:
        """The SR step's inputs but its condition: the first stage's prompt embeddings,
        positive only, and after image-to-video the image's SigLIP tokens at the SR size."""
        embeds = {k: v for k, v in embeds.items() if k not in hunyuan.IMAGE_NAMES}
        if hunyuan.SR_PREFIX + "image_embeds" in embeds:
            embeds["image_embeds"] = embeds.pop(hunyuan.SR_PREFIX + "image_embeds")
        embeds.pop(hunyuan.SR_PREFIX + "condition", None)
        return hunyuan.model_inputs(embeds, self.config)


def stage(config, pipe) -> SrStage:
    """The run's ``SrStage`` (``config.upscale`` set by ``validate``)."""
    return SrStage(config, pipe)


UPSCALE = Upscale(choices=tuple(SR_VERSIONS), validate=validate, stage=stage,
                  dry_stage=SrDryStage, for_size=for_size)
