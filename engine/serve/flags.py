"""The server's flags and its shape buckets, checked before any model loads."""

from __future__ import annotations

import dataclasses
import os
import re

import sqlalchemy as sa

from engine.run.errors import fail
from engine.serve.jobs import DEFAULT_LEASE_S, masked
from engine.serve.webhooks import secret_rule_error

API_KEY_ENV = "GENERATE_FLAX_API_KEY"
JOBS_DB_ENV = "GENERATE_FLAX_JOBS_DB"  # keeps a database password off the command line
WEBHOOK_SECRET_ENV = "GENERATE_FLAX_WEBHOOK_SECRET"  # the same for the webhooks' secret
FLAGS = ("serve", "host", "port", "api_key", "serve_sizes", "serve_frames", "retention_hours",
         "jobs_db", "job_lease_s", "webhook_secret", "webhook_allow_private",
         "embedding_cache_bytes")
# --embedding_cache_bytes' default: 1 GiB holds ~256 Wan texts (UMT5: 512 x 4096 bf16 = 4 MiB
# each) or ~135 HunyuanVideo-1.5 texts (Qwen 1000 x 3584 + ByT5 256 x 1472 bf16 = 7.9 MB), in
# host RAM that already holds the text encoders (11-28 GB): a prompt library's recent texts.
EMBEDDING_CACHE_BYTES = 1 << 30
# --job_lease_s bounds: a heartbeat every third of the lease must fit a busy host's scheduling
# hiccups (below 3 s, a loaded CPU host lost leases in tests); above an hour, a dead server's
# job waits longer than anyone would.
LEASE_RANGE = (3.0, 3600.0)
# What --serve cannot combine with: each runs a different protocol than one job at a time
# (--image: one picture for every job; a served job sends its own as input_reference).
_EXCLUSIVE = (("stage", "all", "--stage"), ("dry_run", False, "--dry_run"),
              ("prompts_file", None, "--prompts_file"), ("seeds", None, "--seeds"),
              ("profile_dir", None, "--profile_dir"), ("image", None, "--image"))


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """What ``--serve`` serves: where (``host``, ``port``), who may (``api_key``, None = no
    key), and the shape buckets compiled at start: ``sizes`` as (width, height) pixels in the
    order given (OpenAI's ``size`` is "WIDTHxHEIGHT"), ``frames`` as frame counts. The first
    size and frames are a request's defaults. ``retention_s``: seconds an ended job's files
    are kept before it becomes ``expired`` (None: kept until deleted). ``jobs_db``: the job
    store's URL (None: SQLite in --output_dir); ``lease_s``: seconds a running job's lease
    lasts without a heartbeat. ``webhook_secret``: the Standard Webhooks secret callbacks are
    signed with (None: a request's ``callback_url`` is refused); ``webhook_allow_private``:
    callbacks may go to private hosts (``engine.serve.webhooks``)."""

    host: str
    port: int
    api_key: str | None
    sizes: tuple
    frames: tuple
    retention_s: float | None = None
    jobs_db: str | None = None
    lease_s: float = DEFAULT_LEASE_S
    webhook_secret: str | None = None
    webhook_allow_private: bool = False
    embedding_cache_bytes: int = EMBEDDING_CACHE_BYTES

    @property
    def buckets(self) -> list[tuple[int, int, int]]:
        """Every (width, height, frames) compiled, sizes outer."""
        return [(w, h, f) for w, h in self.sizes for f in self.frames]

    def settings(self) -> dict:
        """The report's entry: everything but the key (only whether there is one)."""
        return dict(host=self.host, port=self.port, api_key_set=self.api_key is not None,
                    sizes=[f"{w}x{h}" for w, h in self.sizes], frames=list(self.frames),
                    retention_hours=None if self.retention_s is None
                    else self.retention_s / 3600,
                    jobs_db=None if self.jobs_db is None else
                    masked(self.jobs_db),
                    job_lease_s=self.lease_s,
                    webhook_secret_set=self.webhook_secret is not None,
                    webhook_allow_private=self.webhook_allow_private,
                    embedding_cache_bytes=self.embedding_cache_bytes)


