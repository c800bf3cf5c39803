"""Multi-host hand-off: process 0 takes HTTP; every process runs every job.

Each job's parameters go from process 0 to the others through the key-value store of JAX's
multi-controller runtime (the coordination service ``jax.distributed.initialize`` started;
``jax.experimental.multihost_utils`` reaches it the same way), before any process runs the
job's first program. The others wait on the store with a timeout in a loop, not in a
collective, so that:

- process 0 gone (crash, ``kill -9``): the store goes with it, the next wait fails, and the
  process ends with a one-line error instead of waiting forever;
- another process gone: JAX's heartbeat (``engine.run.runtime.DISTRIBUTED_HEARTBEAT_TIMEOUT_S``)
  ends the run on every process, as in a CLI run; its fatal log becomes one error line
  (``filter_stderr``);
- a job that fails on some processes only: process 0 compares every process's outcome after
  each job (``HandOff.outcomes``) and ends the server with a one-line error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from jax._src import distributed

from engine.run.errors import GenerationError, first_line
from engine.serve.requests import VideoJob

PREFIX = "generate_flax_serve"
POLL_MS = 5_000  # each wait on the store; the loop goes on until a message or an error
OUTCOME_TIMEOUT_MS = 600_000  # process 0 waits this long for another process's outcome
CHUNK_BYTES = 1 << 20  # an image's bytes per key: well under gRPC's 4 MB message limit
_FILTERS: list = []  # the stderr filter process: it ends after this one (kept, not reaped)


def _client():
    if distributed.global_state.client is None:
        raise GenerationError("multi-host serving needs jax.distributed to be initialized")
    return distributed.global_state.client


class JobCancelled(Exception):
    """A running job stopped at a denoising step boundary by its cancel (``steps``: the
    steps it ran). Every process of the run raises it at the same step."""

    def __init__(self, steps: int):
        super().__init__(f"cancelled after {steps} denoising steps")
        self.steps = steps


def outcome(error: Exception | None) -> str:
    """A job's outcome as the processes compare it: "ok", "cancelled", or the error line."""
    if error is None:
        return "ok"
    return "cancelled" if isinstance(error, JobCancelled) else \
        f"{type(error).__name__}: {first_line(error)}"


def _timed_out(error: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(error) or "timed out" in str(error).lower()


class HandOff:
    """Process 0's side: ``send`` a job (or the stop message) to every other process,
    then ``outcomes`` collects what each reported."""

    def __init__(self, num_processes: int):
        self.num_processes, self.seq = num_processes, 0

    def send(self, message: dict, image: bytes | None = None) -> int:
        """Publish ``message`` ({"job": {"id", "settings"}} or {"stop": True}) as the next
        in order, with an image-to-video job's ``input_reference`` bytes (in chunks of
        ``CHUNK_BYTES``, under keys written before the message); returns its sequence
        number."""
        self.seq += 1
        if image is not None:
            chunks = [image[i:i + CHUNK_BYTES] for i in range(0, len(image), CHUNK_BYTES)]
            for i, chunk in enumerate(chunks):
                _client().key_value_set_bytes(f"{PREFIX}/image/{self.seq}/{i}", chunk)
            message = dict(message, image_chunks=len(chunks))
        _client().key_value_set(f"{PREFIX}/job/{self.seq}", json.dumps(message))
        return self.seq

    def decide(self, seq: int, step: int, stop: bool) -> None:
        """After denoising step ``step`` of job ``seq``: tell the other processes whether
        the job goes on (they wait for it at the same step, so all stop together)."""
        _client().key_value_set(f"{PREFIX}/step/{seq}/{step}", "stop" if stop else "go")

    def outcomes(self, seq: int) -> dict[int, str]:
        """{process: "ok" or its one-line error} of the other processes for job ``seq``.

        Raises:
            GenerationError: a process did not report within ``OUTCOME_TIMEOUT_MS``.
        """
        out = {}
        for pid in range(1, self.num_processes):
            try:
                out[pid] = _client().blocking_key_value_get(f"{PREFIX}/done/{seq}/{pid}",
                                                            OUTCOME_TIMEOUT_MS)
            except Exception as e:
                raise GenerationError(f"process {pid} did not finish job {seq}: "
                                      f"{first_line(e)}") from None
        return out


def job_message(job) -> dict:
    """A job (``engine.serve.jobs.Job``) as the other processes need it: its id and its
    settings' JSON form."""
    return dict(job=dict(id=job.id, settings=job.settings.to_json()))


def follow(run, process_id: int) -> None:
    """A process other than 0: wait for each job, ``run(job_id, settings, image bytes or
    None, on_step)`` it (raising on failure; ``settings`` a ``VideoJob``; ``on_step(done,
    steps)`` waits for process 0's decision after each denoising step and raises
    ``JobCancelled`` on a cancel), report the outcome; return on the stop message.

    Raises:
        GenerationError: process 0 is gone (the store could not be reached).
    """
    seq = 0
    while True:
        seq += 1
        message = json.loads(_wait_for(f"{PREFIX}/job/{seq}"))
        if message.get("stop"):
            return
        job, image = message["job"], None
        if "image_chunks" in message:  # written before the message: no wait
            image = b"".join(
                _client().blocking_key_value_get_bytes(f"{PREFIX}/image/{seq}/{i}", POLL_MS)
                for i in range(message["image_chunks"]))
        error = None
        try:
            run(job["id"], VideoJob.from_json(job["settings"]), image,
                lambda done, steps, seq=seq: _await_decision(seq, done))
        except Exception as e:  # reported to process 0, which decides
            error = e
        _client().key_value_set(f"{PREFIX}/done/{seq}/{process_id}", outcome(error))


def _await_decision(seq: int, step: int) -> None:
    """Process 0's word after denoising step ``step`` of job ``seq``: go on, or stop.

    Raises:
        JobCancelled: process 0 cancelled the job at this step.
        GenerationError: process 0 is gone.
    """
    if _wait_for(f"{PREFIX}/step/{seq}/{step}") == "stop":
        raise JobCancelled(step)


def _wait_for(key: str) -> str:
    """The value process 0 writes under ``key``, waited for in ``POLL_MS`` slices (not one
    long wait, so a lost process 0 shows as an error, not a hang).

    Raises:
        GenerationError: process 0 is gone (the store could not be reached).
    """
    while True:
        try:
            return _client().blocking_key_value_get(key, POLL_MS)
        except Exception as e:
            if not _timed_out(e):
                raise GenerationError(f"lost process 0 (the server): {first_line(e)}") \
                    from None


def filter_stderr(process_id: int) -> None:
    """Run this process's stderr (file descriptor 2, so C++ logs too) through
    ``engine.serve.fatal_log``: JAX's fatal coordination-service log, when another process
    dies, becomes one ``generate_flax.py: error: process N: ...`` line. The filter is a
    child process (it must outlive an ``abort()`` of this one to print the line); it ends
    when this process's end closes the pipe."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fatal_log.py")
    read, write = os.pipe()
    real = os.dup(2)
    _FILTERS.append(subprocess.Popen([sys.executable, script, str(process_id)], stdin=read,
                                     stdout=real, close_fds=True))
    os.close(read)
    os.close(real)
    sys.stderr.flush()
    os.dup2(write, 2)
    os.close(write)
