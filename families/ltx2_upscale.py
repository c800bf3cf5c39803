"""LTX-2's two-stage run: ``--sr 2x`` (stage 1 at half size, the latent upsampler, stage 2).

diffusers composes it from three pipeline calls (docs ``api/pipelines/ltx2.md``, "Two-stages
Generation" and "Distilled checkpoint generation"; diffusers 0.42.1 ``pipelines/ltx2/``:
P = ``pipeline_ltx2.py``, U = ``pipeline_ltx2_latent_upsample.py``), one CPU generator
seeded once running through all three:

1. ``LTX2Pipeline(height / 2, width / 2, output_type="latent")``: the engine's first stage at
   half the ``--height`` / ``--width`` (Lightricks' ``TI2VidTwoStagesPipeline`` runs stage 1
   at ``width // 2, height // 2`` of its target, ``ltx_pipelines/ti2vid_two_stages.py:222-228``
   at Lightricks/LTX-2 400fd31). Its "latent" output is the video latents unpacked and
   de-normalised (P:1614-1633), the audio latents de-normalised and unpacked.
2. ``LTX2LatentUpsamplePipeline(latents=..., output_type="latent")`` with the
   ``LTX2LatentUpsamplerModel`` of ``--sr_model_dir`` (default: the checkpoint's
   ``latent_upsampler/``): raw latents in, the upsampler (x2 in height and width), raw latents
   out (``latents_normalized`` False, no AdaIN, no tone map: U:380-396).
3. ``LTX2Pipeline(latents=upsampled, audio_latents=stage 1's, sigmas=STAGE_2_DISTILLED_SIGMA_
   VALUES, num_inference_steps=3, noise_scale=sigmas[0])`` at the full size: the 5-D video
   latents normalised and packed, the audio latents packed and normalised (P:770-834), both
   re-noised as ``noise_scale * eps + (1 - noise_scale) * x`` with eps drawn from the same
   generator after stage 1's draws (P:719-724), then 3 steps on the checkpoint's scheduler
   without dynamic or terminal shift (the docs swap that scheduler in for stage 2). Every
   guidance term is off (one pass a step): Lightricks' two-stage pipeline runs stage 2
   unguided (``ti2vid_two_stages.py:287-311``); the diffusers docs set only
   ``guidance_scale=1``, leaving STG and modality guidance on, and the issue (66) asks for
   Lightricks' choice. The audio is stage 2's, as ``LTX2Pipeline`` returns it.

On the engine: steps 2 and the re-noising of 3 are the upscale stage's hand-off, one compiled
program on the mesh (``engine.pipeline.upscale``; the upsampler's weights replicated, float32
as diffusers loads it in the docs' float32 runs); the hand-off returns the stage's initial
latents (``hand_off_latents``). Stage 2's step is ``families.ltx2.step_fn`` at the full size;
its transformer is the same checkpoint's, placed a second time on its own mesh (stage 2 is
batch 1). Stage 2 needs the distilled weights: the distilled checkpoint (its scheduler has
neither dynamic nor terminal shift, ``ltx2.is_distilled``). The dev checkpoint with the
distilled LoRA fused is not done yet and is refused in one line.

``--dry_run`` / ``--estimate`` compile and estimate stage 2's step on its own mesh and the
decode at the final size (``TwoStageDry``); the upsampler is neither compiled nor estimated
there.

Not done here (each refused in one line before loading): image-to-video with ``--sr 2x``,
``--serve``, ``--sr_steps`` / ``--sr_flow_shift`` (stage 2 runs the published stage-2
sigmas).
"""

from __future__ import annotations

import dataclasses
import json
import os

import torch

from engine.files.checkpoint import read_component_config
from engine.run.errors import UsageError, fail
from families import ltx2
from families.base import Upscale, checkpoint_config

