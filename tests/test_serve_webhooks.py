"""Webhooks (engine.serve.webhooks): durable in the job store's outbox, written with the end
of their job; claimed once across servers; signed with Standard Webhooks and verified here
with its own library; only to public hosts, checked at the request and again at each
delivery. The proof of durability is a real ``kill -9``: a server ends a job while the
receiver is down and is killed; the next server on the same database delivers it, once."""

from __future__ import annotations

import base64
import dataclasses
import http.server
import ipaddress
import json
import signal
import socket
import threading
import time
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
import standardwebhooks
from serve_util import KEY, PROMPT, SETTINGS, Server, free_port, wait_done

import generate_flax as gf
from engine.run.errors import UsageError
from engine.serve import jobs as store_rows
from engine.serve import requests as checks
from engine.serve import webhooks
from engine.serve.jobs import CANCEL_AND_DELETE, JobStore
from engine.serve.model import Served
from engine.serve.requests import ApiError

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
SERVED = Served(model="tiny-wan", model_id="checkpoints/tiny-wan", sizes=((64, 64),),
                frames=(5,), frame_step=4, fps=16, num_inference_steps=2, guidance_scale=5.0,
                guidance_scale_2=None, negative_prompt="", variable_guidance=True,
                fixed_steps=False, image_mode="none")
BUCKETS = ("tiny-wan:64x64x5",)
OWNER = "srv_a"
# What the fake resolver answers: a public name, the cloud metadata address behind a name,
# a name with one public and one private address, and a name for loopback.
HOSTS = {"hook.example": ["93.184.216.34"], "metadata.example": ["169.254.169.254"],
         "mixed.example": ["93.184.216.34", "192.168.1.9"], "loop.example": ["127.0.0.1"],
         "localhost": ["127.0.0.1", "::1"]}


def resolver(table: dict):
    """``socket.getaddrinfo``'s signature over ``table`` (name -> addresses); a literal
    address resolves to itself; another name does not resolve."""
    def resolve(host, port, family=0, type=0, proto=0, flags=0):
        try:
            addresses = table[host] if host in table else [str(ipaddress.ip_address(host))]
        except ValueError:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port)) for a in addresses]
    return resolve


@pytest.mark.parametrize("url,rule", [
    ("https://10.0.0.5/", "10.0.0.5 is a private address"),
    ("https://metadata.example/latest", "169.254.169.254, a link-local address"),
    ("https://mixed.example/", "192.168.1.9, a private address"),  # every address counts
    ("https://loop.example/", "127.0.0.1, a loopback address"),
    ("https://[fe80::1]/", "a link-local address"),
    ("https://[fc00::5]/", "a private address"),
    ("https://[::ffff:10.0.0.1]/", "a private address"),
    ("https://100.64.0.1/", "a non-public address"),
    ("https://0.0.0.0/", "0.0.0.0 is an unspecified address"),
    ("https://[::]/", ":: is an unspecified address"),
    ("https://224.0.0.1/", "a multicast address"),
    ("https://nowhere.example/", "does not resolve"),
    ("http://10.1.2.3/", "plain http only to a loopback host"),
    ("ftp://hook.example/", "expected an absolute https:// URL"),
    ("https://hook.example:99999/", "does not resolve"),
])
def test_a_callback_to_a_non_public_host_is_a_400_naming_callback_url(url, rule):
    with pytest.raises(ApiError) as e:
        webhooks.check_url(url, True, resolve=resolver(HOSTS))
    error = e.value
    assert (error.status, error.param) == (400, "callback_url")
    assert error.message.startswith(f"callback_url={url!r}: ") and "\n" not in error.message
    assert rule in error.message, error.message


@pytest.mark.parametrize("url", ["https://hook.example/hook?a=1", "http://127.0.0.1:9/hook",
                                 "http://[::1]:9/hook", "http://localhost:9/"])
def test_public_and_loopback_callbacks_are_accepted(url):
    assert webhooks.check_url(url, True, resolve=resolver(HOSTS)) == url


def test_without_a_webhook_secret_a_callback_is_refused():
    with pytest.raises(ApiError, match="--webhook_secret") as e:
        webhooks.check_url("https://hook.example/", False, resolve=resolver(HOSTS))
    assert (e.value.status, e.value.param) == (400, "callback_url")


