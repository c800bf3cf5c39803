"""Helpers of the server tests (tests/test_serve*.py): start ``generate_flax.py --serve`` as
a real process, wait for /health, read the frames the server and the CLI wrote."""

from __future__ import annotations

import base64
import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import httpx2
import psycopg
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "generate_flax.py")
KEY = "test-key-36"
# The servers' --webhook_secret (Standard Webhooks: "whsec_" + base64 of 32 bytes).
WEBHOOK_SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
# The served shape and settings: small enough that a job takes well under a second on CPU.
SHAPE = ["--height", "64", "--width", "64", "--frames", "5"]
SETTINGS = [*SHAPE, "--num_inference_steps", "2", "--warmup_steps", "1", "--dtype", "float32",
            "--attention", "xla", "--save_frames"]
PROMPT = "a red fox in the snow"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# XLA's CPU backend at LLVM -O0 and without its expensive passes: the tests' tiny programs
# compile about a quarter faster (tests/test_sharding.py's frame tests: 82 s against 107 s on
# the 2-core host), and every comparison is between runs compiled alike or against an eager
# reference at a stated tolerance. libtpu's deviceless compiles ignore them (the same static
# profile with and without: benchmarks/elementwise_cycles.py).
FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def cpu_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's CPU subprocess: ``devices`` host devices, compiled fast."""
    return f"--xla_force_host_platform_device_count={devices} {FAST_CPU_COMPILE}"


def env(devices: int = 1, **extra) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_xla_flags(devices), **extra)


class Server:
    """A ``generate_flax.py --serve`` process; its log goes to ``log``."""

    def __init__(self, argv, out, *, port=None, environ=None, log=None, err=None):
        self.port = port or free_port()
        self.err = err  # stderr's own file (default: with stdout in ``log``)
        self.url = f"http://127.0.0.1:{self.port}"
        self.out = str(out)
        self.log = str(log or f"{out}.server.log")
        self.argv = [sys.executable, SCRIPT, "--serve", *argv, "--output_dir", self.out,
                     "--port", str(self.port)]
        self.env = environ or env()
        self.proc = None

    def start(self) -> Server:
        with open(self.log, "ab") as log, open(self.err or os.devnull, "ab") as err:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=err if self.err
                                         else subprocess.STDOUT, env=self.env, cwd=ROOT)
        return self

    def wait_ready(self, timeout: float = 300) -> dict:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited {self.proc.returncode}: {self.tail()}")
            try:
                r = httpx2.get(self.url + "/health", timeout=5)
                if r.status_code == 200:
                    return r.json()
                assert r.status_code == 503 and r.json()["status"] == "loading", r.text
            except httpx2.TransportError:
                pass
            time.sleep(0.5)
        raise AssertionError(f"server not ready after {timeout} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-n:]

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def client(self, key: str | None = KEY) -> httpx2.Client:
        return httpx2.Client(base_url=self.url, timeout=60,
                            headers={"Authorization": f"Bearer {key}"} if key else {})


def wait_done(client: httpx2.Client, ids, timeout: float = 180) -> dict:
    """{id: video object} once every job in ``ids`` is completed or failed."""
    t0, done = time.monotonic(), {}
    while time.monotonic() - t0 < timeout:
        for i in set(ids) - set(done):
            job = client.get(f"/v1/videos/{i}").json()
            if job["status"] in ("completed", "failed"):
                done[i] = job
        if len(done) == len(set(ids)):
            return done
        time.sleep(0.3)
    raise AssertionError(f"jobs not done after {timeout} s: {set(ids) - set(done)}")


def wait_for(client: httpx2.Client, video_id: str, test, timeout: float = 60.0) -> dict:
    """The video object once ``test(it)`` holds, polled every 50 ms."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        job = client.get(f"/v1/videos/{video_id}").json()
        if test(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"{video_id}: condition not met in {timeout} s: {job}")


def server_frames(out, video_id: str):
    return load_file(os.path.join(str(out), f"{video_id}.frames.safetensors"))["frames"]


def cli_frames(checkpoint: str, out, seeds, *flags, devices: int = 1, prompt: str = PROMPT):
    """Start the CLI (``--seeds``, one compile for all) in the background; ``result()`` of
    the returned object waits and gives {seed: (F, H, W, 3) frames}."""
    argv = [sys.executable, SCRIPT, "--model_id", checkpoint, *SETTINGS, *flags,
            "--prompt", prompt, "--seeds", ",".join(map(str, seeds)), "--output_dir",
            str(out), "--no_plots", "--compilation_cache_dir", "none"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env(devices), cwd=ROOT)

    class Pending:
        @staticmethod
        def result() -> dict:
            log, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, log[-3000:]
            frames = {}
            for seed in seeds:
                (path,) = glob.glob(os.path.join(str(out), f"*_seed{seed}.frames.safetensors"))
                frames[seed] = load_file(path)["frames"]
            return frames

    return Pending


def chromium():
    """Headless Chromium (Debian's ``chromium`` and ``chromium-driver``, the driver's path
    given, so selenium downloads nothing); skips without them, except under CI."""
    import pytest

    if not os.path.exists(CHROMEDRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium-driver is not installed (.ci/run installs it)")
        pytest.skip("needs Debian's chromium and chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--autoplay-policy=no-user-gesture-required"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)


def create_database(server_url: str, prefix: str) -> str:
    """A new, empty database named ``prefix`` + a unique suffix on the PostgreSQL server at
    ``server_url`` (a URL naming any database there); its URL."""
    name = f"{prefix}_{time.time_ns()}_{os.getpid()}"
    with psycopg.connect(server_url, autocommit=True) as db:
        db.execute(f"CREATE DATABASE {name}")
    return server_url.rsplit("/", 1)[0] + "/" + name


def drop_database(server_url: str, url: str) -> None:
    """Drop the database ``url`` names (made by ``create_database``), connections and all."""
    with psycopg.connect(server_url, autocommit=True) as db:
        db.execute(f"DROP DATABASE IF EXISTS {url.rsplit('/', 1)[1]} WITH (FORCE)")
