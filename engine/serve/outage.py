"""The job store's outages: the database stopped answering (a restart, a failover, a cut
network) and came back. One log line when an outage starts and one when it ends, however
many calls failed between them, and the rule that keeps a brief outage from handing a
running job to another server.

**The lease rule.** A lease (``jobs.JobStore``) says a server is alive because it renews it.
While the database is away no server can renew anything, and the lease's time, on the
database's clock, goes on passing: after an outage longer than a lease every running job
looks abandoned, although its server kept running it (or finished it and waits to record
the result). So a server takes over another's lapsed job only once it has itself reached
the database without a break for one whole lease (``Outage.settled``): by then every live
owner has renewed its lease (its heartbeat tries every third of a lease) or recorded its
job, and only a dead server's job is still lapsed. A server that never saw the outage
(it was cut off alone, the case leases exist for) takes the job over as before.
"""

from __future__ import annotations

import math
import sys
import threading
import time

import sqlalchemy as sa

from engine.run.errors import first_line

# Seconds between a worker's retries while the store is away: doubling from the first to the
# last, so a long outage costs a few connection attempts a minute, and a short one is over
# within a second or two of the database's return.
RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


def retry_delay(attempt: int) -> float:
    """Seconds to wait before retry number ``attempt`` (0 first) of a call the store failed."""
    return RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)]


class Outage:
    """Whether the store at ``url`` (masked) answers, learned from every statement the
    engine runs (``watch``). ``since``: ``time.monotonic()`` when it stopped answering,
    None while it answers; ``back_at``: when it last came back (-inf: never away)."""

    def __init__(self, url: str, lease_s: float, log=None):
        self.url, self.lease_s = url, float(lease_s)
        self.log = log or sys.stderr
        self.since: float | None = None
        self.back_at = -math.inf
        self.outages = 0
        self.reached = False  # until the store first answers, a failure is the start's own
        self._lock = threading.Lock()

    def watch(self, engine: sa.Engine) -> None:
        """Follow ``engine``: a lost connection or a refused connect starts an outage; the
        next statement that runs ends it."""
        sa.event.listen(engine, "handle_error", self._error)
        sa.event.listen(engine, "after_cursor_execute", self._answered)

    def _error(self, ctx) -> None:
        # A pooled connection the database dropped fails its pre-ping and is replaced: no
        # outage unless the new connection fails too. An error on a live connection
        # (constraint, deadlock) is the statement's, not an outage.
        if not ctx.is_pre_ping and (ctx.is_disconnect or ctx.connection is None):
            self.failed(ctx.original_exception or ctx.sqlalchemy_exception)

    def _answered(self, *_) -> None:
        self.reached = True
        if self.since is not None:
            self.answered()

    def failed(self, error: BaseException) -> None:
        """A call could not reach the store: the outage's first line, once. Before the store
        has ever answered there is no outage to announce: the server's start refuses the
        store in its own one line (``--jobs_db``)."""
        with self._lock:
            if self.since is not None or not self.reached:
                return
            self.since, self.outages = time.monotonic(), self.outages + 1
        print(f"job store unreachable ({self.url}: {first_line(error)}): running jobs go "
              "on and are recorded when it is back; new jobs get 503 until then",
              file=self.log, flush=True)

    def answered(self) -> None:
        """A call reached the store: the outage's last line, once."""
        with self._lock:
            if self.since is None:
                return
            away, self.since, self.back_at = time.monotonic() - self.since, None, \
                time.monotonic()
        print(f"job store back after {away:.1f} s; other servers' jobs whose lease passed "
              f"meanwhile are taken over only after {self.lease_s:g} s more",
              file=self.log, flush=True)

    @property
    def away(self) -> bool:
        return self.since is not None

    def settled(self) -> bool:
        """True once the store has answered for one lease since the last outage (the rule
        above): lapsed leases may then be taken over."""
        return self.since is None and time.monotonic() - self.back_at >= self.lease_s
