"""HunyuanVideo-1.5's super-resolution (SR) stage: its building blocks, not yet a run.

Sources (read, not copied), Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7 ("Update
README_CN.md"); diffusers has none of this stage:

* ``hyvideo/models/transformers/modules/upsample.py:55-169``: the two latent upsamplers,
  ``SRTo720pUpsampler`` (causal-conv residual blocks) and ``SRTo1080pUpsampler`` (ResNet
  blocks of the VAE's kind), built from ``hyvideo/models/autoencoders/hunyuanvideo_15_vae.py``'s
  ``CausalConv3d`` (:129-160), ``RMS_norm`` (:110-126) and ``ResnetBlock`` (:219-248).
* ``hyvideo/pipelines/hunyuan_video_sr_pipeline.py``: the bucket map from the low-res to the
  high-res size (:46-72, :243-248), the bilinear resize and the upsampler (:337-344), noise at
  strength 0.7 (:142-146, :346-347), the extra input channels with their mask channel beside
  the I2V/T2V condition (:148-162, :349-358) and their zeroing once t < 700 (:373-377).
* ``hyvideo/pipelines/hunyuan_video_pipeline.py:1416-1424``: where the SR transformer and the
  upsampler are read from (``transformer/<version>``, ``upsampler/<version>``; the upsampler
  class chosen by "720p" in the version's name).
* ``hyvideo/commons/__init__.py:108-140``: ``SR_PIPELINE_CONFIGS`` (steps, shift, guidance,
  base resolution) and ``TRANSFORMER_VERSION_TO_SR_VERSION``.

The upsamplers are diffusers ``ModelMixin``/``ConfigMixin`` classes with the official class
names, constructor arguments and parameter names, so the official ``config.json`` and
``diffusion_pytorch_model.safetensors`` load by name. They reuse diffusers' own HunyuanVideo-1.5
VAE parts (``HunyuanVideo15CausalConv3d``: replicate padding, two frames before the first in
time, one on each side in space; ``HunyuanVideo15RMS_norm``), which have the official modules'
parameter names (``conv``, ``gamma``). The official ResNet block differs from diffusers' only in
naming its 1x1 shortcut ``nin_shortcut`` (diffusers: ``conv_shortcut``), hence ``_ResnetBlock``.

The conditioning functions are torch code that runs eagerly or under torchax's ``jit``; shapes
are (batch, channels, latent frames, latent height, latent width).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import (
    HunyuanVideo15CausalConv3d,
    HunyuanVideo15RMS_norm,
)
from diffusers.models.modeling_utils import ModelMixin
from diffusers.pipelines.hunyuan_video1_5.image_processor import generate_crop_size_list
from safetensors.torch import load_file

from engine.run.errors import UsageError
from families.hunyuan import scheduler_sigmas, vae_compression, vae_config

SOURCE = "Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7"
# hunyuan_video_sr_pipeline.py:346: the low-res latents are noised to t = 700 of 1000, and
# the transformer sees them only while t >= 700 (:374).
LQ_STRENGTH = 0.7
TRAIN_TIMESTEPS = 1000
# hunyuan_video_sr_pipeline.py:74-78 (SizeMap): a resolution's bucket base size in pixels.
BUCKET_BASE = {"480p": 640, "720p": 960, "1080p": 1440}
WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"  # diffusers' ModelMixin file names
CONFIG_NAME = "config.json"
PICKLE_NAMES = ("diffusion_pytorch_model.bin", "diffusion_pytorch_model.pt", "model.bin")


@dataclasses.dataclass(frozen=True)
class SrConfig:
    """One entry of the official ``SR_PIPELINE_CONFIGS`` (commons/__init__.py:109-124).

    ``steps`` is the default number of SR denoising steps, ``flow_shift`` the shift of its
    own flow-matching schedule, ``guidance_scale`` 1.0 (CFG-distilled: one transformer pass
    per step), ``base`` the resolution of the first stage it upsamples from, ``target`` the
    resolution it produces. ``embedded_guidance_scale`` is None for both (no guidance
    embedding input).
    """

    version: str
    base: str
    target: str
    steps: int
    flow_shift: float
    guidance_scale: float

    @property
    def transformer_folder(self) -> str:
        """Where the SR transformer lives in the official checkpoint tree
        (hunyuan_video_pipeline.py:1418)."""
        return f"transformer/{self.version}"

    @property
    def upsampler_folder(self) -> str:
        """Where its latent upsampler lives (hunyuan_video_pipeline.py:1423)."""
        return f"upsampler/{self.version}"


SR_CONFIGS = {
    "720p_sr_distilled": SrConfig("720p_sr_distilled", base="480p", target="720p", steps=6,
                                  flow_shift=2.0, guidance_scale=1.0),
    "1080p_sr_distilled": SrConfig("1080p_sr_distilled", base="720p", target="1080p", steps=8,
                                   flow_shift=2.0, guidance_scale=1.0),
}
# TRANSFORMER_VERSION_TO_SR_VERSION (commons/__init__.py:126-140) by the base model's
# resolution: every 480p variant goes to 720p, every 720p one to 1080p.
SR_FOR_BASE = {"480p": "720p_sr_distilled", "720p": "1080p_sr_distilled"}


class _ResidualCausalBlock(torch.nn.Module):
    """x + conv(silu(conv(silu(conv(x))))), three causal 3x3x3 convs (upsample.py:55-67).
    Parameter names ``block.{0,2,4}.conv.*``, as the official ``SRResidualCausalBlock3D``."""

    def __init__(self, channels: int):
        super().__init__()
        self.block = torch.nn.Sequential(
            HunyuanVideo15CausalConv3d(channels, channels, kernel_size=3), torch.nn.SiLU(),
            HunyuanVideo15CausalConv3d(channels, channels, kernel_size=3), torch.nn.SiLU(),
            HunyuanVideo15CausalConv3d(channels, channels, kernel_size=3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.block(x)


class _ResnetBlock(torch.nn.Module):
    """The official VAE's ``ResnetBlock`` (hunyuanvideo_15_vae.py:219-248): RMS norm, SiLU,
    causal conv, twice, plus a 1x1x1 ``nin_shortcut`` when the width changes."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = HunyuanVideo15RMS_norm(in_channels, images=False)
        self.conv1 = HunyuanVideo15CausalConv3d(in_channels, out_channels, kernel_size=3)
        self.norm2 = HunyuanVideo15RMS_norm(out_channels, images=False)
        self.conv2 = HunyuanVideo15CausalConv3d(out_channels, out_channels, kernel_size=3)
        self.nin_shortcut = (torch.nn.Conv3d(in_channels, out_channels, kernel_size=1)
                             if in_channels != out_channels else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class SRTo720pUpsampler(ModelMixin, ConfigMixin):
    """480p -> 720p latent refiner (upsample.py:70-97): a causal conv in, ``num_blocks``
    residual blocks of three causal convs, a causal conv out; ``x`` added back when
    ``global_residual`` and the shapes agree. It does not change the grid: the caller resizes
    first (``resize_to_grid``).

    forward: (B, in_channels, F, H, W) -> (B, out_channels, F, H, W), float32 as the
    official pipeline runs it (hunyuan_video_sr_pipeline.py:343). Causal in time: output
    frame f depends on input frames <= f only.
    """

    @register_to_config
    def __init__(self, in_channels: int, out_channels: int, hidden_channels: int | None = None,
                 num_blocks: int = 6, global_residual: bool = False):
        super().__init__()
        hidden = 64 if hidden_channels is None else hidden_channels
        self.in_conv = HunyuanVideo15CausalConv3d(in_channels, hidden, kernel_size=3)
        self.blocks = torch.nn.ModuleList(_ResidualCausalBlock(hidden) for _ in range(num_blocks))
        self.out_conv = HunyuanVideo15CausalConv3d(hidden, out_channels, kernel_size=3)
        self.global_residual = bool(global_residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.in_conv(x)
        for block in self.blocks:
            y = block(y)
        y = self.out_conv(y)
        return y + x if self.global_residual and y.shape == x.shape else y


class SRTo1080pUpsampler(ModelMixin, ConfigMixin):
    """720p -> 1080p latent refiner (upsample.py:100-169): ``conv_in`` plus the input
    repeated channel-wise to ``block_out_channels[0]``, then per level ``num_res_blocks + 1``
    ResNet blocks, RMS norm, SiLU, ``conv_out``. ``is_residual`` is stored, unused (as in
    the official forward). The official levels have no ``upsample`` module, so the grid is
    unchanged; ``target_shape`` (H, W) resizes first as ``resize_to_grid`` does.

    forward: (B, z_channels, F, h, w) -> (B, out_channels, F, H, W), float32; causal in time.
    """

    @register_to_config
    def __init__(self, z_channels: int, out_channels: int, block_out_channels: tuple,
                 num_res_blocks: int = 2, is_residual: bool = False):
        super().__init__()
        self.z_channels, self.block_out_channels = z_channels, tuple(block_out_channels)
        width = self.block_out_channels[0]
        self.conv_in = HunyuanVideo15CausalConv3d(z_channels, width, kernel_size=3)
        self.up = torch.nn.ModuleList()
        for channels in self.block_out_channels:
            level = torch.nn.Module()
            level.block = torch.nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                level.block.append(_ResnetBlock(width, channels))
                width = channels
            self.up.append(level)
        self.norm_out = HunyuanVideo15RMS_norm(width, images=False)
        self.conv_out = HunyuanVideo15CausalConv3d(width, out_channels, kernel_size=3)

    def forward(self, z: torch.Tensor, target_shape: tuple | None = None) -> torch.Tensor:
        if target_shape is not None and tuple(z.shape[-2:]) != tuple(target_shape):
            z = resize_to_grid(z, *target_shape)
        repeats = self.block_out_channels[0] // self.z_channels
        h = self.conv_in(z) + z.repeat_interleave(repeats, dim=1)
        for level in self.up:
            for block in level.block:
                h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


UPSAMPLER_CLASSES = {cls.__name__: cls for cls in (SRTo720pUpsampler, SRTo1080pUpsampler)}


def upsampler_class(version: str, config: dict):
    """The class of ``upsampler/<version>``: the official rule ("720p" in the version's name:
    ``SRTo720pUpsampler``, else ``SRTo1080pUpsampler``; hunyuan_video_pipeline.py:1422),
    which the config's ``_class_name`` must agree with when it has one.

    Raises:
        UsageError: the config names another class.
    """
    cls = SRTo720pUpsampler if "720p" in version else SRTo1080pUpsampler
    named = config.get("_class_name")
    if named is not None and named != cls.__name__:
        raise UsageError(f"upsampler/{version}/{CONFIG_NAME}: _class_name={named!r}, expected "
                         f"{cls.__name__!r} for {version!r} (official rule: '720p' in the name)")
    return cls


def load_upsampler(root: str, version: str) -> torch.nn.Module:
    """The latent upsampler of an official checkpoint tree, float32, in eval mode.

    ``root`` is the folder holding ``upsampler/<version>/`` with ``config.json`` (diffusers
    ``ConfigMixin`` format) and ``diffusion_pytorch_model.safetensors``; ``version`` is a key
    of ``SR_CONFIGS``. Every parameter must be in the file and every tensor of the file must
    be a parameter (strict, by name).

    Raises:
        UsageError: unknown version, missing folder or file, pickle weights only (refused:
            safetensors only), a config naming another class, or names/shapes that do not
            match (one line each).
    """
    if version not in SR_CONFIGS:
        raise UsageError(f"SR version={version!r}: expected one of {sorted(SR_CONFIGS)}")
    folder = os.path.join(root, "upsampler", version)
    weights, config_path = os.path.join(folder, WEIGHTS_NAME), os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(weights):
        pickled = [n for n in PICKLE_NAMES if os.path.isfile(os.path.join(folder, n))]
        rule = (f"only pickle weights ({pickled[0]}); refusing them: safetensors only" if pickled
                else f"no {WEIGHTS_NAME}")
        raise UsageError(f"upsampler folder={folder!r}: {rule}")
    if not os.path.isfile(config_path):
        raise UsageError(f"upsampler folder={folder!r}: no {CONFIG_NAME}")
    with open(config_path) as f:
        config = json.load(f)
    cls = upsampler_class(version, config)
    model = cls.from_config(config)
    try:
        model.load_state_dict(load_file(weights), strict=True)
    except RuntimeError as error:  # torch lists every missing/unexpected/mis-shaped name
        detail = " ".join(str(error).split())
        raise UsageError(f"upsampler weights={weights!r}: do not match {cls.__name__}: "
                         f"{detail[:300]}") from None
    return model.float().eval()


def sr_size(lr_height: int, lr_width: int, version: str, lr_base: int | None = None,
            hr_base: int | None = None, *, stride: int | None = None) -> tuple[int, int]:
    """(height, width) in pixels of the SR video for a first stage of this size.

    The official ``BucketMap`` (hunyuan_video_sr_pipeline.py:46-72, :243-248): the low-res
    size must be a bucket of the base resolution (16-pixel steps); it maps to the bucket of
    the target resolution whose width/height ratio is nearest its own (the first such bucket
    on a tie). E.g. 720 x 1280 -> 1072 x 1904 for ``1080p_sr_distilled``. ``lr_base`` /
    ``hr_base``: the bucket base sizes in pixels (default: the official ``SizeMap`` of the
    version's base and target resolutions; the run passes the two transformers'
    ``target_size``, which equal those for the released checkpoints and let a tiny one run).
    ``stride``: the buckets' pixel step, the first stage VAE's spatial compression (as
    diffusers' ``HunyuanVideo15ImageProcessor`` steps its buckets); None: the released
    checkpoints' VAE (the shipped config).

    Raises:
        UsageError: the size is not a bucket of the base resolution (the official code
            raises ValueError there too).
    """
    config = SR_CONFIGS[version]
    stride = vae_compression(vae_config(None))[1] if stride is None else stride
    lr_base = BUCKET_BASE[config.base] if lr_base is None else lr_base
    hr_base = BUCKET_BASE[config.target] if hr_base is None else hr_base
    lr_buckets = generate_crop_size_list(base_size=lr_base, patch_size=stride)
    if (lr_width, lr_height) not in lr_buckets:
        raise UsageError(f"--height/--width={lr_height}x{lr_width}: not a {config.base} bucket "
                         f"size, which {version} needs (e.g. 480x848 for 480p, 720x1280 for "
                         "720p)")
    hr_buckets = generate_crop_size_list(base_size=hr_base, patch_size=stride)
    ratios = np.array([w / h for w, h in hr_buckets])
    width, height = hr_buckets[int(np.abs(ratios - lr_width / lr_height).argmin())]
    return height, width


def resize_to_grid(lq: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """Each latent frame resized to the high-res latent grid, bilinear, ``align_corners=False``
    (hunyuan_video_sr_pipeline.py:337-341; also ``SRTo1080pUpsampler.forward``).

    (B, C, F, h, w) -> (B, C, F, height, width), the input's dtype.
    """
    b, c, f, h, w = lq.shape
    frames = lq.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
    frames = F.interpolate(frames, size=(height, width), mode="bilinear", align_corners=False)
    return frames.reshape(b, f, c, height, width).permute(0, 2, 1, 3, 4)


def upsample_lq(upsampler: torch.nn.Module, lq: torch.Tensor, height: int,
                width: int) -> torch.Tensor:
    """The first stage's latents on the SR latent grid, refined by the upsampler in float32
    (hunyuan_video_sr_pipeline.py:337-344): (B, C, F, h, w) -> (B, C, F, height, width),
    float32."""
    with torch.no_grad():
        return upsampler(resize_to_grid(lq, height, width).float())


def noise_lq(lq: torch.Tensor, noise: torch.Tensor, strength: float = LQ_STRENGTH) -> torch.Tensor:
    """``add_noise_to_lq`` (hunyuan_video_sr_pipeline.py:142-146): (1 - s) * lq + s * noise
    with s = t / 1000, t = 1000 * strength as a float32 tensor, so the values equal the
    official ones bit for bit. ``noise`` is standard normal, the shape of ``lq`` (the official
    code draws it with ``torch.randn_like`` from torch's global generator, not the run's seed).

    (B, C, F, H, W) -> same shape, float32 (the official float32 t promotes a bf16 ``lq``).
    """
    t = (torch.tensor([float(TRAIN_TIMESTEPS)]) * strength).reshape(1, 1, 1, 1, 1)
    return (1 - t / TRAIN_TIMESTEPS) * lq + (t / TRAIN_TIMESTEPS) * noise


def sr_condition(condition: torch.Tensor, lq: torch.Tensor) -> torch.Tensor:
    """The SR transformer's extra input channels (hunyuan_video_sr_pipeline.py:148-162,
    :349-353): the I2V/T2V ``condition`` (C latent channels + 1 mask channel: the first frame's
    latents and mask 1 on frame 0 for I2V, zeros for T2V), then the noised low-res latents
    ``lq`` and a mask channel of ones.

    condition (B, C + 1, F, H, W), lq (B, C, F, H, W) -> (B, 2C + 2, F, H, W), the promoted
    dtype of the two. The model input is [latents (C), this (2C + 2)]: 98 channels at C = 32.
    """
    ones = torch.ones_like(lq[:, :1])
    return torch.cat([condition, lq, ones], dim=1)


def without_lq(condition: torch.Tensor, latent_channels: int) -> torch.Tensor:
    """``condition`` with the low-res latents and their mask zeroed, the I2V/T2V part kept
    (hunyuan_video_sr_pipeline.py:355-358: channels C + 1 .. 2C + 1).

    (B, 2C + 2, F, H, W) -> same shape and dtype.
    """
    keep = latent_channels + 1
    return torch.cat([condition[:, :keep], torch.zeros_like(condition[:, keep:])], dim=1)


def select_condition(timestep: torch.Tensor, condition: torch.Tensor,
                     zeroed: torch.Tensor, strength: float = LQ_STRENGTH) -> torch.Tensor:
    """The condition of one step (hunyuan_video_sr_pipeline.py:373-375): ``zeroed`` once the
    step's timestep (0..1000 scale) is below 1000 * strength (700), else ``condition``.

    A ``torch.where`` rather than a Python ``if``, so it traces under ``jit`` with the
    timestep an array. timestep: a scalar or (1,) tensor; condition, zeroed: same shape.
    """
    return torch.where(timestep.reshape(()) < TRAIN_TIMESTEPS * strength, zeroed, condition)


def sr_timesteps(version: str, steps: int | None = None) -> np.ndarray:
    """The SR stage's timesteps (0..1000 scale), its ``steps`` (default: the version's) on a
    flow-matching schedule shifted by its ``flow_shift``: diffusers'
    ``FlowMatchEulerDiscreteScheduler`` fed ``HunyuanVideo15Pipeline``'s sigmas, which give
    the official ``FlowMatchDiscreteScheduler``'s values (sigmas linspace(1, 0, n + 1),
    shift * s / (1 + (shift - 1) * s), times 1000; scheduling_flow_match_discrete.py:146-177).
    E.g. 6 steps at shift 2: 1000, 909.1, 800, 666.7, 500, 285.7 (the first 3 see the low-res
    latents). float32, (steps,)."""
    config = SR_CONFIGS[version]
    n = config.steps if steps is None else steps
    scheduler = FlowMatchEulerDiscreteScheduler(shift=config.flow_shift)
    scheduler.set_timesteps(sigmas=scheduler_sigmas(n))
    return scheduler.timesteps.numpy().astype(np.float32)
