"""The HTTP side: OpenAI's Videos API, ``/health``, ``/v1/models`` and the web page, as one
FastAPI app, served by uvicorn (``serve``).

Errors have OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with a
message naming the field, the value and the rule. Ids from a URL are matched against
``jobs.ID_PATTERN`` before they name anything: another string is a 404, never a path.
"""

from __future__ import annotations

import dataclasses
import errno
import hmac
import os
import socket
import threading
import time

import jax
import sqlalchemy as sa
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    Response,
    StreamingResponse,
)
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from engine.run import runtime
from engine.run.errors import GenerationError, fail, first_line
from engine.serve import hosts, uploads, webhooks
from engine.serve import jobs as store_rows
from engine.serve import model as warm
from engine.serve import requests as checks
from engine.serve.fleet import Fleet
from engine.serve.jobs import CANCEL_AND_DELETE, ID_PATTERN, Job, JobStore, new_id
from engine.serve.metrics import Metrics
from engine.serve.requests import MAX_UPLOAD_BYTES, ApiError, refuse
from engine.serve.storage import SharedFolder, Storage
from engine.serve.worker import Worker, video_name

PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static", "index.html")
# A streamed job's fields in its video object (``Job.stream``).
STREAM_FIELDS = ("chunks_done", "seconds_generated", "first_chunk_seconds", "codecs")
# How often ``GET .../content`` of a running streamed job looks for new bytes and the end.
STREAM_POLL_S = 0.1
# Seconds a client is asked to wait (``Retry-After``) when the job store does not answer:
# a database restart or failover takes seconds to tens of seconds.
STORE_RETRY_AFTER_S = 5


@dataclasses.dataclass
class State:
    """What the handlers share: the job store, the files' storage, this server among the
    store's servers (``fleet``), the worker's wake-up, the key, and the model once it is
    ready (``served`` None while loading)."""

    store: JobStore
    storage: Storage
    fleet: Fleet
    api_key: str | None
    wake: threading.Event
    served: warm.Served | None = None
    ready: dict | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)
    metrics: Metrics | None = None
    webhooks: webhooks.Webhooks | None = None
    retention_s: float | None = None  # --retention_hours in seconds


def video_object(job: Job, queue_position: int | None = None,
                 retention_s: float | None = None) -> dict:
    """A job as OpenAI's ``video`` object, with the extension fields, ``queue_position``
    (jobs ahead of a queued one; None otherwise), ``expires_at`` (an ended job's
    ``completed_at`` + ``retention_s``; None without a retention), the timings and the
    files of a finished job, its sound's ``audio_sample_rate`` (Hz), ``audio_channels`` and
    ``audio_seconds`` (a model with sound; the CLI report's fields), ``steps_done`` of a
    cancelled one, and, for a job whose model streams its video chunk by chunk, from its
    first chunk on: ``chunks_done``, ``seconds_generated`` (seconds of video written) and
    ``first_chunk_seconds`` (from the job's start on its server to the first chunk in the
    file) and ``codecs`` (the RFC 6381 codec string of its mp4, for a Media Source
    player); ``GET .../content`` serves such a job's mp4 while it runs."""
    expires_at = None if retention_s is None or job.completed_at is None else \
        int(job.completed_at + retention_s)
    s = job.settings
    out = dict(id=job.id, object="video", status=job.status, progress=job.progress,
               created_at=job.created_at, completed_at=job.completed_at,
               expires_at=expires_at, error=None, model=s.model, prompt=s.prompt,
               seconds=s.seconds, size=s.size, remixed_from_video_id=None,
               queue_position=queue_position,
               **{k: getattr(s, k) for k in ("negative_prompt", "num_frames",
                                             "num_inference_steps", "guidance_scale",
                                             "guidance_scale_2", "seed", "fps")})
    image = s.input_reference
    out["input_reference"] = None if image is None else dict(
        format=image.format, width=image.width, height=image.height, sha256=image.sha256)
    if job.error:
        out["error"] = dict(code="generation_failed", message=job.error)
    if job.result:
        out.update(timings=job.result["timings"], files=job.result["files"])
        out.update({k: v for k, v in job.result.items() if k.startswith("audio_")})
        if "steps_done" in job.result:
            out["steps_done"] = job.result["steps_done"]
    if job.stream:
        out.update({k: job.stream[k] for k in STREAM_FIELDS})
    return out


