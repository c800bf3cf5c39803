"""LTX-2 text-to-video with sound (diffusers ``LTX2Pipeline``): the family module.

Sources: diffusers 0.42.1's ``LTX2Pipeline`` (``pipelines/ltx2/pipeline_ltx2.py``, "P:"
below), ``LTX2VideoTransformer3DModel`` (``models/transformers/transformer_ltx2.py``, "T:"),
``AutoencoderKLLTX2Video``, ``AutoencoderKLLTX2Audio`` and ``LTX2Vocoder``, which run
unmodified; docs/models.md "LTX-2: what diffusers runs per step" lists the passes.

How the pipeline maps onto the engine (one latent array, one scheduler, one step program):

* **Video and audio latents in one array.** The pipeline denoises packed video latents
  (1, S_v, C_v) and packed audio latents (1, S_a, C_a) with two ``FlowMatchEulerDiscrete``
  schedulers that are deep copies with the same sigmas (P:1354-1370); their step is
  ``x + (sigma_next - sigma) * v`` per element. So the engine's one latent array here is
  [video.flatten(), audio.flatten()] (1, S_v*C_v + S_a*C_a) float32, stepped by one scheduler:
  the same float32 operations on the same numbers. The step and the decoder unpack it.
* **Every guidance pass in one step program.** The step runs the CFG pass (batch 2,
  [negative, positive]), the STG pass (positive, ``spatio_temporal_guidance_blocks``: block
  29 on LTX-2.0, 28 on 2.3, Lightricks' recipe; skipped where the checkpoint's
  ``perturbed_attn`` is false, which makes it the plain pass: ``stg_perturbs``) and the
  modality-isolation pass (positive, ``isolate_modalities``) that the scales ask
  for, then diffusers' guidance: x0 = x - v * sigma, the deltas, ``rescale_noise_cfg`` 0.7
  and back to a velocity (P:1440-1600), per modality. The block list and the isolation flag
  are Python values, fixed at trace time: one compiled program, nothing per step.
* **Recipes.** A checkpoint whose scheduler has neither dynamic nor terminal shift (the
  distilled one) defaults to Lightricks' distilled recipe: 8 steps of DISTILLED_SIGMA_VALUES,
  no guidance (``checkpoint_defaults``); ``--sigmas`` gives diffusers' ``sigmas``, shifted
  as the pipeline shifts them (``sigma_table``). Flags the user gives win.
* **The scheduler's shift.** The checkpoint's scheduler shifts by ``mu`` from the video token
  count (``use_dynamic_shifting``, exponential, P:1345-1352). The engine sets timesteps from
  sigmas only, so the run's scheduler is the same config with the static shift exp(mu):
  exp(mu) s / (1 + (exp(mu) - 1) s) is the exponential time shift written another way
  (float32 rounding aside: ``tests/test_ltx2.py`` compares the schedules).
* **The step needs sigma.** x0 uses ``scheduler.sigmas[i]``; the engine passes the timestep.
  A (B, 2, steps) table [timesteps; sigmas] is a model input and the step looks its
  timestep up (as HunyuanVideo-1.5's MeanFlow table).
* **RoPE in float64.** The RoPE modules build their frequencies in float64
  (``rope_double_precision``, T:1029); JAX runs without x64, which moved outputs by 4e-5.
  Their forwards run under ``jax.enable_x64`` (``install_x64_ropes``); nothing else does.
  Their coordinates are computed on the host, as the pipeline precomputes them, and enter
  the step as constants (``rope_coords``: traced, they came out an ulp off).
* **Decode.** The video VAE decode, the audio VAE decode and the vocoder run as ONE compiled
  program (``AudioVideoDecode`` through ``LtxDecoder``): latents -> (video, waveform). The
  audio side is small (126 latent frames -> 120,240 stereo samples at 24 kHz) but compiled
  too, so the host never runs a model; the tiny checkpoint's parity tests cover both.

What runs where: Gemma (text encoder) and the connectors on the CPU, before any device work
(the embeddings are the connectors' outputs); the transformer, the VAEs and the vocoder on the
devices. The video self-attention goes through the SDPA override (our kernel on TPU); every
other attention (the text cross-attentions with their additive mask, the audio
self-attention and the audio-video cross-attentions: 126 audio tokens) runs on XLA
(``route_short_attentions``).

Image-to-video (``--image``, any LTX-2 checkpoint): ``families.ltx2_i2v``. Conditions
(``--condition PATH@FRAME[:STRENGTH]``, ``LTX2ConditionPipeline``): ``families.ltx2_conditions``.

Dry run and ``--estimate``: ``empty_vae`` builds ``AudioVideoDecode`` with meta weights for
the run's video size, ``latent_shape`` reads the checkpoint's audio VAE config, and the
estimate compiles the first block once per distinct pass of the step (the CFG pair, the STG
pass, the modality pass) and counts each (docs/dry_run.md, "Dry-run figures: LTX-2").

LoRA (``--lora``): diffusers' ``LTX2LoraLoaderMixin.lora_state_dict`` converts the keys
(diffusers/PEFT ``transformer.`` / ``connectors.``, or Lightricks/ComfyUI ``diffusion_model.``
and ``text_embedding_projection.``); the transformer's deltas are fused at placement as for
every family, the connectors' at load on the CPU (``lora_host_components``, ``load_pipeline``).

Not done here (refused in one line): the step caches, --serve_sizes, staged runs,
--scan_layers (diffusers' block loop passes per-block STG arguments by keyword),
--quantize. The two-stage run (``--sr 2x``): ``families.ltx2_upscale``.
"""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop

from custom_splash_attention import forced_attention
from engine.files.checkpoint import read_component_config
from engine.files.report import Audio
from engine.programs import executables
from engine.run.errors import GenerationError, first_line
from engine.run.runtime import to_host
from engine.weights import lora
from engine.weights.scan_layers import BlockStack
from families import ltx2_conditions, ltx2_i2v
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

# The compression ratios and patch sizes are read from the checkpoint (``video_compression``,
# ``audio_compression``, ``layout``), as the pipeline reads them from its components
# (P:271-296); the dry run reads the config files (``checkpoint_config``).
SHIPPED = "Lightricks/LTX-2"
TEXT_TOKENS = 1024  # the pipeline's max_sequence_length default (P:976)
# The pipeline's defaults that are not flags here (P:945-953).
GUIDANCE_RESCALE = 0.7
# The STG block per version, Lightricks' recipe (ltx_pipelines constants.py:56, 66 at
# Lightricks/LTX-2 400fd31: 29 for LTX-2.0, 28 for LTX-2.3); diffusers' docstring recommends
# the same (P:1063-1066) though its default is [28] (P:953). ``stg_blocks`` reads the version.
STG_BLOCKS = {"2.0": (29,), "2.3": (28,)}
# The distilled checkpoint's recipe, Lightricks' ``DistilledPipeline``: diffusers'
# DISTILLED_SIGMA_VALUES (pipelines/ltx2/utils.py:27, 8 steps) and one sample a step, no
# guidance (``SimpleDenoiser``, ltx_pipelines distilled.py:266, 295). diffusers' converter
# writes that checkpoint's scheduler without dynamic shifting or a terminal shift, its one
# file difference from Lightricks/LTX-2 (configs/rootonchair/LTX-2-19b-distilled/scheduler/).
DISTILLED_SOURCE = ("distilled: scheduler_config.json has use_dynamic_shifting=false, "
                    "shift_terminal=null")
PIPELINE_DEFAULTS = "pipeline defaults"
STG_RUNS = "runs when a STG scale > 0 (transformer perturbed_attn=true)"
STG_SKIPPED = ("skipped: transformer perturbed_attn=false makes it the plain positive pass, "
               "its delta zero")
