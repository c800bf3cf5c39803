"""One job at a time on the mesh, in arrival order (process 0's worker thread).

The worker claims the oldest queued job of its buckets from the job store (with several
servers on one store, another server may take the next one: ``JobStore.claim``), holds its
lease while it runs (``engine.serve.fleet``'s heartbeat), and after each denoising step
learns whether it was cancelled or is no longer its own (its lease passed while this server
was unreachable, and another server took it over): either stops the job at that step.

While the job store is away (``engine.serve.outage``) the running job goes on; its end is
written once the store answers again, retried with bounded backoff (its lease holds
meanwhile: the outage module's rule), and the next claim waits the same way.

A job's failure (NaN latents, out of device memory) marks it
``failed`` with a one-line reason and the next job runs. In a multi-host run the other
processes run the same job (``engine.serve.hosts``); when their outcome differs from
process 0's, the processes no longer agree on where they are, so the server stops with a
one-line error instead of risking a hang in the next collective.
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time

import sqlalchemy as sa

from engine.files import report as reporting
from engine.files import stream_writer, videos
from engine.files.writer import VideoWriter
from engine.run import runtime
from engine.run.errors import GenerationError, UsageError, first_line
from engine.serve import hosts, uploads
from engine.serve.fleet import Fleet
from engine.serve.jobs import CANCEL, LOST, Job, JobStore
from engine.serve.outage import retry_delay
from engine.serve.storage import Storage

# Test hook: seconds to sleep after each denoising step of a served job, so a test can
# cancel a running job between steps on the tiny checkpoint. Unset in normal use.
STEP_DELAY_ENV = "GENERATE_FLAX_TEST_STEP_DELAY_S"


def video_name(job_id: str) -> str:
    """The mp4's name of a job (``job_id`` already matched ``jobs.ID_PATTERN``)."""
    return os.path.basename(videos.video_files("", job_id, None, False)["video"])


class LeaseLost(hosts.JobCancelled):
    """The running job is no longer this server's (its lease passed and another server
    claimed it): stop at this step and write nothing; the other server's run stands."""


