"""Cancel on a real ``generate_flax.py --serve`` (tiny checkpoint, CPU): a queued job never
runs, a running job stops at the next denoising step boundary with no file, DELETE of a
running job cancels and removes it, and the worker goes on to the next job, whose frames
equal the CLI's; ``/metrics`` counts what ran; webhooks arrive signed, once per ended job,
retried past a failing receiver. Each served step sleeps
``GENERATE_FLAX_TEST_STEP_DELAY_S`` (a test hook of the worker) so the cancel lands between
steps."""

import http.server
import json
import os
import threading
import time

import numpy as np
import pytest
import standardwebhooks
from prometheus_client.parser import text_string_to_metric_families
from serve_util import (
    KEY,
    PROMPT,
    SETTINGS,
    WEBHOOK_SECRET,
    Server,
    cli_frames,
    env,
    server_frames,
    wait_done,
    wait_for,
)

STEP_DELAY_S = 0.4
LONG = dict(prompt=PROMPT, size="64x64", num_frames=5, num_inference_steps=8)
NEXT_SEED = 21


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    root = tmp_path_factory.mktemp("cancel")
    cli = cli_frames(tiny_checkpoint, root / "cli", [NEXT_SEED])
    server = Server(["--model_id", tiny_checkpoint, *SETTINGS, "--api_key", KEY,
                     "--webhook_secret", WEBHOOK_SECRET, "--compilation_cache_dir", "none"],
                    root / "out",
                    environ=env(1, GENERATE_FLAX_TEST_STEP_DELAY_S=str(STEP_DELAY_S))).start()
    try:
        server.wait_ready()
        yield server, cli.result()
    finally:
        assert server.stop() == 0, server.tail()


def _files(out, video_id):
    return [n for n in os.listdir(out) if n.startswith(video_id)]


