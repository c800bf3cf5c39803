"""Compile while loading (``--overlap_compile``, issue 46): the step and the VAE decode
compiled from shapes on a thread while the checkpoint is read, the prompts encoded and the
weights placed.

The references are independent of the code under test: the frames of a sequential run
(``--overlap_compile off``, the executable cache off, a fresh JAX cache) bit for bit; the
executable cache's own counters (a warm overlapped run, and a warm sequential run reading
the overlapped run's entries, compile nothing); the thread's clock against the main
thread's.
"""

import json
import logging

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file

import generate_flax
from engine.files import report as reporting
from engine.pipeline import ahead

SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--dtype", "float32", "--attention", "xla", "--warmup_steps", "1", "--save_frames",
         "--no_plots"]


def _cli(checkpoint, tmp, name, jax_cache, *extra):
    out = tmp / name
    code = generate_flax.cli(["--model_id", checkpoint, *SMALL, "--output_dir", str(out),
                              "--compilation_cache_dir", str(jax_cache), *extra])
    assert code == 0
    (report_path,) = list(out.glob("*.json"))
    (frames_path,) = list(out.glob("*.frames.safetensors"))
    return json.loads(report_path.read_text()), load_file(str(frames_path))["frames"]


@pytest.fixture(scope="module")
def runs(tiny_checkpoint, tmp_path_factory):
    """An overlapped cold run, the same warm, a sequential run warm on the overlapped run's
    executables, and a sequential reference with no caches of its own; each run's
    "overlap compile:" warnings."""
    tmp = tmp_path_factory.mktemp("overlap")
    shared = tmp / "shared" / "jax"
    out, warned = {}, {}
    handler = logging.Handler()
    handler.emit = lambda record: warned.setdefault(current[0], []).append(record.getMessage())
    log = logging.getLogger("generate_flax")
    log.addHandler(handler)
    current = [None]
    try:
        for name, cache, extra in (
                ("cold", shared, ["--overlap_compile", "on"]),
                ("warm", shared, ["--overlap_compile", "on"]),
                ("warm_off", shared, ["--overlap_compile", "off"]),
                ("reference", tmp / "ref" / "jax",
                 ["--overlap_compile", "off", "--executable_cache_dir", "none"])):
            current[0] = name
            out[name] = _cli(tiny_checkpoint, tmp, name, cache, *extra)
    finally:
        log.removeHandler(handler)
    return out, {k: [m for m in v if "overlap compile" in m] for k, v in warned.items()}


def test_overlapped_frames_equal_the_sequential_ones_bit_for_bit(runs):
    out, warned = runs
    reference = out["reference"][1]
    assert reference.shape == (9, 64, 96, 3) and reference.std() > 0.01
    for name in ("cold", "warm", "warm_off"):
        np.testing.assert_array_equal(out[name][1], reference, err_msg=name)
    assert not any(warned.values()), warned  # every program compiled ahead was used
    assert "overlap_wall_s" not in out["reference"][0]["timings"]


def test_the_compile_ran_beside_the_load_chain(runs):
    t = runs[0]["cold"][0]["timings"]
    # The thread started before the read, encode and place ended, and did all the work:
    # nothing was lowered or compiled after the join.
    assert 0 <= t["overlap_thread_start_s"] < t["overlap_load_end_s"]
    assert t["xla_compile_s"] > 0 and t["trace_lower_s"] > 0
    assert t["overlap_xla_compile_s"] == pytest.approx(t["xla_compile_s"])
    assert t["overlap_lower_s"] == pytest.approx(t["trace_lower_s"])
    assert t["programs_compiled"] >= 2  # the step and the decode's chunks
    assert t["overlap_load_chain_s"] >= t["read_s"] + t["text_encode_s"]
    wall = t["overlap_wall_s"]
    assert wall == pytest.approx(max(t["overlap_load_end_s"], t["overlap_compile_chain_s"]))
    # The split counts the main thread's path once: the thread's seconds are off it.
    split = t["time_to_first_video"]
    assert split["compile_s"] == 0 and split["trace_lower_s"] == 0
    assert split["compile_wait_s"] == pytest.approx(t["overlap_build_s"] + t["overlap_wait_s"])


def test_warm_runs_compile_nothing_with_overlap_on_or_off(runs):
    out, _ = runs
    cold = out["cold"][0]["executable_cache"]
    for name in ("warm", "warm_off"):
        ex = out[name][0]["executable_cache"]
        assert ex["programs_compiled"] == 0, name
        assert ex["programs_loaded"] == cold["programs_compiled"], name
    t = out["warm"][0]["timings"]
    assert t["executable_load_s"] > 0  # loaded on the thread:
    assert t["overlap_load_s"] == pytest.approx(t["executable_load_s"])


def test_auto_is_off_on_a_small_cpu_host_and_outside_compiling_stages(monkeypatch):
    cpu = jax.devices("cpu")[:1]
    monkeypatch.setattr(ahead.os, "cpu_count", lambda: 2)
    assert not ahead.wanted("auto", "all", cpu)
    assert ahead.wanted("on", "all", cpu) and not ahead.wanted("off", "all", cpu)
    assert not ahead.wanted("on", "decode", cpu) and not ahead.wanted("on", "encode", cpu)
    monkeypatch.setattr(ahead.os, "cpu_count", lambda: 8)
    assert ahead.wanted("auto", "denoise", cpu)


def test_difference_names_the_first_leaf_that_differs():
    mesh = Mesh(np.array(jax.devices("cpu")[:1]), ("dp",))
    a = jax.ShapeDtypeStruct((2, 3), np.float32, sharding=NamedSharding(mesh, P()))
    b = jax.ShapeDtypeStruct((2, 3), np.float32, sharding=NamedSharding(mesh, P(None,)))
    assert ahead.difference(({"w": a},), ({"w": a},)) is None
    assert "leaf 0" in ahead.difference(({"w": a},), ({"w": b},))
    assert ahead.difference(({"w": a},), ({"v": a},)) == "pytree"


def test_the_split_takes_the_threads_seconds_off_the_main_path():
    timings = dict(read_s=1.0, text_encode_s=2.0, place_transformer_s=0.5, trace_lower_s=3.0,
                   xla_compile_s=4.0, executable_load_s=0.0, overlap_wall_s=7.5,
                   overlap_lower_s=3.0, overlap_xla_compile_s=3.5, overlap_load_s=0.0,
                   overlap_build_s=0.25, overlap_wait_s=3.75)
    split = reporting.time_to_first_video(timings, [])
    assert split["trace_lower_s"] == 0 and split["compile_s"] == 0.5  # 0.5 s after the join
    assert split["compile_wait_s"] == 4.0
    assert split["total_s"] == pytest.approx(1.0 + 2.0 + 0.5 + 4.0 + 0.5)
