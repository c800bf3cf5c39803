"""Helios's chunks streamed into the CLI's mp4 (issue 68 item 3): the chunk loop hands each
decoded chunk to the ``engine.files.stream_writer.FragmentedMp4Writer`` of the run's mp4
(``engine.programs.denoise.run_chunks`` forwards to the sink ``engine.pipeline.
run_videos`` installs; ``engine.files.videos.RunFiles`` finishes it in place of the encode).

References: the same run's ``--save_frames`` (the lossless frames the run returned) encoded
once, continuously, by PyAV with the writer's encoder settings and an I frame at each chunk
start, as tests/test_stream_writer.py does: the streamed file's decoded frames are equal to
that encode's, pixel for pixel, so the file is those frames within H.264's loss and nothing
else; PyAV's demuxer sees a keyframe at each chunk start (frames 0 and 33), and the file's
top-level boxes are one init segment, then moof + mdat fragments. Measured (64 x 64 x 65,
2 chunks, 1 CPU device): mean |streamed - saved frames| 12.62 levels of 255 (bound 20, the
random tiny model's noisy frames), pixel-equal to the continuous encode; the server's path
(``WarmModel.run`` under a sink) gives the CLI's file frame for frame, and its growing file
decodes to the first chunk's 33 frames after chunk 1; over HTTP (the server's app, store,
worker and uvicorn), ``GET /content`` of the running job decodes to those 33 frames while
the job is held before its second chunk, and the finished job's mp4 equals the CLI's; a
3-chunk job cancelled after its first chunk keeps 2 whole chunks (66 frames, the first 65
the CLI's). The four tests: 43 s on the 2-core host (CLI run 14 s, served 6-7 s each).
"""

from __future__ import annotations

import contextlib
import glob
import os
import threading
import time

import av
import httpx2
import jax
import numpy as np
import pytest
import uvicorn
from safetensors.numpy import load_file
from serve_util import free_port, wait_for
from test_serve_stream import Reader

import generate_flax
from engine.files import report as reporting
from engine.files import stream_writer as sw
from engine.pipeline.generation import Generation
from engine.serve import model as served_model
from engine.serve.app import State, create_app
from engine.serve.fleet import Fleet
from engine.serve.jobs import JobStore
from engine.serve.requests import VideoJob
from engine.serve.storage import SharedFolder
from engine.serve.worker import Worker
from families import FAMILIES

FPS, WINDOW, SEED, PROMPT = 16, 33, 0, "A cat walks on the grass."


def _decode(path) -> np.ndarray:
    with av.open(str(path)) as f:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in f.decode(video=0)])


def _keyframes(path) -> list[int]:
    with av.open(str(path)) as f:
        packets = [p for p in f.demux(video=0) if p.size]
    return [i for i, p in enumerate(packets) if p.is_keyframe]