@pytest.mark.parametrize("url,accepted", [
    ("https://10.0.0.5/", True), ("https://metadata.example/", True),
    ("https://loop.example/", True), ("https://[fc00::5]/", True),
    ("https://0.0.0.0/", False), ("https://224.0.0.1/", False),
    ("http://10.0.0.5/", False),  # plain http stays loopback-only
])
def test_webhook_allow_private_opens_private_hosts_only(url, accepted, tmp_path):
    hooks = webhooks.Webhooks(JobStore(str(tmp_path)), SECRET, owner=OWNER,
                              allow_private=True, resolve=resolver(HOSTS), start=False)
    if accepted:
        assert hooks.check(url) == url
    else:
        with pytest.raises(ApiError, match="callback_url"):
            hooks.check(url)


# The outbox: one transaction with the job's end, claimed once, held, re-claimed.

@pytest.fixture(params=["sqlite", "postgresql"])
def jobs_db(request):
    """None (SQLite in the test's folder) or a new PostgreSQL database's URL."""
    return None if request.param == "sqlite" else request.getfixturevalue("postgres_url")


def _job(seed: int, callback: str | None = "https://hook.example/h"):
    """A checked job as the server stores it (the handler adds the checked callback_url)."""
    settings = checks.check(checks.parse(dict(prompt="a fox", seed=seed, size="64x64",
                                              num_frames=5)), SERVED)
    return dataclasses.replace(settings, callback_url=callback)


def _outbox(store: JobStore) -> dict:
    with store.engine.begin() as db:
        return {r.id: r for r in db.execute(sa.select(store_rows.outbox)).all()}


def test_every_end_of_a_job_writes_its_callback_with_it(tmp_path, jobs_db):
    """completed, failed, cancelled while queued, cancelled while running, cancelled by the
    reaper (a dead server's pending cancel): one row each, with the video object the
    server's ``render`` makes. None for a job without a callback, nor for a DELETE."""
    store = JobStore(str(tmp_path), jobs_db, lease_s=1.0,
                     render=lambda job: dict(id=job.id, status=job.status, seed=job.settings.seed))
    ids = [store.add(_job(seed, None if seed == 5 else "https://hook.example/h")).id
           for seed in range(8)]
    held = [store.claim(OWNER, BUCKETS).id for _ in range(6)]
    assert held == ids[:6]
    assert store.complete(ids[0], dict(files=["a.mp4"], timings={}, wall_s=1.0), OWNER)
    assert store.fail(ids[1], "boom", OWNER)
    store.cancel(ids[2])
    store.cancelled(ids[2], dict(files=[], timings={}, steps_done=1, wall_s=0.1), OWNER)
    store.cancel(ids[3], CANCEL_AND_DELETE)  # deleted while running: no callback
    store.cancelled(ids[3], dict(files=[], timings={}, steps_done=1, wall_s=0.1), OWNER)
    store.cancel(ids[4], CANCEL_AND_DELETE)  # a DELETE during the decode: dropped after
    assert store.complete(ids[4], dict(files=["e.mp4"], timings={}, wall_s=1.0), OWNER)
    assert store.complete(ids[5], dict(files=["f.mp4"], timings={}, wall_s=1.0), OWNER)
    assert store.cancel(ids[6]) == "queued"
    assert store.claim("srv_dead", BUCKETS).id == ids[7]
    store.cancel(ids[7])
    time.sleep(1.3)  # srv_dead's lease passes: the reaper ends the job
    assert store.reap() == 1
    rows = _outbox(store)
    want = {ids[0]: "completed", ids[1]: "failed", ids[2]: "cancelled", ids[6]: "cancelled",
            ids[7]: "cancelled"}
    assert set(rows) == {f"{i}:{s}" for i, s in want.items()}
    for i, status in want.items():
        row = rows[f"{i}:{status}"]
        assert json.loads(row.body) == dict(id=i, status=status, seed=ids.index(i))
        assert (row.url, row.attempts, row.owner) == ("https://hook.example/h", 0, None)
    store.close()


def test_a_failed_render_leaves_the_job_unended(tmp_path):
    """The outbox row and the job's end are one transaction: when the row cannot be
    written, the job is not completed either (its lease runs on, so it runs again)."""
    def broken(job):
        raise RuntimeError("no body")

    store = JobStore(str(tmp_path), render=broken)
    added = store.add(_job(1))
    store.claim(OWNER, BUCKETS)
    with pytest.raises(RuntimeError, match="no body"):
        store.complete(added.id, dict(files=["a.mp4"], timings={}, wall_s=1.0), OWNER)
    assert store.get(added.id).status == "in_progress" and _outbox(store) == {}


