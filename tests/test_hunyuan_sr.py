"""HunyuanVideo-1.5's super-resolution building blocks (families/hunyuan_sr.py) against eager
references written here from the official code's math, Tencent-Hunyuan/HunyuanVideo-1.5 @
60783e7 (file:line cited at each reference). Weights are random and tiny; float32.
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.run.errors import UsageError
from families import hunyuan_sr as sr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
C = 4  # latent channels of the hand-built modules


# --- references, written from the official code ---------------------------------------------

def ref_causal_conv(x, sd, name):
    """hunyuanvideo_15_vae.py:129-160 CausalConv3d, kernel 3: replicate padding of 1 on each
    side in H and W and 2 before the first frame in T, then an unpadded Conv3d."""
    x = F.pad(x, (1, 1, 1, 1, 2, 0), mode="replicate")
    return F.conv3d(x, sd[f"{name}.conv.weight"], sd[f"{name}.conv.bias"])


def ref_rms(x, gamma):
    """hunyuanvideo_15_vae.py:110-126 RMS_norm, channel first: normalize(x, dim=1) *
    sqrt(C) * gamma."""
    return F.normalize(x, dim=1) * x.shape[1] ** 0.5 * gamma


def ref_720p(x, sd, num_blocks, global_residual):
    """upsample.py:55-97: in_conv, blocks of three convs with SiLU between and a skip,
    out_conv, and x added back when global_residual and the shapes agree."""
    y = ref_causal_conv(x, sd, "in_conv")
    for i in range(num_blocks):
        h = F.silu(ref_causal_conv(y, sd, f"blocks.{i}.block.0"))
        h = F.silu(ref_causal_conv(h, sd, f"blocks.{i}.block.2"))
        y = y + ref_causal_conv(h, sd, f"blocks.{i}.block.4")
    y = ref_causal_conv(y, sd, "out_conv")
    return y + x if global_residual and y.shape == x.shape else y


def ref_1080p(z, sd, block_out_channels, num_res_blocks):
    """upsample.py:137-169 with ResnetBlock (hunyuanvideo_15_vae.py:219-248)."""
    h = ref_causal_conv(z, sd, "conv_in") + z.repeat_interleave(
        block_out_channels[0] // z.shape[1], dim=1)
    for level in range(len(block_out_channels)):
        for j in range(num_res_blocks + 1):
            p = f"up.{level}.block.{j}"
            r = ref_causal_conv(F.silu(ref_rms(h, sd[f"{p}.norm1.gamma"])), sd, f"{p}.conv1")
            r = ref_causal_conv(F.silu(ref_rms(r, sd[f"{p}.norm2.gamma"])), sd, f"{p}.conv2")
            if f"{p}.nin_shortcut.weight" in sd:
                h = F.conv3d(h, sd[f"{p}.nin_shortcut.weight"], sd[f"{p}.nin_shortcut.bias"])
            h = h + r
    return ref_causal_conv(F.silu(ref_rms(h, sd["norm_out.gamma"])), sd, "conv_out")


def ref_prepare_cond(task, image_cond, shape):
    """hunyuan_video_pipeline.py:734-774 (_prepare_cond_latents, get_task_mask): I2V repeats
    the image latents over frames and zeroes frames >= 1, mask 1 on frame 0; T2V all zeros."""
    b, c, f, h, w = shape
    if task == "i2v":
        lat = image_cond.repeat(1, 1, f, 1, 1)
        lat[:, :, 1:] = 0.0
    else:
        lat = torch.zeros(shape)
    mask = torch.zeros(b, 1, f, h, w)
    if task == "i2v":
        mask[:, :, 0] = 1.0
    return torch.concat([lat, mask], dim=1)


def ref_official_timesteps(steps, shift):
    """scheduling_flow_match_discrete.py:146-177: linspace(1, 0, n + 1), sd3 shift, x1000."""
    s = torch.linspace(1, 0, steps + 1)
    s = (shift * s) / (1 + (shift - 1) * s)
    return (s[:-1] * 1000).to(torch.float32)


def ref_crop_sizes(base, patch=16, max_ratio=4.0):
    """hyvideo/utils/data_utils.py:61-73 generate_crop_size_list, (w, h) pairs."""
    n = round((base / patch) ** 2)
    out, wp, hp = [], n, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= max_ratio:
            out.append((wp * patch, hp * patch))
        if (hp + 1) * wp <= n:
            hp += 1
        else:
            wp -= 1
    return out


def ref_bucket(lr_w, lr_h, lr_base, hr_base):
    """hunyuan_video_sr_pipeline.py:46-72 BucketMap: the HR bucket of nearest w/h ratio."""
    hr = ref_crop_sizes(hr_base)
    ratios = np.array([float(w) / float(h) for w, h in hr])
    return hr[np.abs(ratios - float(lr_w) / float(lr_h)).argmin()]


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 if name.endswith("gamma") else 0) + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


# --- the upsamplers --------------------------------------------------------------------------

@pytest.mark.parametrize("global_residual", [True, False])
def test_720p_upsampler_equals_reference_and_is_causal(global_residual):
    model = _randomize(sr.SRTo720pUpsampler(C, C, hidden_channels=6, num_blocks=2,
                                            global_residual=global_residual), 1)
    x = torch.randn(1, C, 4, 5, 7, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        y = model(x)
        assert y.shape == (1, C, 4, 5, 7)
        ref = ref_720p(x, model.state_dict(), 2, global_residual)
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
        x2 = x.clone()
        x2[:, :, 2] += 1.0  # a later frame changes: earlier output frames must not
        y2 = model(x2)
    torch.testing.assert_close(y2[:, :, :2], y[:, :, :2], rtol=0, atol=0)
    assert (y2[:, :, 2:] - y[:, :, 2:]).abs().amax() > 1e-3


def test_1080p_upsampler_equals_reference_resizes_and_is_causal():
    blocks = (2 * C, 3)  # channel repeat x2, then a width change (nin_shortcut)
    model = _randomize(sr.SRTo1080pUpsampler(C, C, block_out_channels=blocks,
                                             num_res_blocks=1), 3)
    assert any("nin_shortcut" in k for k in model.state_dict())
    z = torch.randn(1, C, 3, 4, 6, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y = model(z)
        torch.testing.assert_close(y, ref_1080p(z, model.state_dict(), blocks, 1),
                                   rtol=1e-5, atol=1e-5)
        big = model(z, target_shape=(6, 9))  # upsample.py:144-148: resize, then the blocks
        assert big.shape == (1, C, 3, 6, 9)
        torch.testing.assert_close(big, model(sr.resize_to_grid(z, 6, 9)), rtol=0, atol=0)
        z2 = z.clone()
        z2[:, :, 1] -= 1.0
        y2 = model(z2)
    torch.testing.assert_close(y2[:, :, :1], y[:, :, :1], rtol=0, atol=0)
    assert (y2[:, :, 1:] - y[:, :, 1:]).abs().amax() > 1e-3


# --- the loader and the tiny official layout --------------------------------------------------

@pytest.fixture(scope="module")
def tiny_sr(tmp_path_factory):
    """tools/make_tiny_hunyuan_sr.py run in this process (its imports are the test's)."""
    spec = importlib.util.spec_from_file_location(
        "make_tiny_hunyuan_sr", os.path.join(ROOT, "tools", "make_tiny_hunyuan_sr.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = str(tmp_path_factory.mktemp("tiny-sr") / "tiny-sr")
    assert tool.main(["--output", out, "--seed", "5"]) == 0
    return out


@pytest.mark.parametrize("version,cls", [("720p_sr_distilled", sr.SRTo720pUpsampler),
                                         ("1080p_sr_distilled", sr.SRTo1080pUpsampler)])
def test_loader_round_trip(tiny_sr, version, cls):
    folder = os.path.join(tiny_sr, "upsampler", version)
    assert sorted(os.listdir(folder)) == ["config.json", "diffusion_pytorch_model.safetensors"]
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f)["_class_name"] == cls.__name__
    model = sr.load_upsampler(tiny_sr, version)
    assert type(model) is cls and not model.training
    stored = load_file(os.path.join(folder, "diffusion_pytorch_model.safetensors"))
    state = model.state_dict()
    assert sorted(state) == sorted(stored)
    for name, value in stored.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)
    x = torch.randn(1, 32, 2, 3, 4, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        y = model(x)
    if cls is sr.SRTo720pUpsampler:
        ref = ref_720p(x, stored, 2, True)
    else:
        ref = ref_1080p(x, stored, (64, 32), 1)
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)


def _copy_layout(src, dst, version):
    folder = os.path.join(dst, "upsampler", version)
    os.makedirs(folder)
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        with open(os.path.join(src, "upsampler", version, name), "rb") as f, \
                open(os.path.join(folder, name), "wb") as g:
            g.write(f.read())
    return folder


def test_loader_refusals(tiny_sr, tmp_path):
    v = "720p_sr_distilled"
    with pytest.raises(UsageError, match="expected one of"):
        sr.load_upsampler(tiny_sr, "540p_sr")
    pickled = tmp_path / "pickled" / "upsampler" / v
    pickled.mkdir(parents=True)
    (pickled / "diffusion_pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UsageError, match="refusing them: safetensors only") as err:
        sr.load_upsampler(str(tmp_path / "pickled"), v)
    assert "\n" not in str(err.value)
    folder = _copy_layout(tiny_sr, str(tmp_path / "partial"), v)
    weights = os.path.join(folder, "diffusion_pytorch_model.safetensors")
    tensors = load_file(weights)
    del tensors["out_conv.conv.bias"]
    save_file(tensors, weights)
    with pytest.raises(UsageError, match="out_conv.conv.bias") as err:
        sr.load_upsampler(str(tmp_path / "partial"), v)
    assert "\n" not in str(err.value)
    folder = _copy_layout(tiny_sr, str(tmp_path / "renamed"), v)
    config = os.path.join(folder, "config.json")
    with open(config) as f:
        cfg = json.load(f)
    with open(config, "w") as f:
        json.dump({**cfg, "_class_name": "SRTo1080pUpsampler"}, f)
    with pytest.raises(UsageError, match="_class_name='SRTo1080pUpsampler'"):
        sr.load_upsampler(str(tmp_path / "renamed"), v)


# --- the conditioning ------------------------------------------------------------------------

def test_resize_is_bilinear_half_pixel():
    """hunyuan_video_sr_pipeline.py:339-341: per frame, bilinear, align_corners=False, i.e.
    source coordinate (i + 0.5) * in / out - 0.5, clamped at 0 (checked in numpy)."""
    lq = torch.randn(2, 3, 2, 3, 4, generator=torch.Generator().manual_seed(7))
    out = sr.resize_to_grid(lq, 5, 7).numpy()

    def taps(n_out, n_in):
        src = np.maximum((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0)
        lo = np.minimum(np.floor(src).astype(int), n_in - 1)
        return lo, np.minimum(lo + 1, n_in - 1), src - lo

    (y0, y1, wy), (x0, x1, wx) = taps(5, 3), taps(7, 4)
    a = lq.numpy()
    rows = a[..., y0, :] * (1 - wy)[:, None] + a[..., y1, :] * wy[:, None]
    ref = rows[..., x0] * (1 - wx) + rows[..., x1] * wx
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_condition_noise_concat_and_switch_equal_official(task):
    """The SR stage's extra inputs, step by step, as hunyuan_video_sr_pipeline.py:337-377
    builds them, with the official 6-step shift-2 schedule."""
    g = torch.Generator().manual_seed(8)
    b, c, f, h, w = 1, C, 3, 6, 8
    upsampler = _randomize(sr.SRTo720pUpsampler(c, c, hidden_channels=5, num_blocks=1), 9)
    lq, noise = torch.randn(b, c, f, 3, 4, generator=g), torch.randn(b, c, f, h, w, generator=g)
    image_cond = torch.randn(b, c, 1, h, w, generator=g)
    # the official steps (:337-358), literally
    up = F.interpolate(lq.permute(0, 2, 1, 3, 4).reshape(b * f, c, 3, 4), size=(h, w),
                       mode="bilinear", align_corners=False)
    up = up.reshape(b, f, c, h, w).permute(0, 2, 1, 3, 4)
    up = ref_720p(up, upsampler.state_dict(), 1, False)
    t = (torch.tensor([1000.0]) * 0.7).reshape(1, 1, 1, 1, 1)  # :142-146
    noised = (1 - t / 1000.0) * up + (t / 1000.0) * noise
    base = ref_prepare_cond(task, image_cond, (b, c, f, h, w))
    condition = torch.concat([base, torch.concat([noised, torch.ones(b, 1, f, h, w)], 1)], 1)
    zero = condition.clone()
    zero[:, c + 1: 2 * c + 1] = torch.zeros_like(noised)
    zero[:, 2 * c + 1] = 0
    # ours
    ours_up = sr.upsample_lq(upsampler, lq, h, w)
    torch.testing.assert_close(ours_up, up, rtol=1e-5, atol=1e-5)
    ours_noised = sr.noise_lq(up, noise)
    torch.testing.assert_close(ours_noised, noised, rtol=0, atol=0)  # same float32 formula
    torch.testing.assert_close(ours_noised, 0.3 * up + 0.7 * noise, rtol=1e-6, atol=1e-6)
    ours_cond = sr.sr_condition(base, ours_noised)
    assert ours_cond.shape[1] == 2 * c + 2
    torch.testing.assert_close(ours_cond, condition, rtol=0, atol=0)
    ours_zero = sr.without_lq(ours_cond, c)
    torch.testing.assert_close(ours_zero, zero, rtol=0, atol=0)
    # :373-377: the condition is replaced once t < 700 and stays replaced
    official_t = ref_official_timesteps(6, 2.0)
    ours_t = sr.sr_timesteps("720p_sr_distilled")
    np.testing.assert_allclose(ours_t, official_t.numpy(), rtol=1e-5)
    current, seen = condition, []
    for step_t, our_t in zip(official_t, ours_t, strict=True):
        if step_t < 1000 * 0.7:
            current = zero
        picked = sr.select_condition(torch.tensor(our_t), ours_cond, ours_zero)
        torch.testing.assert_close(picked, current, rtol=0, atol=0)
        seen.append(bool((picked[:, c + 1:] != 0).any()))
    assert seen == [True, True, True, False, False, False]
    latents = torch.randn(b, 32, f, h, w, generator=g)  # the real model's C = 32: 98 inputs
    real = sr.sr_condition(torch.zeros(b, 33, f, h, w), torch.zeros(b, 32, f, h, w))
    assert torch.concat([latents, real], dim=1).shape[1] == 98


def test_sr_timesteps_8_steps_switch_after_four():
    t = sr.sr_timesteps("1080p_sr_distilled")
    np.testing.assert_allclose(t, ref_official_timesteps(8, 2.0).numpy(), rtol=1e-5)
    assert [bool(x >= 700) for x in t] == [True] * 4 + [False] * 4


def test_settings_from_official_configs():
    """commons/__init__.py:109-140 (SR_PIPELINE_CONFIGS, TRANSFORMER_VERSION_TO_SR_VERSION)."""
    a, b = sr.SR_CONFIGS["720p_sr_distilled"], sr.SR_CONFIGS["1080p_sr_distilled"]
    assert (a.base, a.target, a.steps, a.flow_shift, a.guidance_scale) == ("480p", "720p", 6, 2.0,
                                                                         1.0)
    assert (b.base, b.target, b.steps, b.flow_shift, b.guidance_scale) == ("720p", "1080p", 8,
                                                                         2.0, 1.0)
    assert a.transformer_folder == "transformer/720p_sr_distilled"
    assert b.upsampler_folder == "upsampler/1080p_sr_distilled"
    assert sr.SR_FOR_BASE == {"480p": "720p_sr_distilled", "720p": "1080p_sr_distilled"}


def test_sr_size_is_the_official_bucket_map():
    assert sr.sr_size(720, 1280, "1080p_sr_distilled") == (1072, 1904)
    for version, lr_base, hr_base in (("720p_sr_distilled", 640, 960),
                                      ("1080p_sr_distilled", 960, 1440)):
        for lr_w, lr_h in ref_crop_sizes(lr_base)[::7]:
            hr_w, hr_h = ref_bucket(lr_w, lr_h, lr_base, hr_base)
            assert sr.sr_size(lr_h, lr_w, version) == (hr_h, hr_w), (lr_w, lr_h)
    with pytest.raises(UsageError, match="not a 480p bucket"):
        sr.sr_size(480, 850, "720p_sr_distilled")


def test_diffusers_transformer_hosts_the_sr_input_width():
    """diffusers' HunyuanVideo15Transformer3DModel takes its patch-embedding input width from
    ``in_channels`` alone (65 for the base models: 32 + 33), so the SR DiT's 98 channels
    (latents 32 + I2V/T2V condition 33 + low-res condition 33) are a config value, with
    ``out_channels`` 32; nothing else in its forward reads the width."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(10)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=98, out_channels=32, num_attention_heads=2, attention_head_dim=16,
        num_layers=1, num_refiner_layers=1, text_embed_dim=8, text_embed_2_dim=8,
        image_embed_dim=8, rope_axes_dim=(4, 6, 6), task_type="t2v").eval()
    assert model.x_embedder.proj.weight.shape[1] == 98
    f, h, w = 2, 2, 4
    latents = torch.randn(1, 32, f, h, w)
    condition = sr.sr_condition(torch.zeros(1, 33, f, h, w), torch.randn(1, 32, f, h, w))
    kwargs = dict(timestep=torch.tensor([900.0]), encoder_hidden_states=torch.randn(1, 3, 8),
                  encoder_attention_mask=torch.ones(1, 3),
                  encoder_hidden_states_2=torch.randn(1, 2, 8),
                  encoder_attention_mask_2=torch.ones(1, 2),
                  image_embeds=torch.zeros(1, 4, 8), return_dict=False)
    with torch.no_grad():
        out = model(torch.concat([latents, condition], 1), **kwargs)[0]
        dropped = model(torch.concat([latents, sr.without_lq(condition, 32)], 1), **kwargs)[0]
    assert out.shape == (1, 32, f, h, w) and torch.isfinite(out).all()
    assert (out - dropped).abs().amax() > 1e-4  # the low-res channels reach the output