def add_serve_flags(g) -> None:
    """The serving flags, on an argparse group."""
    g.add_argument("--serve", action="store_true",
                   help="serve OpenAI's /v1/videos API and a web page on the loaded model "
                        "instead of generating once: load, compile every bucket, warm up, "
                        "then one job at a time until stopped (docs/serving.md)")
    g.add_argument("--host", default="127.0.0.1",
                   help="address --serve binds (0.0.0.0 exposes it to the network)")
    g.add_argument("--port", type=int, default=8000, help="TCP port of --serve")
    g.add_argument("--api_key", default=None,
                   help=f"with --serve, requests need 'Authorization: Bearer KEY' (default: "
                        f"${API_KEY_ENV} if set, else no key)")
    g.add_argument("--serve_sizes", default=None,
                   help="comma-separated WIDTHxHEIGHT buckets compiled at start, e.g. "
                        "1280x720,832x480 (default: --width x --height)")
    g.add_argument("--serve_frames", default=None,
                   help="comma-separated frame counts compiled at start, each 4n+1, e.g. 81 "
                        "(default: --frames)")
    g.add_argument("--retention_hours", type=float, default=None,
                   help="hours an ended job's video is kept; then a sweeper removes its files "
                        "and its status becomes 'expired' (default: kept until deleted)")
    g.add_argument("--jobs_db", default=None,
                   help=f"the job store: postgresql://USER:PASSWORD@HOST/DB lets several "
                        f"servers share one queue (each needs the same --output_dir, a shared "
                        f"folder); default ${JOBS_DB_ENV} if set, else SQLite in --output_dir "
                        f"(docs/serving.md)")
    g.add_argument("--job_lease_s", type=float, default=None,
                   help=f"seconds a running job stays this server's without a heartbeat; a "
                        f"dead server's job runs again elsewhere after it (default "
                        f"{DEFAULT_LEASE_S:g})")
    g.add_argument("--webhook_secret", default=None,
                   help=f"with --serve, a request's callback_url gets the ended job POSTed, "
                        f"signed with this Standard Webhooks secret (whsec_ + base64 of 24-64 "
                        f"random bytes; default ${WEBHOOK_SECRET_ENV} if set, else callbacks "
                        f"are refused)")
    g.add_argument("--webhook_allow_private", action="store_true",
                   help="with --webhook_secret, callbacks may also go to private, link-local "
                        "and loopback hosts (a trusted network; default: public hosts only)")
    g.add_argument("--embedding_cache_bytes", default=None, metavar="BYTES",
                   help=f"with --serve, the prompt embeddings of recent texts kept in memory "
                        f"(least recently used out first), over the --embeddings_cache folder: "
                        f"a job whose texts are cached runs no text encoder; 0 keeps none in "
                        f"memory (default {EMBEDDING_CACHE_BYTES}, 1 GiB)")


def validate_serve_flags(args, family, values: dict, defaults: dict) -> ServeSettings | None:
    """The serving flags against each other and the family's shape rules; None without
    --serve. ``values`` (the resolved family flags) get the first bucket's width, height and
    frames, so the run's configuration (and its default flow shift) is the first bucket's.
    ``defaults``: the family's and checkpoint's defaults (``flow_shift``).

    Raises:
        UsageError: one line naming the flag, the value and the rule.
    """
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if not args.serve:
        for flag in ("api_key", "serve_sizes", "serve_frames", "retention_hours", "jobs_db",
                     "job_lease_s", "webhook_secret", "embedding_cache_bytes"):
            if getattr(args, flag) is not None:
                fail(f"--{flag}", getattr(args, flag) if flag != "webhook_secret" else
                     "<redacted>", "needs --serve")
        if args.webhook_allow_private:
            fail("--webhook_allow_private", True, "needs --serve")
        return None
    for name, allowed, flag in _EXCLUSIVE:
        if getattr(args, name) != allowed:
            fail(flag, getattr(args, name), "cannot be combined with --serve (a server runs "
                 "whole generations, one job at a time)")
    if not 1 <= args.port <= 65535:
        fail("--port", args.port, "must be a TCP port in 1..65535")
    retention = args.retention_hours
    if retention is not None and not (retention > 0 and retention < float("inf")):
        fail("--retention_hours", retention, "must be a number of hours > 0 (omit it to keep "
             "videos until deleted)")
    if api_key is not None and not api_key.strip():
        fail("--api_key", "''", f"must not be empty (omit it and unset ${API_KEY_ENV} for "
             "no key)")
    jobs_db, lease_s = _jobs_db(args)
    cache_bytes = _embedding_cache_bytes(args.embedding_cache_bytes)
    webhook_secret = _webhook_secret(args)
    multiple = family.sizes.pixel_multiple(args.model_id)  # the checkpoint's VAE x patch
    sizes = _parse_sizes(args.serve_sizes, values, multiple, family.name)
    frames = _parse_frames(args.serve_frames, values, family.sizes.frame_step(args.model_id),
                           family.name)
    if args.flow_shift is None and "flow_shift" not in defaults:
        shifts = {family.scheduler.default_flow_shift(h, w) for w, h in sizes}
        if len(shifts) > 1:  # one scheduler serves every bucket
            fail("--serve_sizes", args.serve_sizes, f"these sizes take different default "
                 f"flow shifts ({', '.join(map(str, sorted(shifts)))}); give --flow_shift")
    values.update(width=sizes[0][0], height=sizes[0][1], frames=frames[0])
    return ServeSettings(host=args.host, port=args.port, api_key=api_key, sizes=sizes,
                         frames=frames,
                         retention_s=None if retention is None else retention * 3600,
                         jobs_db=jobs_db, lease_s=lease_s, webhook_secret=webhook_secret,
                         webhook_allow_private=args.webhook_allow_private,
                         embedding_cache_bytes=cache_bytes)


