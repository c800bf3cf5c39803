"""``generate_flax.py --serve`` on the tiny LTX-2 checkpoint: a served video carries its sound.

One server (one CPU device, 64 x 64 x 9, 2 steps, guidance off: one pass per step), then the
one-shot CLI on the same settings and seed, loading the programs the server compiled from
their shared executable cache (one compile for both). A job made through the official
``openai`` client is downloaded from ``/content``; ffmpeg (imageio-ffmpeg's binary,
``test_audio_mp4``'s helpers) lists one H.264 stream and one AAC stream (24 kHz, stereo) and
decodes them: 9 frames and at least the waveform's 7,920 samples. The job's frames file
(frames and waveform) equals the CLI's bit for bit, as ``tests/test_serve.py`` checks Wan's.
Requests LTX-2 cannot honour are one-line 400s; more than one served shape is a one-line
usage error.
"""

import glob
import json
import os

import imageio_ffmpeg
import numpy as np
import pytest
from openai import OpenAI
from safetensors.numpy import load_file
from serve_util import KEY, PROMPT, SETTINGS, Server, cli_frames, env
from test_audio_mp4 import decoded_audio, streams

import generate_flax
from engine.files import plots
from engine.files.checkpoint import read_component_config
from engine.run.errors import UsageError
from engine.serve import model
from families import FAMILIES

FRAMES, SEED = 9, 5
SAMPLES = 7920  # the vocoder's output for 9 frames: (4 x 9 latent audio frames - 3) x 240
# LTX-2 with every guidance pass off (one transformer pass per step: the cheapest compile).
OFF = ["--guidance_scale", "1", "--stg_scale", "0", "--modality_scale", "1",
       "--audio_guidance_scale", "1", "--audio_stg_scale", "0", "--audio_modality_scale", "1"]
FLAGS = ["--frames", str(FRAMES), *OFF]


@pytest.fixture(scope="module")
def served(ltx2_checkpoint, tmp_path_factory):
    """(server, the CLI's frames file for SEED, the CLI's JSON report). The server compiles
    into an executable cache that the CLI then loads (``--executable_cache_dir``): one
    compile for both."""
    root = tmp_path_factory.mktemp("serve-ltx2")
    programs = ["--executable_cache_dir", str(root / "executables")]
    server = Server(["--model_id", ltx2_checkpoint, *SETTINGS, *FLAGS, *programs, "--api_key",
                     KEY, "--compilation_cache_dir", "none"], root / "out",
                    environ=env(1)).start()
    try:
        server.wait_ready()
        cli_frames(ltx2_checkpoint, root / "cli", [SEED], *FLAGS, *programs).result()
        (path,) = glob.glob(str(root / "cli" / f"*_seed{SEED}.frames.safetensors"))
        (report,) = glob.glob(str(root / "cli" / "*.json"))
        with open(report) as f:
            report = json.load(f)
        timings = report["timings"]
        assert timings["programs_loaded"] == 2 and timings["programs_compiled"] == 0, timings
        yield server, load_file(path), report
    finally:
        code = server.stop()
        assert code == 0, server.tail()


def test_served_mp4_has_the_audio_track_and_the_clis_frames_and_waveform(served, tmp_path):
    server, want, _ = served
    client = OpenAI(base_url=server.url + "/v1", api_key=KEY)
    video = client.videos.create_and_poll(prompt=PROMPT, size="64x64", poll_interval_ms=300,
                                          extra_body={"num_frames": FRAMES, "seed": SEED})
    assert video.status == "completed", video
    extra = video.model_extra
    assert (extra["audio_sample_rate"], extra["audio_channels"]) == (24000, 2)
    assert extra["audio_seconds"] == pytest.approx(SAMPLES / 24000, abs=1e-12)
    path = str(tmp_path / "served.mp4")
    client.videos.download_content(video.id).write_to_file(path)
    lines = streams(path)
    assert len(lines) == 2, lines
    assert "Video: h264" in lines[0] and "Audio: aac" in lines[1], lines
    assert "24000 Hz" in lines[1] and "stereo" in lines[1], lines
    assert imageio_ffmpeg.count_frames_and_secs(path)[0] == FRAMES
    track = decoded_audio(path, 2)  # AAC pads its last 1,024-sample frame
    assert SAMPLES <= track.shape[1] <= SAMPLES + 2 * 1024 and np.abs(track).max() > 0.05
    saved = load_file(os.path.join(server.out, f"{video.id}.frames.safetensors"))
    assert saved["frames"].shape == (FRAMES, 64, 64, 3) and saved["audio"].shape == (2, SAMPLES)
    np.testing.assert_array_equal(saved["frames"], want["frames"])
    np.testing.assert_array_equal(saved["audio"], want["audio"])


