"""LTX-2 conditions (families/ltx2_conditions.py, ``--condition PATH@FRAME[:STRENGTH]``) against
diffusers' own eager ``LTX2ConditionPipeline`` on CPU.

Float32 on the tiny random LTX-2 checkpoint (tools/make_tiny_ltx2_checkpoint.py: 32x spatial,
8x temporal compression), test_ltx2's prompts, seed, steps (2) and bound. 64 x 64 pixels, 25
frames: 4 x 2 x 2 = 16 base video tokens, 26 audio tokens; pixel frames 0, 1, 9, 17 map to
latent indices 0, 1, 2, 3. Three runs, each on one CPU device (XLA attention), each against
diffusers given the same ``LTX2VideoCondition`` list (CRF 33 as the tiny Gemma 3 implies):

* ``first_last``: an image at frame 0 (replaces latent frame 0), strength 1, and another at
  frame 17 (the last latent frame: 4 keyframe tokens appended), strength 0.7; CFG (batch 2,
  the mask per side). The CI tier's case.
* ``keyframe``: an image at frame 9 (mid-video keyframe), strength 0.6; guidance off.
* ``extension``: a 9-frame video at frame 0 (replaces latent frames 0 and 1), strength 1;
  the pipeline's default guidance (CFG + STG + modality passes).
* ``video_keyframe``: the same video at frame 9, strength 0.8 (8 keyframe tokens appended,
  two latent frames, no single-frame clamp on their RoPE time); guidance off.

Refusals: one line, exit 2, no file, before anything loads.
"""

import glob
import os

import av
import jax
import numpy as np
import pytest
import torch
from PIL import Image
from test_ltx2 import ATOL, CFG, NEGATIVE, OFF, PROMPT, SEED, STEPS, _argv, run_recorded

import generate_flax
from engine.files.video_input import read_video
from families import ltx2_conditions

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FIRST_FRAME = os.path.join(DATA, "first_frame.png")
SHAPE = dict(height=64, width=64, frames=25)
GRID = (4, 2, 2)  # latent frames, height, width
BASE = 16  # base video tokens
AUDIO = 26  # latent audio frames: round(25 / 24 x 25)
CHANNELS = 8


