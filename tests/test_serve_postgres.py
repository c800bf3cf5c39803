"""Two ``generate_flax.py --serve`` processes (tiny checkpoint, CPU, one device each) on one
job queue in a real PostgreSQL server and one output folder: jobs created on either run
once, on whichever server holds their bucket, and every server answers every id; a cancel
sent to one server stops the job the other runs; ``kill -9`` of the server running a job
hands the job to the other after its lease. Frames are checked against the CLI's for each
seed. Skipped, with the reason, where no PostgreSQL server runs (never under CI: .ci/run
starts one)."""

import os
import re
import signal
import time

import numpy as np
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from serve_util import (
    KEY,
    PROMPT,
    SETTINGS,
    Server,
    cli_frames,
    env,
    server_frames,
    wait_done,
    wait_for,
)

LEASE_S = 3.0
STEP_DELAY_S = 0.2  # per served step: a 12-step job runs for seconds, so it can be hit
SEEDS = list(range(200, 208))  # 8 jobs, 4 sent to each server
LONG_SEED, LONG_STEPS = 31, 12


@pytest.fixture(scope="module")
def started_fleet(tiny_checkpoint, postgres_url_module, tmp_path_factory):
    """(server A: 64x64, server B: 64x64 and 96x64, their shared folder, {seed: CLI
    frames}, CLI frames of the long job); the CLI runs while the servers start."""
    root = tmp_path_factory.mktemp("fleet")
    cli = cli_frames(tiny_checkpoint, root / "cli", SEEDS)
    cli_long = cli_frames(tiny_checkpoint, root / "cli_long", [LONG_SEED],
                          "--num_inference_steps", str(LONG_STEPS))
    common = ["--model_id", tiny_checkpoint, *SETTINGS, "--api_key", KEY,
              "--compilation_cache_dir", "none", "--jobs_db", postgres_url_module,
              "--job_lease_s", str(LEASE_S)]
    environ = env(1, GENERATE_FLAX_TEST_STEP_DELAY_S=str(STEP_DELAY_S))
    out = root / "shared"
    a = Server(common, out, environ=environ, log=root / "a.log").start()
    b = Server([*common, "--serve_sizes", "64x64,96x64"], out, environ=environ,
               log=root / "b.log").start()
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, str(out), cli.result(), cli_long.result()[LONG_SEED]
    finally:
        for server in (a, b):
            server.stop()


@pytest.fixture
def fleet(started_fleet):
    """``started_fleet`` with both servers alive: a server the kill -9 test killed is started
    again (same port, log and store), so the tests hold in any order (pytest-randomly found
    the others failing with "Connection refused" when that test ran first)."""
    for server in started_fleet[:2]:
        if server.proc.poll() is not None:
            server.start().wait_ready()
    return started_fleet


def _completed_lines(*servers) -> dict:
    """{job id: how many "completed" lines the servers' logs hold for it}."""
    count = {}
    for server in servers:
        for m in re.finditer(r"(video_[0-9a-f]{32}): completed in", server.tail(10**7)):
            count[m[1]] = count.get(m[1], 0) + 1
    return count


def test_two_servers_one_queue_eight_jobs(fleet):
    a, b, out, want, _ = fleet
    clients = [OpenAI(base_url=s.url + "/v1", api_key=KEY) for s in (a, b)]
    models = clients[0].models.list().data[0].model_extra
    assert models["buckets"] == {"64x64x5": 2, "96x64x5": 1}  # the union of live servers
    before = (_metrics(a)[0], _metrics(a)[1] + _metrics(b)[1])
    ids = {}
    for i, seed in enumerate(SEEDS):
        video = clients[i % 2].videos.create(prompt=PROMPT, model="tiny-wan", size="64x64",
                                             extra_body={"num_frames": 5, "seed": seed})
        ids[video.id] = seed
    # A holds no 96x64 bucket, yet takes the job: B runs it.
    wide = clients[0].videos.create(prompt=PROMPT, size="96x64", extra_body={"seed": 1}).id
    with b.client() as cb:  # every id answered by the server it was not sent to
        done = wait_done(cb, [*ids, wide])
    assert all(j["status"] == "completed" for j in done.values()), done
    for video_id, seed in ids.items():
        mp4 = clients[1 - list(ids).index(video_id) % 2].videos.download_content(video_id)
        assert mp4.read()[4:8] == b"ftyp"
        np.testing.assert_array_equal(server_frames(out, video_id), want[seed])
    runs = _completed_lines(a, b)
    assert {i: runs.get(i) for i in [*ids, wide]} == {i: 1 for i in [*ids, wide]}
    assert f"{wide}: completed" in b.tail(10**7) and wide not in a.tail(10**7)
    with a.client() as ca:
        bad = ca.post("/v1/videos", json=dict(prompt="p", size="96x64", num_frames=9))
    assert bad.status_code == 400 and "num_frames=9" in bad.json()["error"]["message"]
    for server in (a, b):
        stored, finished, queued = _metrics(server)
        assert stored == before[0] + len(ids) + 1 and queued == 0  # the shared store
    # each server counts what it ran (other tests of this module may have run jobs before)
    assert sum(_metrics(s)[1] for s in (a, b)) == before[1] + len(ids) + 1


