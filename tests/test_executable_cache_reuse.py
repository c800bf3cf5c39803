"""The executable cache over a folder JAX's persistent compilation cache already fills (issue
65 item 1): a run with the executable cache off, then two with it on, all exit 0, the third
loads what the second stored, and its frames are the first's bit for bit. Before the fix the
second stored executables JAX's cache had handed back, which XLA:CPU serialises without their
code, and the third failed at its first dispatch ("Function ... not found").

References independent of the code under test: the first run's frames (no executable cache),
a numpy evaluation of the toy program, and JAX's own monitoring events (via
``engine.run.runtime``) for whether its cache was asked.
"""

import contextlib
import json
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors.numpy import load_file
from serve_util import PROMPT, SETTINGS, Server, env, server_frames, wait_done

from engine.programs import executables
from engine.run import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--height", "32", "--width", "48", "--frames", "5", "--num_inference_steps", "1",
         "--num_iterations", "1", "--warmup_steps", "1", "--save_frames", "--no_plots"]


def _cli(checkpoint, tmp_path, name, *flags):
    """One CLI process with its caches under ``tmp_path / "cache"`` (XDG_CACHE_HOME, the
    default folders); returns (report, frames, stderr)."""
    out = tmp_path / name
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"),
                           "--model_id", checkpoint, *SMALL, "--output_dir", str(out), *flags],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env(1, XDG_CACHE_HOME=str(tmp_path / "cache")))
    assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
    (report,) = out.glob("*.json")
    (frames,) = out.glob("*.frames.safetensors")
    return json.loads(report.read_text()), load_file(str(frames))["frames"], proc.stderr


def test_a_run_loads_what_a_run_after_jax_s_cache_stored(tiny_checkpoint, tmp_path):
    first, frames1, _ = _cli(tiny_checkpoint, tmp_path, "first", "--executable_cache_dir",
                             "none")
    second, frames2, _ = _cli(tiny_checkpoint, tmp_path, "second")
    third, frames3, log3 = _cli(tiny_checkpoint, tmp_path, "third")
    assert first["compilation_cache"]["misses"] > 0  # JAX's cache is filled first
    assert first["executable_cache"]["dir"] == "none"
    stored = second["executable_cache"]["programs_compiled"]
    assert stored >= 2 and second["executable_cache"]["programs_loaded"] == 0  # step + decode
    assert (third["executable_cache"]["programs_compiled"],
            third["executable_cache"]["programs_loaded"]) == (0, stored)
    assert third["timings"]["xla_compile_s"] == 0 and third["timings"]["executable_load_s"] > 0
    # Loaded and run as stored: no entry was evicted at its first call.
    assert "executable cache:" not in log3, log3[-3000:]
    assert frames1.shape == (5, 32, 48, 3) and frames1.std() > 0.01
    np.testing.assert_array_equal(frames2, frames1)
    np.testing.assert_array_equal(frames3, frames1)


def test_servers_in_turn_load_what_the_second_stored(tiny_checkpoint, tmp_path):
    """The same over three servers: one without the executable cache, then two with it; the
    third is ready with nothing compiled, and a job's frames are the first's."""
    argv = ["--model_id", tiny_checkpoint, *SETTINGS]
    frames, health = [], []
    for i, flags in enumerate((["--executable_cache_dir", "none"], [], [])):
        server = Server([*argv, *flags], tmp_path / f"s{i}",
                        environ=env(1, XDG_CACHE_HOME=str(tmp_path / "cache"))).start()
        try:
            health.append(server.wait_ready()["time_to_ready"])
            with server.client() as c:
                video_id = c.post("/v1/videos", json=dict(prompt=PROMPT, seed=4)).json()["id"]
                assert wait_done(c, [video_id])[video_id]["status"] == "completed"
            frames.append(server_frames(tmp_path / f"s{i}", video_id))
        finally:
            assert server.stop() == 0, server.tail()
        if i == 2:
            assert "executable cache:" not in server.tail(100000), server.tail()
    stored = health[1]["programs_compiled"]
    assert stored >= 2 and health[1]["programs_loaded"] == 0
    assert (health[2]["programs_compiled"], health[2]["programs_loaded"]) == (0, stored)
    np.testing.assert_array_equal(frames[1], frames[0])
    np.testing.assert_array_equal(frames[2], frames[0])


# --- one program, in this process ----------------------------------------------------------


def _program(x, y):
    # A select of converted values: XLA:CPU fuses it into a named function, the kind a
    # re-serialised cached executable lost ("Function convert_select_fusion not found").
    return jnp.where(x > 0.5, x * 2.0, (y * 3.0).astype(jnp.int32).astype(jnp.float32)) + 1.0


def _reference(x, y):
    return np.where(x > 0.5, x * 2.0, (y * 3.0).astype(np.int32).astype(np.float32)) + 1.0


