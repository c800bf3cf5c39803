"""The job store's PostgreSQL stops (``pg_ctl stop -m immediate``, a crash) while jobs run,
and starts again: nothing accepted is lost or run twice, new work gets 503 with
``Retry-After`` meanwhile, and the servers recover without a restart.

The test's own throwaway cluster (the installed PostgreSQL binaries, a temporary folder, a
free port), never the shared one CI starts: other tests use that one at the same time.
Skipped, with the reason, where the binaries are missing (never under CI: .ci/run installs
them through tools/postgres.sh)."""

import glob
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time

import httpx2
import psycopg
import pytest
import sqlalchemy as sa
from serve_util import KEY, PROMPT, SETTINGS, Server, env, server_frames

from engine.serve import jobs as store_rows
from engine.serve import outage
from engine.serve import requests as checks
from engine.serve.jobs import JobStore
from engine.serve.model import Served

LEASE_S = 3.0
STEPS = 6  # per job, each followed by the step delay: a job runs ~2-3 s, so the stop hits some
STEP_DELAY_S = 0.3
OUTAGE_S = 2 * LEASE_S  # longer than a lease: every running job's lease passes meanwhile
BUCKETS = ["tiny-wan:64x64x9"]
SERVED = Served(model="tiny-wan", model_id="checkpoints/tiny-wan", sizes=((64, 64),),
                frames=(9,), frame_step=4, fps=16, num_inference_steps=2,
                guidance_scale=5.0, guidance_scale_2=None, negative_prompt="blurry",
                variable_guidance=True, fixed_steps=False, image_mode="none")


def _pg_bin() -> str | None:
    """The newest installed PostgreSQL's bin folder (as tools/postgres.sh finds it)."""
    found = glob.glob("/usr/lib/postgresql/*/bin")
    return max(found, key=lambda p: int(p.split("/")[-2])) if found else None


class Cluster:
    """A throwaway PostgreSQL cluster on a free loopback port, trust auth. initdb and
    postgres refuse to run as root: as root they run as the ``postgres`` user."""

    def __init__(self, bin_dir: str):
        self.bin = bin_dir
        self.dir = tempfile.mkdtemp(prefix="generate-flax-pg-restart-")
        self.data = os.path.join(self.dir, "data")
        if os.getuid() == 0:
            shutil.chown(self.dir, "postgres")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self._run("initdb", "-D", self.data, "-U", "postgres", "-A", "trust", "--no-sync")

    def _run(self, tool: str, *args) -> None:
        argv = [os.path.join(self.bin, tool), *args]
        if os.getuid() == 0:
            argv = ["runuser", "-u", "postgres", "--", *argv]
        subprocess.run(argv, check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "server.log"), "-w",
                  "-o", f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir}", "start")

    def crash(self) -> None:
        """Stop at once, as a crash does: clients' connections drop mid-statement, and the
        next start replays the log."""
        self._run("pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop")

    def remove(self) -> None:
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self.crash()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    bin_dir = _pg_bin()
    if bin_dir is None:
        reason = "needs PostgreSQL's binaries (/usr/lib/postgresql/*/bin; tools/postgres.sh " \
                 "start installs them)"
        if os.environ.get("CI"):
            pytest.fail(reason + "; .ci/run installs them")
        pytest.skip(reason)
    c = Cluster(bin_dir)
    try:
        c.start()
        yield c
    finally:
        c.remove()


def _job(seed: int) -> checks.VideoJob:
    return checks.check(checks.parse(dict(prompt="p", seed=seed)), SERVED)


def test_a_lease_that_passed_in_an_outage_is_not_taken_over(cluster, tmp_path, capsys):
    """Two stores (two servers) on the cluster; one runs a job. The database crashes for
    longer than the lease and comes back: the other server does not take the job over until
    it has reached the store for one lease, by which time the owner has renewed it; a dead
    owner's job is taken over after that. Each store logs one line per outage start and end,
    however many calls failed."""
    lease = 2.0
    owner, other = (JobStore(str(tmp_path), cluster.url, lease_s=lease) for _ in range(2))
    added = owner.add(_job(1))
    assert owner.claim("srv_owner", BUCKETS).id == added.id
    cluster.crash()
    try:
        for store in (owner, other):
            for _ in range(3):  # retries: one line for all of them
                with pytest.raises(sa.exc.OperationalError):
                    store.claim("srv_x", BUCKETS)
        assert owner.outage.away and other.outage.away
        time.sleep(lease + 0.5)  # the lease passes on the database's clock meanwhile
    finally:
        cluster.start()
    back = time.monotonic()
    assert owner.get(added.id).lease_until < owner._execute(
        sa.select(store_rows.db_now()), rows=True)[0][0]  # lapsed, by the database's clock
    assert other.claim("srv_other", BUCKETS) is None  # back, not settled: the owner's turn
    assert not other.outage.away and not other.outage.settled()
    time.sleep(0.8)
    assert owner.heartbeat("srv_owner") is False  # (no servers row here) the lease moves on
    time.sleep(max(0.0, back + lease + 0.3 - time.monotonic()))
    assert other.outage.settled()
    assert other.claim("srv_other", BUCKETS) is None  # renewed: still the owner's
    time.sleep(max(0.0, back + 0.8 + lease + 0.5 - time.monotonic()))  # the owner is silent
    taken = other.claim("srv_other", BUCKETS)  # as a dead server's job: taken over
    assert (taken.id, taken.owner, taken.attempts) == (added.id, "srv_other", 2)
    err = capsys.readouterr().err
    assert err.count("job store unreachable (") == 2, err  # one per store, not per retry
    assert err.count("job store back after") == 2, err
    for store in (owner, other):
        store.close()


