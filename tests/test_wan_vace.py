"""Wan VACE (``WanVACEPipeline``: --video, --mask, --reference_image, --conditioning_scale)
against diffusers' eager pipeline on a tiny random checkpoint
(tools/make_tiny_vace_checkpoint.py), float32, same inputs, prompt, seed and steps.

Compared on the final latents (``output_type="latent"``), not frames: the tiny Wan 2.1 VAE's
one-channel RMS norm can flip a patch on a float32 rounding difference (tests/parity.py).
diffusers' latents keep the reference frames in front; ours are the decode's input, without
them (the pipeline cuts them before its decode), so ours equal diffusers' from frame
``refs`` on. The inputs reach diffusers as the PIL frames ``engine.files.video_input`` reads
from the same files (what ``diffusers.utils.load_video`` gives, tests/test_video_input.py).

32 x 64 pixels (the VAE encode splits the width over 8 devices down to 64 / 8 / 8 = 1 latent
column each), 5 frames, 2 steps.
"""

import os

import av
import jax
import numpy as np
import pytest
import torch
from diffusers.utils import load_image
from parity import assert_frames_close, latents_of
from PIL import Image

import generate_flax
from engine.files.video_input import read_video
from engine.pipeline import generate
from families import FAMILIES, wan

H, W, F, STEPS, SEED, SHIFT = 32, 64, 5, 2, 3, 3.0
FIRST_FRAME = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "first_frame.png")
# Final latents (1, 16, 2 + refs, 4, 8), float32, up to ~4: ours and diffusers' agree to
# 3.8e-6 (control video only: 1 device 3.8e-6, dp2 x tp2 x sp2 3.9e-6); the bound is 25
# times that. FAR: another conditioning scale moves them by far more.
LATENT_ATOL, FAR = 1e-4, 1e-2


def _write_video(path, frames, rate=8):
    """uint8 RGB ``frames`` (F, h, w, 3) as lossless ffv1 (bgr0)."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("ffv1", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "bgr0"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Files: a smooth control video (7 frames: longer than the run's 5, cut), a mask video
    (a white box moving over black: inpaint it), a mask image, two reference images of other
    aspect ratios (letterboxed by the pipeline), and refusal cases."""
    d = tmp_path_factory.mktemp("vace-inputs")
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:H, 0:W]
    video = np.stack([np.stack([(x * 4 + 30 * t) % 256, (y * 8) % 256,
                                rng.integers(0, 256, (H, W))], -1)
                      for t in range(7)]).astype(np.uint8)
    mask = np.zeros((7, H, W, 3), np.uint8)
    for t in range(7):
        mask[t, 8:24, 8 + 4 * t:32 + 4 * t] = 255
    out = dict(video=_write_video(d / "control.mkv", video),
               mask=_write_video(d / "mask.mkv", mask),
               short=_write_video(d / "short.mkv", video[:3]),
               square=_write_video(d / "square.mkv", video[:, :, :32]),
               mask_small=_write_video(d / "mask_small.mkv", mask[:, :16, :32]))
    for name, (h, w) in dict(mask_image=(H, W), ref1=(40, 24), ref2=(24, 48)).items():
        pixels = mask[0] if name == "mask_image" else rng.integers(0, 256, (h, w, 3),
                                                                    dtype=np.uint8)
        out[name] = str(d / f"{name}.png")
        Image.fromarray(pixels).save(out[name])
    out["broken"] = str(d / "broken.mp4")
    with open(out["broken"], "wb") as f:
        f.write(b"not a video at all")
    return out