def test_two_servers_claim_each_callback_once_and_a_dead_ones_hold_passes(tmp_path,
                                                                           jobs_db):
    stores = [JobStore(str(tmp_path), jobs_db) for _ in range(2)]
    a, b = stores
    ids = [a.add(_job(seed)).id for seed in range(8)]
    for i in ids:
        assert a.claim(OWNER, BUCKETS).id == i
        assert a.complete(i, dict(files=[], timings={}, wall_s=0.0), OWNER)
    claimed: dict = {0: [], 1: []}

    def drain(n: int) -> None:
        while (row := stores[n].claim_callback(f"srv_{n}", 60.0)) is not None:
            claimed[n].append(row["id"])

    threads = [threading.Thread(target=drain, args=(n,)) for n in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed[0] + claimed[1]) == sorted(f"{i}:completed" for i in ids)
    for n in (0, 1):  # done by the holder only
        for hook in claimed[n]:
            assert not stores[1 - n].callback_done(hook, f"srv_{1 - n}")
            assert stores[n].callback_done(hook, f"srv_{n}")
    assert a.pending_callbacks() == 0
    late = a.add(_job(9)).id
    a.claim(OWNER, BUCKETS)
    a.complete(late, dict(files=[], timings={}, wall_s=0.0), OWNER)
    first = a.claim_callback("srv_dead", 0.5)  # and then it dies
    assert first["attempts"] == 1 and b.claim_callback("srv_b", 60.0) is None
    time.sleep(0.8)
    again = b.claim_callback("srv_b", 60.0)
    assert (again["id"], again["attempts"]) == (first["id"], 2)
    assert not a.callback_done(first["id"], "srv_dead")  # its hold passed: not its row
    assert b.callback_retry(first["id"], "srv_b", 60.0) and b.claim_callback("x", 1) is None
    for store in stores:
        store.close()


# Delivery: signed, retried with backoff, re-checked at each attempt.