GUIDANCE_OFF = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0,
                    audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0)

DEFAULTS = dict(
    prompt="A cat walks on the grass, realistic style.",
    negative_prompt="",  # LTX2Pipeline encodes "" when no negative prompt is given (P:428)
    height=512, width=768, frames=121, fps=24,  # P:935-942, 1212
    num_inference_steps=30, guidance_scale=3.0,  # P:943-945
    max_sequence_length=TEXT_TOKENS,
    scan_layers=False,
    # The decode's shapes follow the video size, which its meta model (built from its folder
    # alone) does not know: nothing is compiled from shapes ahead of the load.
    overlap_compile="off",
)

# LTX-2's own flags, diffusers' argument names and defaults (P:945-952). An audio scale of 0
# falls back to the video one, as the pipeline's ``or`` does (P:1157-1159).
OPTIONS = {
    "stg_scale": (1.0, "LTX-2 spatio-temporal guidance scale (video): > 0 (either "
                       "modality) adds a pass with self-attention skipped in block 29 "
                       "(LTX-2.0; 2.3: 28), run only where the checkpoint's perturbed_attn "
                       "makes it differ"),
    "modality_scale": (3.0, "LTX-2 modality-isolation guidance scale (video): > 1 (either "
                            "modality) adds a pass without audio-video cross-attention"),
    "audio_guidance_scale": (7.0, "LTX-2 CFG scale of the audio (0: --guidance_scale); "
                                  "either scale > 1 runs the negative prompt"),
    "audio_stg_scale": (1.0, "LTX-2 STG scale of the audio (0: --stg_scale)"),
    "audio_modality_scale": (3.0, "LTX-2 modality-isolation scale of the audio (0: "
                                  "--modality_scale)"),
}

DOWNLOAD_HINT = "hf download Lightricks/LTX-2 --local-dir PATH"

# Flags this family does not take yet: (flag, the only value allowed, why).
REFUSED = (
    ("flow_shift", None, "LTX-2's scheduler shifts by the video token count (mu), not a flag"),
    ("stage", "all", "staged runs are not supported for LTX-2 yet"),
    # --serve: one shape, the --width/--height/--frames one. The run's scheduler shift (mu,
    # from the video token count) and the decode's geometry are set at load for that shape.
    ("serve_sizes", None, "LTX-2 serves one shape: give it with --width and --height "
                          "(its scheduler shift and decode are set up for it at load)"),
    ("serve_frames", None, "LTX-2 serves one shape: give its length with --frames (its "
                           "scheduler shift and decode are set up for it at load)"),
    ("cache", None, "the step caches are not supported for LTX-2"),
    ("enable_cache", False, "the step caches are not supported for LTX-2"),
    ("scan_layers", False, "LTX-2's blocks run unrolled: diffusers' block loop passes "
                           "per-block STG arguments by keyword"),
    ("vae_tiling", False, "LTX-2's decode is one program of video and audio"),
    ("overlap_compile", "off", "LTX-2 compiles after the load (its decode's meta model "
                               "does not know the video size)"),
)

# Unrolled only (REFUSED: scan_layers). diffusers calls each block by keyword: sequence
# parallelism shards ``hidden_states`` (the video tokens) and pads the video RoPE tables, (B,
# heads, tokens, head_dim / 2) for the "split" RoPE of every LTX-2 config, on their token axis,
# and ``temb``, per token (B, tokens, k D) with --image (its per-token timestep; else (B, 1,
# k D), left as it is).
# The audio stream (126 tokens) stays whole; its attention over the video tokens masks the
# padding as the self-attention does.
BLOCKS = BlockStack(attr="transformer_blocks", carry=2, token_axes=(1, None),
                    self_attention="attn1", sublayers=(),
                    token_kwargs=(("hidden_states", 1), ("video_rotary_emb", 2),
                                  ("ca_video_rotary_emb", 2), ("temb", 1)),
                    video_key_attention=("video_to_audio_attn",))


# ---------------------------------------------------------------------------------------------
# Flags, sizes, scheduler
# ---------------------------------------------------------------------------------------------


def scales(config) -> dict:
    """The run's resolved guidance scales: the video ones and the audio ones with the
    pipeline's fallback (an audio scale of 0 takes the video one)."""
    o = config.video.options or {}
    g = config.video.guidance_scale
    out = dict(guidance_scale=g, stg_scale=o["stg_scale"], modality_scale=o["modality_scale"])
    for name in ("guidance_scale", "stg_scale", "modality_scale"):
        out["audio_" + name] = o["audio_" + name] or out[name]
    return out


def stg_perturbs(cfg: dict) -> bool:
    """Whether the STG pass differs from the plain positive pass for transformer config
    ``cfg``: its ``perturbed_attn``. diffusers 0.42.1 (models/transformers/
    transformer_ltx2.py) hands a block the perturbation mask only ``if self.perturbed_attn``
    (T:644-646 video, T:668-670 audio self-attention); otherwise the block's attention
    processor is ``LTX2AudioVideoAttnProcessor`` (T:459-462), which takes no mask, and
    ``spatio_temporal_guidance_blocks`` changes nothing else (T:1603-1614 only build the
    masks), so the STG pass computes the plain positive pass and its delta
    stg_scale * (x0_cond - x0_stg) is zero up to float rounding (the cond sample ran in the
    CFG batch). LTX-2.0's converted config has ``perturbed_attn`` false (configs/Lightricks/
    LTX-2/transformer/config.json), LTX-2.3's true (diffusers'
    scripts/convert_ltx2_to_diffusers.py)."""
    from diffusers import LTX2VideoTransformer3DModel as Model

    return bool(init_value(Model, cfg, "perturbed_attn"))


def version(cfg: dict) -> str:
    """"2.3" for an LTX-2.3-style transformer config (gated attention and cross-attention
    modulation, the converter's 2.3 overrides: ``gated_attn``, ``cross_attn_mod``), else
    "2.0"."""
    from diffusers import LTX2VideoTransformer3DModel as Model

    later = init_value(Model, cfg, "gated_attn") and init_value(Model, cfg, "cross_attn_mod")
    return "2.3" if later else "2.0"


def stg_blocks(cfg: dict) -> tuple:
    """The STG blocks of ``cfg``'s version (``STG_BLOCKS``, Lightricks' recipe)."""
    return STG_BLOCKS[version(cfg)]


def stg_asked(config) -> bool:
    """Whether either STG scale is > 0 (diffusers then runs the STG pass, P:906-907)."""
    s = scales(config)
    return s["stg_scale"] > 0 or s["audio_stg_scale"] > 0


def passes(config) -> dict:
    """Which passes a step runs (P:902-912): cfg (batch 2), stg, modality (batch 1 each).
    The STG pass is skipped where its delta is zero by construction (``stg_perturbs``):
    diffusers runs it, with the same frames up to float rounding."""
    s = scales(config)
    cfg = configs(config.model.model_id)[0]
    return dict(cfg=s["guidance_scale"] > 1 or s["audio_guidance_scale"] > 1,
                stg=stg_asked(config) and stg_perturbs(cfg),
                modality=s["modality_scale"] > 1 or s["audio_modality_scale"] > 1)


def sample_passes(config) -> int:
    """Transformer samples per step: 2 for CFG (else 1), + 1 for STG, + 1 for modality."""
    p = passes(config)
    return (2 if p["cfg"] else 1) + p["stg"] + p["modality"]


