"""Webhooks: a job with a ``callback_url`` gets its video object POSTed there when it ends
(completed, failed or cancelled), signed, retried, durable, never on the worker's time.

**Durable.** The callback is a row of the job store's ``outbox`` table, written in the same
transaction that ends the job (``engine.serve.jobs``): a ``kill -9`` loses none, and a
restarted server, or another server on the same ``--jobs_db``, delivers what a dead one left.
Each server's delivery thread **claims** a due row (``JobStore.claim_callback``: ``FOR UPDATE
SKIP LOCKED`` and a guarded ``UPDATE``, so two servers never hold one row at once), holding
it for ``HOLD_S`` seconds on the database's clock; a server that dies holding it lets the
next claim take it once the hold has passed. Delivery is **at least once**: a receiver drops
duplicates by the ``webhook-id`` header, ``<job id>:<status>``, the same on every retry.

**Signed** with the Standard Webhooks scheme (https://www.standardwebhooks.com/, through its
``standardwebhooks`` library) keyed with ``--webhook_secret``: ``webhook-id``,
``webhook-timestamp`` (Unix seconds, taken at each attempt) and ``webhook-signature``
(``v1,<base64 HMAC-SHA256 of "id.timestamp.body">``). A receiver verifies with
``standardwebhooks.Webhook(secret).verify(body, headers)``, which also refuses a timestamp more
than 5 minutes from its clock: a captured delivery cannot be replayed later.

**Only to public hosts.** ``callback_url`` is https, or plain http to a loopback host (tests,
a sidecar). Its host is resolved (``socket.getaddrinfo``) when the request comes and again at
each attempt (DNS can change), and EVERY address must be public: a private, link-local,
loopback, shared, reserved, multicast or unspecified one is refused (a 400 naming
``callback_url``; at delivery, a logged line and no POST). ``--webhook_allow_private`` opens
the non-public ones but multicast and unspecified, for a trusted network. The POST goes to the
address that was checked (the name still gives the Host header and TLS's server name), so a
resolver cannot swap the address between the check and the connection.

**Retried.** An attempt fails on no answer in ``TIMEOUT_S``, a status >= 300 (redirects are
not followed) or an unresolvable host; the row is then due again after ``BACKOFF_S`` doubling,
up to ``ATTEMPTS`` attempts in all (counted across servers), then dropped with a logged line.
"""

from __future__ import annotations

import base64
import binascii
import collections
import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from datetime import UTC, datetime

import sqlalchemy as sa
import standardwebhooks

from engine.serve.requests import refuse

ATTEMPTS = 5
BACKOFF_S = 0.5
TIMEOUT_S = 10.0
HOLD_S = 3 * TIMEOUT_S  # a claim outlives one attempt (resolve, connect, answer)
POLL_S = 0.5  # how often an idle delivery thread looks at the outbox
KEEP = 100  # the ``delivered`` entries kept (the newest)
ANSWER_BYTES = 64 * 1024  # what is read of a receiver's answer
log = logging.getLogger("generate_flax.serve.webhooks")


def secret_rule_error(secret: str) -> str | None:
    """Why ``secret`` is no Standard Webhooks secret ("whsec_" + base64 of 24..64 bytes, the
    spec's sizes), or None."""
    body = secret[len("whsec_"):] if secret.startswith("whsec_") else None
    try:
        raw = b"" if body is None else base64.b64decode(body + "=" * (-len(body) % 4),
                                                         validate=True)
    except binascii.Error:
        raw = b""
    if not 24 <= len(raw) <= 64:
        return ("expected 'whsec_' and the base64 of 24 to 64 random bytes (Standard "
                "Webhooks), e.g. python -c \"import base64, os; print('whsec_' + "
                "base64.b64encode(os.urandom(32)).decode())\"")
    return None


