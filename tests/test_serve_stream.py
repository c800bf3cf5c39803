"""A served job whose model makes its video chunk by chunk streams it (``GET .../content``
while it runs), reports its chunks, and keeps its whole chunks when cancelled; a job whose
model does not stream is served as before.

The server's own app, job store (SQLite), worker and uvicorn run in this process on a
test-only model: ``ChunkedModel`` hands 4 chunks of 9 deterministic frames (32x48, the
frames of tests/test_stream_writer.py) to the run's sink, as a chunked family's loop does,
and waits before each chunk for the test to let it go, so a read lands between chunks.
References: PyAV decoding what the HTTP client has received so far (exactly the whole
chunks done), and test_stream_writer's continuous PyAV encode of the same frames (equal
pixels); the frames file equals the frames handed over.
"""

import glob
import os
import threading
import time
import types
from collections import defaultdict

import httpx2
import numpy as np
import pytest
import uvicorn
from safetensors.numpy import load_file
from serve_util import chromium, free_port, wait_for
from test_stream_writer import CHUNKS, FPS, F, chunks, continuous_encode, decode

from engine.files import stream_writer
from engine.serve.app import State, create_app
from engine.serve.fleet import Fleet
from engine.serve.jobs import JobStore
from engine.serve.model import Served
from engine.serve.storage import SharedFolder
from engine.serve.worker import Worker

SERVED = Served(model="chunky", model_id="test/chunky", sizes=((48, 32),), frames=(36,),
                frame_step=1, fps=FPS, num_inference_steps=2, guidance_scale=1.0,
                guidance_scale_2=None, negative_prompt="", variable_guidance=False,
                fixed_steps=False, image_mode="none")
JOB = dict(size="48x32", num_frames=CHUNKS * F, seed=1)
PLAIN = "a video made in one piece"  # this prompt's run hands no chunk to the sink


class ChunkedModel:
    """The test's producer (``WarmModel.run``'s interface): per chunk, 2 steps (``on_step``,
    which raises a cancel) and the chunk's frames to ``stream_writer.chunk_sink()``; chunk
    k > 0 waits for ``gate(job id, k)``."""

    def __init__(self, folder):
        self.config = types.SimpleNamespace(
            run=types.SimpleNamespace(output_dir=str(folder), save_frames=True),
            video=types.SimpleNamespace(fps=FPS))
        self._gates, self._lock = defaultdict(threading.Event), threading.Lock()

    def gate(self, job_id: str, k: int) -> threading.Event:
        with self._lock:
            return self._gates[job_id, k]

    def run(self, job_id, settings, image, on_step):
        sink = stream_writer.chunk_sink()
        for k, chunk in enumerate(chunks()):
            if k:
                assert self.gate(job_id, k).wait(30), f"chunk {k} never let go"
            for s in range(2):
                on_step(2 * k + s + 1, 2 * CHUNKS)
            if settings.prompt != PLAIN:
                sink.on_chunk(chunk)
        return np.concatenate(chunks()), self.config, {}, None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stream")
    store = JobStore(str(folder))
    state = State(store=store, storage=SharedFolder(str(folder)),
                  fleet=Fleet(store, "127.0.0.1:0"), api_key=None, wake=threading.Event())
    model = ChunkedModel(folder)
    worker = Worker(store, model, print, None, fleet=state.fleet, storage=state.storage)
    worker.wake = state.wake
    state.fleet.join(SERVED, ["48x32x36"])
    state.served = SERVED
    http = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1",
                                         port=free_port(), log_level="warning"))
    threads = [threading.Thread(target=worker.loop, daemon=True),
               threading.Thread(target=http.run, daemon=True)]
    for t in threads:
        t.start()
    while not http.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{http.config.port}"
    try:
        yield types.SimpleNamespace(url=url, model=model, folder=str(folder))
    finally:
        worker.stop()
        http.should_exit = True
        for t in threads:
            t.join(timeout=10)
        state.fleet.leave()
        store.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("ref") / "continuous.mp4"
    continuous_encode(path, chunks())
    return decode(path)