def _embedding_cache_bytes(text: str | None) -> int:
    """--embedding_cache_bytes as an int (None: the default).

    Raises:
        UsageError: not a whole number of bytes >= 0.
    """
    if text is None:
        return EMBEDDING_CACHE_BYTES
    if not str(text).strip().isdigit():
        fail("--embedding_cache_bytes", text, "must be a whole number of bytes >= 0 (0 keeps "
             "no embeddings in memory)")
    return int(text)


def _jobs_db(args) -> tuple[str | None, float]:
    """(--jobs_db or $GENERATE_FLAX_JOBS_DB, --job_lease_s), checked.

    Raises:
        UsageError: a URL that is neither PostgreSQL nor SQLite, or a lease out of range.
    """
    url = args.jobs_db if args.jobs_db is not None else os.environ.get(JOBS_DB_ENV) or None
    if url is not None:
        try:
            backend = sa.make_url(url).get_backend_name()
        except sa.exc.ArgumentError:
            backend = None
        if backend not in ("postgresql", "sqlite"):
            fail("--jobs_db", url if backend is None else masked(url),
                 "expected postgresql://USER:PASSWORD@HOST[:PORT]/DB (or sqlite:///PATH)")
    lease = DEFAULT_LEASE_S if args.job_lease_s is None else args.job_lease_s
    if not LEASE_RANGE[0] <= lease <= LEASE_RANGE[1]:
        fail("--job_lease_s", lease, f"must be in {LEASE_RANGE[0]:g}..{LEASE_RANGE[1]:g} "
             "seconds")
    return url, float(lease)


def _webhook_secret(args) -> str | None:
    """--webhook_secret or $GENERATE_FLAX_WEBHOOK_SECRET, checked (the value never shown).

    Raises:
        UsageError: not a Standard Webhooks secret, or --webhook_allow_private without one.
    """
    secret = args.webhook_secret if args.webhook_secret is not None else \
        os.environ.get(WEBHOOK_SECRET_ENV) or None
    if secret is not None and (why := secret_rule_error(secret)) is not None:
        fail("--webhook_secret", f"<redacted, {len(secret)} characters>", why)
    if secret is None and args.webhook_allow_private:
        fail("--webhook_allow_private", True, f"needs --webhook_secret (or "
             f"${WEBHOOK_SECRET_ENV}): without it no callback is accepted")
    return secret


def _parse_sizes(text, values, multiple: int, name: str) -> tuple:
    if text is None:
        return ((values["width"], values["height"]),)
    out = []
    for item in text.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", item)
        if not m:
            fail("--serve_sizes", text, "expected comma-separated WIDTHxHEIGHT, e.g. "
                 "1280x720,832x480")
        w, h = int(m[1]), int(m[2])
        if min(w, h) < multiple or w % multiple or h % multiple:
            fail("--serve_sizes", text, f"{w}x{h}: width and height must be positive "
                 f"multiples of {multiple} for {name}")
        if (w, h) not in out:
            out.append((w, h))
    return tuple(out)


def _parse_frames(text, values, step: int, name: str) -> tuple:
    if text is None:
        return (values["frames"],)
    out = []
    for item in text.split(","):
        if not item.strip().isdigit():
            fail("--serve_frames", text, "expected comma-separated frame counts, e.g. 81")
        f = int(item)
        if f < 1 or (f - 1) % step:
            fail("--serve_frames", text, f"{f}: frames must be of the form {step}n+1 "
                 f"for {name}")
        if f not in out:
            out.append(f)
    return tuple(out)
