"""``GET /metrics``: the server's state in Prometheus' text exposition format, through
``prometheus-client`` (its own registry per server, so nothing global is shared).

What operators scale and alert on (vLLM-Omni and SGLang expose the same kinds of signals):
- ``video_jobs{status}``: jobs in the store by status, read at scrape time;
- ``video_jobs_running`` / ``video_jobs_waiting``: the gauges to autoscale on;
- ``video_jobs_finished_total{status}``: jobs this server's worker ended (completed, failed,
  cancelled);
- histograms, in seconds: ``video_queue_wait_seconds`` (created to started),
  ``video_denoise_seconds``, ``video_vae_decode_seconds``, ``video_job_seconds`` (created to
  ended), ``video_step_seconds`` (each denoising step);
- ``video_compilation_cache_events{event}``: the persistent cache's hits and misses while
  the server got ready;
- ``video_device_memory_bytes{device, kind}``: bytes in use and the limit per local device,
  where the backend reports them (GPU, TPU; the CPU reports none).
"""

from __future__ import annotations

import jax
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engine.serve.jobs import STATUSES

# Bucket edges in seconds: from a tiny CPU job's fraction of a second to a 720p video's
# tens of minutes.
SECONDS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)


class _StoreAndDevices:
    """Gauges read at scrape time: the store's counts, the cache, device memory."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        jobs = GaugeMetricFamily("video_jobs", "jobs in the store by status", labels=["status"])
        counts = {s: self.state.store.count(s) for s in STATUSES}
        for status, n in counts.items():
            jobs.add_metric([status], n)
        yield jobs
        yield GaugeMetricFamily("video_jobs_running", "jobs running now",
                                value=counts["in_progress"])
        yield GaugeMetricFamily("video_jobs_waiting", "jobs queued", value=counts["queued"])
        cache = (self.state.ready or {}).get("compilation_cache") or {}
        events = GaugeMetricFamily("video_compilation_cache_events", "persistent compilation "
                                   "cache events while getting ready", labels=["event"])
        for event in ("hits", "misses"):
            if event in cache:
                events.add_metric([event], cache[event])
        yield events
        yield _device_memory()


def _device_memory() -> GaugeMetricFamily:
    out = GaugeMetricFamily("video_device_memory_bytes", "device memory per local device, "
                            "where the backend reports it", labels=["device", "kind"])
    for device in jax.local_devices():
        stats = device.memory_stats() or {}
        for kind in ("bytes_in_use", "bytes_limit", "peak_bytes_in_use"):
            if kind in stats:
                out.add_metric([str(device.id), kind], stats[kind])
    return out


class Metrics:
    """The server's registry; ``job_ended`` records one job the worker finished."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        self.registry.register(_StoreAndDevices(state))
        r = self.registry
        self.finished = Counter("video_jobs_finished", "jobs the worker ended, by status",
                                ["status"], registry=r)
        self.queue_wait = Histogram("video_queue_wait_seconds", "created to started",
                                    buckets=SECONDS, registry=r)
        self.denoise = Histogram("video_denoise_seconds", "a job's denoising loop",
                                 buckets=SECONDS, registry=r)
        self.decode = Histogram("video_vae_decode_seconds", "a job's VAE decode",
                                buckets=SECONDS, registry=r)
        self.job = Histogram("video_job_seconds", "created to ended", buckets=SECONDS,
                             registry=r)
        self.step = Histogram("video_step_seconds", "one denoising step", buckets=SECONDS,
                              registry=r)

    def job_ended(self, status: str, *, queue_wait_s: float, total_s: float,
                  timings: dict) -> None:
        """One job ended with ``status`` (completed, failed, cancelled); ``timings`` is the
        job's timings (empty unless it completed)."""
        self.finished.labels(status).inc()
        self.queue_wait.observe(queue_wait_s)
        self.job.observe(total_s)
        if "denoise_s" in timings:
            self.denoise.observe(timings["denoise_s"])
        if "vae_decode_s" in timings:
            self.decode.observe(timings["vae_decode_s"])
        for seconds in timings.get("step_seconds", ()):
            self.step.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