def check_url(url: str, secret_set: bool, allow_private: bool = False,
              resolve=socket.getaddrinfo) -> str:
    """A request's ``callback_url``, checked: a server with ``--webhook_secret``
    (``secret_set``), https, or plain http to a loopback host, and a host whose every address
    (``resolve``: ``socket.getaddrinfo``'s signature) is allowed (``refusal``).

    Raises:
        ApiError: 400 naming ``callback_url``, the value and the rule.
    """
    if not secret_set:
        refuse("callback_url", url, "needs a server started with --webhook_secret (callbacks "
               "are signed with it)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        refuse("callback_url", url, "expected an absolute https:// URL")
    if parts.scheme == "http" and not _loopback_host(parts.hostname):
        refuse("callback_url", url, "plain http only to a loopback host (127.0.0.0/8, ::1, "
               "localhost); use https")
    try:
        port = _port(parts)
        addresses = _resolve(parts.hostname, port, resolve)
    except (OSError, ValueError) as e:
        refuse("callback_url", url, f"its host does not resolve ({e})")
    why = refusal(parts.hostname, addresses, allow_private)
    if why is not None:
        refuse("callback_url", url, why)
    return url


def refusal(host: str, addresses: list, allow_private: bool) -> str | None:
    """Why a callback may not go to ``host`` at ``addresses`` (``ipaddress`` values), or None.
    A loopback host (a loopback literal, "localhost") must resolve to loopback only; another
    host to public (``is_global``) addresses only, or with ``allow_private`` to any but
    multicast and unspecified ones."""
    for ip in addresses:
        kind = _kind(ip)
        if _loopback_host(host) and kind == "loopback":
            continue
        if kind is None or (allow_private and kind not in ("multicast", "unspecified")):
            continue
        what = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} address"
        where = f"{host} is" if host == str(ip) else f"{host} resolves to {ip},"
        return (f"{where} {what}; callbacks go to public hosts only (a server started with "
                "--webhook_allow_private also sends to private ones; never multicast or "
                "unspecified)")
    return None