@pytest.mark.parametrize("field,value,needle", [
    ("fps", 30, "fps=30: is fixed at 24 for LTX-2 here"),
    ("num_inference_steps", 3, "num_inference_steps=3: only 2 steps are served (the step "
                               "program's inputs hold a per-step table"),
    ("guidance_scale", 3.0, "guidance_scale=3.0: this model's CFG scale is compiled in"),
    ("guidance_scale_2", 2.0, "guidance_scale_2=2.0: only two-expert models take it"),
])
def test_requests_ltx2_cannot_honour_are_one_line_400s(served, field, value, needle):
    server, _, _ = served
    with server.client() as c:
        r = c.post("/v1/videos", json={"prompt": PROMPT, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith(needle) and "\n" not in error["message"], error
    assert error["param"] == field


@pytest.mark.parametrize("flag,value", [("--serve_sizes", "64x64"), ("--serve_frames", "9")])
def test_one_served_shape(ltx2_checkpoint, flag, value):
    with pytest.raises(UsageError) as e:
        generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", ltx2_checkpoint, "--serve", flag, value]))
    assert str(e.value).startswith(f"{flag}={value!r}: LTX-2 serves one shape")
    assert "\n" not in str(e.value)



def test_timeline_names_the_audio_phases_and_its_legend_overlaps_nothing(served):
    """The CLI's report (a video with sound) drawn: the decode and write phases carry their
    audio names, the title the track; the legend (three lines here) lies below the x-axis
    label and tick labels, inside the figure, with at most a few pixels under it (matplotlib's
    own geometry: each artist's window extent)."""
    import matplotlib.pyplot as plt

    report = served[2]
    fig, phases = plots.draw_timeline(report)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,), (legend,) = fig.axes, fig.legends
        names = [t.get_text() for t in legend.get_texts()]
        assert {"video + audio decode", "decode video + audio", "write mp4 + AAC",
                "warmup video + audio decode"} <= set(names), names
        assert not {"VAE decode", "decode", "write", "warmup VAE decode"} & set(names), names
        assert ax.get_title().endswith("audio 24000 Hz x 2, 0.33 s")
        box = legend.get_window_extent(renderer)
        label = ax.xaxis.label.get_window_extent(renderer)
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert ticks and box.y1 <= min([label.y0, *(t.y0 for t in ticks)])
        assert 0 <= box.y0 <= 12 and box.x0 >= 0 and box.x1 <= fig.bbox.width
    finally:
        plt.close(fig)


def test_only_the_family_rules_fix_steps_and_fps(tiny_checkpoint, ltx2_checkpoint):
    """What the server fixes comes from the family, not from a list of names: LTX-2's
    step inputs hold a (B, 2, steps) table and its flag check fixes fps 24; Wan 2.1 takes
    any step count and fps (its fps is the mp4's rate only)."""
    rules = {}
    for name, checkpoint in (("wan", tiny_checkpoint), ("ltx2", ltx2_checkpoint)):
        config = generate_flax.validate_args(generate_flax.parse_args(
            ["--model_id", checkpoint, "--serve", "--height", "64", "--width", "64",
             "--frames", "9", "--num_inference_steps", "2"]))
        family = FAMILIES[config.model.family]
        cfg = read_component_config(checkpoint, "transformer")
        rules[name] = (model._steps_in_inputs(config, family, cfg),
                       model._fps_rule(config, family))
    assert rules["wan"] == (None, None)
    steps, fps = rules["ltx2"]
    assert steps == "the step program's inputs hold a per-step table of that length"
    assert fps.startswith("is fixed at 24 for LTX-2 here")
