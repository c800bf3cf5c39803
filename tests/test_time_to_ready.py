"""Time to first video: the report's split, the prompt-embedding cache and the executable
cache (issue 46).

The references are independent of the code under test: a warm run's frames against the cold
run's (bit for bit), the cold run's compile count against the warm run's load count, the
text encoder's loads counted by wrapping its class's ``from_pretrained``, a program loaded
from a damaged entry against the same function run by plain ``jax.jit``.
"""

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file
from serve_util import PROMPT, SETTINGS, Server, cpu_xla_flags, server_frames, wait_done
from transformers import UMT5EncoderModel

import generate_flax
from engine.files import report as reporting
from engine.programs import executables

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2",
         "--dtype", "float32", "--attention", "xla", "--warmup_steps", "1", "--save_frames",
         "--no_plots"]


def test_split_adds_up_and_keeps_the_run_order():
    timings = dict(prologue_s=0.5, read_s=1.0, text_encode_s=2.0, image_encode_s=0.25,
                   place_transformer_s=3.0, place_transformer_gbps=9.0, place_vae_s=0.5,
                   trace_lower_s=4.0, xla_compile_s=5.0, executable_load_s=0.0, warmup_s=6.0,
                   compile_transformer_s=99.0)
    runs = [dict(denoise_s=7.0, vae_decode_s=1.5), dict(denoise_s=7.0, vae_decode_s=1.5)]
    split = reporting.time_to_first_video(timings, runs, imports_s=2.5, checkpoint_check_s=0.75,
                                          write_s=0.125, total_s=60.0)
    expected = dict(imports_s=2.5, checkpoint_check_s=0.75, prologue_s=0.5, read_s=1.0,
                    text_encode_s=2.25, place_s=3.5, trace_lower_s=4.0, compile_s=5.0,
                    executable_load_s=0.0, warmup_s=6.0, denoise_s=14.0, decode_s=3.0,
                    write_s=0.125)
    assert {k: split[k] for k in expected} == expected
    assert split["other_s"] == pytest.approx(60.0 - sum(expected.values()))
    assert split["total_s"] == 60.0
    order = [k for k, _ in reporting.FIRST_VIDEO_PHASES]
    assert [k for k in split if k != "total_s"] == [k for k in order if k in split]
    # Without a total from the process start, the total is the phases' sum and no "other".
    bare = reporting.time_to_first_video(timings, runs[:1])
    assert "other_s" not in bare and "imports_s" not in bare
    assert bare["total_s"] == pytest.approx(sum(v for k, v in bare.items() if k != "total_s"))


def test_process_start_precedes_the_interpreters_first_line():
    code = (f"import time; first = time.time(); import sys; sys.path.insert(0, {ROOT!r}); "
            "from engine.run import clock; print(first, clock.process_start_time())")
    before = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    first, started = map(float, out.stdout.split())
    # The kernel's start time (10 ms ticks) is before the first line ran and after the
    # parent launched it; the interpreter's own start-up lies between.
    assert before - 0.05 <= started <= first + 0.02
    assert first - started < 5.0


def _cli(checkpoint, tmp_path, name, cache, *extra):
    out = tmp_path / name
    code = generate_flax.cli(["--model_id", checkpoint, *SMALL, "--output_dir", str(out),
                              "--compilation_cache_dir", str(cache / "jax"), *extra])
    assert code == 0
    (report_path,) = [p for p in out.glob("*.json")]
    (frames_path,) = list(out.glob("*.frames.safetensors"))
    return json.loads(report_path.read_text()), load_file(str(frames_path))["frames"]


