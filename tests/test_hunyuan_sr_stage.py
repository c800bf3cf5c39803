"""``--sr``: HunyuanVideo-1.5's super-resolution stage run after the first stage, against a
test-only eager reference of the official SR pipeline.

diffusers has no SR pipeline, so the reference below is ported from the official code
(Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7, ``hyvideo/pipelines/hunyuan_video_sr_pipeline.py``
``__call__``: the bucket map, ``prepare_latents`` with the seeded generator, the bilinear
resize and the upsampler in float32, ``add_noise_to_lq`` at 0.7, the T2V condition with the
low-res latents and their ones mask, the zeroed copy, the switch once t < 700, the Euler steps)
and written out here on its own, in eager torch: the first stage is diffusers' own
``HunyuanVideo15Pipeline`` (``output_type="latent"``), the SR transformer diffusers'
``HunyuanVideo15Transformer3DModel``, the decode diffusers' VAE. The one stated difference
(``families/hunyuan_sr_stage.py``): the low-res noise comes from the seeded generator after
the latents, not from torch's global generator.

Weights are random (tiny checkpoints): a tiny SR DiT with the first stage's text widths and a
``target_size`` of 96 (the released ones use the SizeMap's 960 / 1440), and a tiny upsampler.
"""

import argparse
import json
import os

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import load_tool
from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15Transformer3DModel
from diffusers.pipelines.hunyuan_video1_5.image_processor import generate_crop_size_list
from serve_util import Server, server_frames, wait_done

import generate_flax
from engine.pipeline import generate
from engine.run.errors import UsageError
from families import FAMILIES
from families.hunyuan_sr import SRTo720pUpsampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIRST_FRAME = os.path.join(ROOT, "tests", "data", "first_frame.png")
VERSION = "720p_sr_distilled"
PROMPT = "A cat walks on the grass, realistic style"
SHAPE = dict(height=48, width=80, frames=9)  # the tiny first stage's 16:9 bucket (base 64)
SR_BASE = 96  # the tiny SR DiT's target_size
STEPS, SR_STEPS, SEED = 2, 3, 3  # SR at shift 2: t = 1000, 800, 500 (the last without lq)


@pytest.fixture(scope="module")
def sr_dir(hunyuan_checkpoint, tmp_path_factory):
    """A tiny ``--sr_model_dir``: transformer/ (diffusers format, what
    tools/convert_hunyuan_sr.py writes) and upsampler/<version>/ (the official layout)."""
    builder = load_tool("make_tiny_hunyuan_sr")
    with open(os.path.join(hunyuan_checkpoint, "transformer", "config.json")) as f:
        first = json.load(f)
    widths = {k: first[k] for k in ("text_embed_dim", "text_embed_2_dim", "image_embed_dim")}
    folder = tmp_path_factory.mktemp("sr")
    builder.tiny_transformer(5, VERSION, target_size=SR_BASE, **widths).save_pretrained(
        folder / "transformer", safe_serialization=True)
    upsampler = builder.build(argparse.Namespace(latent_channels=32, seed=4))[VERSION]
    upsampler.save_pretrained(folder / "upsampler" / VERSION, safe_serialization=True)
    return str(folder)


def _hr_size(height: int = SHAPE["height"], width: int = SHAPE["width"]) -> tuple[int, int]:
    """The official BucketMap (hunyuan_video_sr_pipeline.py:46-72): the hr bucket whose w/h is
    nearest the lr video's (first on a tie)."""
    hr = generate_crop_size_list(base_size=SR_BASE, patch_size=16)
    ratios = np.array([w / h for w, h in hr])
    w, h = hr[int(np.abs(ratios - width / height).argmin())]
    return h, w


@pytest.fixture(scope="module")
def reference(hunyuan_checkpoint, sr_dir):
    """The first stage (diffusers) then the official SR stage's math, eager: frames (F, H, W, 3)."""
    return _t2v_reference(hunyuan_checkpoint, sr_dir, SHAPE["height"], SHAPE["width"])