def layout_batch(config) -> int:
    """The batch the default layout serves: 1 when a step runs a batch-1 pass (STG or
    modality isolation) beside the CFG pair. Under dp2 such a pass runs twice, once per dp
    half, and its attention cannot take the kernel's dp split; the static estimate of the
    default 768 x 512 x 121 video: tpu7x:2x2x1 dp2 x sp4 0.434 s/step against dp1 x sp8 0.183,
    v6e:2x4 dp2 x tp4 0.496 against dp1 x tp8 0.445 (benchmarks/dry_run_results.md)."""
    p = passes(config)
    return 1 if p["stg"] or p["modality"] else (2 if p["cfg"] else 1)


def named_sigmas() -> dict:
    """The ``--sigmas`` names: {"distilled": diffusers' DISTILLED_SIGMA_VALUES (8)}."""
    from diffusers.pipelines.ltx2.utils import DISTILLED_SIGMA_VALUES

    return {"distilled": tuple(DISTILLED_SIGMA_VALUES)}


def is_distilled(scheduler_cfg: dict) -> bool:
    """Whether a scheduler config is the distilled checkpoint's: no dynamic shifting and no
    terminal shift (both the scheduler's defaults when absent)."""
    from diffusers import FlowMatchEulerDiscreteScheduler as Scheduler

    return not init_value(Scheduler, scheduler_cfg, "use_dynamic_shifting") and \
        init_value(Scheduler, scheduler_cfg, "shift_terminal") is None


def checkpoint_defaults(model_id: str) -> dict:
    """The recipe the checkpoint's files imply: for the distilled scheduler (``is_distilled``)
    Lightricks' distilled recipe (8 steps of DISTILLED_SIGMA_VALUES, every guidance term off:
    one transformer pass a step), with ``sources``; else LTX2Pipeline's defaults. ``recipe``
    names it: {"name", "source", "stg_pass"} (the report's ``settings.recipe``; "stg_pass"
    says whether an STG scale > 0 runs its pass, ``stg_perturbs``)."""
    sched = checkpoint_config(model_id, "scheduler", SHIPPED, filename="scheduler_config.json")
    stg = STG_RUNS if stg_perturbs(configs(model_id)[0]) else STG_SKIPPED
    if not is_distilled(sched):
        return dict(recipe=dict(name=PIPELINE_DEFAULTS, source=PIPELINE_DEFAULTS, stg_pass=stg))
    sigmas = named_sigmas()["distilled"]
    recipe = dict(num_inference_steps=len(sigmas), sigmas=sigmas, **GUIDANCE_OFF)
    return dict(recipe, recipe=dict(name="distilled", source=DISTILLED_SOURCE, stg_pass=stg),
                sources={k: DISTILLED_SOURCE for k in recipe})


def check_flags(values: dict) -> tuple[str, str] | None:
    if values["max_sequence_length"] != TEXT_TOKENS:
        return ("--max_sequence_length", f"is fixed at {TEXT_TOKENS} for LTX-2 (the "
                "connectors' 128 registers must divide it; the pipeline's default)")
    if values["fps"] != DEFAULTS["fps"]:
        return ("--fps", f"is fixed at {DEFAULTS['fps']} for LTX-2 here (the audio length and "
                "the RoPE coordinates follow it; the dry run's shapes assume it)")
    return None


def default_flow_shift(height: int, width: int) -> float:
    """Unused (--flow_shift is refused): the shift is exp(mu), ``make_scheduler``."""
    return 1.0


def video_compression(vae_cfg: dict) -> tuple[int, int]:
    """(temporal, spatial) compression of an ``AutoencoderKLLTX2Video`` config, as the model
    sets its ``temporal_compression_ratio`` / ``spatial_compression_ratio``: the config's
    values, else patch x 2^(encoder blocks that scale) (autoencoder_kl_ltx2.py:1151-1160;
    LTX-2.0's config sets 8 / 32, the formula would give 16 / 64)."""
    from diffusers import AutoencoderKLLTX2Video as Vae

    scaling = init_value(Vae, vae_cfg, "spatio_temporal_scaling")
    if isinstance(scaling, bool):  # one flag for every block but the last (:1105-1106)
        scaling = (scaling,) * (len(init_value(Vae, vae_cfg, "layers_per_block")) - 1)
    ratios = []
    for name, patch in (("temporal_compression_ratio", "patch_size_t"),
                        ("spatial_compression_ratio", "patch_size")):
        value = init_value(Vae, vae_cfg, name)
        ratios.append(int(value if value is not None
                          else init_value(Vae, vae_cfg, patch) * 2 ** sum(scaling)))
    return ratios[0], ratios[1]


def audio_compression() -> tuple[int, int]:
    """(temporal, mel) compression of ``AutoencoderKLLTX2Audio``: diffusers sets both from its
    module's ``LATENT_DOWNSAMPLE_FACTOR`` (autoencoder_kl_ltx2_audio.py:28, 751-753), not from
    the config, and the pipeline reads them from the model (P:278-283)."""
    from diffusers.models.autoencoders import autoencoder_kl_ltx2_audio as audio

    return audio.LATENT_DOWNSAMPLE_FACTOR, audio.LATENT_DOWNSAMPLE_FACTOR


def audio_frames(frames: int, fps: float, audio_vae_cfg: dict) -> int:
    """Latent audio frames of a video: round(frames / fps x rate / hop / temporal
    compression) (P:1300-1305), the rate and hop from the audio VAE config."""
    from diffusers import AutoencoderKLLTX2Audio as Audio

    per_second = init_value(Audio, audio_vae_cfg, "sample_rate") / init_value(
        Audio, audio_vae_cfg, "mel_hop_length") / float(audio_compression()[0])
    return round(frames / fps * per_second)