class Reader:
    """``GET /content`` read on a thread into ``data`` as the bytes arrive."""

    def __init__(self, url: str):
        self.data, self.headers, self.status = bytearray(), None, None
        self.thread = threading.Thread(target=self._read, args=(url,), daemon=True)
        self.thread.start()

    def _read(self, url):
        with httpx2.Client(timeout=60) as c, c.stream("GET", url) as r:
            self.status, self.headers = r.status_code, r.headers
            for block in r.iter_raw():
                self.data.extend(block)

    def frames_when(self, folder, n: int, timeout: float = 20.0) -> np.ndarray:
        """The received bytes' decoded frames once they are ``n`` (PyAV on a copy)."""
        t0, path, got = time.monotonic(), os.path.join(folder, "received.mp4"), None
        while time.monotonic() - t0 < timeout:
            with open(path, "wb") as f:
                f.write(bytes(self.data))
            try:
                got = decode(path)
            except Exception:  # noqa: BLE001 - nothing whole received yet
                got = None
            if got is not None and len(got) == n:
                return got
            time.sleep(0.05)
        raise AssertionError(f"received {0 if got is None else len(got)} frames, not {n}")


def test_a_running_job_streams_its_chunks_and_reports_them(server, reference, tmp_path):
    with httpx2.Client(base_url=server.url, timeout=60) as c:
        job = c.post("/v1/videos", json=dict(prompt="a fox", **JOB)).json()
        first = wait_for(c, job["id"], lambda j: j.get("chunks_done") == 1)
        assert first["status"] == "in_progress" and first["seconds_generated"] == F / FPS
        assert 0 < first["first_chunk_seconds"] < 20
        assert first["codecs"].startswith("avc1.64")  # H.264 High (x264's default)
        reader = Reader(f"{server.url}/v1/videos/{job['id']}/content")
        np.testing.assert_array_equal(reader.frames_when(tmp_path, F), reference[:F])
        server.model.gate(job["id"], 1).set()
        wait_for(c, job["id"], lambda j: j.get("chunks_done") == 2)
        np.testing.assert_array_equal(reader.frames_when(tmp_path, 2 * F),
                                      reference[:2 * F])
        assert reader.thread.is_alive()  # the response goes on while the job runs
        for k in range(2, CHUNKS):
            server.model.gate(job["id"], k).set()
        end = wait_for(c, job["id"], lambda j: j["status"] == "completed")
        reader.thread.join(timeout=20)
        assert not reader.thread.is_alive() and reader.status == 200
        assert reader.headers["transfer-encoding"] == "chunked"
        final = c.get(f"/v1/videos/{job['id']}/content")
        assert final.status_code == 200 and bytes(reader.data) == final.content
    np.testing.assert_array_equal(decode(os.path.join(server.folder, f"{job['id']}.mp4")),
                                  reference)
    assert (end["chunks_done"], end["seconds_generated"]) == (CHUNKS, CHUNKS * F / FPS)
    assert end["first_chunk_seconds"] == first["first_chunk_seconds"]
    assert end["files"] == [f"{job['id']}.mp4", f"{job['id']}.frames.safetensors"]
    saved = load_file(os.path.join(server.folder, end["files"][1]))["frames"]
    np.testing.assert_array_equal(saved, np.concatenate(chunks()))
    assert not glob.glob(os.path.join(server.folder, ".*partial*"))