def _continuous_encode(path, pixels: np.ndarray) -> None:
    """One PyAV encode of ``pixels`` (F, H, W, 3) uint8 into an ordinary MP4, with the
    writer's encoder and options and an I frame at each chunk start."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(sw.ENCODER, rate=FPS, options=dict(sw.ENCODER_OPTIONS))
        stream.height, stream.width, stream.pix_fmt = *pixels.shape[1:3], "yuv420p"
        for i, image in enumerate(pixels):
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts = i
            if i % WINDOW == 0:
                frame.pict_type = av.video.frame.PictureType.I
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))


@pytest.fixture(scope="module")
def cli_run(helios_checkpoint, tmp_path_factory):
    """The CLI: 2 chunks (66 frames asked, 65 made: 33 + 32), 64 x 64, 2 steps, no CFG,
    timed twice, on one CPU device (the CLI's run on the first device only: 8 interpreted
    ones cost minutes here, and sharding is test_helios' case): its output folder."""
    out = tmp_path_factory.mktemp("helios-stream")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(generate_flax, "Generation",
                   lambda config, family: Generation(config, family, jax.devices()[:1]))
        code = generate_flax.main(_argv(helios_checkpoint, SEED) + [
            "--num_iterations", "2", "--save_frames", "--no_plots", "--output_dir", str(out)])
    assert code == 0
    return out


def _argv(checkpoint, seed: int) -> list[str]:
    return ["--model_id", checkpoint, "--dtype", "float32", "--seed", str(seed),
            "--prompt", PROMPT, "--max_sequence_length", "16", "--height", "64", "--width",
            "64", "--frames", "66", "--num_inference_steps", "2", "--guidance_scale", "1.0",
            "--fps", str(FPS), "--compilation_cache_dir", "none"]


def test_cli_streams_each_chunk_into_a_fragmented_mp4(cli_run, tmp_path):
    """The CLI's mp4 is the streamed one (fragments, a keyframe at each chunk start, the
    first timed run's chunks only) and decodes as a plain encode of its --save_frames."""
    out = cli_run
    (mp4,) = glob.glob(str(out / "*.mp4"))
    (saved,) = glob.glob(str(out / "*.frames.safetensors"))
    assert not glob.glob(str(out / ".*partial*")), os.listdir(out)
    frames = load_file(saved)["frames"]
    assert frames.shape == (65, 64, 64, 3)
    data = open(mp4, "rb").read()
    boxes = [k for k, _, _ in sw.top_level_boxes(data)]
    # an init segment, then one fragment (moof + mdat) per chunk: keyframes at the chunk
    # starts only (no scene cuts, stream_writer.ENCODER_OPTIONS)
    assert boxes == ["ftyp", "moov"] + ["moof", "mdat"] * 2, boxes
    keys = _keyframes(mp4)
    assert keys == [0, WINDOW], keys
    reference = tmp_path / "continuous.mp4"
    _continuous_encode(reference, reporting.to_uint8(frames))
    assert _keyframes(reference) == keys
    streamed = _decode(mp4)
    np.testing.assert_array_equal(streamed, _decode(reference))
    err = np.abs(streamed.astype(np.float32) - frames * 255).mean()
    print(f"mean |streamed - saved frames| {err:.2f} levels of 255")
    assert err < 20, err


def test_a_served_job_streams_the_same_file(cli_run, helios_checkpoint, tmp_path):
    """The server's path (``engine.serve.model.WarmModel.run`` under the sink the worker
    installs, ``engine.serve.worker``): a reader decodes the growing file after the first
    chunk (its 33 frames, whole), and the finished file's frames equal the CLI's. The
    model is built at seed 5 and the job asks seed 0: equal frames also show the job's own
    seed reaches the chunk loop."""
    config = generate_flax.validate_args(generate_flax.parse_args(_argv(
        helios_checkpoint, 5) + ["--serve", "--serve_sizes", "64x64", "--serve_frames", "65",
                                 "--output_dir", str(tmp_path)]))
    warm = served_model.build(config, FAMILIES[config.model.family], jax.devices()[:1])
    job = VideoJob(prompt=PROMPT, negative_prompt="", width=64, height=64, num_frames=65,
                   seconds="4", num_inference_steps=2, guidance_scale=1.0,
                   guidance_scale_2=None, seed=SEED, fps=FPS, model="helios")
    grown = []
    path = tmp_path / "served.mp4"
    sink = sw.FragmentedMp4Writer(str(path), FPS, on_written=lambda stats: grown.append(
        (stats["chunks_done"], _decode(sink.partial))))
    with sw.streaming(sink):
        frames, _, timings, _ = warm.run("job", job, None, lambda done, steps: None)
    stats = sink.finish()
    assert (stats["chunks_done"], stats["frames_done"], timings["chunks"]) == (2, 65, 2)
    final, (cli_mp4,) = _decode(path), glob.glob(str(cli_run / "*.mp4"))
    assert [(k, f.shape[0]) for k, f in grown] == [(1, 33), (2, 65)]
    np.testing.assert_array_equal(grown[0][1], final[:33])
    np.testing.assert_array_equal(final, _decode(cli_mp4))


class HeldAfterFirstChunk:
    """The warm model, its run held (in ``on_step``) once its first chunk is handed to the
    sink the worker installed, until ``go`` is set: a read lands while the job runs."""

    def __init__(self, warm):
        self.warm, self.go = warm, threading.Event()

    def __getattr__(self, name):
        return getattr(self.warm, name)

    def run(self, job_id, settings, image, on_step):
        sink = sw.chunk_sink()

        def held(done, steps):
            if sink.handed and not self.go.is_set():
                assert self.go.wait(60), "never let go"
            on_step(done, steps)

        return self.warm.run(job_id, settings, image, held)


@contextlib.contextmanager
def _server(model, warm, folder):
    """The server (its app, SQLite store, worker and uvicorn) in this process on ``model``
    (``warm`` or a wrapper of it), its files in ``folder``: yields its URL."""
    store = JobStore(str(folder))
    state = State(store=store, storage=SharedFolder(str(folder)),
                  fleet=Fleet(store, "127.0.0.1:0"), api_key=None, wake=threading.Event())
    worker = Worker(store, model, print, None, fleet=state.fleet, storage=state.storage)
    worker.wake = state.wake
    state.fleet.join(warm.served, list(warm.buckets))
    state.served = warm.served
    http = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1",
                                         port=free_port(), log_level="warning"))
    threads = [threading.Thread(target=worker.loop, daemon=True),
               threading.Thread(target=http.run, daemon=True)]
    for t in threads:
        t.start()
    try:
        while not http.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{http.config.port}"
    finally:
        model.go.set()
        worker.stop()
        http.should_exit = True
        for t in threads:
            t.join(timeout=10)
        state.fleet.leave()
        store.close()