def layout(cfg: dict, vae_cfg: dict, audio_cfg: dict, height: int, width: int,
           frames: int, fps: float = 24.0) -> dict:
    """The packed latents' geometry from the transformer (``cfg``), video VAE and audio VAE
    configs of one checkpoint: video (latent frames f, h, w, patch sizes p and pt, tokens,
    width) and audio (frames, mel bins, tokens, width); ``size`` is the one float32 array's
    length. As the pipeline sizes them (P:795-797, 1272-1274, 1300-1330)."""
    from diffusers import AutoencoderKLLTX2Audio as Audio
    from diffusers import AutoencoderKLLTX2Video as Vae
    from diffusers import LTX2VideoTransformer3DModel as Model

    temporal, spatial = video_compression(vae_cfg)
    f = (frames - 1) // temporal + 1
    h, w = height // spatial, width // spatial
    p, pt = init_value(Model, cfg, "patch_size"), init_value(Model, cfg, "patch_size_t")
    video_tokens = (f // pt) * (h // p) * (w // p)
    video_width = init_value(Vae, vae_cfg, "latent_channels") * p * p * pt
    a = audio_frames(frames, fps, audio_cfg)
    mel = init_value(Audio, audio_cfg, "mel_bins") // audio_compression()[1]
    audio_width = init_value(Audio, audio_cfg, "latent_channels") * mel
    return dict(f=f, h=h, w=w, p=p, pt=pt, video_tokens=video_tokens, video_width=video_width,
                audio_frames=a, mel=mel, audio_tokens=a, audio_width=audio_width,
                size=video_tokens * video_width + a * audio_width)


def configs(model_id: str | None) -> tuple[dict, dict, dict]:
    """The transformer, video VAE and audio VAE configs of ``model_id`` (a local folder or
    a shipped Hub id), each else the shipped LTX-2.0 one (``checkpoint_config``)."""
    return tuple(checkpoint_config(model_id, sub, SHIPPED)
                 for sub in ("transformer", "vae", "audio_vae"))


def shift_tokens(config, g: dict) -> int:
    """The token count the scheduler's shift takes: the video tokens, with the keyframe
    tokens of ``--condition`` (LTX2ConditionPipeline's whole sequence, C:1771-1777)."""
    r = frame_step(config.model.model_id)
    return g["video_tokens"] + ltx2_conditions.extra_tokens(config, g, r)


def run_layout(model_id: str, height: int, width: int, frames: int) -> dict:
    """``layout`` from ``model_id``'s configs (or the shipped ones)."""
    return layout(*configs(model_id), height, width, frames)


def frame_step(model_id: str) -> int:
    """Frames are ``frame_step * n + 1``: the video VAE's temporal compression."""
    return video_compression(configs(model_id)[1])[0]


def pixel_multiple(model_id: str) -> int:
    """Height and width are multiples of the VAE's spatial compression x the patch."""
    from diffusers import LTX2VideoTransformer3DModel as Model

    cfg, vae_cfg, _ = configs(model_id)
    return video_compression(vae_cfg)[1] * init_value(Model, cfg, "patch_size")


def latent_shape(vae_cfg: dict, height: int, width: int, frames: int,
                 model_id: str | None = None) -> tuple:
    """(1, size) of the packed latents: ``vae_cfg`` with ``model_id``'s transformer and audio
    VAE configs (without ``model_id``, the shipped LTX-2.0 ones)."""
    cfg, _, audio = configs(model_id)
    return (1, layout(cfg, vae_cfg, audio, height, width, frames)["size"])


def token_count(cfg: dict, height: int, width: int, frames: int, model_id: str) -> int:
    """Video tokens per sample (the self-attention's sequence)."""
    _, vae_cfg, audio = configs(model_id)
    return layout(cfg, vae_cfg, audio, height, width, frames)["video_tokens"]


def make_scheduler(scheduler_config, kind: str, flow_shift: float, mu: float | None = None):
    """The run's ``FlowMatchEulerDiscreteScheduler``: the checkpoint's config, with a dynamic
    (exponential) shift replaced by the static shift exp(mu) (see the module docstring)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    cfg = dict(scheduler_config)
    if cfg.get("use_dynamic_shifting"):
        if cfg.get("time_shift_type", "exponential") != "exponential":
            raise GenerationError(f"scheduler time_shift_type={cfg['time_shift_type']!r}: "
                                  "only 'exponential' is supported for LTX-2")
        cfg.update(use_dynamic_shifting=False, shift=math.exp(mu))
    return FlowMatchEulerDiscreteScheduler.from_config(cfg)


def scheduler_sigmas(num_inference_steps: int) -> list:
    """The pipeline's sigmas before the shift: linspace(1, 1/n, n) (P:1344)."""
    return list(np.linspace(1.0, 1 / num_inference_steps, num_inference_steps))


def shift_mu(scheduler_config, video_tokens: int) -> float:
    """``calculate_shift`` of the video token count, as the pipeline calls it (P:1345-1351)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    c = scheduler_config
    return calculate_shift(video_tokens, c.get("base_image_seq_len", 1024),
                           c.get("max_image_seq_len", 4096), c.get("base_shift", 0.95),
                           c.get("max_shift", 2.05))


# ---------------------------------------------------------------------------------------------
# Loading and encoding (CPU)
# ---------------------------------------------------------------------------------------------


def num_heads(cfg: dict) -> int:
    return cfg["num_attention_heads"]


ROPES = ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")


def install_x64_ropes(transformer) -> None:
    """Run each RoPE module's forward under ``jax.enable_x64`` (its float64 frequency grid,
    T:1029, then stays float64 when traced; eager torch is unaffected)."""
    for name in ROPES:
        module = getattr(transformer, name)
        forward = module.forward

        def x64(*args, _forward=forward, **kwargs):
            with jax.enable_x64(True):
                return _forward(*args, **kwargs)

        module.forward = x64


ENCODER_MODULES = pipeline_modules("text_encoder", "connectors")  # Gemma 3, the connectors


def encoder_modules(pipe) -> dict:
    """Gemma 3 and ``LTX2TextConnectors`` (``--text_encoder_device mesh``), the connectors'
    1-D RoPEs (``rope``: a float64 frequency grid, C:125) under ``jax.enable_x64`` as the
    transformer's (traced without it, the embeddings moved by 0.23); eager torch (the CPU
    path) is unaffected."""
    modules = ENCODER_MODULES(pipe)
    connectors = modules.get("connectors")
    for name, module in connectors.named_modules() if connectors is not None else ():
        if name.rsplit(".", 1)[-1] == "rope" and "forward" not in module.__dict__:
            forward = module.forward

            def x64(*args, _forward=forward, **kwargs):
                with jax.enable_x64(True):
                    return _forward(*args, **kwargs)

            module.forward = x64
    return modules


# Each block's attentions other than the video self-attention: the text cross-attentions
# (an additive text mask, 1,024 keys), the audio self-attention (126 tokens) and the
# audio-video cross-attentions (126 audio tokens on one side). Short or masked: XLA.
XLA_ATTENTIONS = ("attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn",
                  "video_to_audio_attn")


def route_short_attentions(transformer) -> None:
    """Trace every block's ``XLA_ATTENTIONS`` under ``forced_attention("xla")`` (forward
    hooks, at run time; diffusers' files are untouched), so only the video self-attention
    (``attn1``) reaches our kernel. The Splash wrapper takes heads or tokens over "sp";
    the audio stream (not sharded over sp, 126 tokens) fits neither rule on every mesh.
    The scope ends even when the attention raises (``always_call``): a raise mid-trace must
    not route every later trace's attention to XLA."""
    for block in transformer.transformer_blocks:
        for name in XLA_ATTENTIONS:
            contexts: list = []

            def enter(_module, _args, _kwargs, contexts=contexts):
                context = forced_attention("xla")
                context.__enter__()
                contexts.append(context)

            def leave(_module, _args, _kwargs, _output, contexts=contexts):
                if contexts:  # empty when an earlier pre-hook raised before ``enter`` ran
                    contexts.pop().__exit__(None, None, None)

            module = getattr(block, name)
            module.register_forward_pre_hook(enter, with_kwargs=True)
            module.register_forward_hook(leave, with_kwargs=True, always_call=True)


def lora_state_dict(tensors: dict) -> dict:
    """diffusers' LTX-2 LoRA key conversion (``LTX2LoraLoaderMixin.lora_state_dict``,
    loaders/lora_pipeline.py:2930-2989 and lora_conversion_utils.py:2170-2216 in 0.42.1):
    diffusers/PEFT keys pass as they are; Lightricks/ComfyUI ``diffusion_model.`` keys become
    ``transformer.`` keys with its renames, ``text_embedding_projection.aggregate_embed`` becomes
    ``connectors.text_proj_in``. What it drops (other prefixes in a Lightricks file, DoRA
    scales), we drop too."""
    from diffusers.loaders.lora_pipeline import LTX2LoraLoaderMixin

    return LTX2LoraLoaderMixin.lora_state_dict(tensors)