def notify(state: State, job_id: str) -> None:
    """A job has ended: its webhook, if any, is already in the store's outbox (written with
    its end); the delivery thread looks now (``engine.serve.webhooks``)."""
    if state.webhooks is not None:
        state.webhooks.wake()


def create_app(state: State) -> FastAPI:
    """The app; ``state.served`` may still be None (loading: /health says 503)."""
    app = FastAPI(title="generate_flax.py --serve", docs_url=None, redoc_url=None,
                  redirect_slashes=False)  # a URL is exactly one route, never a redirect
    _errors(app)

    def key(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                           None, "invalid_api_key")

    def job_or_404(video_id: str) -> Job:
        job = state.store.get(video_id) if ID_PATTERN.fullmatch(video_id) else None
        if job is None:
            raise ApiError(404, f"video_id={video_id!r}: no such video", "video_id",
                           "not_found")
        return job

    _status_routes(app, state, Depends(key))

    @app.post("/v1/videos", dependencies=[Depends(key)])
    async def create(request: Request):
        if state.served is None:
            raise ApiError(503, "the model is loading; GET /health says when it is ready",
                           None, "loading", "server_error")
        fields, image, name = await _read_body(request)
        info = None if image is None else uploads.check(image, name)
        req = checks.parse(fields)
        served, live = state.fleet.view(state.served)  # every live server's buckets
        settings = checks.check(req, served, info)
        if store_rows.job_bucket(settings) not in live:
            refuse("size", settings.size, f"no live server runs {settings.size} at "
                   f"{settings.num_frames} frames; live buckets: "
                   f"{', '.join(sorted(k.rsplit(':', 1)[1] for k in live))}")
        if req.callback_url is not None:  # resolving its host blocks: off the event loop
            settings = dataclasses.replace(settings, callback_url=await run_in_threadpool(
                state.webhooks.check, req.callback_url))
        job_id = new_id()
        if info is not None:  # on disk before the job is committed: a restart finds it
            settings = dataclasses.replace(settings, input_reference=checks.InputReference(
                **info, file=uploads.save(state.storage.folder, job_id, image, info)))
        try:
            job = state.store.add(settings, job_id)
        except sa.exc.SQLAlchemyError:  # not accepted (503): no orphaned image file
            if info is not None:
                uploads.remove(state.storage.folder, settings)
            raise
        state.wake.set()
        return video_object(job, state.store.queue_position(job), state.retention_s)

    @app.get("/v1/videos", dependencies=[Depends(key)])
    def listing(after: str | None = None, limit: int = 20, order: str = "desc"):
        if not 1 <= limit <= 100:
            refuse("limit", limit, "must be in 1..100")
        if order not in ("asc", "desc"):
            refuse("order", order, "must be 'asc' or 'desc'")
        if after is not None:
            job_or_404(after)
        jobs, more = state.store.page(after=after, limit=limit, order=order)
        data = [video_object(j, state.store.queue_position(j), state.retention_s) for j in jobs]
        return dict(object="list", data=data, has_more=more,
                    first_id=data[0]["id"] if data else None,
                    last_id=data[-1]["id"] if data else None)

    _video_routes(app, state, Depends(key), job_or_404)
    return app


def _status_routes(app: FastAPI, state: State, key) -> None:
    """The web page, ``/health`` (no key: load balancers probe it), ``/metrics`` and
    ``/v1/models``."""
    @app.get("/", response_class=HTMLResponse)
    def page():
        with open(PAGE, encoding="utf-8") as f:
            return f.read()

    @app.get("/health")
    def health():
        # One read: the loading thread may set ``served`` while the counts below query the
        # store, and the body and status code must agree (a 200 "loading" was seen in CI).
        ready = state.served is not None
        body = dict(status="ready" if ready else "loading",
                    queued=state.store.count("queued"),
                    in_progress=state.store.count("in_progress"),
                    server_id=state.fleet.id, jobs_db=state.store.url,
                    time_to_ready=state.ready,
                    seconds_up=time.perf_counter() - state.started)
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    def metrics():  # no key, as /health: scrapers read it; counts only, no prompts
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=[key])
    def models():
        served = state.served  # one read, as /health
        return dict(object="list", data=[state.fleet.describe(served)] if served else [])


