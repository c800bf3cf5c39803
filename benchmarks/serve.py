"""The server on CPU: time-to-ready (cold and warm compilation cache), throughput and p50/p95
latency for N concurrent clients, and its overhead against the CLI's steady state.

Builds the tiny Wan checkpoint, then:

1. starts ``generate_flax.py --serve`` with an empty persistent compilation cache (cold), and
   again on the same cache (warm); each start's wall time to ``/health`` 200 and the
   server's own split (load, compile, warmup);
2. for each client count N: N threads each submit ``--jobs`` videos one after another
   (``POST /v1/videos``, poll ``GET /v1/videos/{id}`` every 20 ms, then download the mp4);
   latency is submit to downloaded, throughput is videos / wall second;
3. the CLI on the same video (``--num_iterations`` timed runs after its warmup): its
   steady-state seconds per video against the server's one-client latency, as a ratio;
4. with ``--postgres URL`` (a server the benchmark may create databases on), the job store's
   rows: one server on SQLite, one on PostgreSQL (the store's overhead per job), and two
   servers sharing PostgreSQL (clients alternate between them), each under the same client
   loads.

CPU figures on this host (JAX's CPU backend, float32, one device, the tiny checkpoint): they
measure the server's own overhead (HTTP, SQLite, polling, mp4 writing, the prompt encode per
job) against a tiny model's generation, which a TPU model's minutes per video dwarf; they are
not TPU figures.

    python benchmarks/serve.py                     # 96x64x9, 4 steps, clients 1 and 4
    python benchmarks/serve.py --clients 1,2,6 --jobs 6
    eval "$(tools/postgres.sh start)"
    python benchmarks/serve.py --postgres "$GENERATE_FLAX_TEST_POSTGRES" --fleet_only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx2
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from serve_util import Server, create_database, env  # noqa: E402  (tests/serve_util.py: start and wait)


def _shape(args) -> list[str]:
    return ["--width", str(args.width), "--height", str(args.height), "--frames",
            str(args.frames), "--num_inference_steps", str(args.steps), "--dtype", "float32",
            "--attention", "xla"]


def time_to_ready(checkpoint, root, args, cache) -> dict:
    server = Server(["--model_id", checkpoint, *_shape(args), "--compilation_cache_dir",
                     cache], os.path.join(root, f"out-{time.monotonic_ns()}"))
    t0 = time.perf_counter()
    server.start()
    health = server.wait_ready()
    wall = time.perf_counter() - t0
    server.stop()
    t = health["time_to_ready"]
    return dict(wall_s=wall, load_s=t["load_s"], compile_s=t["compile_s"],
                warmup_s=t["warmup_s"], ready_s=t["ready_s"],
                cache=t["compilation_cache"])


def one_video(client: httpx2.Client, seed: int, outside: list | None = None) -> float:
    """Submit, poll every 20 ms, download: the latency in seconds. ``outside`` gets the part
    of it not spent denoising and decoding (HTTP, queue, store, prompt encode, write)."""
    t0 = time.perf_counter()
    video_id = client.post("/v1/videos", json={"prompt": "a red fox", "seed": seed}).json()["id"]
    while (job := client.get(f"/v1/videos/{video_id}").json())["status"] not in (
            "completed", "failed"):
        time.sleep(0.02)
    assert job["status"] == "completed", job
    assert client.get(f"/v1/videos/{video_id}/content").content[4:8] == b"ftyp"
    latency = time.perf_counter() - t0
    if outside is not None:
        outside.append(latency - job["timings"]["denoise_s"] - job["timings"]["vae_decode_s"])
    return latency


def load(server, clients: int, jobs: int) -> dict:
    """``clients`` threads, each sending ``jobs`` videos one after another to ``server``
    (a list of servers: client k uses server k mod n)."""
    servers = server if isinstance(server, list) else [server]
    latencies, outside, lock = [], [], threading.Lock()

    def run(k):
        with httpx2.Client(base_url=servers[k % len(servers)].url, timeout=600) as c:
            for j in range(jobs):
                s = one_video(c, 1000 * k + j, outside)
                with lock:
                    latencies.append(s)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=20, method="inclusive")
    return dict(clients=clients, videos=len(latencies), wall_s=wall,
                videos_per_s=len(latencies) / wall, p50_s=statistics.median(latencies),
                p95_s=q[18], outside_p50_s=statistics.median(outside))


def rss_over_jobs(server: Server, jobs: int, every: int = 10) -> dict:
    """The server process's resident memory (psutil, bytes) after each ``every`` of ``jobs``
    one-client videos. The first sample is taken after ``every`` jobs, so the first jobs'
    one-time allocations (allocator pools, the first mp4 write) are not counted as growth;
    drift is (last - first) / first."""
    proc = psutil.Process(server.proc.pid)
    samples = []
    with httpx2.Client(base_url=server.url, timeout=600) as c:
        for j in range(1, jobs + 1):
            one_video(c, 5000 + j)
            if j % every == 0:
                samples.append(proc.memory_info().rss)
    return dict(jobs=jobs, every=every, first_mib=samples[0] / 2**20,
                last_mib=samples[-1] / 2**20, max_mib=max(samples) / 2**20,
                drift=(samples[-1] - samples[0]) / samples[0],
                samples_mib=[round(x / 2**20, 1) for x in samples])


def cli_steady(checkpoint, root, args) -> float:
    out = os.path.join(root, "cli")
    subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id",
                    checkpoint, *_shape(args), "--prompt", "a red fox", "--num_iterations",
                    str(args.iterations), "--output_dir", out, "--no_plots",
                    "--compilation_cache_dir", "none"], check=True, capture_output=True,
                   env=env(1), cwd=ROOT)
    (report,) = [f for f in os.listdir(out) if f.endswith(".json")]
    with open(os.path.join(out, report)) as f:
        return json.load(f)["timings"]["steady_mean_s"]


def postgres_rss(checkpoint, root, args, cache, postgres: str) -> dict:
    """``rss_over_jobs`` on a server whose jobs live in PostgreSQL."""
    server = Server(["--model_id", checkpoint, *_shape(args), "--compilation_cache_dir", cache,
                     "--jobs_db", create_database(postgres, "bench")],
                    os.path.join(root, "out-rss-pg"), log=os.path.join(root, "rss-pg.log")).start()
    try:
        server.wait_ready()
        one_video(httpx2.Client(base_url=server.url, timeout=600), 0)
        return rss_over_jobs(server, args.rss_jobs)
    finally:
        server.stop()


def fleet_rows(checkpoint, root, args, cache, postgres: str) -> list[dict]:
    """Throughput and latency per client load for: one server on SQLite, one on PostgreSQL,
    two sharing PostgreSQL (a new database per row, created on the ``postgres`` server), then
    SQLite again: a drift check, since other work on the host changes every row's speed."""
    rows = []
    for label, n, pg in (("1 server, SQLite", 1, False), ("1 server, PostgreSQL", 1, True),
                         ("2 servers, one PostgreSQL", 2, True),
                         ("1 server, SQLite (again)", 1, False)):
        url = create_database(postgres, "bench") if pg else None
        out = os.path.join(root, f"out-{len(rows)}")
        servers = [Server(["--model_id", checkpoint, *_shape(args), "--compilation_cache_dir",
                           cache, *(["--jobs_db", url] if url else [])], out,
                          log=os.path.join(root, f"row{len(rows)}-{k}.log")).start()
                   for k in range(n)]
        try:
            for server in servers:
                server.wait_ready()
                one_video(httpx2.Client(base_url=server.url, timeout=600), 0)  # first job
            rows += [dict(row=label, **load(servers, int(c), args.jobs))
                     for c in args.clients.split(",")]
        finally:
            for server in servers:
                server.stop()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--frames", type=int, default=9)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--clients", default="1,4")
    p.add_argument("--jobs", type=int, default=4, help="videos per client")
    p.add_argument("--iterations", type=int, default=4, help="CLI timed runs")
    p.add_argument("--rss_jobs", type=int, default=0,
                   help="also run this many one-client videos and sample the server's RSS "
                        "every 10 (e.g. 200; default: skip)")
    p.add_argument("--postgres", default=None,
                   help="a PostgreSQL URL to create databases on: adds the job store's rows "
                        "(SQLite against PostgreSQL, one server against two)")
    p.add_argument("--fleet_only", action="store_true",
                   help="with --postgres, only the job store's rows")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="serve-bench-")
    checkpoint = os.path.join(root, "tiny-wan")
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tiny_checkpoint.py"),
                    "--output", checkpoint], check=True, capture_output=True, env=env(1))
    cache = os.path.join(root, "jax-cache")
    out = dict(host="CPU (JAX CPU backend, 1 device), tiny Wan checkpoint",
               shape=f"{args.width}x{args.height}x{args.frames}, {args.steps} steps")
    if args.postgres:
        out["fleet"] = fleet_rows(checkpoint, root, args, cache, args.postgres)
        if args.rss_jobs:
            out["rss_postgres"] = postgres_rss(checkpoint, root, args, cache, args.postgres)
        if args.fleet_only:
            print(json.dumps(out, indent=2))
            return 0
    out["cold"] = time_to_ready(checkpoint, root, args, cache)
    out["warm"] = time_to_ready(checkpoint, root, args, cache)
    server = Server(["--model_id", checkpoint, *_shape(args), "--compilation_cache_dir",
                     cache], os.path.join(root, "out-load")).start()
    server.wait_ready()
    try:
        one_video(httpx2.Client(base_url=server.url, timeout=600), 0)  # first-job effects
        out["load"] = [load(server, int(n), args.jobs) for n in args.clients.split(",")]
        if args.rss_jobs:
            out["rss"] = rss_over_jobs(server, args.rss_jobs)
    finally:
        server.stop()
    steady = cli_steady(checkpoint, root, args)
    one = next(r for r in out["load"] if r["clients"] == 1) if any(
        r["clients"] == 1 for r in out["load"]) else out["load"][0]
    out["overhead"] = dict(cli_steady_s=steady, server_p50_s=one["p50_s"],
                           ratio=one["p50_s"] / steady)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