CHOICE = "2x"
FOLDER = "latent_upsampler"  # the checkpoint's subfolder (diffusers' docs: subfolder=...)
WEIGHTS = "diffusion_pytorch_model.safetensors"
VIDEO_NOISE, AUDIO_NOISE = "video_noise", "audio_noise"  # the hand-off's per-video inputs
STATS = ("video_mean", "video_std", "audio_mean", "audio_std")  # the VAEs' latent statistics


@dataclasses.dataclass(frozen=True)
class TwoStageSettings:
    """``--sr 2x`` of a run: ``model_dir`` (the ``LTX2LatentUpsamplerModel`` folder; None in a
    dry run of a checkpoint without one), the final
    video's ``height`` and ``width`` in pixels (stage 1 runs at half), stage 2's ``sigmas``
    (diffusers' STAGE_2_DISTILLED_SIGMA_VALUES), ``steps`` (their count) and ``noise_scale``
    (their first, as ``LTX2ConditionPipeline`` infers it)."""

    model_dir: str
    height: int
    width: int
    sigmas: tuple[float, ...]
    steps: int
    noise_scale: float
    version: str = CHOICE


def stage_2_sigmas() -> tuple[float, ...]:
    """diffusers' ``STAGE_2_DISTILLED_SIGMA_VALUES`` (pipelines/ltx2/utils.py:36, 3 values)."""
    from diffusers.pipelines.ltx2.utils import STAGE_2_DISTILLED_SIGMA_VALUES

    return tuple(float(s) for s in STAGE_2_DISTILLED_SIGMA_VALUES)