def _metrics(server) -> tuple[float, float, float]:
    """(completed jobs in the shared store, jobs this server completed, queued jobs), from
    its /metrics."""
    with server.client() as c:
        text = c.get("/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    finished = sum(s.value for s in families["video_jobs_finished"].samples
                   if s.labels.get("status") == "completed" and s.name.endswith("_total"))
    jobs = {s.labels["status"]: s.value for s in families["video_jobs"].samples}
    return jobs.get("completed", 0.0), finished, jobs.get("queued", 0.0)


def _runner(video_id, *servers) -> Server:
    """The server whose log says it started ``video_id`` last."""
    started = [s for s in servers if f"{video_id}: started" in s.tail(10**7)]
    assert len(started) == 1, [s.tail() for s in servers]
    return started[0]


def test_a_cancel_sent_to_one_server_stops_the_job_the_other_runs(fleet):
    a, b, out, _, _ = fleet
    body = dict(prompt=PROMPT, size="64x64", num_frames=5, num_inference_steps=LONG_STEPS,
                seed=3)
    with a.client() as ca, b.client() as cb:
        running = ca.post("/v1/videos", json=body).json()["id"]
        wait_for(ca, running, lambda j: j["status"] == "in_progress" and j["progress"] > 10)
        other = cb if _runner(running, a, b) is a else ca
        progress = other.post(f"/v1/videos/{running}/cancel").json()["progress"]
        end = wait_for(other, running, lambda j: j["status"] == "cancelled")
    steps_seen = -(-progress * (LONG_STEPS + 1) // 100)  # progress = 100 * done // (steps + 1)
    assert steps_seen <= end["steps_done"] <= steps_seen + 2, (progress, end)
    assert end["steps_done"] < LONG_STEPS and not [n for n in os.listdir(out)
                                                   if n.startswith(running)]


def test_kill_9_hands_the_running_job_to_the_other_server(fleet):
    """The server running a job dies mid-job: the other claims the job once the lease has
    passed and runs it from the start, with the same seed: the CLI's frames."""
    a, b, out, _, want_long = fleet
    body = dict(prompt=PROMPT, size="64x64", num_frames=5, num_inference_steps=LONG_STEPS,
                seed=LONG_SEED)
    with a.client() as ca:
        video_id = ca.post("/v1/videos", json=body).json()["id"]
        wait_for(ca, video_id, lambda j: j["status"] == "in_progress" and j["progress"] > 10)
    victim = _runner(video_id, a, b)
    survivor = b if victim is a else a
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait()
    killed = time.monotonic()
    with survivor.client() as c:
        done = wait_for(c, video_id, lambda j: j["status"] in ("completed", "failed"),
                     timeout=120)
        waited = time.monotonic() - killed
        assert done["status"] == "completed", done
        assert len(c.get("/v1/models").json()["data"][0]["buckets"]) == (
            2 if survivor is b else 1)  # the dead server's buckets left the union
    job_s = done["timings"]["denoise_s"] + done["timings"]["vae_decode_s"]
    assert waited < LEASE_S + job_s + 15, (waited, job_s)  # lease + one job + start slack
    assert f"{video_id}: started (attempt 2" in survivor.tail(10**7)
    assert _completed_lines(a, b).get(video_id) == 1
    np.testing.assert_array_equal(server_frames(out, video_id), want_long)
