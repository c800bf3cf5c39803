"""Webhooks: a job with a ``callback_url`` gets its video object POSTed there when it ends
(completed, failed or cancelled), signed, retried, never on the worker's time.

The body is the job's ``video`` object as JSON (what ``GET /v1/videos/{id}`` returns). The
headers carry ``X-Signature-256: sha256=<hex>``, the HMAC-SHA256 of the exact body bytes keyed
with the server's API key (the scheme GitHub's webhooks use), and ``X-Webhook-Id`` (the job id
and status, the same on every retry, so a receiver can drop duplicates). A receiver verifies
with ``hmac.compare_digest(signature(key, body), header)``.

Delivery runs on one daemon thread behind a queue: a slow or failing receiver delays other
callbacks, never a job. Each callback is tried up to ``ATTEMPTS`` times with exponential
backoff (``BACKOFF_S`` doubling) while the receiver errors (a status >= 300 or no answer).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from engine.serve.requests import refuse

ATTEMPTS = 5
BACKOFF_S = 0.5
TIMEOUT_S = 10.0
HEADER = "X-Signature-256"
log = logging.getLogger("generate_flax.serve.webhooks")


def signature(key: str, body: bytes) -> str:
    """``sha256=<hex>``: HMAC-SHA256 of ``body`` keyed with ``key`` (UTF-8)."""
    return "sha256=" + hmac.new(key.encode(), body, hashlib.sha256).hexdigest()


def check_url(url: str, api_key: str | None) -> str:
    """A request's ``callback_url``: https anywhere, plain http only to a loopback host
    (tests, a sidecar), and only on a server with an API key (the key signs the body).

    Raises:
        ApiError: 400 naming ``callback_url``, the value and the rule.
    """
    if api_key is None:
        refuse("callback_url", url, "needs a server started with --api_key (callbacks are "
               "signed with it)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        refuse("callback_url", url, "expected an absolute https:// URL")
    if parts.scheme == "http" and not _loopback(parts.hostname):
        refuse("callback_url", url, "plain http only to a loopback host (127.0.0.0/8, ::1, "
               "localhost); use https")
    return url


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an error: the receiver is the URL the request named, nothing else."""

    def redirect_request(self, *args, **kwargs):
        return None


class Webhooks:
    """The delivery thread; ``send`` queues one callback and returns at once."""

    def __init__(self, api_key: str | None):
        self.api_key = api_key
        self.opener = urllib.request.build_opener(_NoRedirect)
        self.queue: queue.Queue = queue.Queue()
        self.delivered: list[tuple[str, int]] = []  # (webhook id, attempts), for the log
        threading.Thread(target=self._run, name="webhooks", daemon=True).start()

    def send(self, url: str, video: dict) -> None:
        """POST ``video`` (a video object) to ``url``, signed, in the background."""
        body = json.dumps(video, sort_keys=True).encode()
        self.queue.put((url, body, f"{video['id']}:{video['status']}"))

    def _run(self) -> None:
        while True:
            url, body, hook_id = self.queue.get()
            self._deliver(url, body, hook_id)

    def _deliver(self, url: str, body: bytes, hook_id: str) -> None:
        headers = {"Content-Type": "application/json", "X-Webhook-Id": hook_id,
                   HEADER: signature(self.api_key, body)}
        for attempt in range(1, ATTEMPTS + 1):
            try:
                request = urllib.request.Request(url, data=body, headers=headers,
                                                 method="POST")
                with self.opener.open(request, timeout=TIMEOUT_S) as response:
                    if response.status < 300:
                        self.delivered.append((hook_id, attempt))
                        return
            except (urllib.error.URLError, OSError) as e:  # HTTPError is a URLError
                log.warning("webhook %s to %s: attempt %d: %s", hook_id, url, attempt, e)
            time.sleep(BACKOFF_S * 2 ** (attempt - 1))
        print(f"webhook {hook_id} to {url}: gave up after {ATTEMPTS} attempts", flush=True)