class Worker:
    """Runs the jobs of ``store`` that ``fleet``'s buckets hold on ``model`` (a
    ``WarmModel``) until ``stop``, writing videos to ``storage``.

    ``fatal`` is set (and ``on_fatal`` called) when the server must end: the one-line
    error the CLI prints.
    """

    def __init__(self, store: JobStore, model, on_fatal, handoff: hosts.HandOff | None,
                 metrics=None, retention_s: float | None = None, on_ended=None, *,
                 fleet: Fleet, storage: Storage):
        self.store, self.model, self.on_fatal, self.handoff = store, model, on_fatal, handoff
        self.fleet, self.storage = fleet, storage
        self.metrics = metrics  # engine.serve.metrics.Metrics, or None
        self.retention_s, self.next_sweep = retention_s, 0.0
        self.on_ended = on_ended  # f(job id) once a job has ended: its webhook
        self.wake, self.stopping, self.fatal = threading.Event(), False, None
        self.halt = threading.Event()  # set by stop: ends a wait for the store at once
        self.done = 0
        # A finished job's files are written, and its end recorded, on this one thread while
        # the next job runs (first in first out; engine/files/writer.py).
        self.writer = VideoWriter()

    def stop(self) -> None:
        self.stopping = True
        self.halt.set()
        self.wake.set()

    def sweep(self) -> list[str]:
        """``--retention_hours``: expire the ended jobs past their retention and remove their
        files (videos, frames, the input image); returns their ids. Runs between jobs, at
        most every ``sweep_interval_s``."""
        if self.retention_s is None or time.monotonic() < self.next_sweep:
            return []
        self.next_sweep = time.monotonic() + sweep_interval_s(self.retention_s)
        expired = self.store.expire(self.retention_s)
        for job in expired:
            for name in (job.result or {}).get("files", []):
                self.storage.remove(name)
            uploads.remove(self.storage.folder, job.settings)
        return [job.id for job in expired]

    def loop(self) -> None:
        """Claim and run jobs until ``stop``; then wait for the writer thread's last files
        and ends (a failure there is fatal, as one in a job's run is)."""
        try:
            self._jobs()
        finally:
            try:
                self.writer.wait()
            except Exception as e:
                if self.fatal is None:
                    self.fatal = first_line(e)
                    self.on_fatal(self.fatal)
            finally:
                self.writer.close()
        if self.handoff is not None and self.fatal is None:
            self.handoff.send({"stop": True})

    def _jobs(self) -> None:
        away = 0  # claims in a row the store failed
        while not self.stopping:
            try:
                self.sweep()
                job = self.store.claim(self.fleet.id, self.fleet.buckets)
                away = 0
            except sa.exc.SQLAlchemyError as e:  # the store is away: wait, never end
                _store_away(self.store, "claiming the next job", e)
                self.halt.wait(retry_delay(away))
                away += 1
                continue
            if job is None:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                self.run_one(job)
            except sa.exc.SQLAlchemyError as e:  # stopping with its end unrecorded
                _store_away(self.store, f"recording how {job.id} ended (it runs again once "
                            "its lease passes)", e, always=True)
            except Exception as e:
                self.fatal = f"job {job.id}: {first_line(e)}"
                self.on_fatal(self.fatal)
                return

    def run_one(self, job: Job) -> None:
        """Run ``job`` to completed, failed or cancelled. Raises only what must end the
        server."""
        job_id, owner = job.id, self.fleet.id
        print(f"{job_id}: started" + (f" (attempt {job.attempts}: the last server's lease "
                                      "passed)" if job.attempts > 1 else ""), flush=True)
        try:
            image = uploads.load(self.storage.folder, job.settings)
        except OSError as e:  # its input_reference was removed: this job only
            line = f"input_reference: {first_line(e)}"
            self._ended(job, "failed", lambda: self.store.fail(job_id, line, owner))
            return
        seq = self.handoff.send(hosts.job_message(job), image) if self.handoff else None
        t0 = time.time()
        stream = self._stream(job, t0)
        on_step = self._on_step(job_id, seq, stream)
        error, timings, audio = None, {}, None
        try:
            with stream_writer.streaming(stream):  # a chunked model streams its video
                frames, config, timings, audio = self.model.run(job_id, job.settings, image,
                                                                on_step)
        except (GenerationError, UsageError, hosts.JobCancelled) as e:
            error = e
        except Exception as e:
            if runtime.in_multi_process_run():
                raise
            error = e  # a bug: this job only
        if seq is not None:
            ours, theirs = hosts.outcome(error), self.handoff.outcomes(seq)
            if any(_kind(o) != _kind(ours) for o in theirs.values()):
                raise GenerationError(f"the processes disagree on the job's outcome "
                                      f"(process 0: {ours}; others: {theirs})")
        if error is None and stream.stats["chunks_done"]:  # its mp4 is written: close it
            self.writer.submit(self._write, job, lambda: _finish_stream(
                stream, self.storage, config, frames, job.id), timings, t0, audio)
        elif error is None:  # the files and the end on the writer thread; the next job starts
            stream.abort()
            self.writer.submit(self._write, job, lambda: self.storage.write(
                config, frames, job.id, audio), timings, t0, audio)
        else:
            self._end(job, error, _kept(stream, error, job.id), timings, t0, audio)

    def _stream(self, job: Job, t0: float) -> stream_writer.FragmentedMp4Writer:
        """The job's ``ChunkSink``, used if its model streams chunks (none: no file): the mp4
        grows under a name of this run's own while each chunk's numbers go to the store
        (``JobStore.streamed``: ``first_chunk_seconds`` from ``t0``, the job's start here)
        for the video object and ``GET .../content``."""
        partial = f".{job.id}.partial-{os.urandom(4).hex()}.mp4"  # recover() removes it

        def written(stats: dict) -> None:
            info = dict(chunks_done=stats["chunks_done"],
                        seconds_generated=stats["seconds_generated"],
                        first_chunk_seconds=stats["first_chunk_at"] - t0,
                        file=partial, codecs=stats["codecs"])
            try:
                self.store.streamed(job.id, info, self.fleet.id)
            except sa.exc.SQLAlchemyError as e:  # the stream goes on; the end is recorded
                _store_away(self.store, f"{job.id}'s chunk {stats['chunks_done']}", e)

        return stream_writer.FragmentedMp4Writer(
            self.storage.path(video_name(job.id)), job.settings.fps, on_written=written,
            partial=self.storage.path(partial))

    def _write(self, job: Job, write, timings: dict, t0: float, audio) -> None:
        """The writer thread: the job's files (``write()``: (names, ``write_video``'s
        timings); the uint8, mp4 encode and audio mux, or a streamed mp4's close), its stages
        (``timings["stages"]``, ``engine.files.videos.video_stages``: ``video_wall_s`` from
        the job's start here to its file in place), then its end recorded. A file that
        could not be written fails the job with that one line."""
        files, error = [], None
        try:
            files, written = write()
            timings["stages"] = videos.video_stages(
                [timings], timings.get("text_encode_s", 0.0), timings.get("to_frames_s", 0.0),
                written, t0)
        except GenerationError as e:
            error = e
        try:
            self._end(job, error, files, timings, t0, audio)
        except sa.exc.SQLAlchemyError as e:  # stopping with its end unrecorded
            _store_away(self.store, f"recording how {job.id} ended (it runs again once its "
                        "lease passes)", e, always=True)

    def _end(self, job: Job, error, files: list, timings: dict, t0: float, audio) -> None:
        """Record how ``job`` ended, then its metrics and webhook."""
        if not self._record(job, error, files, timings, time.time() - t0, audio):
            return  # another server holds the job now: its run announces the end
        if self.metrics is not None:
            status = "completed" if error is None else \
                "cancelled" if isinstance(error, hosts.JobCancelled) else "failed"
            self.metrics.job_ended(status, queue_wait_s=max(0.0, t0 - job.created_at),
                                   total_s=time.time() - job.created_at, timings=timings)
        if self.on_ended is not None:
            self.on_ended(job.id)
        self.done += 1

    def _on_step(self, job_id: str, seq: int | None, stream=None):
        """After each denoising step: the job's progress, then its pending cancel (decided
        here for every process of the run); raises ``hosts.JobCancelled`` to stop.

        A job that has streamed a chunk (``stream.handed``: the ``ChunkSink``'s count)
        finishes the chunk it is making: a plain cancel stops it at the first step after
        that chunk is handed over, so the chunk is kept (every process stops at that same
        step); a DELETE or a lost lease stops it at once."""
        last, mark = [-1], [None]  # mark: chunks handed when the cancel was first seen
        delay = float(os.environ.get(STEP_DELAY_ENV, 0))

        def on_step(done: int, steps: int) -> None:
            percent = 100 * done // (steps + 1)  # the decode is the last part
            try:
                if percent != last[0]:
                    last[0] = percent
                    self.store.progress(job_id, percent, self.fleet.id)
                time.sleep(delay)  # the test hook: a cancel lands between steps
                pending = self.store.check(job_id, self.fleet.id)
            except sa.exc.SQLAlchemyError as e:  # go on; the lease says whose the job is
                _store_away(self.store, f"{job_id}'s step {done}", e)
                pending = None
            if pending == CANCEL and stream is not None and stream.handed:
                mark[0] = stream.handed if mark[0] is None else mark[0]
                if stream.handed == mark[0]:  # the chunk being made is not handed yet
                    pending = None
            if seq is not None:
                self.handoff.decide(seq, done, pending is not None)
            if pending == LOST:
                raise LeaseLost(done)
            if pending is not None:
                raise hosts.JobCancelled(done)

        return on_step

    def _record(self, job: Job, error, files: list, timings: dict, wall_s: float,
                audio=None) -> bool:
        """Write how the job ended (a completed job with sound: its ``audio_fields``, as the
        CLI's report has them); False when it was no longer this server's (nothing written:
        the server that took it over records its own run)."""
        owner, lost = self.fleet.id, False
        if isinstance(error, LeaseLost):
            lost = True
        elif isinstance(error, hosts.JobCancelled):  # files: a streamed job's whole chunks
            result = dict(files=files, timings={}, steps_done=error.steps, wall_s=wall_s)
            self._ended(job, "cancelled",
                        lambda: self.store.cancelled(job.id, result, owner) or True)
            if self._answered(lambda: self.store.get(job.id)) is None:  # DELETE of a
                uploads.remove(self.storage.folder, job.settings)  # running job: its image
                for name in files:
                    self.storage.remove(name)
            print(f"{job.id}: cancelled after {error.steps} steps", flush=True)
        elif error is not None:
            line = first_line(error) if isinstance(error, (GenerationError, UsageError)) \
                else f"{type(error).__name__}: {first_line(error)}"
            lost = not self._ended(job, "failed", lambda: self.store.fail(job.id, line, owner))
            if not lost:
                print(f"{job.id}: failed: {line}", flush=True)
        else:
            result = dict(files=files, timings=timings, wall_s=wall_s,
                          **reporting.audio_fields(audio))
            lost = not self._ended(job, "completed",
                                   lambda: self.store.complete(job.id, result, owner))
            if not lost:
                print(f"{job.id}: completed in {wall_s:.2f} s ({', '.join(files)})",
                      flush=True)
        if lost:
            print(f"{job.id}: its lease passed and another server runs it; this run's "
                  "outcome is dropped", flush=True)
            return False
        if not isinstance(error, hosts.JobCancelled) and self.store.drop_if_deleted(job.id):
            for name in files:  # a DELETE that came during the decode
                self.storage.remove(name)
            uploads.remove(self.storage.folder, job.settings)
        return True

    def _answered(self, call):
        """``call()``, a store call, retried with backoff while the store is away.

        Raises:
            sqlalchemy.exc.SQLAlchemyError: the store's error, only once the server stops.
        """
        for attempt in itertools.count():
            try:
                return call()
            except sa.exc.SQLAlchemyError as e:
                if self.stopping:
                    raise
                _store_away(self.store, "recording a job's end", e)
                self.halt.wait(retry_delay(attempt))

    def _ended(self, job: Job, status: str, write) -> bool:
        """Record how ``job`` ended: ``write()`` (a guarded store call, True when it wrote)
        until the store answers, so a job that finished while the database was away is
        recorded when it is back, neither lost nor run again (its lease holds meanwhile:
        ``engine.serve.outage``). False when the job is no longer this server's."""
        tries = [0]

        def once():
            tries[0] += 1
            return write()

        if self._answered(once):
            return True
        if tries[0] == 1:
            return False
        # A try that failed may have committed and lost only its answer: the row says.
        row = self._answered(lambda: self.store.get(job.id))
        return row is not None and row.owner == self.fleet.id and row.status == status


