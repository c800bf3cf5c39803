"""The job store: every accepted job and its state in one SQLite file (stdlib ``sqlite3``)
under --output_dir, so that a crash or ``kill -9`` loses nothing that was accepted.

Each change is its own committed transaction (autocommit, ``synchronous=FULL``): a job
is in the file before ``POST /v1/videos`` answers. A restart (``recover``) puts jobs that
were queued or running back in the queue, in their arrival order, and removes the partial
files an interrupted write left (``engine.files.report.atomic_write`` names them
``.<stem>.partial<ext>``).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import sqlite3
import threading
import time
import uuid

from engine.serve.requests import VideoJob

DB_NAME = "jobs.sqlite3"
# The only ids the server makes: a URL's id must match this before it names anything.
ID_PATTERN = re.compile(r"video_[0-9a-f]{32}")
STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled", "expired")
ENDED = ("completed", "failed", "cancelled")  # what --retention_hours expires
# What a cancel asks of a running job (the ``cancel`` column): stop at the next denoising step
# boundary and keep the job as ``cancelled``, or stop and delete it (DELETE of a running job).
CANCEL, CANCEL_AND_DELETE = "cancel", "delete"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- arrival order
    id TEXT UNIQUE NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    error TEXT,
    settings TEXT NOT NULL,  -- JSON: the checked request
    result TEXT,  -- JSON: timings and file names
    cancel TEXT  -- a running job's pending cancel: 'cancel' or 'delete'
)"""


def new_id() -> str:
    return f"video_{uuid.uuid4().hex}"


@dataclasses.dataclass(frozen=True)
class Job:
    """One row of the store: the job's ``id``, its arrival ``seq``, ``status`` (one of
    ``STATUSES``), ``progress`` (percent), times (Unix seconds; ``completed_at`` None until
    it ends), ``error`` (one line, or None), ``settings`` (the checked ``VideoJob``) and
    ``result`` ({"files", "timings", "wall_s"} once completed, else None)."""

    id: str
    seq: int
    status: str
    progress: int
    created_at: int
    completed_at: int | None
    error: str | None
    settings: VideoJob
    result: dict | None
    cancel: str | None = None