def _make_inputs(folder) -> dict:
    """A second image (the first, mirrored and darkened) and a 9-frame 96 x 160 H.264 video
    (the first image rolled sideways frame by frame), written once."""
    first = np.array(Image.open(FIRST_FRAME).convert("RGB"))
    last = os.path.join(folder, "last.png")
    Image.fromarray((first[:, ::-1] * 0.6).astype(np.uint8)).save(last)
    video = os.path.join(folder, "clip.mp4")
    with av.open(video, "w") as container:
        stream = container.add_stream("libx264", rate=24)
        stream.height, stream.width, stream.pix_fmt = first.shape[0], first.shape[1], "yuv420p"
        for i in range(9):
            frame = av.VideoFrame.from_ndarray(np.roll(first, 8 * i, axis=1), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return dict(first=FIRST_FRAME, last=last, video=video)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return _make_inputs(tmp_path_factory.mktemp("conditions"))


def _cases(paths) -> dict:
    """{case: (guidance scales, [(path, frame, strength), ...])}."""
    return {
        "first_last": (CFG, [(paths["first"], 0, 1.0), (paths["last"], 17, 0.7)]),
        "keyframe": (OFF, [(paths["first"], 9, 0.6)]),
        "extension": ({}, [(paths["video"], 0, 1.0)]),
        "video_keyframe": (OFF, [(paths["video"], 9, 0.8)]),
    }


def _diffusers_frames(path):
    """What the example passes: a PIL image (``load_image``), or the video's frames as PIL
    images (decoded by PyAV as ours are: diffusers' ``load_video`` decodes H.264 through
    imageio, up to 3 levels apart, tests/test_video_input.py)."""
    from diffusers.utils import load_image

    return load_image(path) if path.endswith(".png") else read_video(path)


def _reference(checkpoint, scales, conditions):
    """diffusers' LTX2ConditionPipeline, eager float32: (frames, waveform, video latents
    (1, C, F', h, w), audio latents (1, C, L, mel)), one call per output type."""
    from diffusers import LTX2ConditionPipeline
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition

    pipe = LTX2ConditionPipeline.from_pretrained(checkpoint, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    for vae in (pipe.vae, pipe.audio_vae):  # the returned latents are the packed ones
        assert not vae.latents_mean.any() and (vae.latents_std == 1).all()
    items = [LTX2VideoCondition(frames=_diffusers_frames(p), index=0 if f == 0 else
                                (f - 1) // 8 + 1, strength=s) for p, f, s in conditions]
    runs = []
    for output_type in ("np", "latent"):
        with torch.no_grad():
            runs.append(pipe(
                conditions=items, prompt=PROMPT, negative_prompt=NEGATIVE,
                num_frames=SHAPE["frames"], height=SHAPE["height"], width=SHAPE["width"],
                frame_rate=24.0, num_inference_steps=STEPS, output_type=output_type,
                return_dict=False, generator=torch.Generator("cpu").manual_seed(SEED),
                **scales))
    (video, audio), (video_latents, audio_latents) = runs
    return video[0], audio[0].float().numpy(), video_latents.numpy(), audio_latents.numpy()


def _unpacked(latents):
    """Our packed (1, size + K C) final latents -> (video (1, 8, 4, 2, 2), audio
    (1, 2, 26, 16)), the keyframe tokens after the audio dropped as the pipeline drops them."""
    from diffusers import LTX2Pipeline

    latents = torch.from_numpy(np.array(latents))
    n = BASE * CHANNELS
    video = LTX2Pipeline._unpack_latents(latents[:, :n].reshape(1, BASE, CHANNELS), *GRID, 1, 1)
    audio = latents[:, n:n + AUDIO * 32].reshape(1, AUDIO, 32)
    audio = LTX2Pipeline._unpack_audio_latents(audio, AUDIO, num_mel_bins=16)
    return video.numpy(), audio.numpy()


def _flags(conditions) -> list:
    return [a for p, f, s in conditions for a in ("--condition", f"{p}@{f}:{s}")]


# The heavy tier (``make test-all``; marked here rather than in tests/conftest.py's SLOW):
# each is a whole run and a diffusers run, 50-85 s on the busy 2-core host | [first_last]
# keeps index 0, an appended keyframe at strength < 1 and CFG in CI.
@pytest.mark.parametrize("case", ["first_last", pytest.param("keyframe", marks=pytest.mark.slow),
                                  pytest.param("extension", marks=pytest.mark.slow),
                                  pytest.param("video_keyframe", marks=pytest.mark.slow)])
def test_conditions_match_diffusers(ltx2_checkpoint, inputs, case):
    """Final latents of both modalities, frames and waveform within test_ltx2's ATOL."""
    _check(ltx2_checkpoint, inputs, case, jax.devices()[:1])


@pytest.mark.slow
def test_sharded_conditions_match_diffusers(ltx2_checkpoint, inputs):
    """``first_last`` on 8 CPU devices as dp 2 x sp 4: the CFG pair, the mask and the clean
    latents split over dp, the 20 video tokens (16 + 4 keyframe tokens) over sp."""
    _check(ltx2_checkpoint, inputs, "first_last", jax.devices(), "--dp", "2", "--tp", "1",
           "--sp", "4")


def _check(checkpoint, inputs, case, devices, *layout):
    scales, conditions = _cases(inputs)[case]
    size = [f"--{k}={v}" for k, v in SHAPE.items()]
    config = generate_flax.validate_args(generate_flax.parse_args(_argv(
        checkpoint, scales, *size, "--attention", "xla", *layout, *_flags(conditions))))
    run, frames, recorder = run_recorded(config, devices)
    wave = run.programs.vae_decode.audio.waveform
    report = run.finish()
    video_latents, audio_latents = _unpacked(recorder.latents)
    want_frames, want_wave, want_video, want_audio = _reference(checkpoint, scales, conditions)
    np.testing.assert_allclose(video_latents, want_video, atol=ATOL)
    np.testing.assert_allclose(audio_latents, want_audio, atol=ATOL)
    assert frames.shape == want_frames.shape == (SHAPE["frames"], SHAPE["height"],
                                                 SHAPE["width"], 3)
    np.testing.assert_allclose(frames, want_frames, atol=ATOL)
    np.testing.assert_allclose(wave, want_wave, atol=ATOL)
    if case == "first_last":  # strength 1 at index 0: latent frame 0 is the image's, exactly
        clean = ltx2_conditions.encoded(config)["clean"][0, :4].numpy()
        np.testing.assert_array_equal(video_latents[0, :, 0].reshape(CHANNELS, 4).T, clean)
        assert np.abs(want_video[0, :, 0] - want_video[0, :, 1]).max() > 100 * ATOL
    got = report["settings"]["inputs"][ltx2_conditions.NAME]
    assert [(c["frame"], c["strength"]) for c in got] == [(f, s) for _, f, s in conditions]
    assert report["mesh"]["dp"] * report["mesh"]["tp"] * report["mesh"]["sp"] == len(devices)
    print(case, len(devices), "devices: max |ours - diffusers|: video latents",
          float(np.abs(video_latents - want_video).max()), "audio latents",
          float(np.abs(audio_latents - want_audio).max()), "frames",
          float(np.abs(frames - want_frames).max()), "waveform",
          float(np.abs(wave - want_wave).max()))


def _refused(checkpoint, tmp_path, capsys, *extra):
    out = tmp_path / "out"
    code = generate_flax.cli(_argv(checkpoint, {}, "--height=64", "--width=64",
                                   "--frames=25", "--output_dir", str(out), *extra))
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert not glob.glob(str(out / "*")), "a refused run wrote a file"
    return err


@pytest.mark.parametrize("value,rule", [
    ("{first}@3", "frame 3 starts no latent frame"),
    ("{first}@25", "outside the video's frames 0..24"),
    ("{first}@9:1.5", "strength 1.5 is outside [0, 1]"),
    ("{first}@9:x", "FRAME must be an integer and STRENGTH a number"),
    ("{first}", "expected PATH@FRAME[:STRENGTH]"),
    ("/no/such.png@0", "file not found"),
    ("{bad}@0", "not a video PyAV can open"),
])
def test_bad_condition_is_one_line(ltx2_checkpoint, inputs, tmp_path, capsys, value, rule):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a video")
    value = value.format(first=inputs["first"], bad=bad)
    err = _refused(ltx2_checkpoint, tmp_path, capsys, "--condition", value)
    assert err.startswith("generate_flax.py: error: --condition='"), err
    assert rule in err and (value.rpartition("@")[0] or value) in err, err


def test_condition_with_image_or_dry_run_is_one_line(ltx2_checkpoint, inputs, tmp_path,
                                                     capsys):
    cond = ["--condition", f"{inputs['first']}@0"]
    err = _refused(ltx2_checkpoint, tmp_path, capsys, *cond, "--image", inputs["first"])
    assert "--image=" in err and "not with --condition" in err
    err = _refused(ltx2_checkpoint, tmp_path, capsys, *cond, "--dry_run",
                   "--topology", "v6e:2x2")
    assert "--condition: not supported with --dry_run" in err
    # Before the server starts: no start line, no jobs database in the output folder.
    err = _refused(ltx2_checkpoint, tmp_path, capsys, *cond, "--serve")
    assert "--condition: not supported with --serve" in err