def _reference(checkpoint, video=None, mask=None, refs=(), scale=1.0):
    """diffusers' WanVACEPipeline.__call__, eager float32 PyTorch on CPU: final latents
    (float32 numpy, the reference frames in front)."""
    from diffusers import UniPCMultistepScheduler, WanVACEPipeline

    pipe = WanVACEPipeline.from_pretrained(checkpoint, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    if mask is not None:
        mask = ([load_image(mask)] * F if mask.endswith(".png")
                else read_video(mask, "--mask", F))
    with torch.no_grad():
        out = pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                   video=None if video is None else read_video(video, "--video", F), mask=mask,
                   reference_images=[load_image(p) for p in refs] or None,
                   conditioning_scale=scale, num_inference_steps=STEPS,
                   generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent",
                   num_frames=F, height=H, width=W)
    return out.frames.float().numpy()


def _args(checkpoint, flags=()):
    return ["--model_id", checkpoint, "--dtype", "float32", "--seed", str(SEED),
            "--flow_shift", str(SHIFT), "--num_inference_steps", str(STEPS),
            "--num_iterations", "1", "--warmup_steps", "0", "--height", str(H), "--width",
            str(W), "--frames", str(F), "--attention", "xla", "--compilation_cache_dir",
            "none", *flags]


def _ours(checkpoint, flags=(), devices=None):
    config = generate_flax.validate_args(generate_flax.parse_args(_args(checkpoint, flags)))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def _flags(video=None, mask=None, refs=(), scale=None):
    out = [] if video is None else ["--video", video]
    out += [] if mask is None else ["--mask", mask]
    for p in refs:
        out += ["--reference_image", p]
    return out + ([] if scale is None else ["--conditioning_scale", scale])


def _check(checkpoint, devices=None, scale=None, **given):
    """Our final latents equal diffusers' (from frame ``refs`` on) within LATENT_ATOL;
    returns (ours, diffusers', report)."""
    scales = None if scale is None else [float(s) for s in scale.split(",")]
    want = _reference(checkpoint, scale=1.0 if scales is None else
                      scales[0] if len(scales) == 1 else scales, **given)
    flags = _flags(scale=scale, **given)
    ours, report = latents_of(_ours, checkpoint, flags, devices=devices)
    refs = len(given.get("refs", ()))
    assert want.std() > 0.01 and ours.shape[2] == want.shape[2] - refs == 2
    print(f"latents: max |ours - diffusers| {np.abs(ours - want[:, :, refs:]).max():.3g} of "
          f"max |latent| {np.abs(want).max():.3g}")
    assert_frames_close(ours, want[:, :, refs:], atol=LATENT_ATOL, what="latents",
                        again=lambda: (latents_of(_ours, checkpoint, flags, devices=devices)[0],
                                       _reference(checkpoint, **given)[:, :, refs:]))
    return ours, want, report


def test_all_inputs_match_diffusers(vace_checkpoint, inputs):
    """Control video, mask video, two reference images and a per-layer conditioning scale
    together, on 1 device; the report names the inputs used."""
    _, _, report = _check(vace_checkpoint, devices=jax.devices()[:1], scale="0.5,1.5",
                          video=inputs["video"], mask=inputs["mask"],
                          refs=(inputs["ref1"], inputs["ref2"]))
    used = report["settings"]["inputs"]
    assert used["video"]["sha256"] and used["mask"]["frames"] == 7
    assert len(used["reference_image"]) == 2 and used["conditioning_scale"] == [0.5, 1.5]
    assert "image_encode_s" in report["timings"]


@pytest.mark.slow
def test_control_video_sharded_equals_unsharded(vace_checkpoint, inputs):
    """A control video alone: 1 device, and the default layout on 8 devices (dp2 x tp2 x
    sp2: the main blocks' tokens padded 16 -> 32 for sp, the VACE hints padded to match),
    each equal to diffusers' and to each other."""
    one, want, _ = _check(vace_checkpoint, devices=jax.devices()[:1], video=inputs["video"])
    eight, _, report = _check(vace_checkpoint, video=inputs["video"])
    assert report["mesh"] == {"dp": 2, "tp": 2, "sp": 2} and report["fallbacks"] == []
    print("8 devices vs 1: max |d|", np.abs(eight - one).max())
    np.testing.assert_allclose(eight, one, atol=LATENT_ATOL, rtol=0)