def _t2v_reference(checkpoint, sr_dir, height, width, seed=SEED):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        lr = pipe(prompt=PROMPT, num_frames=SHAPE["frames"], height=height, width=width,
                  num_inference_steps=STEPS, output_type="latent",
                  generator=torch.Generator("cpu").manual_seed(seed)).frames
        return _sr_reference(pipe, lr, sr_dir, seed=seed)


def _sr_reference(pipe, lr, sr_dir, image=None, seed=SEED):
    transformer = HunyuanVideo15Transformer3DModel.from_pretrained(
        os.path.join(sr_dir, "transformer")).eval()
    upsampler = SRTo720pUpsampler.from_pretrained(os.path.join(sr_dir, "upsampler",
                                                               VERSION)).eval()
    height, width = _hr_size(lr.shape[-2] * 16, lr.shape[-1] * 16)  # VAE: 16 px per latent
    generator = torch.Generator("cpu").manual_seed(seed)
    latents = pipe.prepare_latents(1, 32, height, width, SHAPE["frames"], torch.float32,
                                   torch.device("cpu"), generator)
    lq_noise = torch.randn(latents.shape, generator=generator, dtype=torch.float32)
    b, c, f, h, w = lr.shape
    lq = F.interpolate(lr.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w),
                       size=latents.shape[-2:], mode="bilinear", align_corners=False)
    lq = upsampler(lq.reshape(b, f, c, *latents.shape[-2:]).permute(0, 2, 1, 3, 4).float())
    t_lq = torch.tensor([700.0]).reshape(1, 1, 1, 1, 1)  # add_noise_to_lq, noise_scale 0.7
    lq = (1 - t_lq / 1000) * lq + (t_lq / 1000) * lq_noise
    cond, image_embeds = _image_condition(pipe, image, latents, height, width,
                                          transformer.config.image_embed_dim)
    condition = torch.cat([cond, lq, torch.ones_like(lq[:, :1])], dim=1)
    zeroed = condition.clone()
    zeroed[:, c + 1:2 * c + 1] = 0
    zeroed[:, 2 * c + 1] = 0
    embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(PROMPT, device=torch.device("cpu"))
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config, shift=2.0)
    scheduler.set_timesteps(sigmas=list(np.linspace(1.0, 0.0, SR_STEPS + 1)[:-1]))
    for t in scheduler.timesteps:
        if t < 700:
            condition = zeroed
        pred = transformer(hidden_states=torch.cat([latents, condition], dim=1),
                           timestep=t.expand(1), encoder_hidden_states=embeds,
                           encoder_attention_mask=mask, encoder_hidden_states_2=embeds_2,
                           encoder_attention_mask_2=mask_2, image_embeds=image_embeds,
                           return_dict=False)[0]
        latents = scheduler.step(pred, t, latents, return_dict=False)[0]
    video = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
    return pipe.video_processor.postprocess_video(video, output_type="np")[0]


def _image_condition(pipe, image, latents, height, width, image_dim):
    """(the I2V/T2V condition (1, C + 1, F, H, W), SigLIP tokens) at the SR size. T2V: zeros,
    mask 0 (``_prepare_cond_latents``, ``_prepare_vision_states`` without an image). I2V:
    the image resized and cropped to the SR size, VAE-encoded on frame 0 with mask 1 there,
    and its SigLIP tokens, by diffusers' I2V pipeline's own functions (its port of the
    official ``get_image_condition_latents`` / ``_prepare_vision_states``, which the official
    SR stage calls at the SR size; hunyuan_video_pipeline.py:698-860)."""
    if image is None:
        return torch.zeros(1, latents.shape[1] + 1, *latents.shape[2:]), torch.zeros(
            1, 729, image_dim)
    cpu = torch.device("cpu")
    image = pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")
    embeds = pipe.encode_image(image=image, batch_size=1, device=cpu, dtype=torch.float32)
    cond, mask = pipe.prepare_cond_latents_and_mask(torch.zeros(latents.shape), image, 1, height,
                                                    width, torch.float32, cpu)
    return torch.cat([cond, mask], dim=1), embeds