def test_a_cancel_finishes_the_chunk_being_made_and_keeps_the_whole_chunks(
        server, reference, tmp_path):
    """Cancelled after its second chunk, the job makes its third (steps 5 and 6 see the
    cancel and go on) and stops at the first step after it (step 7): 27 frames kept."""
    with httpx2.Client(base_url=server.url, timeout=60) as c:
        job = c.post("/v1/videos", json=dict(prompt="a cat", **JOB)).json()
        server.model.gate(job["id"], 1).set()
        wait_for(c, job["id"], lambda j: j.get("chunks_done") == 2)
        reader = Reader(f"{server.url}/v1/videos/{job['id']}/content")
        assert c.post(f"/v1/videos/{job['id']}/cancel").status_code == 200
        server.model.gate(job["id"], 2).set()
        wait_for(c, job["id"], lambda j: j.get("chunks_done") == 3)
        assert c.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
        server.model.gate(job["id"], 3).set()  # its next step stops it
        end = wait_for(c, job["id"], lambda j: j["status"] == "cancelled")
        reader.thread.join(timeout=20)
        kept = c.get(f"/v1/videos/{job['id']}/content")
        assert kept.status_code == 200 and bytes(reader.data) == kept.content
    assert end["steps_done"] == 7 and end["chunks_done"] == 3
    assert end["files"] == [f"{job['id']}.mp4"]
    np.testing.assert_array_equal(decode(os.path.join(server.folder, end["files"][0])),
                                  reference[:3 * F])
    assert not glob.glob(os.path.join(server.folder, ".*partial*"))