def _finish_stream(stream, storage: Storage, config, frames, job_id: str
                   ) -> tuple[list[str], dict]:
    """A streamed job's files once its run returned: the mp4 closed and in place
    (``FragmentedMp4Writer.finish``), and the frames file with --save_frames (the frames
    the run returned: the chunks' concatenation). Returns (names, timings as
    ``write_video``'s: uint8_s 0, the encode having run beside the chunks).

    Raises:
        GenerationError: a chunk's write, or the frames file (one line naming it).
    """
    t0 = time.perf_counter()
    stream.finish()
    names = [video_name(job_id)]
    path = videos.video_files(storage.folder, job_id, None, config.run.save_frames)["frames"]
    if path:
        try:
            reporting.save_frames(frames, path)
        except OSError as e:
            raise GenerationError(f"could not write {path}: {first_line(e)}") from e
        names.append(os.path.basename(path))
    return names, dict(uint8_s=0.0, write_s=time.perf_counter() - t0, written_at=time.time())


def _kept(stream, error: Exception, job_id: str) -> list[str]:
    """A job that did not complete: a cancelled one keeps its streamed whole chunks (its
    mp4's name; none streamed: []); any other end removes the stream's file."""
    if isinstance(error, hosts.JobCancelled) and not isinstance(error, LeaseLost):
        try:
            return [video_name(job_id)] if stream.cancel()["chunks_done"] else []
        except GenerationError as e:  # cancel removed the file: the job keeps none
            print(f"{job_id}: its streamed chunks were not kept: {first_line(e)}",
                  file=sys.stderr, flush=True)
            return []
    stream.abort()
    return []


def _store_away(store: JobStore, doing: str, error: Exception, always: bool = False) -> None:
    """One line for a store error, unless it is an outage the store already reported
    (``engine.serve.outage``: one line per outage, not one per retry)."""
    if always or not store.outage.away:
        print(f"job store error while {doing}: {first_line(error)}", file=sys.stderr,
              flush=True)


def sweep_interval_s(retention_s: float) -> float:
    """How often the sweeper looks: a tenth of the retention, between 0.5 s and a minute
    (an expired video lingers at most that much longer than its retention)."""
    return min(60.0, max(0.5, retention_s / 10))


def _kind(outcome: str) -> str:
    """What the processes must agree on: "ok", "cancelled" or "error" (texts may differ)."""
    return outcome if outcome in ("ok", "cancelled") else "error"