@pytest.mark.slow
def test_inpainting_with_a_mask_image(vace_checkpoint, inputs):
    """Video + one mask image (repeated over the frames, as a list of one image each)."""
    _check(vace_checkpoint, devices=jax.devices()[:1], video=inputs["video"],
           mask=inputs["mask_image"])


@pytest.mark.slow
def test_reference_images_only(vace_checkpoint, inputs):
    """No video (the pipeline's zero video), two references: two more latent frames in
    front of the noise, cut before the decode."""
    _check(vace_checkpoint, devices=jax.devices()[:1], refs=(inputs["ref1"], inputs["ref2"]))


@pytest.mark.slow
def test_conditioning_scale_moves_the_video(vace_checkpoint, inputs):
    """One scale for every VACE layer (0.3) equals diffusers' float scale and differs from
    the default 1 by more than FAR."""
    ours, _, _ = _check(vace_checkpoint, devices=jax.devices()[:1], scale="0.3",
                        video=inputs["video"])
    default = latents_of(_ours, vace_checkpoint, _flags(video=inputs["video"]),
                         devices=jax.devices()[:1])[0]
    print("scale 0.3 vs 1: max |d|", np.abs(ours - default).max())
    assert np.abs(ours - default).max() > FAR


@pytest.fixture(scope="module")
def vace_fun_checkpoint(tmp_path_factory):
    """Wan 2.2 VACE-Fun A14B layout: two experts, boundary_ratio 0.875."""
    from conftest import _build

    return _build(tmp_path_factory, "make_tiny_vace_checkpoint.py", "tiny-wan22-vace-fun",
                  "--experts", "2")


@pytest.mark.slow
def test_vace_fun_two_experts_match_diffusers(vace_fun_checkpoint, inputs):
    """4 steps: the high-noise expert for t >= 875 with guidance 4, then the low-noise one
    with guidance 2, as diffusers' loop; without --guidance_scale_2 the low-noise expert
    takes --guidance_scale, as the pipeline defaults it."""
    from diffusers import UniPCMultistepScheduler, WanVACEPipeline

    pipe = WanVACEPipeline.from_pretrained(vace_fun_checkpoint, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        want = pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS[
            "negative_prompt"], video=read_video(inputs["video"], "--video", F),
            num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=2.0,
            generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent",
            num_frames=F, height=H, width=W).frames.float().numpy()
    flags = ["--video", inputs["video"], "--guidance_scale", "4", "--guidance_scale_2", "2",
             "--num_inference_steps", "4"]
    ours, report = latents_of(_ours, vace_fun_checkpoint, flags, devices=jax.devices()[:1])
    print("two experts: max |d|", np.abs(ours - want).max())
    np.testing.assert_allclose(ours, want, atol=LATENT_ATOL, rtol=0)
    assert report["experts"]["steps"] == {"transformer": [0, 1], "transformer_2": [2, 3]}
    config = generate_flax.validate_args(generate_flax.parse_args(
        _args(vace_fun_checkpoint, ["--guidance_scale", "3.5"])))
    assert config.video.guidance_scale_2 == 3.5


def _vace_lora(path, checkpoint):
    """A random rank-4 PEFT LoRA (``tools/tiny_lora.py``) on every main block, plus the same
    kind of pairs on every VACE block's attention and FFN (``transformer.vace_blocks.N``)."""
    import sys

    from safetensors.torch import save_file

    from engine.files.checkpoint import read_component_config

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    from tiny_lora import write_lora

    cfg = read_component_config(checkpoint, "transformer")
    tensors = write_lora(path, cfg, fmt="peft", rank=4, seed=1)
    for name in [k for k in tensors if k.startswith("transformer.blocks.0.")]:
        for i in range(len(cfg["vace_layers"])):
            tensors[name.replace("blocks.0.", f"vace_blocks.{i}.")] = tensors[name] * (i + 2)
    save_file(tensors, path)
    return path


