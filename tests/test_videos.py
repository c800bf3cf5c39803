"""Many videos from one compile (--prompts_file, --seeds) and the pictures of a run.

Each video of a prompts-file run must equal a separate single-prompt run of the same prompt
and seed (the independent reference: one process, one video, as every other test runs), and
after the first video nothing compiles (JAX's persistent-cache events stay at zero).
"""

import json
import os

import jax
import numpy as np
import pytest
from PIL import Image

import generate_flax
from engine.files import plots
from engine.pipeline import generate
from families import FAMILIES

SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "3",
         "--dtype", "float32", "--attention", "xla", "--warmup_steps", "1"]
ENTRIES = [{"prompt": "a red fox in the snow", "seed": 1},
           {"prompt": "a blue bird", "seed": 2, "name": "bird", "negative_prompt": "cats"},
           {"prompt": "a red fox in the snow", "seed": 3}]


def _write(tmp_path, lines, name="prompts.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _run(checkpoint, extra, tmp_path, cache_dir="none"):
    """generate() in-process on one device; returns ({label: frames}, report)."""
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, *SMALL, "--output_dir", str(tmp_path / "out"),
        "--compilation_cache_dir", cache_dir, *extra]))
    frames = {}

    def keep(video, f):
        frames[video.label] = f
        return []

    last, report = generate(config, FAMILIES[config.model.family], devices=jax.devices()[:1],
                            on_video=keep)
    return frames or {None: last}, report