def test_retry_delays_double_and_stay_bounded():
    assert [outage.retry_delay(i) for i in range(7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def _status(client: httpx2.Client, video_id: str) -> str | None:
    """The job's status, or None while the server answers 503 (the store is away)."""
    r = client.get(f"/v1/videos/{video_id}")
    return r.json()["status"] if r.status_code == 200 else None


def _wait(test, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not test():
        assert time.monotonic() - t0 < timeout, f"{what}: not after {timeout} s"
        time.sleep(0.1)


def _lines(pattern: str, *servers) -> dict:
    """{job id: how many log lines of ``servers`` match ``(video_...)`` + ``pattern``}."""
    count: dict = {}
    for server in servers:
        for m in re.finditer(r"(video_[0-9a-f]{32})" + pattern, server.tail(10**7)):
            count[m[1]] = count.get(m[1], 0) + 1
    return count


def _videos(out: str, ids) -> set:
    """The jobs of ``ids`` whose mp4 is in ``out``."""
    return {i for i in ids if os.path.exists(os.path.join(out, f"{i}.mp4"))}


def _order(server, video_id: str) -> bool:
    """Whether ``server``'s log says: ``video_id`` started, then the store went away, then
    came back, then ``video_id`` completed."""
    log = server.tail(10**7)
    marks = [log.find(f"{video_id}: started"), log.find("job store unreachable ("),
             log.find("job store back after"), log.find(f"{video_id}: completed in")]
    return -1 not in marks and marks == sorted(marks)


def _assert_503(response: httpx2.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["retry-after"] == "5"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "store_unavailable" and "retry after 5 s" in error["message"]


@pytest.fixture(scope="module")
def servers(cluster, tiny_checkpoint, tmp_path_factory):
    """Servers A and B (64x64x5 each, one CPU device) on the cluster and one folder."""
    root = tmp_path_factory.mktemp("restart")
    with psycopg.connect(cluster.url, autocommit=True) as db:
        db.execute("CREATE DATABASE restart_jobs")
    url = cluster.url.rsplit("/", 1)[0] + "/restart_jobs"
    common = ["--model_id", tiny_checkpoint, *SETTINGS, "--api_key", KEY,
              "--compilation_cache_dir", "none", "--jobs_db", url,
              "--job_lease_s", str(LEASE_S)]
    environ = env(1, GENERATE_FLAX_TEST_STEP_DELAY_S=str(STEP_DELAY_S))
    out = root / "shared"
    a = Server(common, out, environ=environ, log=root / "a.log").start()
    b = Server(common, out, environ=environ, log=root / "b.log").start()
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b, str(out), url
    finally:
        for server in (a, b):
            server.stop()


def test_two_servers_survive_the_database_restarting_under_load(cluster, servers):
    a, b, out, url = servers
    body = dict(prompt=PROMPT, size="64x64", num_frames=5, num_inference_steps=STEPS)
    with a.client() as ca, b.client() as cb:
        clients = (ca, cb)
        before = [clients[i % 2].post("/v1/videos", json=dict(body, seed=300 + i)).json()["id"]
                  for i in range(4)]
        _wait(lambda: sum(_status(ca, i) == "in_progress" for i in before) == 2, 60,
              "both servers running a job")
        cluster.crash()
        crashed = time.monotonic()
        try:
            at_crash = _videos(out, before)
            for c in clients:  # new work and reads are refused in one line, never a 500
                _assert_503(c.post("/v1/videos", json=dict(body, seed=1)))
                _assert_503(c.get(f"/v1/videos/{before[0]}"))
                _assert_503(c.get("/v1/videos"))
                _assert_503(c.get("/health"))
            # Down for longer than a lease, and until a running job has written its video.
            _wait(lambda: time.monotonic() - crashed > OUTAGE_S and
                  _videos(out, before) - at_crash, 120,
                  "a running job's video written during the outage")
            written = _videos(out, before) - at_crash
        finally:
            cluster.start()
        _wait(lambda: all(_status(ca, i) == "completed" for i in before), 120,
              "the jobs sent before the outage")
        after = [c.post("/v1/videos", json=dict(body, seed=400 + k)).json()["id"]
                 for k, c in enumerate(clients)]  # both servers take jobs again
        _wait(lambda: all(_status(cb, i) == "completed" for i in after), 60,
              "the jobs sent after the recovery")
        for c in clients:
            listed = c.get("/v1/videos", params=dict(limit=100)).json()["data"]
            assert {v["id"] for v in listed} == {*before, *after}
            assert all(v["status"] == "completed" for v in listed)
    assert a.proc.poll() is None and b.proc.poll() is None
    every = [*before, *after]
    assert _lines(": started", a, b) == {i: 1 for i in every}  # each ran once
    assert _lines(": completed in", a, b) == {i: 1 for i in every}
    with psycopg.connect(url) as db:
        attempts = dict(db.execute("SELECT id, attempts FROM jobs").fetchall())
    assert attempts == {i: 1 for i in every}  # no claim was ever repeated
    # A job that started before the outage and finished during it (its video written while
    # the store was away) recorded its end after the store came back, on the same server.
    through = [i for i in written for s in (a, b) if _order(s, i)]
    assert through, "no running job finished during the outage: lengthen it"
    for i in every:
        assert server_frames(out, i).shape == (5, 64, 64, 3)
    for server in (a, b):
        log = server.tail(10**7)
        assert log.count("job store unreachable (") == 1, log[-3000:]
        assert log.count("job store back after") == 1, log[-3000:]
        assert "job store error" not in log and "Traceback" not in log, log[-3000:]
