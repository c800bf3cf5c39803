"""One job at a time on the mesh, in arrival order (process 0's worker thread).

A job's failure (NaN latents, out of device memory) marks it
``failed`` with a one-line reason and the next job runs. In a multi-host run the other
processes run the same job (``engine.serve.hosts``); when their outcome differs from
process 0's, the processes no longer agree on where they are, so the server stops with a
one-line error instead of risking a hang in the next collective.
"""

from __future__ import annotations

import os
import threading
import time

from engine.files import videos
from engine.run import runtime
from engine.run.errors import GenerationError, UsageError, first_line
from engine.serve import hosts, uploads
from engine.serve.jobs import Job, JobStore

# Test hook: seconds to sleep after each denoising step of a served job, so a test can
# cancel a running job between steps on the tiny checkpoint. Unset in normal use.
STEP_DELAY_ENV = "GENERATE_FLAX_TEST_STEP_DELAY_S"


def video_path(folder: str, job_id: str) -> str:
    """The mp4 of a job (``job_id`` already matched ``jobs.ID_PATTERN``)."""
    return videos.video_files(folder, job_id, None, False)["video"]


def save(config, frames, job_id: str) -> list[str]:
    """The job's mp4 (and frames with --save_frames) beside the job store, atomically, as
    the CLI writes them; returns the file names."""
    return [os.path.basename(p) for p in videos.save_video(config, frames, job_id)]


class Worker:
    """Runs queued jobs of ``store`` on ``model`` (a ``WarmModel``) until ``stop``.

    ``fatal`` is set (and ``on_fatal`` called) when the server must end: the one-line
    error the CLI prints.
    """

    def __init__(self, store: JobStore, model, on_fatal, handoff: hosts.HandOff | None,
                 metrics=None, retention_s: float | None = None, on_ended=None):
        self.store, self.model, self.on_fatal, self.handoff = store, model, on_fatal, handoff
        self.metrics = metrics  # engine.serve.metrics.Metrics, or None
        self.retention_s, self.next_sweep = retention_s, 0.0
        self.on_ended = on_ended  # f(job id) once a job has ended: its webhook
        self.wake, self.stopping, self.fatal = threading.Event(), False, None
        self.done = 0

    def stop(self) -> None:
        self.stopping = True
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
                path = os.path.join(self.store.folder, name)
                if os.path.exists(path):
                    os.remove(path)
            uploads.remove(self.store.folder, job.settings)
        return [job.id for job in expired]

    def loop(self) -> None:
        while not self.stopping:
            self.sweep()
            job = self.store.next_queued()
            if job is None:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            try:
                self.run_one(job)
            except Exception as e:
                self.fatal = f"job {job.id}: {first_line(e)}"
                self.on_fatal(self.fatal)
                return
        if self.handoff is not None and self.fatal is None:
            self.handoff.send({"stop": True})

    def run_one(self, job: Job) -> None:
        """Run ``job`` to completed, failed or cancelled. Raises only what must end the
        server."""
        job_id = job.id
        self.store.start(job_id)
        try:
            image = uploads.load(self.store.folder, job.settings)
        except OSError as e:  # its input_reference was removed: this job only
            self.store.fail(job_id, f"input_reference: {first_line(e)}")
            return
        seq = self.handoff.send(hosts.job_message(job), image) if self.handoff else None
        t0 = time.time()
        error, files, timings = None, [], {}
        try:
            frames, config, timings = self.model.run(job_id, job.settings, image,
                                                     self._on_step(job_id, seq))
            files = save(config, frames, job_id)
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
        self._record(job, error, files, timings, time.time() - t0)
        if self.metrics is not None:
            status = "completed" if error is None else \
                "cancelled" if isinstance(error, hosts.JobCancelled) else "failed"
            self.metrics.job_ended(status, queue_wait_s=max(0.0, t0 - job.created_at),
                                   total_s=time.time() - job.created_at, timings=timings)
        if self.on_ended is not None:
            self.on_ended(job.id)
        self.done += 1

    def _on_step(self, job_id: str, seq: int | None):
        """After each denoising step: the job's progress, then its pending cancel (decided
        here for every process of the run); raises ``hosts.JobCancelled`` to stop."""
        last = [-1]
        delay = float(os.environ.get(STEP_DELAY_ENV, 0))

        def on_step(done: int, steps: int) -> None:
            percent = 100 * done // (steps + 1)  # the decode is the last part
            if percent != last[0]:
                last[0] = percent
                self.store.progress(job_id, percent)
            time.sleep(delay)
            stop = self.store.pending_cancel(job_id) is not None
            if seq is not None:
                self.handoff.decide(seq, done, stop)
            if stop:
                raise hosts.JobCancelled(done)

        return on_step

    def _record(self, job: Job, error, files: list, timings: dict, wall_s: float) -> None:
        if isinstance(error, hosts.JobCancelled):
            self.store.cancelled(job.id, dict(files=[], timings={}, steps_done=error.steps,
                                              wall_s=wall_s))
            if self.store.get(job.id) is None:  # DELETE of a running job: its image too
                uploads.remove(self.store.folder, job.settings)
            print(f"{job.id}: cancelled after {error.steps} steps", flush=True)
        elif error is not None:
            line = first_line(error) if isinstance(error, (GenerationError, UsageError)) \
                else f"{type(error).__name__}: {first_line(error)}"
            self.store.fail(job.id, line)
            print(f"{job.id}: failed: {line}", flush=True)
        else:
            self.store.complete(job.id, dict(files=files, timings=timings, wall_s=wall_s))
            print(f"{job.id}: completed in {wall_s:.2f} s ({', '.join(files)})", flush=True)
        if not isinstance(error, hosts.JobCancelled) and self.store.drop_if_deleted(job.id):
            for name in files:  # a DELETE that came during the decode
                os.remove(os.path.join(self.store.folder, name))
            uploads.remove(self.store.folder, job.settings)


def sweep_interval_s(retention_s: float) -> float:
    """How often the sweeper looks: a tenth of the retention, between 0.5 s and a minute
    (an expired video lingers at most that much longer than its retention)."""
    return min(60.0, max(0.5, retention_s / 10))


def _kind(outcome: str) -> str:
    """What the processes must agree on: "ok", "cancelled" or "error" (texts may differ)."""
    return outcome if outcome in ("ok", "cancelled") else "error"