def check_upsampler(folder: str, flag_value, latent_channels: int) -> dict:
    """The upsampler config of ``folder`` after checking it is a 2x spatial
    ``LTX2LatentUpsamplerModel`` over ``latent_channels`` with safetensors weights.

    Raises:
        UsageError: a missing folder, config or weights file, another class, other
            channels, or another upsampling (one line naming ``--sr_model_dir``).
    """
    where = f"--sr_model_dir={flag_value!r}" if flag_value else f"--sr=2x: {folder}"
    try:
        with open(os.path.join(folder, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{where}: no readable latent upsampler config.json in {folder} "
                         f"({type(e).__name__}); tools/make_tiny_ltx2_upsampler.py writes a "
                         "tiny one") from None
    if cfg.get("_class_name") != "LTX2LatentUpsamplerModel":
        raise UsageError(f"{where}: config.json names {cfg.get('_class_name')!r}, expected "
                         "LTX2LatentUpsamplerModel")
    if cfg.get("in_channels") != latent_channels:
        raise UsageError(f"{where}: in_channels={cfg.get('in_channels')}, expected the video "
                         f"VAE's {latent_channels} latent channels")
    if cfg.get("temporal_upsample") or not cfg.get("spatial_upsample", True) or \
            float(cfg.get("rational_spatial_scale", 2.0)) != 2.0:
        raise UsageError(f"{where}: not a 2x spatial upsampler (spatial_upsample, "
                         "temporal_upsample, rational_spatial_scale)")
    if not os.path.isfile(os.path.join(folder, WEIGHTS)):
        raise UsageError(f"{where}: {WEIGHTS} is missing in {folder} (safetensors only)")
    return cfg


def _check_combination(args) -> None:
    """The flags ``--sr 2x`` does not take (one-line ``UsageError``s)."""
    for flag, given, why in (
            ("--sr_steps", args.sr_steps, "stage 2 runs diffusers' 3 STAGE_2_DISTILLED_SIGMA_"
                                          "VALUES"),
            ("--sr_flow_shift", args.sr_flow_shift, "stage 2's sigmas are not shifted"),
            ("--image", getattr(args, "image", None), "two-stage image-to-video is not done"),
            ("--serve", getattr(args, "serve", False) or None, "serving the two-stage run is "
                                                                "not done")):
        if given is not None:
            fail(flag, given, f"not with --sr 2x for LTX-2 ({why})")


def validate(args, values: dict) -> TwoStageSettings:
    """``--sr 2x`` against the checkpoint and the size, before any model loads. ``values``:
    the run's flag values; ``--height`` / ``--width`` are the final video's, and this sets
    ``values["height"]`` / ``values["width"]`` to stage 1's (half).

    Raises:
        UsageError: see ``check_upsampler`` and ``_check_combination``; a checkpoint that is
            not the distilled one; a height or width that is not a multiple of twice the
            checkpoint's pixel multiple (64 for LTX-2.0: stage 1's half must be a multiple
            of 32).
    """
    _check_combination(args)
    sched = checkpoint_config(args.model_id, "scheduler", ltx2.SHIPPED,
                              filename="scheduler_config.json")
    if not ltx2.is_distilled(sched):
        fail("--sr", args.sr, f"stage 2 runs the distilled weights, and --model_id "
             f"{args.model_id!r} is not the distilled checkpoint (its scheduler shifts: "
             "use_dynamic_shifting or shift_terminal); the dev checkpoint with the distilled "
             "LoRA is not supported yet")
    multiple = 2 * ltx2.pixel_multiple(args.model_id)
    for flag in ("height", "width"):
        if values[flag] % multiple:
            fail(f"--{flag}", values[flag], f"must be a multiple of {multiple} with --sr 2x "
                 f"(the final size; stage 1 runs at half, a multiple of {multiple // 2})")
    from diffusers import AutoencoderKLLTX2Video as Vae

    channels = ltx2.init_value(Vae, ltx2.configs(args.model_id)[1], "latent_channels")
    folder = args.sr_model_dir or os.path.join(args.model_id, FOLDER)
    if args.sr_model_dir is None and args.dry_run and not os.path.isdir(folder):
        folder = None  # a dry run of a shipped config compiles no upsampler (no weights)
    else:
        check_upsampler(folder, args.sr_model_dir, channels)
    sigmas = stage_2_sigmas()
    values["height"], values["width"] = values["height"] // 2, values["width"] // 2
    settings = TwoStageSettings(folder, 0, 0, sigmas, len(sigmas), sigmas[0])
    return for_size(settings, values["height"], values["width"])


def for_size(settings: TwoStageSettings, height: int, width: int) -> TwoStageSettings:
    """``settings`` for a stage 1 of ``height`` x ``width`` pixels: the final size is twice."""
    return dataclasses.replace(settings, height=2 * height, width=2 * width)


def second_config(config):
    """Stage 2's ``RunConfig``: the final size, the stage-2 sigmas and their step count, every
    guidance term off, its own layout (dp/tp/sp left to the resolver); the same checkpoint
    and LoRAs."""
    s = config.upscale
    off = {k: v for k, v in ltx2.GUIDANCE_OFF.items() if k != "guidance_scale"}
    return config.replace(
        height=s.height, width=s.width, num_inference_steps=s.steps, sigmas=s.sigmas,
        guidance_scale=1.0, options={**(config.video.options or {}), **off},
        recipe=dict(name="stage 2", source="STAGE_2_DISTILLED_SIGMA_VALUES, unguided"),
        dp=None, tp=None, sp=None, step_cache=None, upscale=None)


def stage_2_scheduler_config(model_id: str) -> dict:
    """The checkpoint's scheduler config without dynamic or terminal shift (what diffusers'
    docs give stage 2; the distilled checkpoint's already is), with its ``_class_name``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = checkpoint_config(model_id, "scheduler", ltx2.SHIPPED,
                            filename="scheduler_config.json")
    cfg = {**cfg, "use_dynamic_shifting": False, "shift_terminal": None}
    return dict(FlowMatchEulerDiscreteScheduler.from_config(cfg).config)


def sigma_table(scheduler_config: dict, sigmas) -> torch.Tensor:
    """(1, 2, steps) float32 [timesteps; sigmas] of stage 2's scheduler (``ltx2.SIGMA_TABLE``,
    which the step reads sigma from)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler_config)
    scheduler.set_timesteps(sigmas=list(sigmas))
    return torch.stack([scheduler.timesteps.float(), scheduler.sigmas[:-1].float()])[None]