class JobStore:
    """Jobs in ``<folder>/jobs.sqlite3``; safe to call from the HTTP handlers and the worker
    thread at once (one connection behind a lock). Rows come back as ``Job`` values."""

    def __init__(self, folder: str):
        self.folder = folder
        self.path = os.path.join(folder, DB_NAME)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.row_factory = sqlite3.Row
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute(_SCHEMA)
            columns = {r[1] for r in self._db.execute("PRAGMA table_info(jobs)")}
            if "cancel" not in columns:  # a store written before cancel existed
                self._db.execute("ALTER TABLE jobs ADD COLUMN cancel TEXT")

    def _one(self, sql: str, args=()) -> Job | None:
        with self._lock:
            row = self._db.execute(sql, args).fetchone()
        return _decode(row)

    def _run(self, sql: str, args=()) -> int:
        with self._lock:
            return self._db.execute(sql, args).rowcount

    def recover(self) -> dict:
        """After a restart: running and queued jobs back to queued (progress 0), partial
        files removed; a running job whose cancel was pending ends as the cancel asked
        (``cancelled``, or deleted). Returns {"requeued": ids, "removed": file names}."""
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE status='in_progress' AND cancel=?",
                             (CANCEL_AND_DELETE,))
            self._db.execute("UPDATE jobs SET status='cancelled', completed_at=?, cancel=NULL "
                             "WHERE status='in_progress' AND cancel IS NOT NULL",
                             (int(time.time()),))
            ids = [r[0] for r in self._db.execute(
                "SELECT id FROM jobs WHERE status IN ('queued', 'in_progress') ORDER BY seq")]
            self._db.execute("UPDATE jobs SET status='queued', progress=0 "
                             "WHERE status='in_progress'")
        removed = []
        for path in glob.glob(os.path.join(self.folder, ".*.partial*")):
            os.remove(path)
            removed.append(os.path.basename(path))
        return dict(requeued=ids, removed=removed)

    def add(self, settings: VideoJob, job_id: str | None = None) -> Job:
        job_id = job_id or new_id()
        self._run("INSERT INTO jobs (id, status, created_at, settings) "
                  "VALUES (?, 'queued', ?, ?)",
                  (job_id, int(time.time()), json.dumps(settings.to_json())))
        return self.get(job_id)

    def get(self, job_id: str) -> Job | None:
        return self._one("SELECT * FROM jobs WHERE id=?", (job_id,))

    def page(self, *, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """(up to ``limit`` jobs after the job ``after`` in ``order`` of arrival ("asc" or
        "desc"), whether more follow)."""
        op, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        sql, args = "SELECT * FROM jobs", []
        if after is not None:
            sql += f" WHERE seq {op} (SELECT seq FROM jobs WHERE id=?)"
            args.append(after)
        sql += f" ORDER BY seq {direction} LIMIT ?"
        with self._lock:
            rows = self._db.execute(sql, (*args, limit + 1)).fetchall()
        return [_decode(r) for r in rows[:limit]], len(rows) > limit

    def next_queued(self) -> Job | None:
        return self._one("SELECT * FROM jobs WHERE status='queued' ORDER BY seq LIMIT 1")

    def count(self, status: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status=?",
                                    (status,)).fetchone()[0]

    def start(self, job_id: str) -> None:
        self._run("UPDATE jobs SET status='in_progress', progress=0 WHERE id=?", (job_id,))

    def progress(self, job_id: str, percent: int) -> None:
        self._run("UPDATE jobs SET progress=? WHERE id=? AND status='in_progress'",
                  (int(percent), job_id))

    def complete(self, job_id: str, result: dict) -> None:
        self._run("UPDATE jobs SET status='completed', progress=100, completed_at=?, "
                  "result=? WHERE id=?", (int(time.time()), json.dumps(result), job_id))
        # A plain cancel that came during the decode was too late: the job is complete.
        self._run("UPDATE jobs SET cancel=NULL WHERE id=? AND cancel=?", (job_id, CANCEL))

    def fail(self, job_id: str, message: str) -> None:
        self._run("UPDATE jobs SET status='failed', completed_at=?, error=? WHERE id=?",
                  (int(time.time()), message, job_id))
        self._run("UPDATE jobs SET cancel=NULL WHERE id=? AND cancel=?", (job_id, CANCEL))

    def queue_position(self, job: Job) -> int | None:
        """Jobs ahead of a queued ``job`` (0: it runs next); None unless it is queued."""
        if job.status != "queued":
            return None
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM jobs WHERE status='queued' AND "
                                    "seq < ?", (job.seq,)).fetchone()[0]

    def cancel(self, job_id: str, how: str = CANCEL) -> str | None:
        """Cancel a job, atomically against the worker's claim: a queued job becomes
        ``cancelled`` at once (it never starts); a running one gets ``how`` as its pending
        cancel, which the worker reads after each denoising step. Returns the job's status
        before the call ("queued" or "in_progress"), or None when it had already ended."""
        with self._lock:
            if self._db.execute("UPDATE jobs SET status='cancelled', completed_at=? "
                                "WHERE id=? AND status='queued'",
                                (int(time.time()), job_id)).rowcount:
                return "queued"
            if self._db.execute("UPDATE jobs SET cancel=? WHERE id=? AND status='in_progress'",
                                (how, job_id)).rowcount:
                return "in_progress"
        return None

    def pending_cancel(self, job_id: str) -> str | None:
        """A running job's pending cancel (``CANCEL``, ``CANCEL_AND_DELETE``) or None."""
        with self._lock:
            row = self._db.execute("SELECT cancel FROM jobs WHERE id=?", (job_id,)).fetchone()
        return None if row is None else row[0]

    def cancelled(self, job_id: str, result: dict) -> None:
        """A running job stopped by its cancel: ``cancelled``, with ``result`` (the steps it
        ran); or removed, when the cancel was a DELETE."""
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id=? AND cancel=?",
                             (job_id, CANCEL_AND_DELETE))
            self._db.execute("UPDATE jobs SET status='cancelled', completed_at=?, result=?, "
                             "cancel=NULL WHERE id=?",
                             (int(time.time()), json.dumps(result), job_id))

    def expire(self, retention_s: float, now: float | None = None) -> list[Job]:
        """Ended jobs whose ``completed_at`` is ``retention_s`` or more before ``now`` (Unix
        seconds) become ``expired``; returns them as they were (the caller removes their
        files)."""
        cutoff = (time.time() if now is None else now) - retention_s
        marks = ",".join("?" * len(ENDED))
        with self._lock:
            rows = self._db.execute(f"SELECT * FROM jobs WHERE status IN ({marks}) AND "
                                    "completed_at <= ? ORDER BY seq", (*ENDED, cutoff)).fetchall()
            self._db.executemany("UPDATE jobs SET status='expired' WHERE id=?",
                                 [(r["id"],) for r in rows])
        return [_decode(r) for r in rows]

    def drop_if_deleted(self, job_id: str) -> bool:
        """After a job ended on its own: remove it if a DELETE came while it ran (too late
        to stop it); True if removed (the caller removes its files)."""
        return self._run("DELETE FROM jobs WHERE id=? AND cancel=? AND status != "
                         "'in_progress'", (job_id, CANCEL_AND_DELETE)) > 0

    def delete(self, job_id: str) -> bool:
        """Remove a job that is not running; False if it is running (or unknown)."""
        return self._run("DELETE FROM jobs WHERE id=? AND status != 'in_progress'",
                         (job_id,)) > 0


def _decode(row) -> Job | None:
    if row is None:
        return None
    job = dict(row)
    return Job(**{**job, "settings": VideoJob.from_json(json.loads(job["settings"])),
                  "result": json.loads(job["result"]) if job["result"] else None})