def lora_host_components(model_id: str, dtype) -> dict:
    """{"connectors": {name: shape}}: the text connectors (run on the CPU at encode) take
    ``connectors.`` LoRA keys, as diffusers' ``load_lora_weights`` loads them; shapes from a
    meta ``LTX2TextConnectors`` of the checkpoint's config (no weights load)."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    cfg = read_component_config(model_id, "connectors", download=True)
    model = empty_model(LTX2TextConnectors, cfg, dtype)
    return {"connectors": {n: tuple(p.shape) for n, p in model.named_parameters()}}


def empty_transformer(cfg: dict, dtype):
    """``LTX2VideoTransformer3DModel`` of config ``cfg`` with meta parameters in ``dtype``
    (``families.base.empty_model``), its RoPEs under x64 (``install_x64_ropes``), its short
    attentions on XLA (``route_short_attentions``)."""
    from diffusers import LTX2VideoTransformer3DModel

    transformer = empty_model(LTX2VideoTransformer3DModel, cfg, dtype)
    install_x64_ropes(transformer)
    route_short_attentions(transformer)
    return transformer


class AudioVideoDecode(torch.nn.Module):
    """The pipeline's decode as one module (P:1607-1664): packed latents (1, size) float32 ->
    (video (1, 3, F, H, W) float32 in [-1, 1], waveform (1, channels, samples) float32).

    Submodules ``video`` (``AutoencoderKLLTX2Video``), ``audio`` (``AutoencoderKLLTX2Audio``)
    and ``vocoder`` (``LTX2Vocoder``); ``config`` is the video VAE's (what the engine reads
    as ``pipe.vae.config``); ``geometry`` is ``layout``'s dict; ``dtype`` the transformer
    dtype the pipeline casts the final video latents to before de-normalising them.
    """

    def __init__(self, video, audio, vocoder, geometry: dict, dtype):
        super().__init__()
        self.video, self.audio, self.vocoder = video, audio, vocoder
        self.config, self.geometry, self.run_dtype = video.config, geometry, dtype

    def forward(self, latents):
        from diffusers import LTX2Pipeline

        g = self.geometry
        n = g["video_tokens"] * g["video_width"]
        video = latents[:, :n].reshape(1, g["video_tokens"], g["video_width"])
        audio = latents[:, n:n + g["audio_tokens"] * g["audio_width"]].reshape(
            1, g["audio_tokens"], g["audio_width"])  # --condition: keyframe tokens after it
        video = LTX2Pipeline._unpack_latents(video, g["f"], g["h"], g["w"], g["p"], g["pt"])
        audio = LTX2Pipeline._denormalize_audio_latents(audio, self.audio.latents_mean,
                                                        self.audio.latents_std)
        audio = LTX2Pipeline._unpack_audio_latents(audio, g["audio_frames"],
                                                   num_mel_bins=g["mel"])
        video = LTX2Pipeline._denormalize_latents(
            video.to(self.run_dtype), self.video.latents_mean, self.video.latents_std,
            self.video.config.scaling_factor)
        frames = self.video.decode(video.to(self.video.dtype), None, return_dict=False)[0]
        mel = self.audio.decode(audio.to(self.audio.dtype), return_dict=False)[0]
        return frames.float(), self.vocoder(mel).float()


def recipe_line(config) -> str:
    """The log's line on the run's recipe: its name and source (``checkpoint_defaults``;
    "flag" for ``--sigmas``), steps, sigmas before the shift and the step's passes."""
    video, recipe, p = config.video, config.video.recipe or {}, passes(config)
    sigmas = "linspace(1, 1/n)" if video.sigmas is None else ", ".join(map(str, video.sigmas))
    run = [name for name in ("cfg", "stg", "modality") if p[name]] or ["one unguided"]
    return (f"LTX-2 recipe: {recipe.get('name', PIPELINE_DEFAULTS)} (from "
            f"{recipe.get('source', PIPELINE_DEFAULTS)}): {video.num_inference_steps} steps, "
            f"sigmas [{sigmas}], {sample_passes(config)} transformer sample(s) per step "
            f"({' + '.join(run)} pass{'es' if len(run) > 1 else ''})"
            + ("; STG pass " + STG_SKIPPED if stg_asked(config) and not p["stg"] else ""))


def load_pipeline(config, components):
    """Load diffusers' ``LTX2Pipeline`` on CPU from safetensors only. The transformer comes
    with meta weights (``empty_transformer``), streamed later into its device shards; the
    text encoder and connectors use ``config.model.dtype``; the VAEs and the vocoder float32,
    joined as ``pipe.vae`` = ``AudioVideoDecode``. The scheduler is ``make_scheduler``'s for
    the run's video token count.

    Raises:
        GenerationError: the weights could not be found or read, or the video VAE asks for
            timestep conditioning (no LTX-2 checkpoint does; not implemented).
    """
    from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel

    ltx2_conditions.check_run(config)
    model_id, dtype = config.model.model_id, getattr(torch, config.model.dtype)
    skip = {}
    if "text_encoder" not in components:
        skip.update(text_encoder=None, tokenizer=None)
    try:
        skip["transformer"] = empty_transformer(dict(LTX2VideoTransformer3DModel.load_config(
            model_id, subfolder="transformer")), dtype)
        pipe = LTX2Pipeline.from_pretrained(model_id, dtype=dtype, use_safetensors=True, **skip)
    except (OSError, ValueError) as e:
        raise GenerationError(f"--model_id={model_id!r}: could not load weights: "
                              f"{first_line(e)}") from None
    for name in ("vae", "audio_vae", "vocoder"):
        getattr(pipe, name).float().eval()
    if pipe.vae.config.timestep_conditioning:
        raise GenerationError(f"--model_id={model_id!r}: a video VAE with timestep "
                              "conditioning is not supported")
    video = config.video
    geometry = layout(dict(pipe.transformer.config), dict(pipe.vae.config),
                      dict(pipe.audio_vae.config), video.height, video.width, video.frames,
                      video.fps)
    pipe.scheduler = make_scheduler(pipe.scheduler.config, "euler", video.flow_shift,
                                    shift_mu(pipe.scheduler.config, shift_tokens(config, geometry)))
    print(recipe_line(config), flush=True)
    decode = AudioVideoDecode(pipe.vae, pipe.audio_vae, pipe.vocoder, geometry, dtype)
    pipe.__dict__["vae"] = decode  # past DiffusionPipeline.__setattr__'s config bookkeeping
    pipe.geometry = geometry
    ltx2_conditions.encode(pipe, config)  # --condition: prepared and encoded on the host
    # The LoRA's connector deltas, fused into the CPU weights before any prompt is encoded
    # (the transformer's are fused at placement; no connectors: every text was cached, under
    # a key that names the LoRA, engine.files.embeddings_cache).
    if getattr(pipe, "connectors", None) is not None:
        lora.fuse_host(pipe.connectors, config.model.lora, "connectors")
    return pipe


EMBEDDING_NAMES = tuple(f"{side}{name}" for side in ("", "negative_") for name in (
    "prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"))


def encode_prompts(pipe, config) -> dict:
    """Gemma on the prompt (and the negative prompt with CFG or ``--stage encode``), then the
    connectors on [negative, positive] as one batch, as the pipeline runs them (P:1225-1254);
    frees Gemma.

    Returns:
        {"prompt_embeds": (1, 1024, video width), "audio_prompt_embeds": (1, 1024, audio
        width), "prompt_attention_mask": (1, 1024)} in the run dtype, and the same with a
        "negative_" prefix with CFG.
    """
    dtype, cpu = getattr(torch, config.model.dtype), torch.device("cpu")
    cfg = passes(config)["cfg"] or config.run.stage == "encode"
    with torch.no_grad():
        embeds, masks = [], []
        for prompt in ([config.video.negative_prompt or ""] if cfg else []) + [
                config.video.prompt]:
            e, m = pipe._get_gemma_prompt_embeds(prompt, max_sequence_length=TEXT_TOKENS,
                                                 device=cpu, dtype=dtype)
            embeds.append(e)
            masks.append(m)
        video, audio, mask = pipe.connectors(torch.cat(embeds), torch.cat(masks),
                                             padding_side="left")
    pipe.text_encoder = None  # Gemma 3 12B: ~24 GB in bf16; nothing needs it after this
    sides = ("negative_", "") if cfg else ("",)
    out = {}
    for i, side in enumerate(sides):
        out.update({f"{side}prompt_embeds": video[i:i + 1].to(dtype),
                    f"{side}audio_prompt_embeds": audio[i:i + 1].to(dtype),
                    f"{side}prompt_attention_mask": mask[i:i + 1]})
    return out