class TwoStage:
    """What the engine's upscale stage places and compiles for one run (see
    ``engine.pipeline.upscale.prepare_upscale`` and ``families.base.Upscale``): ``config``
    (stage 2's ``RunConfig``), ``first`` (stage 1's), ``transformer`` (meta weights),
    ``upsampler`` (float32, CPU), ``scheduler_config``, ``sigmas``, ``step_fn``,
    ``hand_off_fn`` (returns the initial latents: ``hand_off_latents``), ``noise`` and
    ``text_inputs``."""

    hand_off_latents = True

    def __init__(self, config, pipe):
        from diffusers.pipelines.ltx2.latent_upsampler import LTX2LatentUpsamplerModel

        s = config.upscale
        self.first, self.pipe, self.settings = config, pipe, s
        self.config = second_config(config)
        model_id = config.model.model_id
        cfg = read_component_config(model_id, "transformer")
        self.transformer = ltx2.empty_transformer(cfg, getattr(torch, config.model.dtype))
        self.upsampler = LTX2LatentUpsamplerModel.from_pretrained(
            s.model_dir, torch_dtype=torch.float32, use_safetensors=True).eval()
        self.scheduler_config = stage_2_scheduler_config(model_id)
        self.sigmas = lambda n: list(s.sigmas)
        v = self.config.video
        self.geometry = ltx2.run_layout(model_id, v.height, v.width, v.frames)
        # Copied now: placing the decode frees the VAEs' host tensors, and every video's
        # hand-off takes them (``noise``).
        vae = pipe.vae  # ltx2.AudioVideoDecode: .video and .audio hold the statistics
        self.statistics = {name: value.detach().float().clone() for name, value in zip(
            STATS, (vae.video.latents_mean, vae.video.latents_std, vae.audio.latents_mean,
                    vae.audio.latents_std), strict=True)}

    def step_fn(self, jm, config):
        return ltx2.step_fn(jm, config)

    def hand_off_fn(self, jm):
        """torch ``(params, buffers, stage 1's final latents (1, size_1) float32, extras) ->
        (stage 2's initial latents (1, size_2) float32, {})``: steps 1-3 of the module
        docstring between stage 1's loop and stage 2's. ``extras``: ``VIDEO_NOISE`` (1, S_2,
        C) and ``AUDIO_NOISE`` (1, A, C_a) float32, and the VAEs' latent statistics
        (``STATS``)."""
        from diffusers import LTX2Pipeline as P

        g1, g2 = self.pipe.geometry, self.geometry
        n1 = g1["video_tokens"] * g1["video_width"]
        scaling = float(self.pipe.vae.video.config.scaling_factor)
        ns = self.settings.noise_scale

        def hand_off(params, buffers, lr_latents, extras):
            video = lr_latents[:, :n1].reshape(1, g1["video_tokens"], g1["video_width"])
            audio = lr_latents[:, n1:].reshape(1, g1["audio_tokens"], g1["audio_width"])
            # Stage 1's output_type="latent" (P:1614-1633).
            video = P._unpack_latents(video, g1["f"], g1["h"], g1["w"], g1["p"], g1["pt"])
            video = P._denormalize_latents(video, extras["video_mean"], extras["video_std"],
                                           scaling)
            audio = P._denormalize_audio_latents(audio, extras["audio_mean"],
                                                 extras["audio_std"])
            audio = P._unpack_audio_latents(audio, g1["audio_frames"], num_mel_bins=g1["mel"])
            # The upsampler (U:380-386), then stage 2's prepare_latents (P:770-834).
            video = jm.functional_call("forward", params, buffers, video.float())
            video = P._normalize_latents(video, extras["video_mean"], extras["video_std"],
                                         scaling)
            video = P._pack_latents(video, g2["p"], g2["pt"])
            audio = P._normalize_audio_latents(P._pack_audio_latents(audio),
                                               extras["audio_mean"], extras["audio_std"])
            video = ns * extras[VIDEO_NOISE] + (1 - ns) * video
            audio = ns * extras[AUDIO_NOISE] + (1 - ns) * audio
            return torch.cat([video.reshape(1, -1), audio.reshape(1, -1)], dim=1).float(), {}

        return hand_off

    def noise(self, config, embeds: dict) -> tuple:
        """(None, the hand-off's extras) on the host for one video (``config``: stage 1's,
        with this video's seed): one CPU generator seeded with the seed draws stage 1's video
        and audio noise as ``ltx2.prepare_latents`` does (discarded here: stage 1 draws its
        own), then stage 2's re-noising eps, video then audio, in their packed shapes
        (P:719-724, 1315-1341)."""
        from diffusers.utils.torch_utils import randn_tensor

        pipe, v, g2 = self.pipe, config.video, self.geometry
        generator, cpu = torch.Generator("cpu").manual_seed(v.seed), torch.device("cpu")
        pipe.prepare_latents(1, pipe.transformer.config.in_channels, v.height, v.width,
                             v.frames, 0.0, torch.float32, cpu, generator)
        pipe.prepare_audio_latents(1, pipe.audio_vae.config.latent_channels,
                                   pipe.geometry["audio_frames"], pipe.audio_vae.config.mel_bins,
                                   0.0, torch.float32, cpu, generator)
        extras = {
            VIDEO_NOISE: randn_tensor((1, g2["video_tokens"], g2["video_width"]),
                                      generator=generator, device=cpu, dtype=torch.float32),
            AUDIO_NOISE: randn_tensor((1, g2["audio_tokens"], g2["audio_width"]),
                                      generator=generator, device=cpu, dtype=torch.float32)}
        return None, {**extras, **self.statistics}

    def text_inputs(self, embeds: dict) -> dict:
        """Stage 2's model inputs: the positive prompt's embeddings (no guidance) and its
        sigma table (``sigma_table`` of stage 2's scheduler)."""
        out = ltx2.model_inputs(embeds, self.config)
        out[ltx2.SIGMA_TABLE] = sigma_table(self.scheduler_config, self.settings.sigmas)
        return out