def test_a_job_that_does_not_stream_is_served_as_before(server):
    with httpx2.Client(base_url=server.url, timeout=60) as c:
        job = c.post("/v1/videos", json=dict(prompt=PLAIN, **JOB)).json()
        running = wait_for(c, job["id"], lambda j: j["status"] == "in_progress")
        r = c.get(f"/v1/videos/{job['id']}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_ready"
        for k in range(1, CHUNKS):
            server.model.gate(job["id"], k).set()
        end = wait_for(c, job["id"], lambda j: j["status"] == "completed")
        assert c.get(f"/v1/videos/{job['id']}/content").status_code == 200
    assert not {"chunks_done", "seconds_generated", "first_chunk_seconds"} & \
        (set(running) | set(end))
    assert decode(os.path.join(server.folder, f"{job['id']}.mp4")).shape == (36, 32, 48, 3)


def test_the_page_plays_a_running_job_live(server):
    """Headless Chromium: the page's player of a running job has the first chunk (9 frames
    at 16 fps) buffered while the job waits before its second, then all four."""
    driver = chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    buffered = "const b = arguments[0].buffered; return b.length ? b.end(b.length - 1) : 0"
    try:
        with httpx2.Client(base_url=server.url, timeout=60) as c:
            job = c.post("/v1/videos", json=dict(prompt="a live fox", **JOB)).json()
            wait_for(c, job["id"], lambda j: j.get("chunks_done") == 1)
            driver.get(server.url + "/")
            wait = WebDriverWait(driver, 60, poll_frequency=0.1)
            video = wait.until(lambda d: d.find_element(
                By.CSS_SELECTOR, f"video[data-id='{job['id']}']"))
            assert video.get_attribute("data-live") == "1"
            wait.until(lambda d: d.execute_script(buffered, video) >= (F - 1) / FPS)
            assert driver.execute_script(buffered, video) <= F / FPS + 0.01
            assert c.get(f"/v1/videos/{job['id']}").json()["status"] == "in_progress"
            assert driver.execute_script("return arguments[0].videoWidth", video) == 48
            for k in range(1, CHUNKS):
                server.model.gate(job["id"], k).set()
            wait.until(lambda d: d.execute_script(buffered, video) >= (CHUNKS * F - 1) / FPS)
            wait_for(c, job["id"], lambda j: j["status"] == "completed")
            assert not driver.find_element(By.ID, "error").text
    finally:
        driver.quit()


def test_a_restart_requeues_a_streaming_job_without_its_chunks(tmp_path):
    """SQLite's recover (one server): the streamed job runs again from the start, its
    stream fields are gone and the growing file of the dead run is removed."""
    from engine.serve import requests as checks

    store = JobStore(str(tmp_path))
    settings = checks.check(checks.parse(dict(prompt="a fox", **JOB)), SERVED)
    job = store.add(settings)
    assert store.claim("srv_a", ["chunky:48x32x36"]).id == job.id
    partial = f".{job.id}.partial-0a1b2c3d.mp4"
    (tmp_path / partial).write_bytes(b"\0" * 8)
    info = dict(chunks_done=1, seconds_generated=F / FPS, first_chunk_seconds=0.5,
                file=partial, codecs="avc1.64000a")
    assert store.streamed(job.id, info, "srv_a") and store.get(job.id).stream == info
    assert not store.streamed(job.id, info, "srv_b")  # only the job's owner records
    store.close()
    again = JobStore(str(tmp_path))
    assert again.recover() == dict(requeued=[job.id], removed=[partial])
    row = again.get(job.id)
    assert (row.status, row.stream) == ("queued", None)
    again.close()


def test_content_of_a_stream_whose_file_is_elsewhere_is_one_error(tmp_path):
    """A running streamed job whose growing file is not in this server's folder (servers
    sharing a store but not a folder): 500 ``file_missing`` naming the file, not an empty
    200; the same request once the job has failed is the usual 409."""
    from fastapi.testclient import TestClient

    from engine.serve import requests as checks

    store = JobStore(str(tmp_path))
    state = State(store=store, storage=SharedFolder(str(tmp_path)),
                  fleet=Fleet(store, "127.0.0.1:0"), api_key=None, wake=threading.Event(),
                  served=SERVED)
    job = store.add(checks.check(checks.parse(dict(prompt="a fox", **JOB)), SERVED))
    store.claim("srv_elsewhere", ["chunky:48x32x36"])
    partial = f".{job.id}.partial-0a1b2c3d.mp4"
    store.streamed(job.id, dict(chunks_done=1, seconds_generated=F / FPS,
                                first_chunk_seconds=0.5, file=partial, codecs="avc1.64000a"),
                   "srv_elsewhere")
    with TestClient(create_app(state)) as c:
        r = c.get(f"/v1/videos/{job.id}/content")
        assert r.status_code == 500 and r.json()["error"]["code"] == "file_missing", r.text
        assert partial in r.json()["error"]["message"]
        assert store.fail(job.id, "out of memory", "srv_elsewhere")
        r = c.get(f"/v1/videos/{job.id}/content")
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_ready", r.text
    store.close()


def test_a_stream_ends_when_its_job_runs_again_elsewhere(tmp_path):
    """A reader of a run's growing file is not left waiting on it when the job's lease
    passes and another server runs it again from the start (a new file): the response
    ends with the bytes the first run wrote."""
    from fastapi.testclient import TestClient

    from engine.serve import requests as checks

    store = JobStore(str(tmp_path), lease_s=0.5)
    state = State(store=store, storage=SharedFolder(str(tmp_path)),
                  fleet=Fleet(store, "127.0.0.1:0"), api_key=None, wake=threading.Event(),
                  served=SERVED)
    job = store.add(checks.check(checks.parse(dict(prompt="a fox", **JOB)), SERVED))
    store.claim("srv_a", ["chunky:48x32x36"])
    partial = f".{job.id}.partial-0a1b2c3d.mp4"
    (tmp_path / partial).write_bytes(b"first run's bytes")
    store.streamed(job.id, dict(chunks_done=1, seconds_generated=F / FPS,
                                first_chunk_seconds=0.5, file=partial, codecs="avc1.64000a"),
                   "srv_a")
    taken = []

    def take_over():  # srv_a went silent: its lease passes and srv_b claims the job
        time.sleep(1.0)
        taken.append(store.claim("srv_b", ["chunky:48x32x36"]))

    threading.Thread(target=take_over, daemon=True).start()
    got, c = [], TestClient(create_app(state))  # no lifespan: a hang stays in its thread
    reader = threading.Thread(target=lambda: got.append(
        c.get(f"/v1/videos/{job.id}/content")), daemon=True)
    reader.start()
    reader.join(timeout=15)
    assert not reader.is_alive(), "the response still waits on the first run's file"
    assert got[0].status_code == 200 and got[0].content == b"first run's bytes"
    assert taken[0].id == job.id and taken[0].owner == "srv_b"
    store.close()