@pytest.mark.slow
def test_lora_on_main_and_vace_blocks_matches_diffusers(vace_checkpoint, inputs, tmp_path):
    """--lora at scale 0.7 on main and VACE blocks equals diffusers' eager
    ``load_lora_weights`` + ``fuse_lora(lora_scale=0.7)``; it moves the video by > FAR."""
    from diffusers import UniPCMultistepScheduler, WanVACEPipeline

    lora = _vace_lora(str(tmp_path / "vace_lora.safetensors"), vace_checkpoint)
    pipe = WanVACEPipeline.from_pretrained(vace_checkpoint, dtype=torch.float32)
    pipe.scheduler = UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                         flow_shift=SHIFT)
    pipe.set_progress_bar_config(disable=True)
    pipe.load_lora_weights(lora, low_cpu_mem_usage=False)
    pipe.fuse_lora(lora_scale=0.7)
    fused = {k: v for k, v in pipe.transformer.state_dict().items() if "vace_blocks.1." in k}
    assert any("attn1.to_q" in k for k in fused)  # the VACE blocks took their pairs
    with torch.no_grad():
        want = pipe(prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS[
            "negative_prompt"], video=read_video(inputs["video"], "--video", F),
            num_inference_steps=STEPS, generator=torch.Generator("cpu").manual_seed(SEED),
            output_type="latent", num_frames=F, height=H, width=W).frames.float().numpy()
    ours = latents_of(_ours, vace_checkpoint, ["--video", inputs["video"], "--lora",
                                               f"{lora}:0.7"], devices=jax.devices()[:1])[0]
    plain = _reference(vace_checkpoint, video=inputs["video"])
    print("LoRA: max |d|", np.abs(ours - want).max(), "moved by", np.abs(want - plain).max())
    np.testing.assert_allclose(ours, want, atol=LATENT_ATOL, rtol=0)
    assert np.abs(want - plain).max() > FAR


@pytest.mark.slow
def test_vace_blocks_attend_through_our_kernel(vace_checkpoint, inputs):
    """--attention splash (our Pallas kernel, interpret mode on CPU) on the default 8-device
    layout: every attention of the step, the VACE blocks' included, is a kernel call (the
    step traces 4 main + 2 VACE blocks, each one self-attention over the video tokens and
    one cross-attention over the 512 text tokens), and the latents equal diffusers'
    (measured 5.5e-6)."""
    from unittest import mock

    import custom_splash_attention as csa

    keys, route = [], csa._splash_route

    def counting(q, k, *args, **kw):
        keys.append(k.shape[-2])
        return route(q, k, *args, **kw)

    want = _reference(vace_checkpoint, video=inputs["video"])
    with mock.patch.object(csa, "_splash_route", counting):
        ours, report = latents_of(_ours, vace_checkpoint, ["--video", inputs["video"],
                                                           "--attention", "splash"])
    print("kernel calls by key length:", {n: keys.count(n) for n in set(keys)},
          "max |d|", np.abs(ours - want).max())
    assert report["settings"]["attention"] == "splash" and report["fallbacks"] == []
    # One trace of the step (compiled once): the 2 VACE blocks' self-attention on the 16
    # real tokens (they run before sequence parallelism pads), the 4 main blocks' on the 32
    # tokens sp2 x 16-row tiles pad them to, and 6 cross-attentions.
    assert {n: keys.count(n) for n in set(keys)} == {16: 2, 32: 4, 512: 6}
    np.testing.assert_allclose(ours, want, atol=LATENT_ATOL, rtol=0)