@pytest.fixture(scope="module")
def cold_warm(tiny_checkpoint, tmp_path_factory):
    """A cold run, then a warm one with the same caches, each counting the text encoder's
    loads from disk."""
    tmp = tmp_path_factory.mktemp("ttr")
    cache = tmp / "cache"
    loads = []
    original = UMT5EncoderModel.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(args[0] if args else kwargs)
        return original(cls, *args, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(UMT5EncoderModel, "from_pretrained", classmethod(counting))
    try:
        cold = _cli(tiny_checkpoint, tmp, "cold", cache)
        cold_loads = len(loads)
        warm = _cli(tiny_checkpoint, tmp, "warm", cache)
        warm_loads = len(loads) - cold_loads
    finally:
        mp.undo()
    return dict(cold=cold, warm=warm, loads=(cold_loads, warm_loads), cache=cache, tmp=tmp)


def test_warm_run_compiles_nothing_and_gives_the_same_frames(cold_warm):
    (cold, cold_frames), (warm, warm_frames) = cold_warm["cold"], cold_warm["warm"]
    compiled = cold["executable_cache"]["programs_compiled"]
    assert compiled >= 2 and cold["executable_cache"]["programs_loaded"] == 0  # step + decode
    assert warm["executable_cache"] == dict(cold["executable_cache"], programs_compiled=0,
                                            programs_loaded=compiled)
    assert warm["timings"]["programs_compiled"] == 0
    np.testing.assert_array_equal(warm_frames, cold_frames)
    assert cold_frames.shape == (9, 64, 96, 3) and cold_frames.std() > 0.01
    # Nothing was traced or compiled warm; the cold run did both.
    assert warm["timings"]["trace_lower_s"] == 0 and warm["timings"]["xla_compile_s"] == 0
    assert cold["timings"]["trace_lower_s"] > 0 and cold["timings"]["xla_compile_s"] > 0
    assert warm["timings"]["executable_load_s"] > 0


def test_repeated_prompt_skips_the_text_encoder(cold_warm):
    (cold, _), (warm, _) = cold_warm["cold"], cold_warm["warm"]
    assert cold_warm["loads"] == (1, 0)  # read from disk cold, never warm
    assert cold["embeddings_cache"]["videos"] == [dict(video=0, hit=False)]
    assert cold["embeddings_cache"]["text_encoder_loaded"] is True
    assert warm["embeddings_cache"]["videos"] == [dict(video=0, hit=True)]
    assert warm["embeddings_cache"]["text_encoder_loaded"] is False
    entries = os.listdir(cold_warm["cache"] / "embeddings")  # the prompt and the negative
    assert len(entries) == 2 and all(e.endswith(".safetensors") for e in entries)


def test_split_in_the_report_adds_up(cold_warm):
    for report, _ in (cold_warm["cold"], cold_warm["warm"]):
        split = report["timings"]["time_to_first_video"]
        phases = [k for k, _ in reporting.FIRST_VIDEO_PHASES if k != "other_s"]
        assert set(phases) <= set(split)
        assert split["total_s"] == pytest.approx(sum(split[k] for k in phases)
                                                 + split["other_s"])
        assert split["denoise_s"] == report["timings"]["runs"][0]["denoise_s"]
        assert split["checkpoint_check_s"] == report["checkpoint_check"]["seconds"]
        assert split["imports_s"] > 0 and split["write_s"] > 0
    cold, warm = (cold_warm[k][0]["timings"]["time_to_first_video"] for k in ("cold", "warm"))
    assert cold["executable_load_s"] == 0 and warm["compile_s"] == 0


def test_changed_prompt_misses_but_loads_the_programs(cold_warm, tiny_checkpoint):
    loads = []
    original = UMT5EncoderModel.from_pretrained.__func__

    def counting(cls, *args, **kwargs):
        loads.append(1)
        return original(cls, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(UMT5EncoderModel, "from_pretrained", classmethod(counting))
        report, frames = _cli(tiny_checkpoint, cold_warm["tmp"], "other", cold_warm["cache"],
                              "--prompt", "a different prompt")
    assert loads == [1]
    assert report["embeddings_cache"]["videos"] == [dict(video=0, hit=False)]
    # The prompt is an input of the programs, not part of them: still nothing compiled.
    assert report["executable_cache"]["programs_compiled"] == 0
    assert np.abs(frames - cold_warm["cold"][1]).max() > 0.01


def test_truncated_entries_recompile_with_the_same_frames(cold_warm, tiny_checkpoint, caplog):
    cache = cold_warm["tmp"] / "cache-truncated"
    shutil.copytree(cold_warm["cache"], cache)
    for name in os.listdir(cache / "executables"):
        if name.endswith(".bin"):
            path = cache / "executables" / name
            path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING, logger="generate_flax"):
        report, frames = _cli(tiny_checkpoint, cold_warm["tmp"], "truncated", cache)
    compiled = cold_warm["cold"][0]["executable_cache"]["programs_compiled"]
    assert report["executable_cache"]["programs_compiled"] == compiled
    misses = [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]
    assert len(misses) == compiled and all("truncated payload (100 of" in m for m in misses)
    np.testing.assert_array_equal(frames, cold_warm["cold"][1])


# --- the executable cache's entries, one program at a time -----------------------------------


def _program(x, y):
    return jnp.sin(x) * 2.0 + y.sum(), [x * 3.0]


@pytest.fixture
def mesh():
    return Mesh(np.array(jax.devices()[:2]).reshape(2), ("dp",))


def _compile(mesh, directory, settings):
    sharding = NamedSharding(mesh, P("dp"))
    x = jax.device_put(jnp.arange(8, dtype=jnp.float32), sharding)
    y = jax.device_put(jnp.ones((2, 3), jnp.float32), NamedSharding(mesh, P()))
    jitted = jax.jit(_program)
    before = dict(executables.STATS)
    with executables.caching(str(directory), settings, mesh):
        compiled, meta = executables.compile_program("toy", lambda: jitted.lower(x, y), (x, y),
                                                     extra=["k"], meta=lambda: ["seen", 1])
    out = compiled(x, y)
    reference = _program(np.arange(8, dtype=np.float32), np.ones((2, 3), np.float32))
    np.testing.assert_allclose(np.asarray(out[0]), reference[0], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out[1][0]), reference[1][0], rtol=1e-6)
    return executables.stats_since(before), meta


