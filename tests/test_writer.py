"""Videos written on one background thread (``engine.files.writer``) while the next video's
work goes on, and every stage of a video timed apart in the report.

References: diffusers' own ``export_to_video`` on the same frames (the bytes of a threaded
write), PyAV reading the files back (frame count, size, each video's own pixels), and the
report's own stage clocks against the video's wall clock.
"""

import json
import os
import subprocess
import sys
import threading
import time
import types

import av
import numpy as np
import pytest
from diffusers.utils import export_to_video
from safetensors.numpy import load_file
from serve_util import cpu_xla_flags

import generate_flax
from engine.files import report as reporting
from engine.files import videos
from engine.files.writer import VideoWriter
from engine.run.errors import GenerationError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "generate_flax.py")
SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--dtype", "float32", "--attention", "xla", "--warmup_steps", "1",
         "--compilation_cache_dir", "none"]
FPS = 16


def config(folder, save_frames=False):
    return types.SimpleNamespace(run=types.SimpleNamespace(output_dir=str(folder),
                                                           save_frames=save_frames),
                                 video=types.SimpleNamespace(fps=FPS))


def clip(seed: int, n: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).random((n, 64, 96, 3), dtype=np.float32)


def read_mp4(path) -> np.ndarray:
    """(F, H, W, 3) uint8 decoded by PyAV."""
    with av.open(str(path)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def test_threaded_writes_are_bit_identical_to_diffusers_export(tmp_path):
    """Three videos through the writer thread (two of them with a muxed AAC track) equal,
    byte for byte, diffusers' export_to_video of the same frames written one after another
    (and the audio ones a direct call of the same writer on this thread)."""
    clips = [clip(s) for s in range(3)]
    wave_ = np.random.default_rng(5).uniform(-0.5, 0.5, (2, 12000)).astype(np.float32)
    audios = [None, reporting.Audio(wave_, 24000), reporting.Audio(wave_[:1], 16000)]
    threaded, direct = tmp_path / "threaded", tmp_path / "direct"
    threaded.mkdir()
    direct.mkdir()
    with VideoWriter() as writer:
        futures = [writer.submit(videos.write_video, config(threaded), c, "v", videos.Video(
            i, "p", "", i), a) for i, (c, a) in enumerate(zip(clips, audios, strict=True))]
    for i, (c, a) in enumerate(zip(clips, audios, strict=True)):
        path = threaded / f"v_{i}.mp4"
        assert futures[i].result()[0] == [str(path)]
        if a is None:
            want = export_to_video(list(c), str(direct / f"{i}.mp4"), fps=FPS)
        else:
            want = videos.save_video(config(direct), c, "v", videos.Video(i, "p", "", i), a)[0]
        assert path.read_bytes() == open(want, "rb").read(), i
    assert sorted(os.listdir(threaded)) == ["v_0.mp4", "v_1.mp4", "v_2.mp4"]


def test_order_kept_under_a_slow_first_write(tmp_path, monkeypatch):
    """The first write sleeps 1.5 s: submit returns at once (the run goes on), the files
    land in submission order, each holding its own video."""
    real, calls = reporting.save_video, []

    def slow_first(frames, path, fps, audio=None):
        calls.append(os.path.basename(path))
        if len(calls) == 1:
            time.sleep(1.5)
        real(frames, path, fps, audio)

    monkeypatch.setattr(reporting, "save_video", slow_first)
    levels = [0.1, 0.5, 0.9]
    writer, futures = VideoWriter(depth=2), []
    t0 = time.perf_counter()
    for i, level in enumerate(levels[:2]):
        futures.append(writer.submit(videos.write_video, config(tmp_path),
                                     np.full((5, 64, 96, 3), level, np.float32), "v",
                                     videos.Video(i, "p", "", i)))
    assert time.perf_counter() - t0 < 0.5  # two submits did not wait for the slow write
    futures.append(writer.submit(videos.write_video, config(tmp_path),
                                 np.full((5, 64, 96, 3), levels[2], np.float32), "v",
                                 videos.Video(2, "p", "", 2)))
    assert time.perf_counter() - t0 >= 1.4  # depth 2: the third waited for the first
    writer.wait()
    writer.close()
    assert calls == ["v_0.mp4", "v_1.mp4", "v_2.mp4"]
    done = [f.result()[1]["written_at"] for f in futures]
    assert done == sorted(done)
    for i, level in enumerate(levels):
        pixels = read_mp4(tmp_path / f"v_{i}.mp4")
        assert pixels.shape == (5, 64, 96, 3)
        assert abs(pixels.mean() - int(level * 255)) < 3, (i, pixels.mean())


def test_failed_write_is_one_line_at_the_next_submit_and_leaves_no_file(tmp_path):
    """A folder that is not there (ffmpeg cannot open its output): the next submit raises
    one line naming the file; no partial file anywhere; close ends the thread."""
    missing = tmp_path / "gone"
    writer = VideoWriter()
    writer.submit(videos.write_video, config(missing), clip(0, 3), "v")
    with pytest.raises(GenerationError) as caught:  # depth 1: this submit waits for it
        writer.submit(videos.write_video, config(tmp_path), clip(1, 3), "w")
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"could not write {missing / 'v.mp4'}: "), line
    writer.close()
    assert not missing.exists()
    assert os.listdir(tmp_path) == []  # the second write was never queued
    assert not any(t.name == "video-writer_0" for t in threading.enumerate())