@pytest.mark.slow
def test_dry_run_compiles_the_vace_step(vace_checkpoint, inputs, tmp_path):
    """--dry_run on a v6e:2x4 topology compiles the step with the control input (a zero
    control video, as the pipeline without --video; the abstract inputs of
    ``wan_vace.abstract_model_inputs``), the decode and the control video's chunked VAE
    encode (first frame, first chunk: 5 frames); the analytic FLOPs count the VACE blocks
    (2 of them beside 4 main blocks: 1.5 times Wan's formula)."""
    import json

    from families import wan_vace

    out = tmp_path / "dry"
    code = generate_flax.cli(["--model_id", vace_checkpoint, "--dry_run", "--topology",
                              "v6e:2x4", "--height", str(H), "--width", str(W), "--frames",
                              str(F), "--output_dir", str(out)])
    assert code == 0
    (report,) = [json.load(open(out / f)) for f in os.listdir(out) if f.endswith(".json")]
    config = generate_flax.validate_args(generate_flax.parse_args(_args(vace_checkpoint)))
    cfg = json.load(open(os.path.join(vace_checkpoint, "transformer", "config.json")))
    assert wan_vace.transformer_flops(cfg, config) == 1.5 * wan.transformer_flops(cfg, config)
    programs = [row["program"] for row in report["per_chip"]]
    assert programs[0] == "transformer step" and "VAE encode (2 programs, peak)" in programs


def test_frames_default_to_the_video_length(vace_checkpoint, inputs, capsys):
    """Without --frames a 7-frame --video gives 5 frames (4n + 1, rounded down) and says
    it cuts the video; --frames 1 takes the first frame."""
    args = _args(vace_checkpoint, ["--video", inputs["video"]])
    i = args.index("--frames")
    del args[i:i + 2]
    config = generate_flax.validate_args(generate_flax.parse_args(args))
    assert config.video.frames == 5 and config.video.inputs["video"].frames == 7
    assert "has 7 frames; using the first 5" in capsys.readouterr().out
    config = generate_flax.validate_args(generate_flax.parse_args(args + ["--frames", "1"]))
    assert config.video.frames == 1


@pytest.mark.parametrize("case, expect", [
    (dict(video="short"), "has 3 frames, fewer than --frames 5"),
    (dict(video="square"), "frames become 32x32 in WanVACEPipeline, not the run's 64x32"),
    (dict(video="broken"), "not a video PyAV can open"),
    (dict(video="video", mask="mask_small"), "is 32x16, --video is 64x32: they must match"),
    (dict(mask="mask"), "needs --video"),
    (dict(refs=("broken",)), "--reference_image="),
    (dict(scale="1,2,3"), "expected 1 value or 2 (one per VACE layer of --model_id), got 3"),
])
def test_refusals_are_one_line(vace_checkpoint, inputs, tmp_path, capsys, case, expect):
    """Each is one line on stderr, exit 2, before any model loads, and writes no file."""
    given = {k: (inputs[v] if k != "refs" else tuple(inputs[p] for p in v))
             for k, v in case.items() if k != "scale"}
    out = tmp_path / "out"
    code = generate_flax.cli(_args(vace_checkpoint, _flags(scale=case.get("scale"), **given))
                             + ["--output_dir", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expect in lines[0], lines
    assert not out.exists() or not os.listdir(out)


@pytest.mark.parametrize("extra, expect", [
    (["--image", FIRST_FRAME], "Wan VACE takes --video, --mask and --reference_image, not "
                               "--image"),
    (["--quantize", "int8"], "--quantize='int8': not supported for Wan VACE yet"),
    (["--sparse", "svg", "--attention", "splash"], "--sparse='svg': not supported for Wan VACE"),
    (["--scan_layers"], "--scan_layers=True: Wan VACE's blocks run unrolled"),
    (["--stage", "encode"], "--stage='encode': staged runs are not supported for Wan VACE"),
    (["--serve"], "--serve=True: serving is not supported for Wan VACE yet"),
])
def test_what_vace_does_not_take_yet_is_one_line(vace_checkpoint, tmp_path, capsys, extra,
                                                 expect):
    out = tmp_path / "out"
    code = generate_flax.cli(_args(vace_checkpoint, extra) + ["--output_dir", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and expect in lines[0], lines
    assert not out.exists() or not os.listdir(out)