@pytest.fixture(scope="module")
def many(tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("many")
    path = _write(tmp, [json.dumps(e) for e in ENTRIES])
    return _run(tiny_checkpoint, ["--prompts_file", path], tmp,
                cache_dir=str(tmp / "jax-cache"))


@pytest.mark.parametrize("index", [1, 2])
def test_each_video_equals_its_single_run(tiny_checkpoint, tmp_path, many, index):
    """Videos after the first re-place their prompt embeddings and noise into the same
    compiled programs; the first is placed exactly as a single run is."""
    frames, report = many
    entry = ENTRIES[index]
    extra = ["--prompt", entry["prompt"], "--seed", str(entry["seed"])]
    if "negative_prompt" in entry:
        extra += ["--negative_prompt", entry["negative_prompt"]]
    single, _ = _run(tiny_checkpoint, extra, tmp_path)
    label = entry.get("name", str(index))
    np.testing.assert_allclose(frames[label], single[None], atol=1e-6, rtol=0)
    # ... and the videos differ from each other (a stuck prompt or seed would not).
    assert np.abs(frames[label] - frames["0"]).max() > 0.05


def test_one_compile_for_all_videos(many):
    _, report = many
    videos = report["videos"]
    assert [v["name"] for v in videos] == [None, "bird", None]
    assert [v["seed"] for v in videos] == [1, 2, 3]
    # After the first video nothing compiled: no persistent-cache event at all (a new
    # program, even a small eager scheduler op, is a miss or a hit here).
    assert all(v["compilation_cache"] == {"hits": 0, "misses": 0} for v in videos[1:]), videos
    assert report["compilation_cache"]["misses"] > 0  # the cache was on and did see compiles
    t = report["timings"]
    assert t["warmup_steps"] == 1 and len(t["runs"]) == 3  # one warmup, three timed videos


def test_seeds_equal_the_prompts_file_videos(tiny_checkpoint, tmp_path, many):
    frames, _ = many
    seeded, report = _run(tiny_checkpoint, ["--prompt", ENTRIES[0]["prompt"], "--seeds", "1,3"],
                          tmp_path)
    assert sorted(seeded) == ["seed1", "seed3"]
    np.testing.assert_allclose(seeded["seed1"], frames["0"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(seeded["seed3"], frames["2"], atol=1e-6, rtol=0)


def test_timeline_phases_match_the_report(many, tmp_path):
    _, report = many
    path = tmp_path / "timeline.png"
    phases = plots.timeline(report, str(path))
    t = report["timings"]
    by = {}
    for row, label, _, seconds in phases:
        by.setdefault((row, label), []).append(seconds)
    for label, key in plots.COLD_PHASES:
        if key in t:
            assert by[("cold start", label)] == [t[key]]
    for video in report["videos"]:
        row = f"video {video['name'] or video['index']} run 1"
        run = video["runs"][0]
        assert by[(row, "step")] == run["step_seconds"]
        assert len(run["step_seconds"]) == 3
        assert by[(row, "VAE decode")] == [run["vae_decode_s"]]
    # Laid end to end: each bar starts where the previous one ended.
    for (_, _, start, seconds), (_, _, nxt, _) in zip(phases, phases[1:], strict=False):
        assert nxt == pytest.approx(start + seconds)
    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] == 1200
        assert im.size[1] >= 100 * (1.2 + 0.45 * 4)


def test_timeline_legend_overlaps_nothing_and_leaves_no_blank_band(many):
    """The legend lies below the x-axis label and the tick labels, inside the figure, with
    at most a few pixels under it (it once sat on the label, over a blank band)."""
    import matplotlib.pyplot as plt

    _, report = many
    fig, _ = plots.draw_timeline(report)
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        (ax,), (legend,) = fig.axes, fig.legends
        box = legend.get_window_extent(renderer)
        label = ax.xaxis.label.get_window_extent(renderer)
        ticks = [t.get_window_extent(renderer) for t in ax.get_xticklabels() if t.get_text()]
        assert ticks and box.y1 <= min([label.y0, *(t.y0 for t in ticks)])  # below, no overlap
        assert 0 <= box.y0 <= 12  # pixels under the legend: no blank band
        assert box.x0 >= 0 and box.x1 <= fig.bbox.width
    finally:
        plt.close(fig)


def test_cli_writes_every_video_and_one_report(tiny_checkpoint, tmp_path):
    path = _write(tmp_path, [json.dumps(ENTRIES[1]), json.dumps({"prompt": "a dog"})])
    out = tmp_path / "out"
    code = generate_flax.cli(["--model_id", tiny_checkpoint, *SMALL, "--prompts_file", path,
                              "--output_dir", str(out), "--compilation_cache_dir", "none",
                              "--num_iterations", "1"])
    assert code == 0
    files = sorted(os.listdir(out))
    stem = files[0].split(".")[0]
    assert files == [f"{stem}.json", f"{stem}_1.mp4", f"{stem}_bird.mp4",
                     f"{stem}_timeline.png"], files
    report = json.loads((out / f"{stem}.json").read_text())
    assert [v["files"] for v in report["videos"]] == [[f"{stem}_bird.mp4"], [f"{stem}_1.mp4"]]
    assert "video" not in report  # one report for many videos, each naming its own files


BAD_LINES = [
    (["{\"prompt\": \"a\"}", "not json"], "line 2: not JSON"),
    (["{\"seed\": 3}"], "line 1: no \"prompt\""),
    (["{\"prompt\": \"a\", \"seed\": \"3\"}"], "line 1: \"seed\" must be a int"),
    (["{\"prompt\": \"a\", \"name\": \"x\"}", "", "{\"prompt\": \"b\", \"name\": \"x\"}"],
     "line 3: duplicate \"name\" 'x' (also line 1)"),
    (["{\"prompt\": \"a\", \"steps\": 3}"], "line 1: unknown key 'steps'"),
    (["[\"a\"]"], "line 1: expected a JSON object, got list"),
    ([""], "no prompts (the file is empty)"),
]


@pytest.mark.parametrize("lines,message", BAD_LINES, ids=[m for _, m in BAD_LINES])
def test_bad_prompts_file_is_one_line_before_loading(tiny_checkpoint, tmp_path, capsys,
                                                     monkeypatch, lines, message):
    def generate(*a, **k):
        raise AssertionError("the run started")

    monkeypatch.setattr(generate_flax, "generate", generate)
    path = _write(tmp_path, lines)
    out = tmp_path / "out"
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--prompts_file", path,
                              "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"--prompts_file={path!r}" in err[0] and message in err[0], err[0]
    assert not out.exists() or not os.listdir(out)


def test_seeds_with_prompts_file_is_refused(tiny_checkpoint, tmp_path, capsys):
    path = _write(tmp_path, [json.dumps(ENTRIES[0])])
    code = generate_flax.cli(["--model_id", tiny_checkpoint, "--prompts_file", path,
                              "--seeds", "1,2", "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--seeds='1,2'" in err[0], err


def test_staged_prompts_file_equals_the_one_stage_run(tiny_checkpoint, tmp_path, many):
    """encode -> denoise -> decode with a 2-entry prompts file: one embeddings and one latents
    file per entry under --work_dir/videos/<label>/, and the decoded videos equal those of
    the one-stage run (same prompts, seeds and device)."""
    from engine.run.errors import UsageError

    path = _write(tmp_path, [json.dumps(e) for e in ENTRIES[:2]])
    stage = ["--prompts_file", path, "--work_dir", str(tmp_path / "work"), "--stage"]
    _, encoded = _run(tiny_checkpoint, stage + ["encode"], tmp_path)
    assert [v["name"] for v in encoded["videos"]] == [None, "bird"]
    _, denoised = _run(tiny_checkpoint, stage + ["denoise"], tmp_path)
    assert [len(v["runs"]) for v in denoised["videos"]] == [1, 1]
    assert sorted(os.listdir(tmp_path / "work" / "videos")) == ["0", "bird"]
    frames, decoded = _run(tiny_checkpoint, stage + ["decode"], tmp_path)
    assert sorted(frames) == ["0", "bird"]
    for label in frames:
        np.testing.assert_allclose(frames[label], many[0][label], atol=1e-6, rtol=0)
    # A later stage given another prompt for an entry refuses its files, naming them.
    other = _write(tmp_path, [json.dumps(ENTRIES[0]), json.dumps(dict(ENTRIES[1], seed=9))],
                   "other.jsonl")
    with pytest.raises(UsageError, match=r"videos/bird/latents\.safetensors: made for seed 2, "
                                         r"but video 'bird' has 9"):
        _run(tiny_checkpoint, ["--prompts_file", other, *stage[2:], "decode"], tmp_path)