def _video_routes(app: FastAPI, state: State, key, job_or_404) -> None:
    """GET, cancel and DELETE of one video, and its mp4."""
    @app.get("/v1/videos/{video_id}", dependencies=[key])
    def retrieve(video_id: str):
        job = job_or_404(video_id)
        return video_object(job, state.store.queue_position(job), state.retention_s)

    @app.post("/v1/videos/{video_id}/cancel", dependencies=[key])
    def cancel(video_id: str):
        """A queued job never starts; a running one stops at its next denoising step
        boundary (on every process), writes no file and becomes ``cancelled`` (one that
        streams chunks finishes the chunk it is making and keeps its whole chunks:
        ``Worker._on_step``)."""
        job_or_404(video_id)
        was = state.store.cancel(video_id)
        if was is None:
            job = state.store.get(video_id)
            raise ApiError(409, f"video_id={video_id!r}: is {job.status}; only a queued or "
                           "running job can be cancelled", "video_id", "not_cancellable")
        if was == "queued":  # ended here; a running job's end is the worker's to announce
            notify(state, video_id)
        return video_object(state.store.get(video_id), None, state.retention_s)

    @app.get("/v1/videos/{video_id}/content", dependencies=[key])
    def content(video_id: str, variant: str = "video"):
        """The mp4 of a completed job (or of a cancelled one that kept its streamed
        chunks); of a running job that streams, the file as it grows (chunked transfer,
        ending when the job ends)."""
        job = job_or_404(video_id)
        if variant != "video":
            refuse("variant", variant, "only 'video' (the mp4) is served")
        growing = _open_stream(state, job)
        if growing is not None:
            return StreamingResponse(_follow(state, job, growing), media_type="video/mp4",
                                     headers={"Cache-Control": "no-store"})
        if job.status == "in_progress" and job.stream:  # it ended meanwhile: how, the row says
            job = job_or_404(video_id)
        kept = job.status == "cancelled" and (job.result or {}).get("files")
        if job.status != "completed" and not kept:
            raise ApiError(409, f"video_id={video_id!r}: is {job.status}, not completed",
                           "video_id", "not_ready")
        name = video_name(video_id)
        if not state.storage.exists(name):  # ran on a server whose --output_dir is not ours
            raise ApiError(500, f"video_id={video_id!r}: completed, but {name} is not in this "
                           "server's --output_dir; servers sharing --jobs_db must share "
                           "--output_dir", "video_id", "file_missing", "server_error")
        return FileResponse(state.storage.path(name), media_type="video/mp4")

    @app.delete("/v1/videos/{video_id}", dependencies=[key])
    def delete(video_id: str):
        """Delete a job and its files; a running job is cancelled first (it stops at its
        next step boundary and the worker then removes it)."""
        job = job_or_404(video_id)
        if not state.store.delete(video_id):
            if state.store.cancel(video_id, CANCEL_AND_DELETE) == "in_progress":
                return dict(id=video_id, object="video.deleted", deleted=True)
            job = job_or_404(video_id)  # it ended meanwhile: an ordinary delete
            state.store.delete(video_id)
        image = job.settings.input_reference
        for name in [*(job.result or {}).get("files", []), *([image.file] if image else [])]:
            state.storage.remove(name)
        return dict(id=video_id, object="video.deleted", deleted=True)


def _open_stream(state: State, job: Job):
    """A running streamed job's mp4, open for reading: the growing file, or the finished
    one it was just renamed to (the job's end is being recorded); None for any other job,
    or one whose file went with its end (failed, deleted).

    Raises:
        ApiError: 500 when the job still runs but neither file is in this server's
            --output_dir (it runs on a server whose folder is not ours).
    """
    if job.status != "in_progress" or not job.stream:
        return None
    for name in (job.stream["file"], video_name(job.id)):
        try:
            return open(state.storage.path(name), "rb")  # noqa: SIM115 - the response's
        except FileNotFoundError:
            pass
    now = state.store.get(job.id)
    if now is not None and now.status == "in_progress":
        raise ApiError(500, f"video_id={job.id!r}: streaming, but {job.stream['file']} is "
                       "not in this server's --output_dir; servers sharing --jobs_db must "
                       "share --output_dir", "video_id", "file_missing", "server_error")
    return None


