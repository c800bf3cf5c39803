"""The job store: every accepted job and its state in a database, so that a crash or
``kill -9`` loses nothing that was accepted, and several servers can share one queue.

One schema and one code path (SQLAlchemy Core) on two engines:

- **SQLite** (the default): ``<output_dir>/jobs.sqlite3``, one server. WAL, ``synchronous=
  FULL``: a job is on disk before ``POST /v1/videos`` answers.
- **PostgreSQL** (``--jobs_db postgresql://...``): any number of servers, each on its own
  slice, sharing the queue and an output folder every server reaches.

A worker **claims** the oldest job of a bucket it serves with ``SELECT ... FOR UPDATE SKIP
LOCKED`` (SQLite, which has one writer at a time, ignores the clause), then a guarded
``UPDATE``: two servers never run the same job at once. The claim is a **lease**
(``lease_until``, on the database's clock, so the servers' clocks need not agree) that the
server's heartbeat renews (``engine.serve.fleet``). A server that dies stops renewing; once
its lease has passed, the next claim by any server runs the job again from the start, with
the same seed (``attempts`` counts the runs). Every write a worker makes about its job is
guarded by ``owner``: a server that lost its lease can no longer complete, fail or cancel
the job, and learns it at its next step (``check``).

Every state change is one guarded ``UPDATE`` (its ``WHERE`` names the status it expects),
so an HTTP handler's cancel and a worker's claim never both win.

The transaction that ends a job with a ``callback_url`` (completed, failed, cancelled) also
writes its webhook to the ``outbox`` table, which ``engine.serve.webhooks`` delivers from
(``claim_callback``, ``callback_done``, ``callback_retry``): a kill -9 loses no callback.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
import threading
import time
import uuid
from contextlib import nullcontext

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.functions import FunctionElement

from engine.serve.outage import Outage
from engine.serve.requests import VideoJob

DB_NAME = "jobs.sqlite3"
# The only ids the server makes: a URL's id must match this before it names anything.
ID_PATTERN = re.compile(r"video_[0-9a-f]{32}")
STATUSES = ("queued", "in_progress", "completed", "failed", "cancelled", "expired")
ENDED = ("completed", "failed", "cancelled")  # what --retention_hours expires
# What a cancel asks of a running job (the ``cancel`` column): stop at the next denoising step
# boundary and keep the job as ``cancelled``, or stop and delete it (DELETE of a running job).
CANCEL, CANCEL_AND_DELETE = "cancel", "delete"
# ``check``'s answer to a worker whose job is no longer its own (its lease passed and another
# server claimed the job, or the job was removed).
LOST = "lost"
DEFAULT_LEASE_S = 30.0
_SCHEMA_LOCK = 0x6A6F6273  # PostgreSQL advisory lock key ("jobs") held while the schema is made

metadata = sa.MetaData()
jobs = sa.Table(
    "jobs", metadata,
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),  # arrival order
    sa.Column("id", sa.String(64), unique=True, nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("progress", sa.Integer, nullable=False, server_default="0"),
    sa.Column("created_at", sa.Integer, nullable=False),  # Unix seconds
    sa.Column("completed_at", sa.Integer),
    sa.Column("error", sa.Text),
    sa.Column("settings", sa.Text, nullable=False),  # JSON: the checked VideoJob
    sa.Column("result", sa.Text),  # JSON: timings and file names
    sa.Column("cancel", sa.String(16)),  # a running job's pending cancel
    sa.Column("bucket", sa.String(255)),  # "model:WxHxF": who may claim it
    sa.Column("owner", sa.String(64)),  # the server holding the lease
    sa.Column("lease_until", sa.Float),  # the database's clock, Unix seconds
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    # JSON: a streamed job's chunks so far (``streamed``), while it runs and after it ends.
    sa.Column("stream", sa.Text),
    sa.Index("jobs_status_seq", "status", "seq"),
    sqlite_autoincrement=True)  # ids of removed rows are never reused (as before SQLAlchemy)
servers = sa.Table(
    "servers", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("address", sa.String(255)),
    sa.Column("model", sa.String(255)),
    sa.Column("buckets", sa.Text, nullable=False),  # JSON list of bucket keys
    sa.Column("served", sa.Text),  # JSON: the Served value (GET /v1/models)
    sa.Column("started_at", sa.Float),
    sa.Column("heartbeat_at", sa.Float))
# Webhooks not yet delivered (engine.serve.webhooks), one row per ended job with a callback.
outbox = sa.Table(
    "outbox", metadata,
    sa.Column("id", sa.String(100), primary_key=True),  # the webhook id: "<job id>:<status>"
    sa.Column("url", sa.Text, nullable=False),
    sa.Column("body", sa.Text, nullable=False),  # JSON: the ended job's video object
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),  # claims so far
    # The database's clock: when it may be tried next, or, while ``owner`` (a server id)
    # delivers it, when that server's hold ends.
    sa.Column("due_at", sa.Float, nullable=False),
    sa.Column("owner", sa.String(64)),
    sa.Index("outbox_due", "due_at"))
# Columns a store written by an older server may lack: added on open.
_ADDED = {"cancel": "VARCHAR(16)", "bucket": "VARCHAR(255)", "owner": "VARCHAR(64)",
          "lease_until": "FLOAT", "attempts": "INTEGER NOT NULL DEFAULT 0", "stream": "TEXT"}


class db_now(FunctionElement):
    """The database's clock in Unix seconds (float): leases and heartbeats use it, so that
    servers whose clocks differ still agree on when a lease has passed."""

    type = sa.Float()
    inherit_cache = True


@compiles(db_now, "postgresql")
def _pg_now(element, compiler, **kw):
    return "extract(epoch from clock_timestamp())"


@compiles(db_now, "sqlite")
def _sqlite_now(element, compiler, **kw):
    return "((julianday('now') - 2440587.5) * 86400.0)"


def new_id() -> str:
    return f"video_{uuid.uuid4().hex}"


def job_bucket(settings: VideoJob) -> str:
    """The bucket a job needs: "model:WIDTHxHEIGHTxFRAMES" (``model.bucket_key`` behind the
    served model's name); a server claims only jobs of the buckets it compiled."""
    return f"{settings.model}:{settings.width}x{settings.height}x{settings.num_frames}"


def engine_url(jobs_db: str | None, folder: str) -> sa.URL:
    """The SQLAlchemy URL of ``--jobs_db`` (None: ``<folder>/jobs.sqlite3``); a
    ``postgresql://`` URL gets the psycopg 3 driver."""
    if jobs_db is None:
        return sa.URL.create("sqlite", database=os.path.join(folder, DB_NAME))
    url = sa.make_url(jobs_db)
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def masked(url) -> str:
    """A database URL (string or ``sqlalchemy.URL``) for logs, reports and errors: the
    password shown as ***."""
    return sa.make_url(url).render_as_string(hide_password=True)


@dataclasses.dataclass(frozen=True)
class Job:
    """One row of the store: the job's ``id``, its arrival ``seq``, ``status`` (one of
    ``STATUSES``), ``progress`` (percent), times (Unix seconds; ``completed_at`` None until
    it ends), ``error`` (one line, or None), ``settings`` (the checked ``VideoJob``),
    ``result`` ({"files", "timings", "wall_s"} once completed, else None), its pending
    ``cancel``, the ``owner`` server's id while it runs, ``attempts`` (runs started), and
    ``stream``: a job whose model streams its video chunk by chunk, what ``streamed`` last
    recorded ({"chunks_done", "seconds_generated", "first_chunk_seconds", "file": the
    growing file's name, "codecs": its RFC 6381 codec string}), else None."""

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
    bucket: str | None = None
    owner: str | None = None
    lease_until: float | None = None
    attempts: int = 0
    stream: dict | None = None


class JobStore:
    """Jobs in ``--jobs_db`` (default ``<folder>/jobs.sqlite3``); ``folder`` holds the
    files. Safe to call from the HTTP handlers and the worker thread at once. Rows come back
    as ``Job`` values.

    ``render(job)``: the body of an ended job's webhook, a JSON-ready dict (the server's
    ``video_object``; default: its id, object and status).

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached (the caller turns it
            into one line naming --jobs_db).
    """

    def __init__(self, folder: str, jobs_db: str | None = None,
                 lease_s: float = DEFAULT_LEASE_S, render=None):
        self.folder, self.lease_s = folder, float(lease_s)
        self.render = render or (lambda job: dict(id=job.id, object="video",
                                                  status=job.status))
        url = engine_url(jobs_db, folder)
        self.shared = url.get_backend_name() != "sqlite"  # several servers may share it
        self.url = masked(url)
        if self.shared:
            # A connection the database dropped (a restart) is replaced at checkout, and a
            # host that does not answer fails a connect in 5 s instead of the OS's minutes.
            self.engine = sa.create_engine(url, pool_pre_ping=True, pool_size=4,
                                           connect_args=dict(connect_timeout=5))
        else:
            self.engine = sa.create_engine(url, connect_args={"check_same_thread": False})
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self.outage = Outage(self.url, self.lease_s)  # engine.serve.outage: its lease rule
        self.outage.watch(self.engine)
        # SQLite has one writer at a time: one lock keeps this process's threads from
        # meeting "database is locked"; PostgreSQL's row locks need none.
        self._lock = nullcontext() if self.shared else threading.Lock()
        with self._lock, self.engine.begin() as db:
            if self.shared:  # servers starting at once: one creates the tables, then the next
                db.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), dict(key=_SCHEMA_LOCK))
            metadata.create_all(db)
            have = {c["name"] for c in sa.inspect(db).get_columns("jobs")}
            for name, kind in _ADDED.items():
                if name not in have:  # a store from an older server
                    db.execute(sa.text(f"ALTER TABLE jobs ADD COLUMN {name} {kind}"))
            for row in db.execute(sa.select(jobs.c.id, jobs.c.settings)
                                  .where(jobs.c.bucket.is_(None))).all():
                bucket = job_bucket(VideoJob.from_json(json.loads(row.settings)))
                db.execute(jobs.update().where(jobs.c.id == row.id).values(bucket=bucket))

    def _execute(self, statement, rows: bool = False):
        """Run one statement in its own committed transaction: its rows (``rows``) or its
        rowcount."""
        with self._lock, self.engine.begin() as db:
            result = db.execute(statement)
            return result.all() if rows else result.rowcount

    def _one(self, where) -> Job | None:
        found = self._execute(jobs.select().where(where), rows=True)
        return _decode(found[0]) if found else None

    def close(self) -> None:
        self.engine.dispose()

    def recover(self) -> dict:
        """At a server's start. SQLite (one server): the jobs the last run left running go
        back to the queue (progress 0) and the partial files an interrupted write left are
        removed. A shared store: nothing is taken from the other servers; a running job
        comes back when its lease passes (``claim``). Both: a job whose pending cancel its
        dead server never honoured ends as the cancel asked (``reap``). Returns
        {"requeued": ids, "removed": file names}."""
        self.reap(expired_only=self.shared)
        if self.shared:
            return dict(requeued=[], removed=[])
        with self._lock, self.engine.begin() as db:
            ids = db.execute(sa.select(jobs.c.id).where(
                jobs.c.status.in_(("queued", "in_progress"))).order_by(jobs.c.seq)).scalars()
            ids = list(ids)
            db.execute(jobs.update().where(jobs.c.status == "in_progress").values(
                status="queued", progress=0, owner=None, lease_until=None, stream=None))
        removed = []
        for path in glob.glob(os.path.join(self.folder, ".*.partial*")):
            os.remove(path)
            removed.append(os.path.basename(path))
        return dict(requeued=ids, removed=removed)

    def reap(self, expired_only: bool = True) -> int:
        """Running jobs with a pending cancel whose server is gone (lease passed; all of
        them with ``expired_only`` False) end as the cancel asked: ``cancelled``, or
        removed. Returns how many."""
        gone = (jobs.c.status == "in_progress") & jobs.c.cancel.is_not(None)
        if expired_only:
            if not self.outage.settled():  # a lease that passed in an outage proves nothing
                return 0
            gone &= sa.func.coalesce(jobs.c.lease_until, 0) < db_now()
        with self._lock, self.engine.begin() as db:
            n = db.execute(jobs.delete().where(gone & (jobs.c.cancel == CANCEL_AND_DELETE)))
            ended = db.execute(jobs.update().where(gone).values(
                status="cancelled", completed_at=int(time.time()), cancel=None, owner=None)
                .returning(jobs.c.id)).scalars().all()
            self._announce(db, ended)
            return n.rowcount + len(ended)

    def add(self, settings: VideoJob, job_id: str | None = None) -> Job:
        job_id = job_id or new_id()
        self._execute(jobs.insert().values(
            id=job_id, status="queued", created_at=int(time.time()),
            settings=json.dumps(settings.to_json()), bucket=job_bucket(settings)))
        return self.get(job_id)

    def get(self, job_id: str) -> Job | None:
        return self._one(jobs.c.id == job_id)

    def page(self, *, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        """(up to ``limit`` jobs after the job ``after`` in ``order`` of arrival ("asc" or
        "desc"), whether more follow)."""
        query = jobs.select().order_by(jobs.c.seq.asc() if order == "asc" else
                                       jobs.c.seq.desc()).limit(limit + 1)
        if after is not None:
            mark = sa.select(jobs.c.seq).where(jobs.c.id == after).scalar_subquery()
            query = query.where(jobs.c.seq > mark if order == "asc" else jobs.c.seq < mark)
        found = self._execute(query, rows=True)
        return [_decode(r) for r in found[:limit]], len(found) > limit

    def count(self, status: str) -> int:
        return self._execute(sa.select(sa.func.count()).select_from(jobs).where(
            jobs.c.status == status), rows=True)[0][0]

    def queue_position(self, job: Job) -> int | None:
        """Jobs ahead of a queued ``job`` (0: it runs next); None unless it is queued."""
        if job.status != "queued":
            return None
        return self._execute(sa.select(sa.func.count()).select_from(jobs).where(
            (jobs.c.status == "queued") & (jobs.c.seq < job.seq)), rows=True)[0][0]

    # The worker's side: claim a job, hold its lease, record how it ended.

    def _claimable(self, buckets):
        """Queued jobs, and running ones whose server's lease has passed (a dead server's:
        run again from the start), of ``buckets``."""
        lapsed = (jobs.c.status == "in_progress") & jobs.c.cancel.is_(None) & \
            (sa.func.coalesce(jobs.c.lease_until, 0) < db_now())
        if not self.outage.settled():  # back from an outage: owners renew first (outage.py)
            lapsed = sa.false()
        return ((jobs.c.status == "queued") | lapsed) & jobs.c.bucket.in_(list(buckets))

    def claim(self, owner: str, buckets) -> Job | None:
        """The oldest claimable job of ``buckets`` (bucket keys, ``job_bucket``), now
        ``in_progress`` under ``owner``'s lease of ``lease_s`` seconds; None if there is
        none. Locked rows are skipped, so servers claiming at once take different jobs."""
        if not buckets:
            return None
        self.reap()
        claimable = self._claimable(buckets)
        with self._lock, self.engine.begin() as db:
            row = db.execute(sa.select(jobs.c.id).where(claimable).order_by(jobs.c.seq)
                             .limit(1).with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            taken = db.execute(jobs.update().where((jobs.c.id == row.id) & claimable).values(
                status="in_progress", progress=0, owner=owner, error=None, stream=None,
                lease_until=db_now() + self.lease_s, attempts=jobs.c.attempts + 1)).rowcount
        return self.get(row.id) if taken else None

    def _held(self, job_id: str, owner: str):
        return (jobs.c.id == job_id) & (jobs.c.owner == owner) & \
            (jobs.c.status == "in_progress")

    def renew(self, owner: str) -> int:
        """Extend the lease of every job ``owner`` runs by ``lease_s`` from now; returns
        how many (the heartbeat calls it)."""
        return self._execute(jobs.update().where(
            (jobs.c.owner == owner) & (jobs.c.status == "in_progress")).values(
            lease_until=db_now() + self.lease_s))

    def progress(self, job_id: str, percent: int, owner: str) -> bool:
        """Record a running job's progress (and extend its lease); False when the job is
        no longer ``owner``'s."""
        return self._execute(jobs.update().where(self._held(job_id, owner)).values(
            progress=int(percent), lease_until=db_now() + self.lease_s)) > 0

    def streamed(self, job_id: str, stream: dict, owner: str) -> bool:
        """Record a running job's streamed chunks (``Job.stream``); False when the job is no
        longer ``owner``'s."""
        return self._execute(jobs.update().where(self._held(job_id, owner)).values(
            stream=json.dumps(stream))) > 0

    def check(self, job_id: str, owner: str) -> str | None:
        """After a step: the job's pending cancel (``CANCEL``, ``CANCEL_AND_DELETE``), or
        ``LOST`` when it is no longer ``owner``'s to run, or None (go on)."""
        found = self._execute(sa.select(jobs.c.owner, jobs.c.status, jobs.c.cancel).where(
            jobs.c.id == job_id), rows=True)
        if not found or found[0].owner != owner or found[0].status != "in_progress":
            return LOST
        return found[0].cancel

    def complete(self, job_id: str, result: dict, owner: str) -> bool:
        """``owner``'s job is ``completed`` with ``result``; False (nothing written) when it
        was no longer ``owner``'s."""
        return self._end(job_id, owner, status="completed", progress=100,
                         result=json.dumps(result))

    def fail(self, job_id: str, message: str, owner: str) -> bool:
        return self._end(job_id, owner, status="failed", error=message)

    def _end(self, job_id: str, owner: str, **values) -> bool:
        with self._lock, self.engine.begin() as db:
            done = db.execute(jobs.update().where(self._held(job_id, owner)).values(
                completed_at=int(time.time()), lease_until=None, **values)).rowcount
            # A plain cancel that came during the decode was too late: the job has ended.
            db.execute(jobs.update().where((jobs.c.id == job_id) &
                                           (jobs.c.cancel == CANCEL)).values(cancel=None))
            if done:
                self._announce(db, [job_id])
        return done > 0

    def cancelled(self, job_id: str, result: dict, owner: str) -> None:
        """``owner``'s running job stopped by its cancel: ``cancelled``, with ``result``
        (the steps it ran); or removed, when the cancel was a DELETE."""
        held = self._held(job_id, owner)
        with self._lock, self.engine.begin() as db:
            db.execute(jobs.delete().where(held & (jobs.c.cancel == CANCEL_AND_DELETE)))
            if db.execute(jobs.update().where(held).values(
                    status="cancelled", completed_at=int(time.time()),
                    result=json.dumps(result), cancel=None, lease_until=None)).rowcount:
                self._announce(db, [job_id])

    # Webhooks: the outbox (engine.serve.webhooks delivers from it).

    def _announce(self, db, job_ids) -> None:
        """Inside the transaction that ended ``job_ids``: an outbox row, due now, for each
        that asked for a ``callback_url`` and is not being deleted (a DELETE that came
        while it ran removes it unannounced, as ``drop_if_deleted`` does)."""
        if not job_ids:
            return
        ended = db.execute(jobs.select().where(
            jobs.c.id.in_(list(job_ids)) & jobs.c.status.in_(ENDED) &
            (sa.func.coalesce(jobs.c.cancel, "") != CANCEL_AND_DELETE))).all()
        for job in map(_decode, ended):
            hook = f"{job.id}:{job.status}"
            known = db.execute(sa.select(outbox.c.id).where(outbox.c.id == hook)).first()
            if job.settings.callback_url and known is None:
                db.execute(outbox.insert().values(
                    id=hook, url=job.settings.callback_url, attempts=0, due_at=db_now(),
                    body=json.dumps(self.render(job), sort_keys=True)))

    def claim_callback(self, owner: str, hold_s: float) -> dict | None:
        """The longest-due webhook, now held by ``owner`` for ``hold_s`` seconds (its
        ``attempts`` counted); None when none is due. Locked rows are skipped and the claim
        is a guarded ``UPDATE``: two servers never hold one row at once, and a row whose
        holder died is due again when the hold passes. Returns the row as a dict: "id",
        "url", "body" (JSON text), "attempts" (this one included)."""
        due = outbox.c.due_at <= db_now()
        with self._lock, self.engine.begin() as db:
            row = db.execute(sa.select(outbox.c.id).where(due).order_by(outbox.c.due_at)
                             .limit(1).with_for_update(skip_locked=True)).first()
            if row is None or not db.execute(outbox.update().where(
                    (outbox.c.id == row.id) & due).values(
                    owner=owner, due_at=db_now() + hold_s,
                    attempts=outbox.c.attempts + 1)).rowcount:
                return None
            return dict(db.execute(outbox.select().where(outbox.c.id == row.id))
                        .one()._mapping)

    def callback_done(self, hook_id: str, owner: str) -> bool:
        """Remove a webhook ``owner`` holds (delivered, refused or given up); False when its
        hold had passed and another server took it."""
        return self._execute(outbox.delete().where(
            (outbox.c.id == hook_id) & (outbox.c.owner == owner))) > 0

    def callback_retry(self, hook_id: str, owner: str, delay_s: float) -> bool:
        """Release a webhook ``owner`` holds, due again ``delay_s`` seconds from now."""
        return self._execute(outbox.update().where(
            (outbox.c.id == hook_id) & (outbox.c.owner == owner)).values(
            owner=None, due_at=db_now() + delay_s)) > 0

    def pending_callbacks(self) -> int:
        """Webhooks in the outbox, held or not."""
        return self._execute(sa.select(sa.func.count()).select_from(outbox), rows=True)[0][0]

    # The HTTP side: cancel, delete, expire.

    def cancel(self, job_id: str, how: str = CANCEL) -> str | None:
        """Cancel a job, atomically against the worker's claim: a queued job becomes
        ``cancelled`` at once (it never starts); a running one gets ``how`` as its pending
        cancel, which its server reads after each denoising step (``check``). Returns the
        job's status before the call ("queued" or "in_progress"), or None when it had
        already ended."""
        with self._lock, self.engine.begin() as db:
            if db.execute(jobs.update().where((jobs.c.id == job_id) &
                                              (jobs.c.status == "queued")).values(
                    status="cancelled", completed_at=int(time.time()))).rowcount:
                self._announce(db, [job_id])
                return "queued"
            if db.execute(jobs.update().where((jobs.c.id == job_id) &
                                              (jobs.c.status == "in_progress")).values(
                    cancel=how)).rowcount:
                return "in_progress"
        return None

    def expire(self, retention_s: float, now: float | None = None) -> list[Job]:
        """Ended jobs whose ``completed_at`` is ``retention_s`` or more before ``now`` (Unix
        seconds) become ``expired``; returns them as they were (the caller removes their
        files). With several servers sweeping, each expired job is returned to one."""
        cutoff = (time.time() if now is None else now) - retention_s
        old = jobs.c.status.in_(ENDED) & (jobs.c.completed_at <= cutoff)
        with self._lock, self.engine.begin() as db:
            rows = db.execute(jobs.select().where(old).order_by(jobs.c.seq)
                              .with_for_update(skip_locked=True)).all()
            db.execute(jobs.update().where(jobs.c.id.in_([r.id for r in rows]) & old)
                       .values(status="expired"))
        return [_decode(r) for r in rows]

    def drop_if_deleted(self, job_id: str) -> bool:
        """After a job ended on its own: remove it if a DELETE came while it ran (too late
        to stop it); True if removed (the caller removes its files)."""
        return self._execute(jobs.delete().where(
            (jobs.c.id == job_id) & (jobs.c.cancel == CANCEL_AND_DELETE) &
            (jobs.c.status != "in_progress"))) > 0

    def delete(self, job_id: str) -> bool:
        """Remove a job that is not running; False if it is running (or unknown)."""
        return self._execute(jobs.delete().where(
            (jobs.c.id == job_id) & (jobs.c.status != "in_progress"))) > 0

    # The servers sharing the store (``engine.serve.fleet``).

    def register(self, server_id: str, *, address: str, model: str, buckets,
                 served: dict) -> None:
        """Announce a ready server and the buckets it runs."""
        with self._lock, self.engine.begin() as db:
            db.execute(servers.delete().where(servers.c.id == server_id))
            db.execute(servers.insert().values(
                id=server_id, address=address, model=model, buckets=json.dumps(list(buckets)),
                served=json.dumps(served), started_at=db_now(), heartbeat_at=db_now()))

    def heartbeat(self, server_id: str) -> bool:
        """The server is alive: its row's time and its running jobs' leases move on;
        servers silent for ten leases are forgotten. False if the row was gone (the caller
        registers again)."""
        with self._lock, self.engine.begin() as db:
            seen = db.execute(servers.update().where(servers.c.id == server_id).values(
                heartbeat_at=db_now())).rowcount
            db.execute(jobs.update().where((jobs.c.owner == server_id) &
                                           (jobs.c.status == "in_progress")).values(
                lease_until=db_now() + self.lease_s))
            db.execute(servers.delete().where(servers.c.heartbeat_at <
                                              db_now() - 10 * self.lease_s))
        return seen > 0

    def unregister(self, server_id: str) -> None:
        """A clean stop: the server's row goes, and the job it was running (cut short by
        the stop) is claimable at once instead of after its lease."""
        with self._lock, self.engine.begin() as db:
            db.execute(servers.delete().where(servers.c.id == server_id))
            db.execute(jobs.update().where((jobs.c.owner == server_id) &
                                           (jobs.c.status == "in_progress")).values(
                lease_until=None))

    def live_servers(self) -> list[dict]:
        """The servers heard from within one lease: {"id", "address", "model", "buckets",
        "served"} each, oldest first."""
        rows = self._execute(sa.select(servers).where(
            servers.c.heartbeat_at >= db_now() - self.lease_s).order_by(
            servers.c.started_at), rows=True)
        return [dict(id=r.id, address=r.address, model=r.model,
                     buckets=json.loads(r.buckets),
                     served=json.loads(r.served) if r.served else None) for r in rows]


def _sqlite_pragmas(connection, _record) -> None:
    """Every SQLite connection: write-ahead log, and a commit is on disk before it returns."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def _decode(row) -> Job | None:
    if row is None:
        return None
    job = dict(row._mapping)
    return Job(**{**job, "settings": VideoJob.from_json(json.loads(job["settings"])),
                  "result": json.loads(job["result"]) if job["result"] else None,
                  "stream": json.loads(job["stream"]) if job["stream"] else None})
