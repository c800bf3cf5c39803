"""The stderr of one process of a multi-host server, passed through, with JAX's fatal
coordination-service log turned into the run's one-line error.

When a process of a multi-controller JAX run dies (``kill -9``, a crash, a lost host), JAX's
coordination service tells the others, and their distributed-runtime client ends each of
them from a C++ thread: an ``F`` log line ("Terminating process because the JAX distributed
service detected fatal errors"), the status over several lines, a native stack trace, then
``abort()`` (exit status 134). It does so at once on the processes that lose process 0 (the
service runs there) and after ``DISTRIBUTED_HEARTBEAT_TIMEOUT_S`` on process 0. Python sees
none of it: the client's replacement callback (``missed_heartbeat_callback``) is not
reachable from JAX 0.10.2's ``jax.distributed.initialize``, and a Python callback given to
jaxlib's client factory directly fails to receive the ``absl::Status`` (``std::bad_cast``,
tried). So the server runs its stderr through this filter, a child process started by
``engine.serve.hosts.filter_stderr``:

- every line passes through unchanged, except the runtime's ``W``/``E``/``F`` log records
  about its coordination service (with their continuation lines) and the stack trace after
  a fatal one;
- when the stream ends after a fatal record and the process printed no error line of its
  own, the filter prints ``generate_flax.py: error: process N: ...`` with the status's
  first line, e.g. "UNAVAILABLE: The following tasks are unhealthy (stopped sending
  heartbeats): 1".

It reads until end of file (the server's death or exit closes the pipe) and ignores SIGINT
and SIGTERM, so Ctrl-C on the terminal reaches the server, not the filter.

Usage (by ``filter_stderr``): ``python fatal_log.py PROCESS_INDEX`` with the server's stderr
on stdin and the real stderr on stdout. Only the standard library: it runs as a script.
"""

from __future__ import annotations

import os
import re
import signal
import sys

PREFIX = "generate_flax.py: error: "
# An absl log record's first line: severity, date, time, thread, file:line] message.
RECORD = re.compile(r"([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([\w.]+):\d+\] ?(.*)")
PARTIAL_RECORD = re.compile(r"[IWEF](\d|$)")  # an unfinished line that may be a record
# The runtime's records about its coordination service (the client, the service, the
# preemption manager that polls it): when a process dies, each of them logs the loss.
COORDINATION = re.compile(r"coordination|distributed|preemption|^client\.(h|cc)$")
FATAL = "Terminating process because the JAX distributed service detected fatal errors"


class Filter:
    """Line-by-line state: ``feed(line) -> str or None`` (what to pass on), ``end()`` ->
    the one-line error owed at end of file, or None."""

    def __init__(self, process: str):
        self.process, self.swallowing, self.fatal, self.cause, self.reported = (
            process, False, False, None, False)

    def feed(self, line: str) -> str | None:
        m = RECORD.match(line)
        if line.startswith(PREFIX):
            self.reported, self.swallowing = True, False
            return line
        if m:
            ours = m[1] in "WEF" and (COORDINATION.search(m[2]) or "coordination" in
                                      m[3].lower())
            if FATAL in m[3]:
                self.fatal = True
                self.cause = m[3].split("absl::Status: ", 1)[-1].strip() if \
                    "absl::Status: " in m[3] else None
            self.swallowing = bool(ours) or self.fatal
            return None if self.swallowing else line
        if self.swallowing:  # a continuation of a swallowed record, or the stack trace
            if self.fatal and self.cause is not None and self.cause.endswith(":") and \
                    re.fullmatch(r"[\d, ]+", line.strip()):
                self.cause += " " + line.strip()  # the dead processes' ids
            elif self.fatal and self.cause is None and line.strip():
                self.cause = line.strip()
            return None
        return line

    def end(self) -> str | None:
        if not self.fatal or self.reported:
            return None
        return (f"{PREFIX}process {self.process}: another process of the run is gone "
                f"(JAX's coordination service: {(self.cause or 'fatal error')[:300]})")


def main(process: str) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    out, state, pending, last = sys.stdout.buffer, Filter(process), b"", b"\n"
    while True:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for raw in lines:
            kept = state.feed(raw.decode("utf-8", "replace"))
            if kept is not None:
                out.write(raw + b"\n")
                last = b"\n"
        text = pending.decode("utf-8", "replace")
        # A progress bar redraws without a newline: pass it on now unless it may be the start
        # of a log record this filter has to see whole.
        if pending and not state.swallowing and not PARTIAL_RECORD.match(text):
            out.write(pending)
            pending, last = b"", pending[-1:]
        out.flush()
    if pending and state.feed(pending.decode("utf-8", "replace")) is not None:
        out.write(pending)
        last = pending[-1:]
    line = state.end()
    if line is not None:  # on a line of its own, after a progress bar's carriage returns
        out.write((b"" if last == b"\n" else b"\n") + line.encode() + b"\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "?"))