def _warm(checkpoint, folder, frames: int):
    """The tiny Helios model served at 64 x 64 x ``frames``, built at seed 5 (jobs ask 0)."""
    config = generate_flax.validate_args(generate_flax.parse_args(_argv(checkpoint, 5) + [
        "--frames", str(frames + 1), "--serve", "--serve_sizes", "64x64", "--serve_frames",
        str(frames), "--output_dir", str(folder)]))
    return served_model.build(config, FAMILIES[config.model.family], jax.devices()[:1])


def test_a_served_job_streams_over_http_while_it_runs(cli_run, helios_checkpoint, tmp_path):
    """``GET /content`` of the running job decodes to the first chunk's 33 frames while the
    job is held before its second chunk; once it ends, the job's mp4 decodes to the CLI's
    frames and its chunks_done is 2."""
    warm = _warm(helios_checkpoint, tmp_path, 65)
    model, folder = HeldAfterFirstChunk(warm), tmp_path / "served"
    folder.mkdir()
    with _server(model, warm, folder) as url, httpx2.Client(base_url=url, timeout=60) as c:
        job = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", num_frames=65,
                                             seed=SEED)).json()
        assert "id" in job, job
        first = wait_for(c, job["id"], lambda j: j.get("chunks_done") == 1, 120)
        reader = Reader(f"{url}/v1/videos/{job['id']}/content")
        grown = reader.frames_when(tmp_path, WINDOW)
        assert c.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
        model.go.set()
        end = wait_for(c, job["id"], lambda j: j["status"] == "completed", 120)
        reader.thread.join(timeout=30)
    final = _decode(folder / f"{job['id']}.mp4")
    np.testing.assert_array_equal(final, _decode(glob.glob(str(cli_run / "*.mp4"))[0]))
    np.testing.assert_array_equal(grown, final[:WINDOW])
    assert (first["status"], end["chunks_done"], end["seconds_generated"]) == (
        "in_progress", 2, 65 / FPS)


def test_a_cancelled_served_job_keeps_its_whole_chunks(cli_run, helios_checkpoint, tmp_path):
    """A 3-chunk job (97 frames) cancelled while held after its first chunk makes its
    second (the chunk being made when the cancel came) and stops at the third's first step:
    cancelled with its mp4 of 2 whole chunks (66 frames), whose first 65 equal the CLI's
    2-chunk video (the same seed's first two chunks)."""
    warm = _warm(helios_checkpoint, tmp_path, 97)
    model, folder = HeldAfterFirstChunk(warm), tmp_path / "served"
    folder.mkdir()
    with _server(model, warm, folder) as url, httpx2.Client(base_url=url, timeout=60) as c:
        job = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", num_frames=97,
                                             seed=SEED)).json()
        wait_for(c, job["id"], lambda j: j.get("chunks_done") == 1, 120)
        assert c.post(f"/v1/videos/{job['id']}/cancel").status_code == 200
        model.go.set()
        end = wait_for(c, job["id"], lambda j: j["status"] == "cancelled", 120)
    assert (end["chunks_done"], end["files"]) == (2, [f"{job['id']}.mp4"])
    kept = _decode(folder / end["files"][0])
    assert kept.shape == (66, 64, 64, 3)
    np.testing.assert_array_equal(kept[:65], _decode(glob.glob(str(cli_run / "*.mp4"))[0]))
    assert not glob.glob(str(folder / ".*partial*"))
