"""Wan video-to-video (``--video PATH --strength S``, ``families.wan_v2v``) against diffusers'
eager ``WanVideoToVideoPipeline`` on the tiny Wan 2.1 text-to-video checkpoint, at two
strengths (the default 0.8 and 0.5: different timestep cuts), on the final latents
(``output_type="latent"``; tests/test_wan_i2v.py's module docstring says why not frames for
the tiny Wan 2.1 VAE). The source video is written losslessly (ffv1), so the reference's
frames are the array itself, read by neither of our readers.
"""

import os

import av
import jax
import numpy as np
import pytest
import torch
from parity import assert_frames_close, latents_of
from PIL import Image

import generate_flax
from engine.pipeline import generate
from families import FAMILIES, wan

SIZE, STEPS, SHIFT, SEED = 32, 4, 3.0, 7
# Final latents (1, 16, 3, 4, 4) float32: the bound is test_wan_i2v's (its measured
# differences are 2.4e-6 .. 4.4e-6); FAR: the two strengths' latents differ by more.
LATENT_ATOL, FAR = 1e-4, 1e-2


def _write(path, frames, rate=12):
    """uint8 RGB ``frames`` (F, H, W, 3) as a lossless ffv1 video (bgr0)."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream("ffv1", rate=rate)
        stream.height, stream.width = frames.shape[1:3]
        stream.pix_fmt = "bgr0"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """(path, frames): 11 frames of 40 x 48 moving stripes (stretched to 32 x 32 by the
    pipeline's VideoProcessor; the run takes the first 9)."""
    y, x = np.mgrid[0:40, 0:48]
    frames = np.stack([np.stack([(x * 5 + t * 9) % 256, (y * 7 + t * 3) % 256,
                                 ((x + y) * 3 + t * 20) % 256], -1)
                       for t in range(11)]).astype(np.uint8)
    path = tmp_path_factory.mktemp("v2v") / "source.mkv"
    _write(path, frames)
    return str(path), frames


def _reference(checkpoint, frames, strength, euler=False):
    """diffusers' WanVideoToVideoPipeline.__call__, eager float32 on the CPU, on the first 9
    frames as PIL images (UniPC, or with ``euler`` flow-match Euler, whose ``scale_noise``
    noises the video): its final latents (float32 numpy)."""
    from diffusers import (
        AutoencoderKLWan,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
        WanVideoToVideoPipeline,
    )

    vae = AutoencoderKLWan.from_pretrained(checkpoint, subfolder="vae", dtype=torch.float32)
    pipe = WanVideoToVideoPipeline.from_pretrained(checkpoint, vae=vae, dtype=torch.float32)
    pipe.scheduler = (FlowMatchEulerDiscreteScheduler.from_config(pipe.scheduler.config,
                                                                  shift=SHIFT) if euler else
                      UniPCMultistepScheduler.from_config(pipe.scheduler.config,
                                                          flow_shift=SHIFT))
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(video=[Image.fromarray(f) for f in frames[:9]], strength=strength,
                   prompt=wan.DEFAULTS["prompt"], negative_prompt=wan.DEFAULTS["negative_prompt"],
                   num_inference_steps=STEPS, guidance_scale=5.0, height=SIZE, width=SIZE,
                   generator=torch.Generator("cpu").manual_seed(SEED), output_type="latent")
    return out.frames.float().numpy()


def _args(checkpoint, video, flags=()):
    return ["--model_id", checkpoint, "--video", video, "--dtype", "float32", "--seed",
            str(SEED), "--flow_shift", str(SHIFT), "--num_inference_steps", str(STEPS),
            "--guidance_scale", "5", "--num_iterations", "1", "--warmup_steps", "0",
            "--height", str(SIZE), "--width", str(SIZE), "--attention", "xla",
            "--compilation_cache_dir", "none", *flags]


def _ours(checkpoint, video, flags=(), devices=None):
    config = generate_flax.validate_args(generate_flax.parse_args(_args(checkpoint, video,
                                                                        flags)))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def test_video_to_video_matches_diffusers_at_two_strengths(tiny_checkpoint, source, capsys):
    """The default strength (0.8: 3 of 4 steps) and 0.5 (2 of 4): our final latents equal
    diffusers' eager pipeline's; the two differ by far more than the bound; --frames came
    from the 11-frame video (9), with a line saying it was cut; the report names the video."""
    path, frames = source
    runs, seen = {}, []  # seen: printed after capsys has read the run's own lines
    for strength, flags in ((0.8, []), (0.5, ["--strength", "0.5"])):
        want = _reference(tiny_checkpoint, frames, strength)
        ours, report = latents_of(_ours, tiny_checkpoint, path, flags,
                                  devices=jax.devices()[:1])
        seen.append(f"strength {strength}: latents max |ours - diffusers| "
                    f"{np.abs(ours - want).max():.3g} of max |latent| {np.abs(want).max():.3g}")
        assert ours.shape == (1, 16, 3, 4, 4) and want.std() > 0.01
        assert_frames_close(ours, want, atol=LATENT_ATOL, what="latents",
                            again=lambda flags=flags, strength=strength: (
            latents_of(_ours, tiny_checkpoint, path, flags, devices=jax.devices()[:1])[0],
            _reference(tiny_checkpoint, frames, strength)))
        settings = report["settings"]
        assert settings["frames"] == 9 and settings["inputs"]["strength"] == strength
        assert settings["inputs"]["video"]["frames"] == 11
        assert len(report["timings"]["runs"][0]["step_seconds"]) == int(STEPS * strength)
        runs[strength] = ours
    assert "has 11 frames; using the first 9" in capsys.readouterr().out
    print("\n".join(seen))
    print("strengths 0.8 vs 0.5: latents max |d|", np.abs(runs[0.8] - runs[0.5]).max())
    assert np.abs(runs[0.8] - runs[0.5]).max() > FAR


def test_video_to_video_euler_matches_diffusers(tiny_checkpoint, source):
    """--scheduler euler: flow-match Euler has no add_noise; the video is noised by its
    ``scale_noise``, as the pipeline does; strength 0.6 keeps 2 of 4 steps."""
    path, frames = source
    want = _reference(tiny_checkpoint, frames, 0.6, euler=True)
    flags = ["--strength", "0.6", "--scheduler", "euler"]
    ours, _ = latents_of(_ours, tiny_checkpoint, path, flags, devices=jax.devices()[:1])
    print(f"euler: latents max |ours - diffusers| {np.abs(ours - want).max():.3g} of "
          f"max |latent| {np.abs(want).max():.3g}")
    assert want.std() > 0.01
    assert_frames_close(ours, want, atol=LATENT_ATOL, what="latents", again=lambda: (
        latents_of(_ours, tiny_checkpoint, path, flags, devices=jax.devices()[:1])[0],
        _reference(tiny_checkpoint, frames, 0.6, euler=True)))


def test_refusals_are_one_line(tiny_checkpoint, i2v_checkpoint, source, tmp_path, capsys):
    """Before any model loads: exit 2, one line naming the flag, value and rule, no file."""
    path, _ = source
    junk = tmp_path / "junk.mp4"
    junk.write_bytes(b"not a video at all" * 10)
    first = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "first_frame.png")
    t2v = ["--model_id", tiny_checkpoint, "--height", "32", "--width", "32"]
    cases = [
        (t2v + ["--video", path, "--strength", "0"], "error: --strength=0.0: must be in (0, 1]"),
        (t2v + ["--video", path, "--strength", "1.5"], "error: --strength=1.5: must be in"),
        (t2v + ["--video", path, "--strength", "0.1", "--num_inference_steps", "4"],
         "error: --strength=0.1: keeps int(4 x 0.1) = 0 of the 4 steps"),
        (t2v + ["--strength", "0.5"], "error: --strength=0.5: needs --video PATH"),
        (t2v + ["--video", str(junk)], f"error: --video={str(junk)!r}: not a video PyAV"),
        (t2v + ["--video", str(tmp_path / "none.mp4")], "file not found"),
        (t2v + ["--video", path, "--frames", "13"],
         f"error: --video={path!r}: has 11 frames, fewer than --frames 13"),
        (t2v + ["--video", path, "--stage", "encode"], "is not taken with --stage encode"),
        (["--model_id", i2v_checkpoint, "--image", first, "--video", path],
         "video-to-video runs on a Wan 2.1 text-to-video checkpoint"),
    ]
    for argv, text in cases:
        out = tmp_path / "out"
        code = generate_flax.cli([*argv, "--output_dir", str(out)])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and text in lines[0], (argv, lines)
        assert not out.exists() or not os.listdir(out)