def _damage_payload(directory):
    (path,) = [os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".bin")]
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("change, reason", [
    ("source", "stale: the program sources changed"),
    ("version", "version mismatch (jax "),
    ("flag", "settings changed (bq)"),
    # other flags are other code (seen on an H200: a Triton GEMM build loaded)
    ("compiler_flags", "compiler flags changed ("),
    ("corrupt", "corrupt payload (sha256 differs)"),
    ("header", "unreadable header"),
    ("writable", "untrusted: "),  # a payload is code: another user must not have written it
])
def test_a_mismatched_entry_is_a_named_miss_then_a_compile(mesh, tmp_path, monkeypatch, caplog,
                                                           change, reason):
    settings = dict(bq=512, dtype="bfloat16")
    cold, meta = _compile(mesh, tmp_path, settings)
    assert (cold["compiled"], cold["loaded"], meta) == (1, 0, ["seen", 1])
    warm, meta = _compile(mesh, tmp_path, settings)
    assert (warm["compiled"], warm["loaded"], meta) == (0, 1, ["seen", 1])
    if change == "source":
        monkeypatch.setattr(executables, "source_digest", lambda: "0" * 64)
    elif change == "version":
        real = executables.versions()
        monkeypatch.setattr(executables, "versions", lambda: dict(real, jax="0.0.1"))
    elif change == "flag":
        settings = dict(settings, bq=256)
    elif change == "compiler_flags":
        monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")
                           + " --xla_cpu_enable_fast_math=false")
    elif change == "corrupt":
        _damage_payload(tmp_path)
    elif change == "writable":
        (payload,) = [tmp_path / n for n in os.listdir(tmp_path) if n.endswith(".bin")]
        payload.chmod(0o666)
    else:
        (header,) = [tmp_path / n for n in os.listdir(tmp_path) if n.endswith(".json")]
        header.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="generate_flax"):
        again, meta = _compile(mesh, tmp_path, settings)
    assert (again["compiled"], again["loaded"], meta) == (1, 0, ["seen", 1])
    (line,) = [r.getMessage() for r in caplog.records if "executable cache" in r.getMessage()]
    assert line.startswith("executable cache: toy: ") and reason in line, line
    # The compile replaced the entry: the same run now loads it.
    healed, _ = _compile(mesh, tmp_path, settings)
    assert (healed["compiled"], healed["loaded"]) == (0, 1)