def stage(config, pipe) -> TwoStage:
    """The run's ``TwoStage`` (``config.upscale`` set by ``validate``). The run's decode
    (``pipe.vae``, ``ltx2.AudioVideoDecode``, built at load for stage 1's size) takes stage
    2's latents: its geometry becomes stage 2's here, before the engine compiles it."""
    two = TwoStage(config, pipe)
    pipe.vae.geometry = two.geometry
    return two


class TwoStageDry:
    """Stage 2 for ``--dry_run`` / ``--estimate`` (no weights; see ``engine.dry_run.fit``):
    ``config`` (stage 2's ``RunConfig``), ``transformer_config`` (the checkpoint's: stage 2
    runs the same transformer), ``step_fn``, ``abstract_inputs(cfg)``, ``estimate_config``
    and ``assumed`` (False: nothing is assumed). The hand-off (the upsampler) is not compiled
    or estimated here; the decode is compiled at the final size (``ltx2.empty_vae`` reads
    ``config.upscale``)."""

    assumed = False

    def __init__(self, config):
        self.first = config
        self.config = self.estimate_config = second_config(config)
        self.transformer_config = checkpoint_config(config.model.model_id, "transformer",
                                                    ltx2.SHIPPED)
        self.step_fn = ltx2.step_fn

    def abstract_inputs(self, cfg: dict) -> dict:
        """Stage 2's model inputs as ``jax.ShapeDtypeStruct``s (batch 1: no guidance)."""
        return ltx2.abstract_model_inputs(cfg, self.config)


UPSCALE = Upscale(choices=(CHOICE,), validate=validate, stage=stage, dry_stage=TwoStageDry,
                  for_size=for_size)