def prompt_sides(config) -> tuple:
    """The texts a video's embeddings hold: (("", prompt), ("negative_", negative or "")),
    the negative with CFG (video or audio guidance > 1) or ``--stage encode``."""
    v = config.video
    if passes(config)["cfg"] or config.run.stage == "encode":
        return ("", v.prompt), ("negative_", v.negative_prompt or "")
    return (("", v.prompt),)


def encode_text(pipe, config, text: str) -> dict:
    """One text's {"prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask"}: Gemma,
    then the connectors on that text alone (batch 1; each row of the pipeline's [negative,
    positive] batch is computed on its own: tests/test_embedding_cache.py checks bitwise
    equality with ``encode_prompts``); keeps the encoders."""
    dtype, cpu = getattr(torch, config.model.dtype), torch.device("cpu")
    with torch.no_grad():
        e, m = pipe._get_gemma_prompt_embeds(text, max_sequence_length=TEXT_TOKENS,
                                             device=cpu, dtype=dtype)
        video, audio, mask = pipe.connectors(e, m, padding_side="left")
    return {"prompt_embeds": video.to(dtype), "audio_prompt_embeds": audio.to(dtype),
            "prompt_attention_mask": mask}


def check_embeddings(embeds: dict, settings: dict, cfg: dict | None) -> str | None:
    for name, value in embeds.items():
        if tuple(value.shape[:2]) != (1, TEXT_TOKENS):
            return f"{name}: expected shape (1, {TEXT_TOKENS}, ...), got {tuple(value.shape)}"
    return None


def prepare_latents(pipe, config):
    """Initial noise as the pipeline draws it from one CPU generator seeded with
    ``config.video.seed``: the video latents, then the audio latents, packed (P:1277-1341);
    returned as one float32 (1, size) tensor (see the module docstring)."""
    g, video = pipe.geometry, config.video
    generator = torch.Generator("cpu").manual_seed(video.seed)
    cpu = torch.device("cpu")
    if ltx2_conditions.conditions(config):  # LTX2ConditionPipeline's draw
        return ltx2_conditions.initial_latents(pipe, config, g["video_tokens"],
                                               g["audio_frames"])
    v = pipe.prepare_latents(1, pipe.transformer.config.in_channels, video.height, video.width,
                             video.frames, 0.0, torch.float32, cpu, generator)
    a = pipe.prepare_audio_latents(1, pipe.audio_vae.config.latent_channels,
                                   g["audio_frames"], pipe.audio_vae.config.mel_bins, 0.0,
                                   torch.float32, cpu, generator)
    return torch.cat([v.reshape(1, -1), a.reshape(1, -1)], dim=1)


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


SIGMA_TABLE = "sigma_table"
TEXT_INPUTS = ("prompt_embeds", "audio_prompt_embeds", "prompt_attention_mask")


def sigma_table(config) -> torch.Tensor:
    """(1, 2, steps) float32: the run's timesteps and sigmas, as the run's scheduler
    (``make_scheduler``) sets them from ``--sigmas`` (``config.video.sigmas``) or
    ``scheduler_sigmas``: shifted as the pipeline's ``retrieve_timesteps(sigmas, mu)``
    shifts them (P:1345-1370)."""
    video = config.video
    cfg = read_component_config(config.model.model_id, "scheduler",
                                 filename="scheduler_config.json")
    g = run_layout(config.model.model_id, video.height, video.width, video.frames)
    scheduler = make_scheduler(cfg, "euler", 1.0, shift_mu(cfg, shift_tokens(config, g)))
    scheduler.set_timesteps(sigmas=list(video.sigmas) if video.sigmas is not None
                            else scheduler_sigmas(video.num_inference_steps))
    return torch.stack([scheduler.timesteps.float(), scheduler.sigmas[:-1].float()])[None]


def model_inputs(embeds: dict, config) -> dict:
    """The step's inputs, batch [negative, positive] with CFG (P:1232-1234) else [positive]:
    "prompt_embeds" (B, 1024, video text width) and "audio_prompt_embeds" (B, 1024, audio
    text width) in the run dtype, "prompt_attention_mask" (B, 1024), and the sigma table
    (B, 2, steps) float32. The RoPE coordinates are built inside ``forward`` from the
    latent sizes, by the same ``prepare_*_coords`` the pipeline calls."""
    sides = ("negative_", "") if passes(config)["cfg"] else ("",)
    out = {name: torch.cat([embeds[side + name] for side in sides]) for name in TEXT_INPUTS}
    out[SIGMA_TABLE] = sigma_table(config).expand(len(sides), -1, -1).contiguous()
    out.update(ltx2_i2v.model_inputs(embeds, len(sides)))  # --image: frame 0's latents
    out.update(ltx2_conditions.model_inputs(config, len(sides)))  # --condition
    return out


def abstract_model_inputs(cfg: dict, config) -> dict:
    ltx2_conditions.check_run(config)  # the dry run refuses --condition in one line
    b = 2 if passes(config)["cfg"] else 1
    dtype = getattr(jnp, config.model.dtype)
    return {"prompt_embeds": jax.ShapeDtypeStruct((b, TEXT_TOKENS, cfg["caption_channels"]),
                                                  dtype),
            "audio_prompt_embeds": jax.ShapeDtypeStruct(
                (b, TEXT_TOKENS, cfg["caption_channels"]), dtype),
            "prompt_attention_mask": jax.ShapeDtypeStruct((b, TEXT_TOKENS), jnp.int32),
            SIGMA_TABLE: jax.ShapeDtypeStruct((b, 2, config.video.num_inference_steps),
                                              jnp.float32),
            **ltx2_i2v.abstract_model_inputs(config, run_layout(
                config.model.model_id, config.video.height, config.video.width,
                config.video.frames), b)}


def guided(x, outs: dict, sigma, s: dict, prefix: str, blend=None):
    """One modality's guided velocity from its passes' velocities, as the pipeline computes
    it (P:1440-1600): x0 = x - v sigma per pass, the CFG / STG / modality deltas added to the
    positive x0, ``rescale_noise_cfg`` at 0.7, back to a velocity (x - x0) / sigma.

    x: (1, S, C) float32; outs: {"cfg" or "plain": (B, S, C), "stg", "modality": (1, S, C)}
    float32; s: ``scales``; prefix: "" (video) or "audio_"; blend: None or x0 -> x0, applied
    after the rescale (``--condition``: the clean latents by the mask, C:2033-2035)."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    def x0(v):
        return x - v * sigma

    if "cfg" in outs:
        uncond, cond = outs["cfg"].chunk(2)
        pred = x0(cond)
        cfg = (s[prefix + "guidance_scale"] - 1) * (pred - x0(uncond))
    else:
        pred, cfg = x0(outs["plain"]), 0
    stg = s[prefix + "stg_scale"] * (pred - x0(outs["stg"])) if "stg" in outs else 0
    mod = (s[prefix + "modality_scale"] - 1) * (pred - x0(outs["modality"])) \
        if "modality" in outs else 0
    total = pred + cfg + stg + mod
    if GUIDANCE_RESCALE > 0:
        total = rescale_noise_cfg(total, pred, guidance_rescale=GUIDANCE_RESCALE)
    if blend is not None:
        total = blend(total)
    return (x - total) / sigma


def rope_coords(transformer, g: dict, fps: float) -> tuple:
    """The video (1, 3, S_v, 2) and audio (1, 1, S_a, 2) RoPE coordinates as float32 numpy
    arrays, computed eagerly on the host as the pipeline precomputes them (P:1380-1390).
    Traced inside ``forward`` instead, XLA's float32 division by fps (``prepare_video_coords``)
    and the audio grid differ from torch's by an ulp from 3 latent frames on (measured: final
    latents 6e-5 off diffusers' at 17 frames, 2e-6 at 9; 2 steps, tiny checkpoint)."""
    cpu = torch.device("cpu")
    video = transformer.rope.prepare_video_coords(1, g["f"], g["h"], g["w"], cpu, fps=fps)
    audio = transformer.audio_rope.prepare_audio_coords(1, g["audio_frames"], cpu)
    return video.numpy(), audio.numpy()