def _inject_write_failure(monkeypatch, label: str):
    """``reporting.save_video`` fails for the file ending ``<label>.mp4`` after writing
    half a file under its temporary name (a disk that filled up mid-encode)."""
    real = reporting.save_video

    def failing(frames, path, fps, audio=None):
        if not path.endswith(f"{label}.mp4"):
            return real(frames, path, fps, audio)

        def write(tmp):
            with open(tmp, "wb") as f:
                f.write(b"\0" * 4096)
            raise OSError(28, "No space left on device")

        reporting.atomic_write(path, write)

    monkeypatch.setattr(reporting, "save_video", failing)


def test_cli_write_failure_is_one_line_exit_1_no_partial_file(tiny_checkpoint, tmp_path,
                                                              monkeypatch, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a fox", "name": "fox"}\n{"prompt": "a cat", "name": "cat"}'
                       '\n{"prompt": "a owl", "name": "owl"}\n')
    _inject_write_failure(monkeypatch, "_cat")
    out = tmp_path / "out"
    code = generate_flax.cli(["--model_id", tiny_checkpoint, *SMALL, "--prompts_file",
                              str(prompts), "--output_dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()  # progress bars, then the error
    errors = [line for line in err if "error" in line.lower() or "Traceback" in line]
    assert code == 1 and errors == err[-1:], err
    assert err[-1].startswith("generate_flax.py: error: could not write ") and \
        err[-1].endswith("_cat.mp4: OSError: [Errno 28] No space left on device"), err[-1]
    files = os.listdir(out)
    assert [f for f in files if f.endswith("_fox.mp4")] and not [  # owl: never queued
        f for f in files if "cat" in f or "owl" in f or "partial" in f or f.endswith(".json")
    ], files


def test_cli_prompts_file_files_and_stage_timings(tiny_checkpoint, tmp_path):
    """A prompts-file run as a user runs it: each mp4 (PyAV) has 9 frames of 96x64 and is
    byte for byte diffusers' export of its own lossless frames (--save_frames); the report
    times every stage apart, and one video's stages add up to at most its wall time."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a red fox", "seed": 1, "name": "fox"}\n'
                       '{"prompt": "a blue bird", "seed": 2}\n')
    out = tmp_path / "out"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(1))
    proc = subprocess.run([sys.executable, SCRIPT, "--model_id", tiny_checkpoint, *SMALL,
                           "--prompts_file", str(prompts), "--output_dir", str(out),
                           "--save_frames", "--no_plots"], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report_path, = [p for p in out.iterdir() if p.suffix == ".json"]
    report = json.loads(report_path.read_text())
    stem = report_path.stem
    assert sorted(os.listdir(out)) == sorted([f"{stem}.json", f"{stem}_fox.mp4", f"{stem}_1.mp4",
                                              f"{stem}_fox.frames.safetensors",
                                              f"{stem}_1.frames.safetensors"])
    for label in ("fox", "1"):  # each mp4 is diffusers' export of its own lossless frames
        mp4 = out / f"{stem}_{label}.mp4"
        assert read_mp4(mp4).shape == (9, 64, 96, 3)
        frames = load_file(str(out / f"{stem}_{label}.frames.safetensors"))["frames"]
        want = export_to_video(list(frames), str(tmp_path / f"want_{label}.mp4"), fps=FPS)
        assert mp4.read_bytes() == open(want, "rb").read(), label
    assert (out / f"{stem}_fox.mp4").read_bytes() != (out / f"{stem}_1.mp4").read_bytes()
    entries = report["videos"]
    assert [v["files"][0] for v in entries] == [f"{stem}_fox.mp4", f"{stem}_1.mp4"]
    for entry in entries:
        s = entry["stages"]
        assert list(s) == list(videos.STAGES)
        assert all(isinstance(v, float) and v >= 0 for v in s.values()), s
        assert s["postprocess_s"] > 0 and s["write_s"] > 0 and s["denoise_s"] > 0, s
        parts = sum(s[k] for k in videos.STAGES[:-1])
        assert parts <= s["video_wall_s"] + 0.01, s
        assert s["text_encode_s"] == report["timings"]["text_encode_s"]
        assert s["decode_s"] == entry["runs"][0]["vae_decode_s"]
    assert entries[0]["stages"]["video_wall_s"] < entries[1]["stages"]["video_wall_s"]


class FakeModel:
    """A warm model's ``run`` without a model: each job's frames are a level picked by its
    seed, its timings the stages a real run reports (seconds slept, so they are real)."""

    def __init__(self, folder):
        self.folder, self.started = folder, []

    def run(self, job_id, settings, image, on_step):
        self.started.append((job_id, time.time()))
        timings = {}
        for key, seconds in (("text_encode_s", 0.02), ("denoise_s", 0.03),
                             ("vae_decode_s", 0.02), ("to_frames_s", 0.01)):
            t0 = time.perf_counter()
            time.sleep(seconds)
            timings[key] = time.perf_counter() - t0
        frames = np.full((5, 64, 96, 3), settings.seed / 10, np.float32)
        return frames, config(self.folder), timings, None


def test_server_writes_on_the_writer_thread_in_order_and_fails_one_job(tmp_path,
                                                                       monkeypatch):
    """Three jobs through the worker (a real SQLite job store and shared folder, a model
    stand-in): job 1's write is slow (1 s) and job 2's fails after 4 KiB. Job 2's run starts
    before job 1's file exists; job 1 and 3 complete with each its own frames (diffusers'
    export of the same frames, byte for byte) and their stages; job 2 fails with one line
    naming its file and leaves none."""
    from engine.serve.fleet import Fleet
    from engine.serve.jobs import JobStore
    from engine.serve.model import Served
    from engine.serve.requests import check, parse
    from engine.serve.storage import SharedFolder
    from engine.serve.worker import Worker

    served = Served(model="tiny-wan", model_id="x", sizes=((96, 64),), frames=(5,),
                    frame_step=4, fps=FPS, num_inference_steps=2, guidance_scale=5.0,
                    guidance_scale_2=None, negative_prompt="", variable_guidance=True,
                    fixed_steps=False, image_mode="none")
    store = JobStore(str(tmp_path))
    ids = [store.add(check(parse(dict(prompt="p", seed=s, size="96x64", seconds="0.3125")),
                           served)).id for s in (1, 5, 9)]
    _inject_write_failure(monkeypatch, ids[1])  # job 2: ENOSPC after 4 KiB
    failing = reporting.save_video

    def slow_first(frames, path, fps, audio=None):
        if path.endswith(f"{ids[0]}.mp4"):
            time.sleep(1.0)
        return failing(frames, path, fps, audio)

    monkeypatch.setattr(reporting, "save_video", slow_first)
    fleet = Fleet(store, "localhost:0")
    fleet.buckets = (store.get(ids[0]).bucket,)
    model, fatal = FakeModel(tmp_path), []
    worker = Worker(store, model, fatal.append, None, fleet=fleet,
                    storage=SharedFolder(str(tmp_path)))
    thread = threading.Thread(target=worker.loop)
    thread.start()
    deadline = time.time() + 60
    while time.time() < deadline and any(store.get(i).status in ("queued", "in_progress")
                                         for i in ids):
        time.sleep(0.05)
    worker.stop()
    thread.join(30)
    assert not fatal and not thread.is_alive()
    jobs = [store.get(i) for i in ids]
    assert [j.status for j in jobs] == ["completed", "failed", "completed"], jobs
    # Job 2 ran while job 1 was still being written.
    assert model.started[1][1] < jobs[0].result["timings"]["stages"]["video_wall_s"] + \
        model.started[0][1]
    line = jobs[1].error
    assert "\n" not in line and line == (f"could not write {tmp_path / ids[1]}.mp4: OSError: "
                                         "[Errno 28] No space left on device"), line
    for job, seed in ((jobs[0], 1), (jobs[2], 9)):
        assert job.result["files"] == [f"{job.id}.mp4"]
        want = export_to_video(list(np.full((5, 64, 96, 3), seed / 10, np.float32)),
                               str(tmp_path / f"want{seed}.mp4"), fps=FPS)
        assert (tmp_path / f"{job.id}.mp4").read_bytes() == open(want, "rb").read()
        s = job.result["timings"]["stages"]
        assert list(s) == list(videos.STAGES) and all(v >= 0 for v in s.values()), s
        assert sum(s[k] for k in videos.STAGES[:-1]) <= s["video_wall_s"] + 0.01, s
        assert s["write_s"] > 0 and s["postprocess_s"] >= 0.01, s
    assert jobs[0].result["timings"]["stages"]["write_s"] >= 1.0  # the slow write, timed
    assert not [f for f in os.listdir(tmp_path) if ids[1] in f or "partial" in f]
    store.close()