def test_the_key_holds_the_flags_that_change_the_platforms_code():
    env = {"XLA_FLAGS": "--xla_b=1 --xla_dump_to=/x --xla_dump_hlo_as_text --xla_a "
                        "--xla_gpu_enable_triton_gemm=false",
           "LIBTPU_INIT_ARGS": "--xla_jf_dump_static_llo_profile_to=/p --xla_c=0"}
    gpu = "--xla_gpu_enable_triton_gemm=false"
    assert executables.compiler_flags(env) == ["--xla_a", "--xla_b=1", "--xla_c=0", gpu]
    assert executables.compiler_flags(env, "tpu") == ["--xla_a", "--xla_b=1", "--xla_c=0"]
    assert executables.compiler_flags(env, "gpu") == ["--xla_a", "--xla_b=1", gpu]
    assert executables.compiler_flags(env, "cpu") == ["--xla_a", "--xla_b=1"]
    assert executables.compiler_flags({}) == []


def test_another_input_signature_is_another_entry(mesh, tmp_path):
    _compile(mesh, tmp_path, {})
    sharding = NamedSharding(mesh, P())  # x replicated instead of split over "dp"
    x = jax.device_put(jnp.arange(8, dtype=jnp.float32), sharding)
    y = jax.device_put(jnp.ones((2, 3), jnp.float32), sharding)
    before = dict(executables.STATS)
    with executables.caching(str(tmp_path), {}, mesh):
        executables.compile_program("toy", lambda: jax.jit(_program).lower(x, y), (x, y),
                                    extra=["k"])
    assert executables.stats_since(before)["compiled"] == 1
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".json")]) == 2


def test_cache_off_compiles_and_writes_nothing(mesh, tmp_path):
    stats, _ = _compile(mesh, "none", {})
    assert (stats["compiled"], stats["loaded"]) == (1, 0)
    assert not os.path.exists("none")


def test_compilation_cache_none_after_a_cached_run_in_the_same_process(tmp_path):
    """JAX's persistent-cache settings are process-wide: a run with --compilation_cache_dir
    none after one with a folder (a test after another in one pytest worker) must compile
    without the cache, and a run with another folder must write to that folder. JAX's own
    monitoring events count the cache's traffic for each fresh program."""
    from engine.run import runtime

    saved = jax.config.jax_compilation_cache_dir

    def traffic(scale):  # a program no earlier compile in this process has seen
        before = dict(runtime.CACHE_STATS)
        jax.jit(lambda x: x * scale + 1.0)(np.float32(2.0)).block_until_ready()
        return runtime.cache_events_since(before)

    try:
        assert runtime.enable_compilation_cache(str(tmp_path / "first"))
        assert traffic(3.0) == {"hits": 0, "misses": 1}
        assert not runtime.enable_compilation_cache("none")
        assert traffic(5.0) == {"hits": 0, "misses": 0}
        assert runtime.enable_compilation_cache(str(tmp_path / "second"))
        assert traffic(7.0) == {"hits": 0, "misses": 1}
        assert os.listdir(tmp_path / "second")
    finally:
        runtime.enable_compilation_cache(saved or "none")


def test_step_cache_programs_load_warm_with_the_same_frames(tiny_checkpoint, tmp_path):
    """DeepCache's full and cached step programs go through the executable cache too."""
    deepcache = ["--num_inference_steps", "8", "--cache", "deepcache", "--cache_start_step",
                 "1", "--cache_end_step", "7", "--cache_step_interval", "3"]
    cache = tmp_path / "cache"
    cold, cold_frames = _cli(tiny_checkpoint, tmp_path, "cold", cache, *deepcache)
    warm, warm_frames = _cli(tiny_checkpoint, tmp_path, "warm", cache, *deepcache)
    compiled = cold["executable_cache"]["programs_compiled"]
    assert compiled >= 3  # full step, cached step, the decode's programs
    assert (warm["executable_cache"]["programs_compiled"],
            warm["executable_cache"]["programs_loaded"]) == (0, compiled)
    assert warm["cache"]["cached_steps"] == cold["cache"]["cached_steps"] == [2, 3, 5, 6]
    assert "cached" in warm["timings"]["runs"][0]["step_kinds"]
    np.testing.assert_array_equal(warm_frames, cold_frames)