def step_fn(jm, config):
    """The torch function of one denoising step, to be viewed as JAX and jitted:
    (params, buffers, latents (1, size) float32, timestep (1,) float32, inputs) -> the
    guided velocity (1, size) float32 of both modalities, packed as the latents.

    Runs the passes ``passes(config)`` asks for (diffusers' transformer ``forward``, its
    arguments as the pipeline gives them; the model input and embeddings in the run dtype,
    the timestep float32), then ``guided`` per modality."""
    dtype = getattr(torch, config.model.dtype)
    s, want = scales(config), passes(config)
    video_cfg = config.video
    g = run_layout(config.model.model_id, video_cfg.height, video_cfg.width, video_cfg.frames)
    n = g["video_tokens"] * g["video_width"]
    static = dict(num_frames=g["f"], height=g["h"], width=g["w"], fps=float(video_cfg.fps),
                  audio_num_frames=g["audio_frames"], use_cross_timestep=True,
                  return_dict=False)
    host_coords = rope_coords(jm._model, g, float(video_cfg.fps))
    keyframes = ltx2_conditions.keyframe_coords(config)  # --condition: appended tokens' RoPE
    if keyframes is not None:
        host_coords = (np.concatenate([host_coords[0], keyframes], axis=2), host_coords[1])
    na = g["audio_tokens"] * g["audio_width"]

    def step(params, buffers, latents, timestep, inputs):
        inputs = dict(inputs)
        coords = [interop.torch_view(jnp.asarray(c)) for c in host_coords]  # constants
        table = inputs.pop(SIGMA_TABLE)
        image = inputs.pop(ltx2_i2v.NAME, None)  # --image: frame 0's latents
        clean = inputs.pop(ltx2_conditions.CLEAN, None)  # --condition (its mask per side)
        sigma = table[0, 1, torch.argmin((table[0, 0] - timestep.float()).abs())]
        video = latents[:, :n].reshape(1, g["video_tokens"], g["video_width"]) if clean is None \
            else ltx2_conditions.video_with_keyframes(latents, n, n + na, g["video_width"])
        audio = latents[:, n:n + na].reshape(1, g["audio_tokens"], g["audio_width"])
        if image is not None:
            video = ltx2_i2v.with_first_frame(video, image)

        def call(text, **kw):
            b = text["prompt_embeds"].shape[0]
            times = ltx2_i2v.timesteps(timestep.float().expand(b), image, g["video_tokens"]) \
                if clean is None else ltx2_conditions.timesteps(timestep.float().expand(b),
                                                                text[ltx2_conditions.MASK])
            v, a = jm.functional_call(
                "forward", params, buffers, hidden_states=video.expand(b, -1, -1).to(dtype),
                audio_hidden_states=audio.expand(b, -1, -1).to(dtype),
                encoder_hidden_states=text["prompt_embeds"],
                audio_encoder_hidden_states=text["audio_prompt_embeds"], **times,
                encoder_attention_mask=text["prompt_attention_mask"],
                audio_encoder_attention_mask=text["prompt_attention_mask"],
                video_coords=coords[0].expand(b, -1, -1, -1),
                audio_coords=coords[1].expand(b, -1, -1, -1), **static, **kw)
            return v.float(), a.float()

        positive = {k: v[-1:] for k, v in inputs.items()}
        outs = {"cfg" if want["cfg"] else "plain": call(inputs)}
        if want["stg"]:
            outs["stg"] = call(positive, spatio_temporal_guidance_blocks=list(
                stg_blocks(dict(jm._model.config))))
        if want["modality"]:
            outs["modality"] = call(positive, isolate_modalities=True)
        v = guided(video, {k: o[0] for k, o in outs.items()}, sigma, s, "", None if clean is None
                   else ltx2_conditions.blend(inputs[ltx2_conditions.MASK], clean))
        a = guided(audio, {k: o[1] for k, o in outs.items()}, sigma, s, "audio_")
        if image is not None:
            v = ltx2_i2v.hold_first_frame(v, image)
        s_v = g["video_tokens"]  # --condition: keyframe tokens after the audio
        return torch.cat([v[:, :s_v].reshape(1, -1), a.reshape(1, -1),
                          v[:, s_v:].reshape(1, -1)], dim=1)

    return step


def transformer_flops(cfg: dict, config) -> float:
    """Analytic FLOPs of one step (2 per multiply-add), all its sample-passes
    (``sample_passes``). Per block, with S video / A audio tokens, T = 1024 text tokens,
    D / E the video / audio attention widths: self-attention 8 S D^2 + 4 S^2 D (and audio);
    text cross-attention 4 S D^2 + 4 T D^2 + 4 S T D (and audio); audio-to-video attention
    (width E) 4 S D E + 4 A E^2 + 4 S A E; video-to-audio 4 A E^2 + 4 S D E + 4 S A E; MLPs
    16 S D^2 + 16 A E^2. Embedders and the output layers are left out (< 1%)."""
    video = config.video
    g = run_layout(config.model.model_id, video.height, video.width, video.frames)
    s_, a_, t_ = g["video_tokens"], g["audio_tokens"], TEXT_TOKENS
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    e = cfg["audio_num_attention_heads"] * cfg["audio_attention_head_dim"]

    def stream(n, w):
        return 8 * n * w * w + 4 * n * n * w + 4 * n * w * w + 4 * t_ * w * w \
            + 4 * n * t_ * w + 16 * n * w * w

    cross = 2 * (4 * s_ * d * e + 4 * a_ * e * e + 4 * s_ * a_ * e)
    per_block = stream(s_, d) + stream(a_, e) + cross
    return float(per_block * cfg["num_layers"] * sample_passes(config))


def self_attention_flops(cfg: dict, config) -> float:
    """The 4 S^2 D (video) + 4 A^2 E (audio) self-attention terms of ``transformer_flops``."""
    video = config.video
    g = run_layout(config.model.model_id, video.height, video.width, video.frames)
    d = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    e = cfg["audio_num_attention_heads"] * cfg["audio_attention_head_dim"]
    per_block = 4 * g["video_tokens"] ** 2 * d + 4 * g["audio_tokens"] ** 2 * e
    return float(per_block * cfg["num_layers"] * sample_passes(config))


# Megatron tensor parallelism (torch Linear weights are (out, in)): every attention's q/k/v
# (video and audio self-, text cross- and audio-video cross-attention) and each MLP's up
# projection column-parallel, their out / down projections row-parallel. The q/k RMS norms
# span all heads (their weights replicated); GSPMD adds the reduction they need.
_ATTN = r"transformer_blocks\.\d+\.(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|" \
        r"video_to_audio_attn)"