def test_cancel_queued_and_running_then_the_next_job_runs(served):
    server, want = served
    with server.client() as c:
        a = c.post("/v1/videos", json={**LONG, "seed": 1}).json()
        b = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", num_frames=5,
                                           seed=NEXT_SEED)).json()
        q = c.post("/v1/videos", json={**LONG, "seed": 3}).json()
        running = wait_for(c, a["id"], lambda j: j["status"] == "in_progress" and j["progress"])
        assert c.get(f"/v1/videos/{b['id']}").json()["queue_position"] == 0
        assert c.get(f"/v1/videos/{q['id']}").json()["queue_position"] == 1
        # The queued job: cancelled at once, never started.
        r = c.post(f"/v1/videos/{q['id']}/cancel")
        assert r.status_code == 200 and r.json()["status"] == "cancelled", r.text
        # The running job: steps done when the cancel is sent (progress = 100 * done // 9,
        # so done = ceil(progress * 9 / 100): 11 % is 1 step, 22 % is 2).
        done_before = -(-c.get(f"/v1/videos/{a['id']}").json()["progress"] * 9 // 100)
        assert c.post(f"/v1/videos/{a['id']}/cancel").status_code == 200
        a_end = wait_for(c, a["id"], lambda j: j["status"] == "cancelled")
        assert running["progress"] > 0
        assert 1 <= a_end["steps_done"] <= done_before + 1 < 8, (done_before, a_end)
        assert a_end["files"] == [] and not _files(server.out, a["id"])
        b_end = wait_done(c, [b["id"]])[b["id"]]
        assert b_end["status"] == "completed" and b_end["queue_position"] is None
        np.testing.assert_array_equal(server_frames(server.out, b["id"]), want[NEXT_SEED])
        q_end = c.get(f"/v1/videos/{q['id']}").json()
        assert q_end["status"] == "cancelled" and "steps_done" not in q_end
        assert not _files(server.out, q["id"])
        again = c.post(f"/v1/videos/{b['id']}/cancel")
        assert again.status_code == 409 and again.json()["error"]["code"] == "not_cancellable"
    assert f"{a['id']}: cancelled after" in server.tail(20000)
    assert q["id"] not in server.tail(20000)  # the worker never saw it


def test_delete_of_a_running_job_cancels_and_removes_it(served):
    server, _ = served
    with server.client() as c:
        d = c.post("/v1/videos", json={**LONG, "seed": 5}).json()
        wait_for(c, d["id"], lambda j: j["status"] == "in_progress" and j["progress"])
        r = c.delete(f"/v1/videos/{d['id']}")
        assert r.status_code == 200 and r.json()["deleted"] is True
        t0 = time.monotonic()
        while c.get(f"/v1/videos/{d['id']}").status_code != 404:
            assert time.monotonic() - t0 < 30, "the deleted job is still listed"
            time.sleep(0.05)
        assert not _files(server.out, d["id"])
        nxt = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", seed=9)).json()
        assert wait_done(c, [nxt["id"]])[nxt["id"]]["status"] == "completed"


def _scrape(c) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample of ``GET /metrics``, read
    by prometheus_client's own parser."""
    r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_the_jobs(served):
    server, _ = served
    with server.client(key=None) as c:  # /metrics needs no key, as /health
        before = _scrape(c)
    with server.client() as c:
        job = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", seed=13)).json()
        end = wait_done(c, [job["id"]])[job["id"]]
        listed = c.get("/v1/videos", params=dict(limit=100)).json()["data"]
        after = _scrape(c)
    completed = (("status", "completed"),)
    assert after[("video_jobs_finished_total", completed)] == \
        before.get(("video_jobs_finished_total", completed), 0) + 1
    steps = len(end["timings"]["step_seconds"])
    assert after[("video_step_seconds_count", ())] == \
        before.get(("video_step_seconds_count", ()), 0) + steps
    assert after[("video_denoise_seconds_count", ())] >= 1
    for status in ("completed", "cancelled"):
        assert after[("video_jobs", (("status", status),))] == \
            sum(j["status"] == status for j in listed)
    assert after[("video_jobs_waiting", ())] == 0 and after[("video_jobs_running", ())] == 0


class _Receiver(http.server.BaseHTTPRequestHandler):
    """A webhook receiver on loopback: records every POST; ``/flaky`` answers 500 to the
    first two posts of each webhook id, then 200."""

    posts: list = []
    tries: dict = {}

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        hook = self.headers["webhook-id"]
        _Receiver.tries[hook] = _Receiver.tries.get(hook, 0) + 1
        failing = self.path == "/flaky" and _Receiver.tries[hook] <= 2
        if not failing:
            _Receiver.posts.append((self.path, hook, body, dict(self.headers)))
        self.send_response(500 if failing else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_webhooks_signed_once_per_terminal_status_and_retried(served):
    server, _ = served
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{receiver.server_address[1]}"
    try:
        with server.client() as c:
            ok = c.post("/v1/videos", json=dict(prompt=PROMPT, size="64x64", seed=31,
                                                callback_url=f"{base}/flaky")).json()
            queued = c.post("/v1/videos", json={**LONG, "seed": 32,
                                                "callback_url": f"{base}/hook"}).json()
            assert c.post(f"/v1/videos/{queued['id']}/cancel").status_code == 200
            wait_done(c, [ok["id"]])
            bad = c.post("/v1/videos", json=dict(prompt=PROMPT, callback_url="http://10.1.2.3/"))
            assert bad.status_code == 400 and "loopback" in bad.json()["error"]["message"]
            private = c.post("/v1/videos", json=dict(prompt=PROMPT,
                                                     callback_url="https://10.0.0.5/"))
            error = private.json()["error"]
            assert (private.status_code, error["param"]) == (400, "callback_url")
            assert error["message"] == "callback_url='https://10.0.0.5/': 10.0.0.5 is a " \
                "private address; callbacks go to public hosts only (a server started with " \
                "--webhook_allow_private also sends to private ones; never multicast or " \
                "unspecified)"
        t0 = time.monotonic()
        while len(_Receiver.posts) < 2:
            assert time.monotonic() - t0 < 30, _Receiver.posts
            time.sleep(0.1)
        time.sleep(1.0)  # nothing more may arrive
    finally:
        receiver.shutdown()
    got = {hook: (path, json.loads(body), sig) for path, hook, body, sig in _Receiver.posts}
    assert len(got) == len(_Receiver.posts) == 2, _Receiver.posts  # each exactly once
    path, video, sig = got[f"{ok['id']}:completed"]
    assert path == "/flaky" and video["status"] == "completed" and video["files"]
    assert _Receiver.tries[f"{ok['id']}:completed"] == 3  # two 500s, then delivered
    assert got[f"{queued['id']}:cancelled"][1]["status"] == "cancelled"
    for _, hook, body, headers in _Receiver.posts:  # Standard Webhooks, its own library
        assert standardwebhooks.Webhook(WEBHOOK_SECRET).verify(body, headers)["id"] == \
            hook.split(":")[0]