def _argv(checkpoint, sr_dir, *extra):
    return ["--model_id", checkpoint, "--prompt", PROMPT, "--dtype", "float32",
            "--seed", str(SEED), "--num_inference_steps", str(STEPS), "--num_iterations", "1",
            "--warmup_steps", "1", "--height", str(SHAPE["height"]), "--width",
            str(SHAPE["width"]), "--frames", str(SHAPE["frames"]), "--compilation_cache_dir",
            "none", "--sr", "720p", "--sr_model_dir", sr_dir, "--sr_steps", str(SR_STEPS),
            *extra]


def _ours(checkpoint, sr_dir, devices, *extra):
    config = generate_flax.validate_args(generate_flax.parse_args(
        _argv(checkpoint, sr_dir, *extra)))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def test_sr_stage_matches_the_official_pipeline_eagerly(hunyuan_checkpoint, sr_dir, reference):
    frames, report = _ours(hunyuan_checkpoint, sr_dir, jax.devices()[:1], "--attention", "xla")
    assert frames.shape == (SHAPE["frames"], *_hr_size(), 3)
    np.testing.assert_allclose(frames, reference, atol=1e-3)
    settings = report["settings"]["upscale"]
    assert (settings["version"], settings["steps"], settings["flow_shift"]) == (VERSION, 3, 2.0)
    assert (settings["height"], settings["width"]) == _hr_size()
    timings = report["timings"]
    assert len(timings["runs"][-1]["upscale_step_seconds"]) == SR_STEPS
    assert timings["warmup_upscale_s"] > 0 and timings["compile_upscale_s"] > 0


def test_sr_stage_sharded_matches_the_reference(hunyuan_checkpoint, sr_dir, reference):
    """The first stage on dp2 x tp2 x sp2 (CFG over dp) and the SR stage on the layout the
    resolver picks for batch 1, through the Splash kernel in interpret mode."""
    frames, report = _ours(hunyuan_checkpoint, sr_dir, None, "--attention", "splash",
                           "--dp", "2", "--tp", "2", "--sp", "2")
    np.testing.assert_allclose(frames, reference, atol=1e-3)


def test_sr_stage_after_image_to_video_matches_the_reference(sr_dir, tmp_path_factory):
    """After diffusers' I2V first stage: the SR stage's condition carries the image's latents
    and SigLIP tokens at the SR size."""
    from conftest import _build
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from diffusers.utils import load_image

    checkpoint = _build(tmp_path_factory, "make_tiny_hunyuan_checkpoint.py",
                        "tiny-hunyuan15-i2v", "--i2v")
    image = load_image(FIRST_FRAME)  # 160 x 96: the 48 x 80 bucket at target_size 64
    pipe = HunyuanVideo15ImageToVideoPipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        lr = pipe(image=image, prompt=PROMPT, num_frames=SHAPE["frames"],
                  num_inference_steps=STEPS, output_type="latent",
                  generator=torch.Generator("cpu").manual_seed(SEED)).frames
        want = _sr_reference(pipe, lr, sr_dir, image)
        t2v_like = _sr_reference(pipe, lr, sr_dir)  # the same first stage, no image in the SR
    frames, _ = _ours(checkpoint, sr_dir, jax.devices()[:1], "--attention", "xla", "--image",
                      FIRST_FRAME)
    np.testing.assert_allclose(frames, want, atol=1e-3)
    assert np.abs(t2v_like - want).max() > 1e-2