def test_a_restarted_server_compiles_nothing(tiny_checkpoint, tmp_path):
    """A server restarted on its caches loads every program it compiled the first time
    (0 compiled), splits its time to ready as the CLI does, and a job's frames are the cold
    server's bit for bit."""
    # Two buckets: the second is compiled apart from the first (on its placed weights), and
    # must go through the executable cache too.
    argv = ["--model_id", tiny_checkpoint, *SETTINGS, "--serve_sizes", "64x64,96x64",
            "--compilation_cache_dir", str(tmp_path / "cache")]
    frames, health = [], []
    for run in ("cold", "warm"):
        server = Server(argv, tmp_path / run).start()
        try:
            health.append(server.wait_ready()["time_to_ready"])
            with server.client() as c:
                video_id = c.post("/v1/videos", json=dict(prompt=PROMPT, seed=4)).json()["id"]
                assert wait_done(c, [video_id])[video_id]["status"] == "completed"
            frames.append(server_frames(tmp_path / run, video_id))
        finally:
            assert server.stop() == 0, server.tail()
    cold, warm = health
    assert cold["programs_compiled"] >= 4 and cold["programs_loaded"] == 0
    assert (warm["programs_compiled"], warm["programs_loaded"]) == (0, cold["programs_compiled"])
    assert warm["split"]["trace_lower_s"] == 0 and warm["split"]["compile_s"] == 0
    assert warm["split"]["executable_load_s"] > 0
    for split in (cold["split"], warm["split"]):
        phases = sum(v for k, v in split.items() if k != "total_s")
        assert split["imports_s"] > 0 and abs(phases - split["total_s"]) < 1e-6, split
    np.testing.assert_array_equal(frames[1], frames[0])


def _entries(folder) -> dict:
    """{program name: header} of an executable-cache folder."""
    out = {}
    for name in os.listdir(folder):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                header = json.load(f)
            out[header["key"]["program"]] = header
    return out


def test_the_dry_run_exports_the_keys_a_run_computes(tiny_checkpoint, tmp_path):
    """``--dry_run --topology v6e:2x4 --aot_export``, deviceless, against a real run of the
    same flags on 8 CPU devices: the transformer step's entry has the same input signature
    (pytree, shapes, dtypes, shardings) and the same header parts but the platform and the
    device kind, which a TPU run shares with the topology. The device order is the mesh's:
    the TPU topology's ring order there, 0..7 on CPU devices, so the CPU run's entry name
    differs by that alone."""
    flags = ["--model_id", tiny_checkpoint, "--dp", "2", "--sp", "4", "--height", "64",
             "--width", "96", "--frames", "5", "--num_inference_steps", "1", "--bq", "4864",
             "--bkv", "2048", "--bkv_compute", "1024", "--no_plots"]
    exported, ran = tmp_path / "exported", tmp_path / "ran"
    subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"), *flags, "--dry_run",
                    "--topology", "v6e:2x4", "--dry_run_skip_vae", "--aot_export",
                    str(exported), "--output_dir", str(tmp_path / "dry")], check=True,
                   capture_output=True, env={**os.environ, "JAX_PLATFORMS": ""}, cwd=ROOT)
    subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"), *flags,
                    "--executable_cache_dir", str(ran), "--compilation_cache_dir", "none",
                    "--embeddings_cache", "none", "--output_dir", str(tmp_path / "run")],
                   check=True, capture_output=True, cwd=ROOT,
                   env={**os.environ, "JAX_PLATFORMS": "cpu",
                        "XLA_FLAGS": cpu_xla_flags(8)})
    tpu, cpu = _entries(exported)["transformer_step"], _entries(ran)["transformer_step"]
    assert tpu["key"]["signature"] == cpu["key"]["signature"]
    assert sorted(tpu["key"]["devices"]) == cpu["key"]["devices"] == list(range(8))
    assert (tpu["parts"]["platform"], tpu["parts"]["device_kind"]) == ("tpu", "TPU v6 lite")
    differ = {k for k in tpu["parts"] if tpu["parts"][k] != cpu["parts"][k]}
    assert differ == {"platform", "device_kind"}, differ
    for name in os.listdir(exported):  # entries are code: this user's only
        assert os.stat(exported / name).st_mode & 0o077 == 0, name