def _follow(state: State, job: Job, f, block: int = 1 << 16):
    """The bytes of a running job's streamed mp4 (``f``, open) as the worker appends them
    (whole chunks are whole fragments: ``engine.files.stream_writer``), until the job has
    ended and every byte is sent; closes ``f``. The writer appends before it records the
    end, and the open file stays readable through its rename (or removal, on a failure)
    on POSIX: once the job has ended, what is left to read is the rest."""
    with f:
        while True:
            data = f.read(block)
            if data:
                yield data
                continue
            try:
                now = state.store.get(job.id)
            except sa.exc.SQLAlchemyError:  # the store is away: the file may still grow
                now = job
            # Ended, or run again from the start elsewhere (a lease passed: a new file)
            if now is None or now.status != "in_progress" or \
                    (now.stream or {}).get("file") != job.stream["file"]:
                while data := f.read(block):
                    yield data
                return
            time.sleep(STREAM_POLL_S)


def _errors(app: FastAPI) -> None:
    """Every error in OpenAI's shape."""

    @app.exception_handler(ApiError)
    async def api_error(_, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(sa.exc.SQLAlchemyError)
    async def store_away(_, e: sa.exc.SQLAlchemyError):
        # Nothing was accepted (a create commits its job before answering): the client may
        # send the same request again after Retry-After.
        return JSONResponse(ApiError(503, f"the job store did not answer "
                                     f"({first_line(getattr(e, 'orig', None) or e)}); retry "
                                     f"after {STORE_RETRY_AFTER_S} s", None,
                                     "store_unavailable", "server_error").body(), 503,
                            headers={"Retry-After": str(STORE_RETRY_AFTER_S)})

    @app.exception_handler(RequestValidationError)
    async def bad_query(_, e: RequestValidationError):
        err = e.errors()[0]
        field = str(err["loc"][-1])
        return JSONResponse(ApiError(400, f"{field}={err.get('input')!r}: "
                                          f"{err['msg'].lower()}", field).body(), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(ApiError(e.status_code, f"{request.method} {request.url.path}: "
                                     f"{e.detail}", None, "not_found").body(), e.status_code)


async def _read_body(request: Request) -> tuple[dict, bytes | None, str | None]:
    """The request's fields from JSON or a form (multipart or urlencoded), and its
    ``input_reference`` image as (bytes, name) or (None, None): a multipart file, or in JSON
    a reference object (``engine.serve.uploads``).

    Raises:
        ApiError: 413 over ``MAX_UPLOAD_BYTES``; 400 for a body that is neither, and for an
            ``input_reference`` in another shape.
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_UPLOAD_BYTES:
        refuse("input_reference", f"{int(length)} bytes", f"a request must be at most "
               f"{MAX_UPLOAD_BYTES} bytes", 413, "too_large")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind == "application/json":
        try:
            fields = await request.json()
        except ValueError as e:
            refuse("body", first_line(e), "not valid JSON")
        if not isinstance(fields, dict):
            refuse("body", type(fields).__name__, "expected a JSON object")
        if "input_reference" not in fields:
            return fields, None, None
        ref = fields.pop("input_reference")
        return fields, uploads.from_reference(ref), "(image_url)"
    if kind not in ("multipart/form-data", "application/x-www-form-urlencoded"):
        refuse("Content-Type", kind, "expected application/json or multipart/form-data")
    form = await request.form(max_files=1, max_fields=32)
    fields = {k: v for k, v in form.multi_items() if isinstance(v, str)}
    upload = fields.pop("input_reference", None) or form.get("input_reference")
    if isinstance(upload, str):
        refuse("input_reference", upload[:40], "a string is not an image; send a file field, "
               "or JSON {\"image_url\": \"data:image/png;base64,...\"}")
    if upload is None:
        return fields, None, None
    data = await upload.read(MAX_UPLOAD_BYTES + 1)
    if len(data) > MAX_UPLOAD_BYTES:
        refuse("input_reference", upload.filename, f"at most {MAX_UPLOAD_BYTES} bytes",
               413, "too_large")
    return fields, data, upload.filename


def serve(config, family) -> int:
    """``generate_flax.py --serve``: on process 0, the HTTP server at once (``/health``
    says 503 "loading") while the model loads, compiles and warms up in a thread, which
    then runs the jobs; on every other process, the same model and the jobs process 0
    hands over. Returns 0 when stopped (Ctrl-C, SIGTERM).

    Raises:
        UsageError, GenerationError: the build failed, or a job failure must end the
            server (multi-host disagreement, a lost process); one line, as the CLI.
    """
    import uvicorn

    if runtime.in_multi_process_run():  # a peer's death: one line, not JAX's fatal log
        hosts.filter_stderr(runtime.process_index())
    if runtime.in_multi_process_run() and not runtime.is_writer():
        model = warm.build(config, family)
        hosts.follow(model.run, runtime.process_index())
        return 0
    s = config.serve
    _check_listen(s.host, s.port)
    store = open_store(config)
    recovered = store.recover()
    state = State(store=store, storage=SharedFolder(config.run.output_dir),
                  fleet=Fleet(store, f"{socket.gethostname()}:{s.port}"), api_key=s.api_key,
                  wake=threading.Event(), retention_s=s.retention_s)
    state.metrics = Metrics(state)
    state.webhooks = webhooks.Webhooks(store, s.webhook_secret, owner=state.fleet.id,
                                       allow_private=s.webhook_allow_private)
    server = uvicorn.Server(uvicorn.Config(create_app(state), host=s.host, port=s.port,
                                           log_level="warning", access_log=False))
    failure: list = []
    worker: list = []

    def on_fatal(error) -> None:
        failure.append(error)
        server.should_exit = True

    thread = threading.Thread(target=_load_and_work, daemon=True,
                              args=(config, family, state, on_fatal, worker))
    print(f"serving http://{s.host}:{s.port} (loading; jobs in {store.url}"
          f"{', shared' if store.shared else ''}; {len(recovered['requeued'])} jobs "
          f"re-queued, {len(recovered['removed'])} partial files removed)", flush=True)
    thread.start()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the signal once it has shut down
        pass
    except SystemExit as e:  # uvicorn's own startup failure (its exit code 3 means no fit here)
        raise GenerationError(f"the HTTP server on {s.host}:{s.port} failed to start "
                              f"(uvicorn exit {e.code})") from None
    if worker:
        worker[0].stop()
        thread.join(timeout=10)
    state.fleet.leave()
    store.close()
    if failure:
        raise failure[0] if isinstance(failure[0], Exception) else GenerationError(failure[0])
    return 0


def open_store(config) -> JobStore:
    """The job store of ``--jobs_db`` (default: SQLite in --output_dir), reached before any
    model loads.

    Raises:
        UsageError: the database cannot be reached or refused the schema (one line naming
            --jobs_db, the URL with its password masked, and the driver's reason).
    """
    s = config.serve
    try:
        return JobStore(config.run.output_dir, s.jobs_db, s.lease_s,  # renders webhooks
                        render=lambda job: video_object(job, None, s.retention_s))
    except sa.exc.SQLAlchemyError as e:
        shown = "the SQLite file in --output_dir" if s.jobs_db is None else \
            store_rows.masked(s.jobs_db)
        reason = first_line(getattr(e, "orig", None) or e)
        fail("--jobs_db", shown, f"cannot open the job store ({reason})")


def _check_listen(host: str, port: int) -> None:
    """Refuse an address uvicorn could not bind, before any model loads.

    Raises:
        UsageError: naming --port (or --host) and the system's reason.
    """
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            sock.bind((host, port))
    except OSError as e:
        fail("--port" if e.errno == errno.EADDRINUSE else "--host", port if
             e.errno == errno.EADDRINUSE else host,
             f"cannot listen on {host}:{port} ({e.strerror or e})")


def _load_and_work(config, family, state: State, on_fatal, worker: list) -> None:
    """The thread behind the server: build the warm model, say ready, run jobs."""
    try:
        model = warm.build(config, family)
    except Exception as e:
        on_fatal(e if not isinstance(e, KeyboardInterrupt) else GenerationError("interrupted"))
        return
    t = dict(model.timings, ready_s=time.perf_counter() - state.started)
    state.ready = t
    handoff = hosts.HandOff(jax.process_count()) if runtime.in_multi_process_run() else None
    w = Worker(state.store, model, on_fatal, handoff, state.metrics, state.retention_s,
               on_ended=lambda job_id: notify(state, job_id), fleet=state.fleet,
               storage=state.storage)
    w.wake = state.wake
    worker.append(w)
    state.fleet.join(model.served, list(model.buckets))
    state.served = model.served
    cache, split = t["compilation_cache"] or {}, t["split"]
    print(f"ready in {t['ready_s']:.1f} s ({split['total_s']:.1f} s from the process start: "
          + ", ".join(f"{k[:-2].replace('_', ' ')} {v:.1f} s" for k, v in split.items()
                      if k != "total_s" and v >= 0.05)
          + f") over {len(model.buckets)} buckets ({', '.join(model.buckets)}); programs "
          f"{t['programs_compiled']} compiled, {t['programs_loaded']} loaded; compilation "
          f"cache {cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses", flush=True)
    w.loop()