class _Receiver(http.server.BaseHTTPRequestHandler):
    """Records every POST (path, headers, body) in the server's ``posts``; answers the
    server's ``statuses`` in turn (then 200)."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.posts.append((self.path, dict(self.headers), body, time.time()))
        self.send_response(self.server.statuses.pop(0) if self.server.statuses else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def receiver(port: int = 0, statuses=()) -> http.server.ThreadingHTTPServer:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Receiver)
    server.posts, server.statuses = [], list(statuses)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _ended_with_callback(store: JobStore, url: str, seed: int = 1) -> str:
    added = store.add(_job(seed, url))
    store.claim(OWNER, BUCKETS)
    assert store.complete(added.id, dict(files=["a.mp4"], timings={}, wall_s=1.0), OWNER)
    return f"{added.id}:completed"


def _deliver_until_empty(hooks: webhooks.Webhooks, timeout: float = 30.0) -> None:
    t0 = time.monotonic()
    while hooks.store.pending_callbacks():
        assert time.monotonic() - t0 < timeout
        if not hooks.deliver_one():
            time.sleep(0.05)


def test_a_delivery_is_signed_per_attempt_and_retried_with_backoff(tmp_path, monkeypatch,
                                                                   capsys):
    """Two 500s, then 200: three POSTs of the same id and body, each verified by
    ``standardwebhooks`` with its own timestamp (backoff 1 s, then 2 s, so they differ);
    then a receiver that always fails gets ATTEMPTS posts and the callback is dropped."""
    monkeypatch.setattr(webhooks, "BACKOFF_S", 1.0)
    hold = receiver(statuses=[500, 500])
    url = f"http://127.0.0.1:{hold.server_address[1]}/hook"
    store = JobStore(str(tmp_path), render=lambda job: dict(id=job.id, status=job.status))
    hooks = webhooks.Webhooks(store, SECRET, owner=OWNER, start=False)
    hook = _ended_with_callback(store, url)
    _deliver_until_empty(hooks)
    assert len(hold.posts) == 3 and list(hooks.delivered) == [(hook, 3)]
    verify = standardwebhooks.Webhook(SECRET)
    stamps = []
    for path, headers, body, _ in hold.posts:
        assert path == "/hook" and headers["webhook-id"] == hook
        assert verify.verify(body, headers) == dict(id=hook.split(":")[0], status="completed")
        stamps.append(int(headers["webhook-timestamp"]))
    assert stamps[1] - stamps[0] >= 1 and stamps[2] - stamps[1] >= 2  # each attempt's own
    wrong = standardwebhooks.Webhook("whsec_" + base64.b64encode(b"x" * 32).decode())
    with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError):
        wrong.verify(hold.posts[0][2], hold.posts[0][1])

    monkeypatch.setattr(webhooks, "BACKOFF_S", 0.05)
    hold.statuses[:] = [503] * 10
    failing = _ended_with_callback(store, url, seed=2)
    _deliver_until_empty(hooks)
    assert [h["webhook-id"] for _, h, _, _ in hold.posts[3:]] == [failing] * webhooks.ATTEMPTS
    assert f"webhook {failing} to {url}: gave up after {webhooks.ATTEMPTS} attempts" in \
        capsys.readouterr().out
    hold.shutdown()


def test_the_host_is_checked_again_at_delivery_and_the_post_goes_where_checked(tmp_path,
                                                                             monkeypatch,
                                                                             capsys):
    """hook.example resolves public when the request comes and private at delivery: no
    connection is made and the callback is dropped with a line. Resolving public at
    delivery, the connection goes to the address checked; with --webhook_allow_private,
    to the private one."""
    connects = []

    def connect(address, timeout=None, *args):
        connects.append(address)
        raise ConnectionRefusedError(111, "Connection refused (test)")

    monkeypatch.setattr(webhooks.socket, "create_connection", connect)
    url = "https://hook.example/hook"
    assert webhooks.check_url(url, True, resolve=resolver(HOSTS)) == url
    store = JobStore(str(tmp_path))
    rebound = resolver({"hook.example": ["93.184.216.34", "10.0.0.7"]})
    hooks = webhooks.Webhooks(store, SECRET, owner=OWNER, resolve=rebound, start=False)
    hook = _ended_with_callback(store, url)
    assert hooks.deliver_one() and store.pending_callbacks() == 0 and connects == []
    assert f"webhook {hook} to {url}: not sent: hook.example resolves to 10.0.0.7, a " \
           f"private address" in capsys.readouterr().out

    hooks.resolve = resolver(HOSTS)  # public again: a connection to the checked address
    _ended_with_callback(store, url, seed=2)
    assert hooks.deliver_one() and connects == [("93.184.216.34", 443)]
    assert store.pending_callbacks() == 1  # refused connection: due again after backoff
    private = webhooks.Webhooks(store, SECRET, owner=OWNER, allow_private=True,
                                resolve=resolver({"hook.example": ["10.0.0.7"]}), start=False)
    time.sleep(webhooks.BACKOFF_S + 0.1)
    assert private.deliver_one() and connects[1:] == [("10.0.0.7", 443)]
    assert "--webhook_allow_private" in capsys.readouterr().out  # said once at its start


def test_delivered_is_bounded(tmp_path):
    hooks = webhooks.Webhooks(JobStore(str(tmp_path)), SECRET, owner=OWNER, start=False)
    for n in range(3 * webhooks.KEEP):
        hooks.delivered.append((f"hook{n}", 1))
    assert len(hooks.delivered) == webhooks.KEEP and hooks.delivered[0][0] == "hook200"


# Flags: one line before any model loads, the secret never shown.

@pytest.mark.parametrize("flags,words", [
    (["--serve", "--webhook_secret", "not-a-secret-123"],
     ["--webhook_secret='<redacted, 16 characters>'", "whsec_", "24 to 64"]),
    (["--serve", "--webhook_secret", "whsec_" + base64.b64encode(b"short").decode()],
     ["--webhook_secret='<redacted, 14 characters>'", "24 to 64"]),
    (["--serve", "--webhook_secret", "whsec_%%%%" + "A" * 40], ["--webhook_secret", "base64"]),
    (["--webhook_secret", SECRET], ["--webhook_secret='<redacted>'", "needs --serve"]),
    (["--serve", "--webhook_allow_private"], ["--webhook_allow_private", "--webhook_secret"]),
])
def test_bad_webhook_flags(tiny_checkpoint, tmp_path, flags, words):
    with pytest.raises(UsageError) as e:
        gf.validate_args(gf.parse_args(["--model_id", tiny_checkpoint, *flags,
                                        "--output_dir", str(tmp_path)]))
    line = str(e.value)
    assert "\n" not in line and "not-a-secret" not in line and SECRET[6:] not in line
    for word in words:
        assert word in line, line


def test_a_webhook_secret_from_the_environment(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("GENERATE_FLAX_WEBHOOK_SECRET", SECRET)
    config = gf.validate_args(gf.parse_args(["--model_id", tiny_checkpoint, "--serve",
                                             "--output_dir", str(tmp_path)]))
    assert config.serve.webhook_secret == SECRET
    assert config.serve.settings()["webhook_secret_set"] is True
    assert SECRET not in json.dumps(config.serve.settings())


# The proof: kill -9 with a callback undelivered, then the next server delivers it once.

@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_callback_survives_kill_9_and_the_next_server_delivers_it_once(
        backend, tiny_checkpoint, tmp_path, request):
    jobs_db = [] if backend == "sqlite" else \
        ["--jobs_db", request.getfixturevalue("postgres_url")]
    port = free_port()  # the receiver's: nothing listens there until the kill
    url = f"http://127.0.0.1:{port}/hook"
    argv = ["--model_id", tiny_checkpoint, *SETTINGS, "--api_key", KEY, "--webhook_secret",
            SECRET, "--compilation_cache_dir", str(tmp_path / "jax-cache"), *jobs_db]
    out = tmp_path / "out"
    first = Server(argv, out, log=tmp_path / "first.log").start()
    first.wait_ready()
    with first.client() as c:
        job = c.post("/v1/videos", json=dict(prompt=PROMPT, seed=5, callback_url=url)).json()
        job = wait_done(c, [job["id"]])[job["id"]]
    hook = f"{job['id']}:completed"
    t0 = time.monotonic()
    while f"webhook {hook} to {url}: attempt 1:" not in first.tail(10**6):  # receiver down
        assert time.monotonic() - t0 < 20, first.tail()
        time.sleep(0.05)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait()
    store = JobStore(str(out), jobs_db[1] if jobs_db else None)
    pending = _outbox(store)
    assert list(pending) == [hook], first.tail()
    assert 1 <= pending[hook].attempts < webhooks.ATTEMPTS  # tried, not given up

    hold = receiver(port)
    second = Server([*argv, "--webhook_allow_private"], out, log=tmp_path / "second.log")
    second.start()
    try:
        t0 = time.monotonic()
        while not hold.posts:  # the delivery thread starts before the model loads
            assert time.monotonic() - t0 < 120, second.tail()
            time.sleep(0.1)
        second.wait_ready()
        with second.client() as c:  # --webhook_allow_private: a private host is accepted
            private = c.post("/v1/videos", json=dict(prompt=PROMPT, seed=6,
                                                     callback_url="https://10.0.0.5/"))
            assert private.status_code == 200, private.text
            c.post(f"/v1/videos/{private.json()['id']}/cancel")  # it need not run
        time.sleep(1.0)  # nothing more may arrive
    finally:
        assert second.stop() == 0, second.tail()
        hold.shutdown()
    assert "--webhook_allow_private: callbacks may go to private" in second.tail(10**6)
    assert len(hold.posts) == 1, hold.posts
    path, headers, body, _ = hold.posts[0]
    video = standardwebhooks.Webhook(SECRET).verify(body, headers)
    assert headers["webhook-id"] == hook and path == "/hook"
    assert (video["id"], video["status"], video["seed"]) == (job["id"], "completed", 5)
    assert video["files"] == job["files"] and len(job["files"]) >= 1
    assert hook not in _outbox(store)
    # A replay ten minutes later: re-signed for that time (what a captured delivery from
    # then would carry), and the captured headers with only the timestamp moved.
    old = time.time() - 600
    replayed = standardwebhooks.Webhook(SECRET)
    headers_then = {**headers, "webhook-timestamp": str(int(old)),
                    "webhook-signature": replayed.sign(
                        hook, datetime.fromtimestamp(int(old), UTC), body.decode())}
    for stale in (headers_then, {**headers, "webhook-timestamp": str(int(old))}):
        with pytest.raises(standardwebhooks.webhooks.WebhookVerificationError,
                           match="too old"):
            replayed.verify(body, stale)
    store.close()


def test_no_secret_means_callbacks_wait(tmp_path, capsys):
    """A server without --webhook_secret delivers nothing and says what waits."""
    store = JobStore(str(tmp_path))
    _ended_with_callback(store, "https://hook.example/h")
    hooks = webhooks.Webhooks(store, None, owner=OWNER)
    assert not hooks.thread.is_alive() and store.pending_callbacks() == 1
    assert "1 callbacks wait in the outbox" in capsys.readouterr().out
