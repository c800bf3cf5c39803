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

    def __init__(self, store: JobStore, model, on_fatal, handoff: hosts.HandOff | None):
        self.store, self.model, self.on_fatal, self.handoff = store, model, on_fatal, handoff
        self.wake, self.stopping, self.fatal = threading.Event(), False, None
        self.done = 0

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()

    def loop(self) -> None:
        while not self.stopping:
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
        """Run ``job`` to completed or failed. Raises only what must end the server."""
        job_id = job.id
        self.store.start(job_id)
        try:
            image = uploads.load(self.store.folder, job.settings)
        except OSError as e:  # its input_reference was removed: this job only
            self.store.fail(job_id, f"input_reference: {first_line(e)}")
            return
        seq = self.handoff.send(hosts.job_message(job), image) if self.handoff else None
        t0 = time.time()
        last = [-1]

        def progress(percent: int) -> None:
            if percent != last[0]:
                last[0] = percent
                self.store.progress(job_id, percent)

        error = None
        try:
            frames, config, timings = self.model.run(job_id, job.settings, image, progress)
            files = save(config, frames, job_id)
        except (GenerationError, UsageError) as e:
            error = first_line(e)
        except Exception as e:
            if runtime.in_multi_process_run():
                raise
            error = f"{type(e).__name__}: {first_line(e)}"  # a bug: this job only
        if seq is not None:
            theirs = self.handoff.outcomes(seq)
            if any((o == "ok") != (error is None) for o in theirs.values()):
                raise GenerationError(f"the processes disagree on the job's outcome "
                                      f"(process 0: {error or 'ok'}; others: {theirs})")
        if error is not None:
            self.store.fail(job_id, error)
            print(f"{job_id}: failed: {error}", flush=True)
        else:
            self.store.complete(job_id, dict(files=files, timings=timings,
                                             wall_s=time.time() - t0))
            print(f"{job_id}: completed in {time.time() - t0:.2f} s ({', '.join(files)})",
                  flush=True)
        self.done += 1