def test_sr_flags_are_one_line_errors(hunyuan_checkpoint, tiny_checkpoint, sr_dir, tmp_path):
    def refused(argv):
        with pytest.raises(UsageError) as e:
            generate_flax.validate_args(generate_flax.parse_args(argv))
        return str(e.value)

    assert "not supported for Wan" in refused(["--model_id", tiny_checkpoint, "--sr", "720p",
                                               "--sr_model_dir", sr_dir])
    assert "needs --sr" in refused(["--model_id", hunyuan_checkpoint, "--sr_steps", "4"])
    assert "needs --sr_model_dir" in refused(["--model_id", hunyuan_checkpoint, "--sr", "720p"])
    assert "not a folder" in refused(_argv(hunyuan_checkpoint, str(tmp_path / "none")))
    damaged = tmp_path / "damaged"
    (damaged / "transformer").mkdir(parents=True)
    (damaged / "transformer" / "config.json").write_text("{not json")
    assert "cannot be read" in refused(_argv(hunyuan_checkpoint, str(damaged)))
    official = tmp_path / "official"
    (official / "transformer").mkdir(parents=True)
    (official / "transformer" / "config.json").write_text(json.dumps(
        {"_class_name": "HunyuanVideo_1_5_DiffusionTransformer"}))
    assert "convert_hunyuan_sr.py" in refused(_argv(hunyuan_checkpoint, str(official)))
    assert "bucket" in refused(_argv(hunyuan_checkpoint, sr_dir, "--height", "48",
                                     "--width", "48"))  # not a bucket of base 64
    assert "--stage" in refused(_argv(hunyuan_checkpoint, sr_dir, "--stage", "denoise"))
    assert "--sr_steps=0" in refused(_argv(hunyuan_checkpoint, sr_dir, "--sr_steps", "0"))
    assert "--serve_sizes=48x48: not with --sr 720p" in refused(_argv(
        hunyuan_checkpoint, sr_dir, "--serve", "--serve_sizes", "80x48,48x48"))


def test_served_sr_jobs_match_the_reference_at_each_size(hunyuan_checkpoint, sr_dir, reference,
                                                         tmp_path):
    """``--serve --sr``: two buckets (the second's SR stage compiled on the SR weights placed
    with the first), one job each with its own seed; each job's frames equal the eager
    reference at its size, and ``/v1/models`` lists the SR sizes."""
    argv = ["--model_id", hunyuan_checkpoint, "--dtype", "float32", "--num_inference_steps",
            str(STEPS), "--warmup_steps", "1", "--compilation_cache_dir", "none", "--sr", "720p",
            "--sr_model_dir", sr_dir, "--sr_steps", str(SR_STEPS), "--attention", "xla",
            "--save_frames", "--serve_sizes", "80x48,64x64", "--serve_frames", "9"]
    server = Server(argv, tmp_path / "out").start()
    try:
        server.wait_ready()
        with server.client() as client:
            model = client.get("/v1/models").json()["data"][0]
            want_sizes = [f"{w}x{h}" for h, w in (_hr_size(48, 80), _hr_size(64, 64))]
            assert model["output_sizes"] == want_sizes
            ids = {size: client.post("/v1/videos", json=dict(
                prompt=PROMPT, size=size, seed=seed)).json()["id"]
                for size, seed in (("80x48", SEED), ("64x64", SEED + 1))}
            jobs = wait_done(client, ids.values(), timeout=300)
    finally:
        assert server.stop() == 0, server.tail()
    assert all(j["status"] == "completed" for j in jobs.values()), jobs
    assert jobs[ids["80x48"]]["timings"]["upscale_s"] > 0
    np.testing.assert_allclose(server_frames(server.out, ids["80x48"]), reference, atol=1e-3)
    square = _t2v_reference(hunyuan_checkpoint, sr_dir, 64, 64, seed=SEED + 1)
    frames = server_frames(server.out, ids["64x64"])
    assert frames.shape == (SHAPE["frames"], *_hr_size(64, 64), 3)
    np.testing.assert_allclose(frames, square, atol=1e-3)