COLUMN_PARALLEL_RULES = (
    (_ATTN + r"\.(to_q|to_k|to_v)\.weight$", ("tp", None)),
    (_ATTN + r"\.(to_q|to_k|to_v)\.bias$", ("tp",)),
    (r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.0\.proj\.weight$", ("tp", None)),
    (r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.0\.proj\.bias$", ("tp",)),
)
ROW_PARALLEL_RULES = (
    (_ATTN + r"\.to_out\.0\.weight$", (None, "tp")),
    (r"transformer_blocks\.\d+\.(ff|audio_ff)\.net\.2\.weight$", (None, "tp")),
)


def sharding_rules(config) -> tuple:
    if config.layout.replicate_row_parallel:
        return COLUMN_PARALLEL_RULES
    return COLUMN_PARALLEL_RULES + ROW_PARALLEL_RULES


# ---------------------------------------------------------------------------------------------
# Decode: video VAE, audio VAE and vocoder in one program
# ---------------------------------------------------------------------------------------------


def is_vae_decode_weight(name: str) -> bool:
    """Every weight of ``AudioVideoDecode`` but the two VAEs' encoders."""
    return name.split(".")[1:2] != ["encoder"]


def empty_vae(folder: str, config) -> AudioVideoDecode:
    """``AudioVideoDecode`` of ``folder``'s video VAE, audio VAE and vocoder configs with meta
    weights (float32, as ``load_pipeline`` runs them), laid out for ``config``'s video size
    (the final one with ``--sr 2x``; ``layout``) and run dtype: the dry run's decode, the same
    module a run compiles."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    with init_empty_weights():
        parts = [cls.from_config(cls.load_config(folder, subfolder=sub)).float().eval()
                 for cls, sub in ((AutoencoderKLLTX2Video, "vae"),
                                  (AutoencoderKLLTX2Audio, "audio_vae"),
                                  (LTX2Vocoder, "vocoder"))]
    video = config.video if config.upscale is None else config.replace(  # --sr 2x: stage 2's
        height=config.upscale.height, width=config.upscale.width).video
    geometry = layout(checkpoint_config(folder, "transformer", SHIPPED),
                      dict(parts[0].config), dict(parts[1].config), video.height, video.width,
                      video.frames, video.fps)
    return AudioVideoDecode(*parts, geometry, getattr(torch, config.model.dtype))


class LtxDecoder:
    """Packed latents (1, size) float32 -> video (1, 3, F, H, W) float32 in [-1, 1], on
    device; the waveform of the last call is ``audio`` (``engine.files.report.Audio``:
    (channels, samples) float32 on the host and the vocoder's rate in Hz).

    One program (``AudioVideoDecode``), weights replicated (the VAEs and the vocoder are
    conv nets of a few hundred MB; the tiny checkpoint's parity test covers it). Interface of
    ``engine.programs.vae_decode.ChunkedDecoder``: ``compile``, ``memory``, ``spatial``,
    call."""

    def __init__(self, placed: dict, mesh, sample_rate: int):
        self.placed, self.sample_rate = placed, sample_rate
        self.replicated = NamedSharding(mesh, P())
        self.program, self.waveform = None, None

    def spatial(self, shape):
        return None

    def _args(self, latents):
        return (self.placed["params"], self.placed["buffers"], latents)

    def compile(self, latents) -> float:
        t0 = time.perf_counter()
        args, jm = self._args(latents), self.placed["module"]

        def decode(params, buffers, latents):
            return jm.functional_call("forward", params, buffers, latents)

        def lower():
            with forced_attention("xla"):
                return jax.jit(interop.jax_view(decode),
                               out_shardings=(self.replicated, self.replicated)).lower(*args)

        self.program, _ = executables.compile_program("vae_decode_full", lower, args)
        return time.perf_counter() - t0

    def memory(self) -> dict:
        m = self.program.memory_analysis()
        peak = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
        return dict(argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                    temp_bytes=m.temp_size_in_bytes, peak_bytes=peak, programs=1)

    def program_calls(self) -> list:
        """[(the compiled program, 1)]: the dry run's decode floor."""
        return [(self.program, 1)]

    def __call__(self, latents):
        if self.program is None:
            self.compile(latents)
        video, self.waveform = self.program(*self._args(latents))
        return video

    @property
    def audio(self):
        """The last decode's ``Audio`` (host float32 (channels, samples), rate), or None."""
        if self.waveform is None:
            return None
        return Audio(np.asarray(to_host(self.waveform))[0], self.sample_rate)


def vae_decoder(placed: dict, vae, mesh, *, tiling: bool = False, abstract: bool = False,
                fallbacks=None):
    """The LTX-2 decode program (``LtxDecoder``) on ``vae`` = ``AudioVideoDecode``."""
    return LtxDecoder(placed, mesh, int(vae.vocoder.config.output_sampling_rate))


FAMILY = ModelFamily(
    name="LTX-2",
    checkpoint=Checkpoint(
        pipeline_classes=("LTX2Pipeline",),
        shipped_configs=("Lightricks/LTX-2", "rootonchair/LTX-2-19b-distilled"),
        download_hint=DOWNLOAD_HINT,
        required_files=("model_index.json", "transformer/config.json", "vae/config.json",
                        "audio_vae/config.json", "vocoder/config.json",
                        "connectors/config.json"),
        components={"all": ("text_encoder", "transformer", "vae"), "encode": ("text_encoder",),
                    "denoise": ("transformer",), "decode": ("vae",)},
        weight_folders={"text_encoder": ("text_encoder", "connectors"),
                        "transformer": ("transformer",),
                        "vae": ("vae", "audio_vae", "vocoder")},
    ),
    flags=Flags(defaults=DEFAULTS, checkpoint_defaults=checkpoint_defaults, check=check_flags,
                options=OPTIONS, refused=REFUSED, inputs=ltx2_conditions.FLAGS,
                check_inputs=lambda inputs, values, model_id, args=None: (
                    ltx2_conditions.check_inputs(inputs, values, model_id,
                                                 frame_step(model_id), args))),
    sizes=Sizes(frame_step=frame_step, pixel_multiple=pixel_multiple,
                latent_shape=latent_shape, token_count=token_count),
    text=TextEncoding(load_pipeline=load_pipeline, encode_prompts=encode_prompts,
                      prompt_sides=prompt_sides, encode_text=encode_text,
                      embedding_names=EMBEDDING_NAMES, check_embeddings=check_embeddings,
                      prepare_latents=prepare_latents, encoder_modules=encoder_modules),
    transformer=Transformer(
        empty=empty_transformer, num_heads=num_heads, flops=transformer_flops,
        self_attention_flops=self_attention_flops, model_inputs=model_inputs,
        abstract_model_inputs=abstract_model_inputs, step_fn=step_fn,
        timestep_dtype="float32", sharding_rules=sharding_rules, block_stack=BLOCKS,
        layout_batch=layout_batch, lora_state_dict=lora_state_dict,
        lora_host_components=lora_host_components),
    vae=VaePrograms(empty=empty_vae, is_decode_weight=is_vae_decode_weight,
                    decoder=vae_decoder),
    image=ImageConditioning(mode=ltx2_i2v.image_mode, encode=ltx2_i2v.encode_image,
                            names=(ltx2_i2v.NAME,), finish_latents=ltx2_i2v.finish),
    scheduler=Scheduling(default_flow_shift=default_flow_shift, sigmas=scheduler_sigmas,
                         named_sigmas=named_sigmas),
)