@pytest.fixture
def jax_cache(tmp_path):
    """JAX's persistent cache on in ``tmp_path / "jax"``, holding ``_program`` already
    (compiled here), and the process's caches cleared so that the next compile asks it."""
    saved = jax.config.jax_compilation_cache_dir
    try:
        assert runtime.enable_compilation_cache(str(tmp_path / "jax"))
        x, y = _inputs()
        # Cleared first too: a compile an earlier test left in this process's caches would
        # be served from memory and never reach JAX's cache (pytest-randomly found that).
        jax.clear_caches()
        jax.jit(_program).lower(x, y).compile()
        jax.clear_caches()
        yield tmp_path / "executables"
    finally:
        runtime.enable_compilation_cache(saved or "none")


def _inputs():
    rng = np.random.RandomState(0)
    return (jnp.asarray(rng.rand(64, 128).astype(np.float32)),
            jnp.asarray(rng.rand(64, 128).astype(np.float32)))


def _compile(directory):
    """compile_program of ``_program`` with the executable cache in ``directory``; returns
    (the program, stats, JAX's cache traffic meanwhile)."""
    x, y = _inputs()
    mesh = Mesh(np.array(jax.devices()[:1]), ("dp",))
    before, traffic = executables.stats_snapshot(), dict(runtime.CACHE_STATS)
    with executables.caching(str(directory), {}, mesh):
        compiled, _ = executables.compile_program(
            "toy", lambda: jax.jit(_program).lower(x, y), (x, y))
    return compiled, executables.stats_since(before), runtime.cache_events_since(traffic)


def _cache_lines(caplog):
    return [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]


def test_a_program_jax_s_cache_holds_is_compiled_afresh_and_stored(jax_cache, caplog):
    with caplog.at_level(logging.WARNING, logger="generate_flax"):
        _, stats, traffic = _compile(jax_cache)
        assert (stats["compiled"], stats["loaded"]) == (1, 0)
        assert traffic == {"hits": 0, "misses": 0}  # JAX's cache was not asked
        jax.clear_caches()
        loaded, stats, _ = _compile(jax_cache)
        assert (stats["compiled"], stats["loaded"]) == (0, 1)
        x, y = _inputs()
        np.testing.assert_allclose(np.asarray(loaded(x, y)), _reference(*map(np.asarray,
                                                                             (x, y))))
    assert _cache_lines(caplog) == []
    # JAX's cache is on again after the compile that skipped it.
    assert jax.config.jax_enable_compilation_cache
    assert runtime.enable_compilation_cache(str(jax_cache.parent / "jax"))


@contextlib.contextmanager
def _storing_what_jax_s_cache_serves(monkeypatch):
    """The executable cache as it was before the fix: JAX's cache asked, its hit stored."""
    with monkeypatch.context() as m:
        m.setattr(executables, "_fresh_compiles", contextlib.nullcontext)
        m.setattr(executables, "_jax_cache_hits", lambda: 0)
        yield


def test_an_entry_failing_its_first_call_is_evicted_and_recompiled(jax_cache, monkeypatch,
                                                                   caplog):
    with _storing_what_jax_s_cache_serves(monkeypatch):
        _, stats, traffic = _compile(jax_cache)
    assert traffic["hits"] == 1 and stats["compiled"] == 1  # an entry JAX's cache served
    jax.clear_caches()
    x, y = _inputs()
    with caplog.at_level(logging.WARNING, logger="generate_flax"):
        loaded, stats, _ = _compile(jax_cache)
        assert stats["loaded"] == 1 and isinstance(loaded, executables.Checked)
        before = executables.stats_snapshot()
        out = loaded(x, y)
        assert executables.stats_since(before)["compiled"] == 1
        np.testing.assert_allclose(np.asarray(out), _reference(*map(np.asarray, (x, y))))
        np.testing.assert_allclose(np.asarray(loaded(x, y)), np.asarray(out))
    (line,) = _cache_lines(caplog)  # once, naming the reason
    assert line.startswith("executable cache: toy: loaded program failed at its first call (")
    assert "not found" in line and line.endswith("; evicted, compiling"), line
    # The entry was replaced by a fresh compile: loaded again, it runs without a warning.
    caplog.clear()
    jax.clear_caches()
    with caplog.at_level(logging.WARNING, logger="generate_flax"):
        again, stats, _ = _compile(jax_cache)
        assert (stats["compiled"], stats["loaded"]) == (0, 1)
        np.testing.assert_allclose(np.asarray(again(x, y)), np.asarray(out))
    assert _cache_lines(caplog) == []


def test_a_program_jax_s_cache_served_anyway_is_not_stored(jax_cache, monkeypatch, caplog):
    """If JAX's cache serves the compile all the same (turned back on meanwhile), the entry
    is not written: one warning, and the next run compiles."""
    monkeypatch.setattr(executables, "_fresh_compiles", contextlib.nullcontext)
    with caplog.at_level(logging.WARNING, logger="generate_flax"):
        compiled, stats, traffic = _compile(jax_cache)
    assert traffic["hits"] == 1 and stats["compiled"] == 1
    (line,) = _cache_lines(caplog)
    assert line.startswith("executable cache: toy: not stored (JAX's compilation cache")
    assert not jax_cache.exists() or os.listdir(jax_cache) == []
    x, y = _inputs()
    np.testing.assert_allclose(np.asarray(compiled(x, y)), _reference(*map(np.asarray,
                                                                           (x, y))))