def _kind(ip) -> str | None:
    """None for a public address, else what it is (the first that applies)."""
    if ip.version == 6 and ip.ipv4_mapped is not None:  # ::ffff:10.0.0.1 is 10.0.0.1
        ip = ip.ipv4_mapped
    for kind in ("unspecified", "multicast", "loopback", "link_local", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "non-public"


def _loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _port(parts) -> int:
    """The URL's port (ValueError when out of range), else the scheme's."""
    return parts.port or (443 if parts.scheme == "https" else 80)


def _resolve(host: str, port: int, resolve) -> list:
    """Every address ``host`` resolves to (``ipaddress`` values, an IPv6 zone dropped), in the
    resolver's order. Raises OSError (``socket.gaierror``) when it does not resolve."""
    infos = resolve(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(ipaddress.ip_address(info[4][0].split("%")[0])
                              for info in infos))


class Refused(Exception):
    """The callback's host resolves to an address it may not go to (``refusal``)."""


class Webhooks:
    """The server's delivery thread over the store's outbox (``engine.serve.jobs``).

    ``store``: the ``JobStore``; ``secret``: ``--webhook_secret`` (None: callbacks are
    refused at request time, and nothing is delivered: the rows wait for a server with a
    secret); ``owner``: this server's id (its claims); ``resolve``: ``socket.getaddrinfo``'s
    signature (a test's resolver); ``start``: run the thread (False: a test calls
    ``deliver_one``). ``delivered`` keeps the newest ``KEEP`` (webhook id, attempt) pairs.
    """

    def __init__(self, store, secret: str | None, *, owner: str, allow_private: bool = False,
                 resolve=socket.getaddrinfo, start: bool = True):
        self.store, self.owner, self.allow_private = store, owner, allow_private
        self.resolve = resolve
        self.signer = standardwebhooks.Webhook(secret) if secret else None
        self.delivered: collections.deque = collections.deque(maxlen=KEEP)
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="webhooks", daemon=True)
        if allow_private:
            print("webhooks: --webhook_allow_private: callbacks may go to private, "
                  "link-local and loopback hosts (a trusted network only)", flush=True)
        if start and self.signer is not None:
            self.thread.start()
        elif start and (waiting := store.pending_callbacks()):
            print(f"webhooks: {waiting} callbacks wait in the outbox for a server started "
                  "with --webhook_secret", flush=True)

    def check(self, url: str) -> str:
        """``check_url`` with this server's settings (blocks on DNS: call it off the event
        loop)."""
        return check_url(url, self.signer is not None, self.allow_private, self.resolve)

    def wake(self) -> None:
        """A job has ended: look at the outbox now rather than at the next poll."""
        self._wake.set()

    def _run(self) -> None:
        away = False
        while True:
            try:
                busy = self.deliver_one()
                away = False
            except sa.exc.SQLAlchemyError as e:  # the store is away: wait, never end
                if not away:
                    print(f"webhooks: the job store did not answer ({type(e).__name__}); "
                          "callbacks wait for it", flush=True)
                busy, away = False, True
            except Exception as e:  # a bug must not end delivery for the server's lifetime
                print(f"webhooks: {type(e).__name__}: {e}", flush=True)
                busy = False
            if not busy:
                self._wake.wait(POLL_S)
                self._wake.clear()

    def deliver_one(self) -> bool:
        """Claim one due callback and make one attempt; False when none was due."""
        row = self.store.claim_callback(self.owner, HOLD_S)
        if row is None:
            return False
        hook, url, attempt = row["id"], row["url"], row["attempts"]
        try:
            self._post(url, hook, row["body"])
        except Refused as e:
            self.store.callback_done(hook, self.owner)
            print(f"webhook {hook} to {url}: not sent: {e}", flush=True)
        except (OSError, http.client.HTTPException, ValueError) as e:  # ssl.SSLError is one
            if attempt >= ATTEMPTS:
                self.store.callback_done(hook, self.owner)
                print(f"webhook {hook} to {url}: gave up after {attempt} attempts ({e})",
                      flush=True)
            else:
                log.warning("webhook %s to %s: attempt %d: %s", hook, url, attempt, e)
                self.store.callback_retry(hook, self.owner, BACKOFF_S * 2 ** (attempt - 1))
        else:
            self.store.callback_done(hook, self.owner)
            self.delivered.append((hook, attempt))
        return True

    def headers(self, hook: str, body: str, now: float | None = None) -> dict:
        """The Standard Webhooks headers of one attempt at ``now`` (Unix seconds)."""
        stamp = int(time.time() if now is None else now)
        signature = self.signer.sign(hook, datetime.fromtimestamp(stamp, UTC), body)
        return {"Content-Type": "application/json", "webhook-id": hook,
                "webhook-timestamp": str(stamp), "webhook-signature": signature}

    def _post(self, url: str, hook: str, body: str) -> None:
        """One POST to the checked address; returns on a status < 300.

        Raises:
            Refused: the host resolves to an address it may not go to (no connection made).
            OSError, http.client.HTTPException: no answer, or the receiver's error status.
        """
        parts = urllib.parse.urlsplit(url)
        port = _port(parts)
        addresses = _resolve(parts.hostname, port, self.resolve)
        why = refusal(parts.hostname, addresses, self.allow_private)
        if why is not None:
            raise Refused(why)
        kind = _PinnedHTTPS if parts.scheme == "https" else _PinnedHTTP
        connection = kind(parts.hostname, port, addresses, timeout=TIMEOUT_S)
        try:
            path = parts.path or "/"
            connection.request("POST", path + (f"?{parts.query}" if parts.query else ""),
                               body=body.encode(), headers=self.headers(hook, body))
            response = connection.getresponse()
            response.read(ANSWER_BYTES)  # only the status matters; a huge answer is not kept
        finally:
            connection.close()
        if response.status >= 300:
            raise http.client.HTTPException(f"HTTP {response.status} {response.reason}")


def _connect(addresses: list, port: int, timeout: float) -> socket.socket:
    """A TCP connection to the first of ``addresses`` that answers."""
    error: OSError = OSError("no address")
    for ip in addresses:
        try:
            return socket.create_connection((str(ip), port), timeout)
        except OSError as e:
            error = e
    raise error


class _PinnedHTTP(http.client.HTTPConnection):
    """http.client's connection to ``host``, made to one of the checked ``addresses``."""

    def __init__(self, host: str, port: int, addresses: list, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.addresses = addresses

    def connect(self) -> None:
        self.sock = _connect(self.addresses, self.port, self.timeout)


class _PinnedHTTPS(_PinnedHTTP):
    """The same over TLS: the certificate is checked against ``host`` (the system's CAs)."""

    default_port = http.client.HTTPS_PORT

    def connect(self) -> None:
        super().connect()
        self.sock = ssl.create_default_context().wrap_socket(self.sock,
                                                             server_hostname=self.host)

