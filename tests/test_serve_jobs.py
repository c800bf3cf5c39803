"""A job is one typed value from the checked request to the store and back: ``VideoJob``
(engine/serve/requests.py) and the store's ``Job`` rows (engine/serve/jobs.py), on a real
SQLite file. No model is loaded."""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest

from engine.serve import requests as checks
from engine.serve.jobs import CANCEL, CANCEL_AND_DELETE, DB_NAME, Job, JobStore
from engine.serve.model import Served
from engine.serve.requests import ApiError, InputReference, VideoJob

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


def test_store_keeps_the_json_form_and_returns_typed_rows(tmp_path):
    store = JobStore(str(tmp_path))
    job = checks.check(checks.parse(dict(prompt="a dog", seed=3)), SERVED)
    added = store.add(job)
    assert isinstance(added, Job) and added.settings == job and added.status == "queued"
    row = sqlite3.connect(tmp_path / DB_NAME).execute("SELECT settings FROM jobs").fetchone()
    assert json.loads(row[0]) == job.to_json()  # what another server version reads
    store.start(added.id)
    store.complete(added.id, dict(files=["a.mp4"], timings={}, wall_s=1.0))
    done = store.get(added.id)
    assert (done.status, done.progress, done.result["files"]) == ("completed", 100, ["a.mp4"])
    assert done.settings == job and store.next_queued() is None


def test_rows_written_before_the_typed_value_still_load(tmp_path):
    """A store written by the dict-era server (same JSON keys) is read as typed jobs."""
    store = JobStore(str(tmp_path))
    old = dict(prompt="p", negative_prompt="", width=96, height=64, size="96x64",
               num_frames=17, seconds="1", num_inference_steps=8, guidance_scale=5.0,
               guidance_scale_2=None, seed=5, fps=16, model="tiny-wan")
    store._run("INSERT INTO jobs (id, status, created_at, settings) VALUES (?, 'queued', 0, ?)",
               ("video_" + "0" * 32, json.dumps(old)))
    assert store.next_queued().settings.to_json() == {**old, "input_reference": None,
                                                      "callback_url": None}


def test_cancel_a_queued_job_ends_it_and_a_running_one_is_asked(tmp_path):
    store = JobStore(str(tmp_path))
    queued = store.add(checks.check(checks.parse(dict(prompt="q", seed=1)), SERVED))
    running = store.add(checks.check(checks.parse(dict(prompt="r", seed=2)), SERVED))
    store.start(running.id)
    assert store.queue_position(store.get(queued.id)) == 0
    assert store.cancel(queued.id) == "queued"
    assert store.get(queued.id).status == "cancelled" and store.next_queued() is None
    assert store.queue_position(store.get(queued.id)) is None
    assert store.cancel(running.id) == "in_progress"
    assert store.get(running.id).status == "in_progress"  # the worker stops it
    assert store.pending_cancel(running.id) == CANCEL
    store.cancelled(running.id, dict(files=[], timings={}, steps_done=3, wall_s=0.1))
    end = store.get(running.id)
    assert (end.status, end.result["steps_done"], end.cancel) == ("cancelled", 3, None)
    assert store.cancel(running.id) is None  # ended: nothing to cancel


def test_a_cancel_pending_at_a_crash_is_honoured_on_restart(tmp_path):
    store = JobStore(str(tmp_path))
    jobs = [store.add(checks.check(checks.parse(dict(prompt=p, seed=i)), SERVED))
            for i, p in enumerate(("keep", "cancel", "delete"))]
    for job in jobs:
        store.start(job.id)
    store.cancel(jobs[1].id)
    store.cancel(jobs[2].id, CANCEL_AND_DELETE)
    recovered = JobStore(str(tmp_path)).recover()
    assert recovered["requeued"] == [jobs[0].id]
    assert store.get(jobs[1].id).status == "cancelled" and store.get(jobs[2].id) is None


def test_a_delete_during_the_decode_drops_the_finished_job(tmp_path):
    store = JobStore(str(tmp_path))
    job = store.add(checks.check(checks.parse(dict(prompt="d", seed=1)), SERVED))
    store.start(job.id)
    store.cancel(job.id, CANCEL_AND_DELETE)
    store.complete(job.id, dict(files=["x.mp4"], timings={}, wall_s=1.0))
    assert store.drop_if_deleted(job.id) and store.get(job.id) is None


def test_a_store_from_before_cancel_gains_the_column(tmp_path):
    db = sqlite3.connect(tmp_path / DB_NAME)
    db.execute("CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT "
               "NULL, status TEXT NOT NULL, progress INTEGER NOT NULL DEFAULT 0, created_at "
               "INTEGER NOT NULL, completed_at INTEGER, error TEXT, settings TEXT NOT NULL, "
               "result TEXT)")
    db.commit()
    db.close()
    store = JobStore(str(tmp_path))
    job = store.add(checks.check(checks.parse(dict(prompt="p", seed=1)), SERVED))
    assert store.get(job.id).cancel is None and store.cancel(job.id) == "queued"


def test_expire_ends_only_jobs_past_their_retention(tmp_path):
    store = JobStore(str(tmp_path))
    jobs = [store.add(checks.check(checks.parse(dict(prompt=p, seed=i)), SERVED))
            for i, p in enumerate(("old", "new", "queued"))]
    for job in jobs[:2]:
        store.start(job.id)
        store.complete(job.id, dict(files=[f"{job.id}.mp4"], timings={}, wall_s=1.0))
    ended = store.get(jobs[0].id).completed_at
    store._run("UPDATE jobs SET completed_at=? WHERE id=?", (ended - 100, jobs[0].id))
    expired = store.expire(50, now=ended)
    assert [j.id for j in expired] == [jobs[0].id]
    assert expired[0].result["files"] == [f"{jobs[0].id}.mp4"]  # as it was: for the sweeper
    assert [store.get(j.id).status for j in jobs] == ["expired", "completed", "queued"]
    assert store.expire(50, now=ended) == []
