"""The servers sharing one job store: who is alive, which buckets each runs, and the
heartbeat that keeps this server's job leases.

A server joins once its buckets are compiled (``join``): its row in the store's ``servers``
table names its buckets, and a heartbeat thread renews the row and the lease of the job it
runs every third of ``--job_lease_s``. A server that dies stops beating: after one lease its
buckets leave the union requests are checked against, and its running job is claimed again
by another server (``JobStore.claim``). With the default SQLite store the fleet is this one
server, through the same code.

Why a thread and not the denoising loop: a step, or a VAE decode, may take longer than a
lease at real sizes; the lease must say whether the process lives, not how long a step is.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import threading
import uuid

import sqlalchemy as sa

from engine.run.errors import first_line
from engine.serve.jobs import JobStore


def bucket_shape(key: str) -> tuple[int, int, int]:
    """(width, height, frames) of a bucket key "model:WxHxF"."""
    w, h, f = key.rsplit(":", 1)[1].split("x")
    return int(w), int(h), int(f)


class Fleet:
    """This server as one of the store's servers. ``id``: unique per process;
    ``buckets``: the bucket keys (``jobs.job_bucket``) it runs, empty until ``join``."""

    def __init__(self, store: JobStore, address: str):
        self.store, self.address = store, address
        self.id = f"srv_{uuid.uuid4().hex[:16]}"
        self.buckets: tuple = ()
        self.served = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self, served, bucket_keys) -> None:
        """Announce the ready server (``served``: its ``model.Served``; ``bucket_keys``:
        "WxHxF" each) and start the heartbeat."""
        self.served = served
        self.buckets = tuple(f"{served.model}:{k}" for k in bucket_keys)
        self._register()
        self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
        self._thread.start()

    def _register(self) -> None:
        self.store.register(self.id, address=self.address, model=self.served.model,
                            buckets=self.buckets, served=dataclasses.asdict(self.served))

    def _beat(self) -> None:
        while not self._stop.wait(self.store.lease_s / 3):
            try:
                if not self.store.heartbeat(self.id):  # forgotten after a long silence
                    self._register()
            except sa.exc.SQLAlchemyError as e:  # tried again in a third of a lease
                if not self.store.outage.away:  # an outage has its own line (outage.py)
                    print(f"heartbeat: the job store failed ({first_line(e)})",
                          file=sys.stderr, flush=True)

    def leave(self) -> None:
        """Stop the heartbeat and remove this server's row (a clean stop; a killed server's
        row ages out)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            try:
                self.store.unregister(self.id)
            except sa.exc.SQLAlchemyError:
                pass  # stopping anyway; the row ages out

    def _live(self, model: str) -> list[dict]:
        return [s for s in self.store.live_servers() if s["model"] == model]

    def view(self, own, live: list | None = None):
        """What a request may ask for now: (``own`` — this server's ``Served`` — with the
        sizes and frames of every live server of the same model, this server's first;
        the set of live bucket keys). A create is checked against these, so a job another
        server will run is accepted here. ``live``: ``_live``'s rows, if already read."""
        live = self._live(own.model) if live is None else live
        keys = set(self.buckets).union(*(s["buckets"] for s in live))
        shapes = sorted(bucket_shape(k) for k in keys)
        sizes = list(own.sizes) + sorted({(w, h) for w, h, _ in shapes} - set(own.sizes))
        frames = list(own.frames) + sorted({f for *_, f in shapes} - set(own.frames))
        return dataclasses.replace(own, sizes=tuple(sizes), frames=tuple(frames)), keys

    def describe(self, own) -> dict:
        """``GET /v1/models``' entry: the model with the union of live servers' sizes and
        frames, each live bucket ("WxHxF") and how many servers run it (one read of the
        servers table)."""
        live = self._live(own.model)
        view, keys = self.view(own, live)
        counts = collections.Counter(k for s in live for k in s["buckets"])
        return dict(view.describe(), buckets={k.rsplit(":", 1)[1]: max(1, counts[k])
                                              for k in sorted(keys)})
