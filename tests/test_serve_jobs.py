"""A job is one typed value from the checked request to the store and back: ``VideoJob``
(engine/serve/requests.py) and the store's ``Job`` rows (engine/serve/jobs.py). The store's
tests run on both engines through the same code: a real SQLite file and a real PostgreSQL
server (``postgres_url``; skipped with the reason when none runs, outside CI). No model is
loaded."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import threading
import time

import pytest

from engine.serve import jobs as store_rows
from engine.serve import requests as checks
from engine.serve.app import State, create_app
from engine.serve.fleet import Fleet
from engine.serve.jobs import CANCEL, CANCEL_AND_DELETE, DB_NAME, LOST, Job, JobStore, job_bucket
from engine.serve.model import Served
from engine.serve.requests import ApiError, InputReference, VideoJob
from engine.serve.storage import SharedFolder

SERVED = Served(model="tiny-wan", model_id="checkpoints/tiny-wan", sizes=((96, 64), (64, 64)),
                frames=(17, 9), frame_step=4, fps=16, num_inference_steps=8,
                guidance_scale=5.0, guidance_scale_2=None, negative_prompt="blurry",
                variable_guidance=True, fixed_steps=False, image_mode="none")


def test_check_resolves_every_field_into_a_video_job():
    job = checks.check(checks.parse(dict(prompt="a cat", size="64x64", seconds="0.5",
                                         seed=7, guidance_scale=3.0)), SERVED)
    assert job == VideoJob(prompt="a cat", negative_prompt="blurry", width=64, height=64,
                           num_frames=9, seconds="0.5", num_inference_steps=8,
                           guidance_scale=3.0, guidance_scale_2=None, seed=7, fps=16,
                           model="tiny-wan")
    assert job.size == "64x64"
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.seed = 8


def test_defaults_and_a_drawn_seed():
    job = checks.check(checks.parse(dict(prompt="a cat")), SERVED)
    assert (job.width, job.height, job.num_frames, job.seconds) == (96, 64, 17, "1")
    assert 0 <= job.seed < 2**31


def test_refusal_names_the_field():
    with pytest.raises(ApiError, match=r"size='32x32': not a served size"):
        checks.check(checks.parse(dict(prompt="a cat", size="32x32")), SERVED)


def test_json_form_round_trips_with_an_input_reference():
    ref = InputReference(format="PNG", width=96, height=64, sha256="ab" * 32, bytes=1234,
                         file="video_x.input.png")
    job = dataclasses.replace(checks.check(checks.parse(dict(prompt="p", seed=1)), SERVED),
                              input_reference=ref)
    data = json.loads(json.dumps(job.to_json()))
    assert data["size"] == "96x64" and data["input_reference"]["file"] == "video_x.input.png"
    assert VideoJob.from_json(data) == job


OWNER = "srv_test"
BUCKETS = ("tiny-wan:96x64x17", "tiny-wan:64x64x9", "tiny-wan:96x64x9", "tiny-wan:64x64x17")


@pytest.fixture(params=["sqlite", "postgresql"])
def jobs_db(request):
    """None (SQLite in the test's folder) or a new PostgreSQL database's URL."""
    return None if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def job(prompt: str, seed: int, **fields) -> checks.VideoJob:
    return checks.check(checks.parse(dict(prompt=prompt, seed=seed, **fields)), SERVED)


def test_store_keeps_the_json_form_and_returns_typed_rows(tmp_path):
    store = JobStore(str(tmp_path))
    job = checks.check(checks.parse(dict(prompt="a dog", seed=3)), SERVED)
    added = store.add(job)
    assert isinstance(added, Job) and added.settings == job and added.status == "queued"
    row = sqlite3.connect(tmp_path / DB_NAME).execute("SELECT settings FROM jobs").fetchone()
    assert json.loads(row[0]) == job.to_json()  # what another server version reads
    assert store.claim(OWNER, BUCKETS).id == added.id
    assert store.complete(added.id, dict(files=["a.mp4"], timings={}, wall_s=1.0), OWNER)
    done = store.get(added.id)
    assert (done.status, done.progress, done.result["files"]) == ("completed", 100, ["a.mp4"])
    assert done.settings == job and store.claim(OWNER, BUCKETS) is None
    assert (done.attempts, done.owner, done.bucket) == (1, OWNER, "tiny-wan:96x64x17")


def test_rows_written_before_the_typed_value_still_load(tmp_path):
    """A store written by the dict-era server (same JSON keys) is read as typed jobs."""
    store = JobStore(str(tmp_path))
    old = dict(prompt="p", negative_prompt="", width=96, height=64, size="96x64",
               num_frames=17, seconds="1", num_inference_steps=8, guidance_scale=5.0,
               guidance_scale_2=None, seed=5, fps=16, model="tiny-wan")
    store.close()
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("INSERT INTO jobs (id, status, created_at, settings) VALUES (?, 'queued', 0, ?)",
               ("video_" + "0" * 32, json.dumps(old)))
    db.commit()
    db.close()
    store = JobStore(str(tmp_path))  # the row gains its bucket on open
    assert store.claim(OWNER, BUCKETS).settings.to_json() == {**old, "input_reference": None,
                                                             "callback_url": None}


def test_cancel_a_queued_job_ends_it_and_a_running_one_is_asked(tmp_path, jobs_db):
    store = JobStore(str(tmp_path), jobs_db)
    running = store.add(job("r", 2))
    queued = store.add(job("q", 1))
    assert store.claim(OWNER, BUCKETS).id == running.id
    assert store.queue_position(store.get(queued.id)) == 0
    assert store.cancel(queued.id) == "queued"
    assert store.get(queued.id).status == "cancelled" and store.claim(OWNER, BUCKETS) is None
    assert store.queue_position(store.get(queued.id)) is None
    assert store.check(running.id, OWNER) is None
    assert store.cancel(running.id) == "in_progress"
    assert store.get(running.id).status == "in_progress"  # the worker stops it
    assert store.check(running.id, OWNER) == CANCEL
    store.cancelled(running.id, dict(files=[], timings={}, steps_done=3, wall_s=0.1), OWNER)
    end = store.get(running.id)
    assert (end.status, end.result["steps_done"], end.cancel) == ("cancelled", 3, None)
    assert store.cancel(running.id) is None  # ended: nothing to cancel


def test_a_cancel_pending_at_a_crash_is_honoured_on_restart(tmp_path):
    store = JobStore(str(tmp_path))
    jobs = [store.add(job(p, i)) for i, p in enumerate(("keep", "cancel", "delete"))]
    for _ in jobs:
        store.claim(OWNER, BUCKETS)
    store.cancel(jobs[1].id)
    store.cancel(jobs[2].id, CANCEL_AND_DELETE)
    recovered = JobStore(str(tmp_path)).recover()
    assert recovered["requeued"] == [jobs[0].id]
    assert store.get(jobs[1].id).status == "cancelled" and store.get(jobs[2].id) is None


def test_a_delete_during_the_decode_drops_the_finished_job(tmp_path, jobs_db):
    store = JobStore(str(tmp_path), jobs_db)
    added = store.add(job("d", 1))
    store.claim(OWNER, BUCKETS)
    store.cancel(added.id, CANCEL_AND_DELETE)
    assert store.complete(added.id, dict(files=["x.mp4"], timings={}, wall_s=1.0), OWNER)
    assert store.drop_if_deleted(added.id) and store.get(added.id) is None


def test_a_store_from_before_cancel_gains_the_column(tmp_path):
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT "
               "NULL, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, created_at "
               "INTEGER NOT NULL, completed_at INTEGER, error TEXT, settings TEXT NOT NULL, "
               "result TEXT)")
    db.commit()
    db.close()
    store = JobStore(str(tmp_path))
    added = store.add(job("p", 1))
    assert store.get(added.id).cancel is None and store.cancel(added.id) == "queued"


def test_expire_ends_only_jobs_past_their_retention(tmp_path, jobs_db):
    store = JobStore(str(tmp_path), jobs_db)
    jobs = [store.add(job(p, i)) for i, p in enumerate(("old", "new", "queued"))]
    for _ in jobs[:2]:
        claimed = store.claim(OWNER, BUCKETS)
        store.complete(claimed.id, dict(files=[f"{claimed.id}.mp4"], timings={}, wall_s=1.0),
                       OWNER)
    ended = store.get(jobs[1].id).completed_at
    table = store_rows.jobs
    store._execute(table.update().where(table.c.id == jobs[0].id).values(
        completed_at=ended - 100))
    expired = store.expire(50, now=ended)
    assert [j.id for j in expired] == [jobs[0].id]
    assert expired[0].result["files"] == [f"{jobs[0].id}.mp4"]  # as it was: for the sweeper
    assert [store.get(j.id).status for j in jobs] == ["expired", "completed", "queued"]
    assert store.expire(50, now=ended) == []


def test_two_servers_claiming_at_once_take_each_job_once(tmp_path, jobs_db):
    """Two stores on one database (two servers), each claiming from its own thread as fast
    as it can: every job is claimed exactly once."""
    stores = [JobStore(str(tmp_path), jobs_db) for _ in range(2)]
    added = [stores[0].add(job(f"p{i}", i)).id for i in range(24)]
    taken: dict = {0: [], 1: []}

    def drain(k: int) -> None:
        idle = 0
        while idle < 20:  # a guarded claim may lose a race and answer None: try again
            got = stores[k].claim(f"srv_{k}", BUCKETS)
            idle = 0 if got else idle + 1
            if got:
                taken[k].append(got.id)

    threads = [threading.Thread(target=drain, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(taken[0] + taken[1]) == sorted(added)
    assert all(stores[0].get(i).attempts == 1 for i in added)
    for k in range(2):  # each job's owner is the server that claimed it
        assert {stores[0].get(i).owner for i in taken[k]} <= {f"srv_{k}"}


def test_a_job_runs_only_where_its_bucket_is_served(tmp_path, jobs_db):
    store = JobStore(str(tmp_path), jobs_db)
    small = store.add(job("s", 1, size="64x64", seconds="0.5"))
    assert small.bucket == job_bucket(small.settings) == "tiny-wan:64x64x9"
    assert store.claim("srv_a", ["tiny-wan:96x64x17"]) is None
    assert store.claim("srv_a", []) is None
    assert store.claim("srv_b", ["tiny-wan:64x64x9"]).id == small.id


def test_a_lapsed_lease_hands_the_job_to_another_server(tmp_path, jobs_db):
    """Server A claims and dies (no heartbeat); after its lease B claims the same job
    (attempt 2), and A, should it wake, can no longer write it."""
    a, b = (JobStore(str(tmp_path), jobs_db, lease_s=1.0) for _ in range(2))
    added = a.add(job("lease", 5))
    assert a.claim("srv_a", BUCKETS).id == added.id
    assert b.claim("srv_b", BUCKETS) is None  # held
    time.sleep(1.3)
    again = b.claim("srv_b", BUCKETS)
    assert (again.id, again.owner, again.attempts, again.status) == (
        added.id, "srv_b", 2, "in_progress")
    assert a.check(added.id, "srv_a") == LOST and b.check(added.id, "srv_b") is None
    assert not a.progress(added.id, 50, "srv_a")
    assert not a.complete(added.id, dict(files=["a.mp4"], timings={}, wall_s=1.0), "srv_a")
    assert not a.fail(added.id, "late", "srv_a")
    assert b.complete(added.id, dict(files=["b.mp4"], timings={}, wall_s=1.0), "srv_b")
    end = b.get(added.id)
    assert (end.status, end.result["files"], end.error) == ("completed", ["b.mp4"], None)


def test_the_heartbeat_keeps_the_lease_and_the_fleet_sees_live_servers(tmp_path, jobs_db):
    a, b = (JobStore(str(tmp_path), jobs_db, lease_s=1.0) for _ in range(2))
    fleet_a, fleet_b = Fleet(a, "a:1"), Fleet(b, "b:2")
    fleet_a.join(SERVED, ["96x64x17"])
    fleet_b.join(dataclasses.replace(SERVED, sizes=((64, 64),), frames=(9,)), ["64x64x9"])
    added = a.add(job("beat", 1))
    assert a.claim(fleet_a.id, fleet_a.buckets).id == added.id
    time.sleep(2.5)  # two and a half leases: only the heartbeat keeps it
    assert b.claim(fleet_b.id, ["tiny-wan:96x64x17"]) is None
    assert a.check(added.id, fleet_a.id) is None
    view, keys = fleet_a.view(SERVED)
    assert keys == {"tiny-wan:96x64x17", "tiny-wan:64x64x9"}
    assert fleet_a.describe(SERVED)["buckets"] == {"64x64x9": 1, "96x64x17": 1}
    fleet_b.leave()
    assert fleet_a.view(SERVED)[1] == {"tiny-wan:96x64x17"}
    fleet_a.leave()
    assert [s["id"] for s in a.live_servers()] == []


def test_a_dead_servers_pending_cancel_ends_its_job(tmp_path, jobs_db):
    store = JobStore(str(tmp_path), jobs_db, lease_s=1.0)
    kept, dropped = store.add(job("c", 1)), store.add(job("d", 2))
    store.claim("srv_dead", BUCKETS)
    store.claim("srv_dead", BUCKETS)
    store.cancel(kept.id)
    store.cancel(dropped.id, CANCEL_AND_DELETE)
    assert store.claim("srv_live", BUCKETS) is None  # leases still held
    time.sleep(1.3)
    assert store.claim("srv_live", BUCKETS) is None  # reaped, not run again
    assert store.get(kept.id).status == "cancelled" and store.get(dropped.id) is None


def test_health_body_and_status_code_agree_when_ready_lands_mid_request(tmp_path):
    """The loading thread sets ``served`` while ``/health`` counts the queue (seen in CI: a
    200 whose body said "loading"). The store here flips ``served`` inside its first count,
    the interleaving that failed; body and code must come from one read."""
    class FlippingStore(JobStore):
        def count(self, *args, **kwargs):
            state.served = SERVED
            return super().count(*args, **kwargs)

    store = FlippingStore(str(tmp_path))
    state = State(store=store, storage=SharedFolder(str(tmp_path)),
                  fleet=Fleet(store, "localhost:0"), api_key=None,
                  wake=threading.Event())
    health = next(r.endpoint for r in create_app(state).routes if r.path == "/health")
    response = health()
    body = json.loads(response.body)
    assert (body["status"], response.status_code) == ("loading", 503)
    response = health()  # now ready from the start of the request
    assert (json.loads(response.body)["status"], response.status_code) == ("ready", 200)
    store.close()
