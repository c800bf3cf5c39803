"""generate_flax.py as a user runs it: a subprocess, its files, its exit codes and messages."""

import dataclasses
import glob
import gzip
import json
import os
import re
import subprocess
import sys
import time

import imageio.v3 as iio
import numpy as np
import pytest
from serve_util import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "generate_flax.py")
SMALL = ["--height", "64", "--width", "96", "--frames", "9", "--num_inference_steps", "2"]


def run(args, timeout=600, devices=8):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=cpu_xla_flags(devices))
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def test_cli_writes_playable_mp4_and_json_report(tiny_checkpoint, tmp_path):
    out, prof = tmp_path / "out", tmp_path / "prof"
    proc = run(["--model_id", tiny_checkpoint, *SMALL, "--num_iterations", "2",
                "--output_dir", str(out), "--profile_dir", str(prof)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = sorted(os.listdir(out))
    assert len(files) == 3, files  # no temporary or partial files left behind
    js, mp4, png = files
    assert re.fullmatch(r"\d{8}_\d{6}\.mp4", mp4) and js == mp4[:-4] + ".json"
    assert png == mp4[:-4] + "_timeline.png"
    assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    frames = np.asarray(iio.imread(out / mp4))
    assert frames.shape == (9, 64, 96, 3)
    assert frames.std() > 1  # a real picture, not a constant

    report = json.loads((out / js).read_text())
    assert report["video"] == mp4
    assert report["settings"]["frames"] == 9 and report["settings"]["seed"] == 42
    assert report["devices"] == {"kind": "cpu", "count": 8, "platform": "cpu"}
    # 64x96 is 480p class: flow_shift defaults to 3.0 (Wan 2.1 model card), recorded as such.
    assert report["settings"]["flow_shift"] == 3.0
    assert report["settings"]["flow_shift_source"] == "resolution"
    assert report["settings"]["warmup_steps"] == 2 and report["settings"]["num_iterations"] == 2
    t = report["timings"]
    for key in ("text_encode_s", "place_transformer_s", "place_vae_s", "compile_transformer_s",
                "compile_vae_s", "warmup_s", "warmup_denoise_s", "warmup_vae_decode_s",
                "cold_start_s", "steady_mean_s", "steady_min_s", "steady_max_s",
                "steady_s_per_step", "steady_vae_decode_s"):
        assert t[key] > 0, key
    # The warmup ran 2 denoising steps and one decode, not a whole generation; both timed
    # runs are steady state.
    assert t["warmup_steps"] == 2 and len(t["runs"]) == 2
    assert t["cold_start_s"] > t["compile_transformer_s"] + t["compile_vae_s"] + t["warmup_s"]
    assert "warmup:" in proc.stdout and "run 2/2" in proc.stdout
    # Width 96 -> latent width 12 does not split over 8 devices: said, not silent.
    assert [f["kind"] for f in report["fallbacks"]] == ["vae_decode_replicated"]
    assert "fallback (vae_decode_replicated)" in proc.stderr
    assert report["kernel_self_check"] is None  # --attention auto is xla off TPU
    for pkg in ("jax", "torch", "torchax", "diffusers"):
        assert report["versions"][pkg]
    assert "== Summary" in proc.stdout and "s/step" in proc.stdout

    # --profile_dir: one steady-state step (step 1, UniPC's predictor-corrector) was traced,
    # and the trace holds that step's annotation, the jitted model call and the UniPC update.
    assert report["profile"]["traced_step"] == 1
    xplane = [f for f in report["profile"]["files"] if f.endswith(".xplane.pb")]
    perfetto = [f for f in report["profile"]["files"] if f.endswith("perfetto_trace.json.gz")]
    assert len(xplane) == 1 and len(perfetto) == 1, report["profile"]["files"]
    from jax.profiler import ProfileData

    names = {ev.name for plane in ProfileData.from_file(str(prof / xplane[0])).planes
             for line in plane.lines for ev in line.events}
    assert "denoising_step" in names
    assert any("multistep_uni_c_bh_update" in n for n in names)  # the UniPC corrector
    assert any(n.startswith("PjitFunction(jit(") for n in names)
    with gzip.open(prof / perfetto[0], "rt") as f:
        assert any(e.get("name") == "denoising_step" for e in json.load(f)["traceEvents"])


BAD = [
    (["--frames", "10"], "--frames=10", "4n+1"),
    (["--frames", "0"], "--frames=0", "4n+1"),
    (["--height", "50"], "--height=50", "multiple of 16"),
    (["--width", "1000"], "--width=1000", "multiple of 16"),
    (["--num_inference_steps", "0"], "--num_inference_steps=0", ">= 1"),
    (["--guidance_scale", "-1"], "--guidance_scale=-1.0", ">= 0"),
    (["--guidance_scale", "nan"], "--guidance_scale=nan", "finite"),
    (["--num_iterations", "0"], "--num_iterations=0", ">= 1"),
    (["--warmup_steps", "-1"], "--warmup_steps=-1", ">= 0"),
    (["--dry_run", "--topology", "v6e"], "--topology='v6e'", "tpu7x:2x2x1"),
    (["--flow_shift", "0"], "--flow_shift=0.0", "> 0"),
    (["--dp", "3"], "--dp/--tp/--sp", "device count 8"),
    (["--bq", "100"], "--bq=100", "expected a multiple of 128"),
    (["--bkv", "1024", "--bkv_compute", "384"], "--bkv=1024", "multiple of block_kv_compute"),
    # Only --bkv given: the chip's default --bkv_compute (1024 on v6e) must divide it.
    (["--dry_run", "--topology", "v6e:2x4", "--bkv", "2816"], "--bkv=2816",
     "multiple of block_kv_compute=1024 (blocks 4864/2816/1024 from the v6e defaults"),
    (["--dp", "2", "--tp", "4", "--sp", "1"], "--tp=4", "head count 2"),
    (["--dp", "2", "--tp", "1", "--sp", "4", "--guidance_scale", "1"], "--dp=2",
     "must divide the transformer batch"),
    (["--stage", "decode", "--profile_dir", "prof"], "--profile_dir='prof'",
     "needs a denoising run"),
    (["--estimate"], "--estimate=True", "needs --dry_run"),
    (["--cache_start_step", "3"], "--cache_start_step=3", "needs --cache deepcache"),
    (["--enable_cache", "--num_inference_steps", "8"], "--cache_start_step=11",
     "0 <= start < --num_inference_steps (8)"),
    (["--cache", "deepcache", "--cache_recompute_blocks", "2"], "--cache_recompute_blocks=2",
     "< the transformer's 2 blocks"),
    (["--cache", "magcache"], "--cache='magcache'", "no calibrated ratios are known"),
    (["--cache", "magcache", "--mag_ratios", "[1, 0]"], "--mag_ratios='[1, 0]'",
     "JSON list of positive numbers"),
    (["--window_size", "-1"], "--window_size=-1", "must be an int >= 0"),
    # --quantize: each chip's 8-bit type (engine/run/chips.py), before any model loads.
    (["--dry_run", "--topology", "v6e:2x4", "--quantize", "fp8"], "--quantize='fp8'",
     "use --quantize int8"),
    (["--dry_run", "--topology", "tpu7x:2x2x1", "--quantize", "int8"], "--quantize='int8'",
     "use --quantize fp8"),
    (["--dry_run", "--topology", "v4:2x2x1", "--quantize", "int8"], "--quantize='int8'",
     "no 8-bit matmul rate above bf16's"),
    (["--attention", "stock_splash", "--window_size", "16"], "--window_size=16",
     "needs --attention splash or xla"),
    (["--attention", "stock_splash", "--k_smoothing"], "--k_smoothing=True",
     "needs --attention splash or xla"),
]


@pytest.mark.parametrize("flags,flag,rule", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_input_is_one_line_before_loading(tiny_checkpoint, tmp_path, capsys, flags, flag,
                                              rule):
    """Each refusal is one line on stderr, exit 2, nothing written. The first row and
    ``--dp 3`` run as a user runs them (a subprocess: the process's own exit code and
    stderr); the rest call the same entry point, ``generate_flax.cli``, in this process, which
    skips a Python start-up (about 10 s on the CI host) per row."""
    import generate_flax as gf

    out = tmp_path / "out"
    argv = ["--model_id", tiny_checkpoint, "--output_dir", str(out), *flags]
    t0 = time.monotonic()
    if flags in (BAD[0][0], ["--dp", "3"]):
        proc = run(argv, timeout=60)
        code, stderr = proc.returncode, proc.stderr
    else:
        code, stderr = gf.cli(argv), capsys.readouterr().err
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert flag in lines[0] and rule in lines[0], lines[0]
    assert "Traceback" not in stderr
    assert time.monotonic() - t0 < 30  # no model was loaded
    assert not out.exists() or not os.listdir(out)


def test_block_sizes_default_per_chip_and_flags_win(tiny_checkpoint):
    import custom_splash_attention as csa
    import generate_flax as gf

    def config(*flags):
        return gf.validate_args(gf.parse_args(["--model_id", tiny_checkpoint, *flags]))

    topologies = {"v5e": "v5e:2x4", "v6e": "v6e:2x4", "tpu7x": "tpu7x:2x2x1"}
    assert set(csa.DEFAULT_BLOCK_SIZES) == set(topologies)
    for chip, blocks in csa.DEFAULT_BLOCK_SIZES.items():  # a dry run knows its chip
        assert config("--dry_run", "--topology", topologies[chip]).kernel.block_sizes() == blocks
    v6e = csa.DEFAULT_BLOCK_SIZES["v6e"]
    got = config("--dry_run", "--topology", "v6e:2x4", "--bq", "2048").kernel.block_sizes()
    assert got == csa.BlockSizes(2048, v6e.block_kv, v6e.block_kv_compute)
    # A real run resolves once it sees its devices: off TPU (no chip), BlockSizes().
    unresolved = config()
    assert (unresolved.kernel.bq, unresolved.kernel.bkv, unresolved.kernel.bkv_compute) == (
        None, None, None)
    assert unresolved.resolve_block_sizes(None).kernel.block_sizes() == csa.BlockSizes()
    assert config("--dry_run", "--topology", "v5p:2x2x1").kernel.block_sizes() == csa.BlockSizes()


def test_missing_model_folder_says_how_to_get_weights(tmp_path):
    proc = run(["--model_id", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path)],
               timeout=60)
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert "\n" not in line and "--model_id=" in line and "not found" in line
    assert "make_tiny_checkpoint.py" in line and "'hf download Wan-AI/" in line


def test_folder_without_model_index_names_the_missing_file(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run(["--model_id", str(tmp_path / "empty"), "--output_dir", str(tmp_path)],
               timeout=60)
    assert proc.returncode == 2 and "missing model_index.json" in proc.stderr


def test_unwritable_output_dir(tiny_checkpoint, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    proc = run(["--model_id", tiny_checkpoint, "--output_dir", str(blocker / "sub")],
               timeout=60)
    assert proc.returncode == 2
    assert "--output_dir=" in proc.stderr and "writable directory" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_no_ffmpeg_is_one_line_before_loading(tiny_checkpoint, tmp_path, monkeypatch):
    """An mp4 needs ffmpeg: where imageio-ffmpeg's binary is missing (here: the environment
    names one that does not exist) the run stops before any model loads, in one line; a
    --stage encode run, which writes no mp4, does not need it."""
    out = tmp_path / "out"
    monkeypatch.setenv("IMAGEIO_FFMPEG_EXE", str(tmp_path / "no-ffmpeg"))
    proc = run(["--model_id", tiny_checkpoint, *SMALL, "--output_dir", str(out)], timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "no ffmpeg to write the mp4" in lines[0], proc.stderr
    assert "IMAGEIO_FFMPEG_EXE" in lines[0] and not (out.exists() and os.listdir(out))
    import generate_flax  # the flags alone: --stage encode passes the check

    generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", tiny_checkpoint, *SMALL, "--stage", "encode", "--work_dir",
        str(tmp_path / "work"), "--output_dir", str(out)]))


def test_nan_weights_fail_naming_the_stage_and_write_nothing(tiny_checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan-wan"
    shutil.copytree(tiny_checkpoint, bad)
    path = bad / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    state["proj_out.bias"][0] = float("nan")
    save_file(state, str(path))
    out = tmp_path / "out"
    proc = run(["--model_id", str(bad), *SMALL, "--num_iterations", "1",
                "--output_dir", str(out)])
    assert proc.returncode == 1
    assert "denoising" in proc.stderr and "NaN" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert glob.glob(str(out / "*")) == []


def test_second_process_hits_the_persistent_compilation_cache(tiny_checkpoint, tmp_path):
    """torchax-jitted programs must be served from JAX's persistent cache in a new process
    (the executable cache off: it would serve the AOT programs before JAX's cache is asked;
    tests/test_time_to_ready.py covers it)."""
    flags = ["--model_id", tiny_checkpoint, "--height", "32", "--width", "48", "--frames", "5",
             "--num_inference_steps", "1", "--num_iterations", "1",
             "--compilation_cache_dir", str(tmp_path / "cache"), "--executable_cache_dir", "none"]
    reports = []
    for i in range(2):
        out = tmp_path / f"out{i}"
        proc = run([*flags, "--output_dir", str(out)], devices=1)
        assert proc.returncode == 0, proc.stderr[-3000:]
        (js,) = glob.glob(str(out / "*.json"))
        reports.append(json.loads(open(js).read())["compilation_cache"])
    cold, warm = reports
    assert cold["hits"] == 0 and cold["misses"] > 0
    assert os.listdir(tmp_path / "cache")
    # Everything the cold process compiled (transformer step, VAE programs, the scheduler's
    # small ops) is now read back instead of compiled.
    assert warm["misses"] == 0 and warm["hits"] == cold["misses"]
    # JAX's saving is each entry's recorded compile time less its read time: on a tiny
    # program a busy host can read slower than it compiled (seen: -0.18 s), so only its
    # presence is asserted; the hits above are the proof.
    assert isinstance(warm["compile_time_saved_s"], float)


# A damaged checkpoint: one line naming the component, the file and the rule, exit 2, before
# any model loads (engine/files/integrity.py). In-process: load_pipeline and the text encoder are
# replaced by a failure, so a row that got as far as loading fails the test.


def _truncate(relpath, keep=0.5):
    def damage(ck):
        path = ck / relpath
        os.truncate(path, int(os.path.getsize(path) * keep))
    return damage


def _edit_config(relpath, **changes):
    def damage(ck):
        path = ck / relpath / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return damage


def _drop_tensor(relpath, name):
    def damage(ck):
        from safetensors.torch import load_file, save_file

        state = load_file(str(ck / relpath))
        del state[name]
        save_file(state, str(ck / relpath), metadata={"format": "pt"})
    return damage


def _index_naming_a_missing_shard(ck):
    """transformer/ as a sharded checkpoint whose index names a second shard not there."""
    from safetensors import safe_open

    folder = ck / "transformer"
    first = "diffusion_pytorch_model-00001-of-00002.safetensors"
    os.rename(folder / "diffusion_pytorch_model.safetensors", folder / first)
    with safe_open(str(folder / first), "pt") as f:
        names = sorted(f.keys())
    weight_map = {n: first for n in names}
    weight_map[names[-1]] = first.replace("00001-of", "00002-of")
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))


TE, TR = "text_encoder/model.safetensors", "transformer/diffusion_pytorch_model.safetensors"
DAMAGED = [
    ("truncated transformer", "wan", [], _truncate(TR),
     "transformer/diffusion_pytorch_model.safetensors: truncated: tensor"),
    ("truncated text encoder", "wan", [], _truncate(TE),
     "text_encoder/model.safetensors: truncated: tensor"),
    ("text encoder cut inside its header", "wan", [], _truncate(TE, keep=0.001),
     "text_encoder/model.safetensors: truncated: the header says it is"),
    ("truncated VAE, --stage decode", "wan", ["--stage", "decode"],
     _truncate("vae/diffusion_pytorch_model.safetensors"),
     "vae/diffusion_pytorch_model.safetensors: truncated: tensor"),
    ("index names a missing shard", "wan", [], _index_naming_a_missing_shard,
     "transformer/diffusion_pytorch_model.safetensors.index.json: its weight_map names 1 "
     "file(s) that do not exist: diffusion_pytorch_model-00002-of-00002.safetensors"),
    ("ffn_dim does not match the weights", "wan", [], _edit_config("transformer", ffn_dim=64),
     "transformer/diffusion_pytorch_model.safetensors: does not match config.json: 6 tensor(s) "
     "have the wrong shape for config.json: blocks.0.ffn.net.0.proj.bias (32), expected (64)"),
    ("one tensor removed", "wan", ["--stage", "denoise"], _drop_tensor(TR, "proj_out.bias"),
     "transformer/diffusion_pytorch_model.safetensors: does not match config.json: 1 "
     "tensor(s) WanTransformer3DModel expects are missing: proj_out.bias"),
    # transformers' rules: the Qwen text model's norm is not tied to anything.
    ("HunyuanVideo text encoder, one tensor removed", "hunyuan", [],
     _drop_tensor(TE, "norm.weight"), "text_encoder/model.safetensors: does not match "
     "config.json: 1 tensor(s) Qwen2_5_VLTextModel expects are missing: norm.weight"),
    ("config that does not parse, --dry_run", "wan", ["--dry_run", "--topology", "v6e:2x4"],
     lambda ck: (ck / "vae" / "config.json").write_text("{"), "vae/config.json: does not parse"),
]


@pytest.mark.parametrize("name,which,flags,damage,message", DAMAGED,
                         ids=[d[0] for d in DAMAGED])
def test_damaged_checkpoint_is_one_line_before_loading(request, tmp_path, capsys, monkeypatch,
                                                       name, which, flags, damage, message):
    import shutil

    import families
    import generate_flax as gf

    source = request.getfixturevalue("tiny_checkpoint" if which == "wan" else
                                     "hunyuan_checkpoint")
    ck = tmp_path / "ck"
    shutil.copytree(source, ck)
    damage(ck)
    for key, family in families.FAMILIES.items():
        monkeypatch.setitem(families.FAMILIES, key, dataclasses.replace(
            family, text=dataclasses.replace(
                family.text, load_pipeline=lambda *a, **k: pytest.fail("weights loaded"),
                encode_prompts=lambda *a, **k: pytest.fail("text encoder ran"),
                encode_text=lambda *a, **k: pytest.fail("text encoder ran"))))
    out = tmp_path / "out"
    code = gf.cli(["--model_id", str(ck), "--output_dir", str(out), "--work_dir",
                   str(tmp_path / "work"), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"generate_flax.py: error: --model_id='{ck}': "), lines[0]
    assert message in lines[0], lines[0]
    # Nothing written (a config the flag checks read stops before --output_dir is made).
    assert not out.exists() or not os.listdir(out)
    assert not (tmp_path / "work").exists()


def _bad_lora(tmp_path, checkpoint, case):
    """A LoRA file broken as ``case`` says; returns the --lora value."""
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, os.path.join(ROOT, "tools"))
    from tiny_lora import write_lora

    with open(os.path.join(checkpoint, "transformer", "config.json")) as f:
        cfg = json.load(f)
    path = tmp_path / "lora.safetensors"
    if case == "unmatched keys":
        good = write_lora(str(path), cfg, fmt="peft", layers=[0])
        good["transformer.blocks.0.attn1.to_zz.lora_A.weight"] = torch.zeros(4, 8)
        save_file(good, str(path))
    elif case == "wrong shape":
        good = write_lora(str(path), cfg, fmt="peft", layers=[0])
        good["transformer.blocks.0.attn1.to_q.lora_A.weight"] = torch.zeros(4, 7)
        save_file(good, str(path))
    elif case == "pickle":
        path = tmp_path / "lora.pt"
        torch.save({"x": torch.zeros(2)}, str(path))
    elif case == "truncated":
        write_lora(str(path), cfg, fmt="original", layers=[0])
        data = path.read_bytes()
        path.write_bytes(data[:len(data) - 100])
    elif case == "scale":
        write_lora(str(path), cfg, fmt="peft", layers=[0])
        return f"{path}:strong"
    return str(path)


BAD_LORA = [("unmatched keys", "1 key(s) match no transformer weight "
             "(transformer.blocks.0.attn1.to_zz.lora_A.weight)"),
            ("wrong shape", "does not fit its weight"),
            ("pickle", "pickled checkpoints are refused"),
            ("truncated", "not a readable safetensors file"),
            ("scale", "must be a number")]


@pytest.mark.parametrize("case,rule", BAD_LORA, ids=[b[0] for b in BAD_LORA])
def test_bad_lora_is_one_line_before_loading(tiny_checkpoint, tmp_path, case, rule):
    out = tmp_path / "out"
    value = _bad_lora(tmp_path, tiny_checkpoint, case)
    proc = run(["--model_id", tiny_checkpoint, "--output_dir", str(out), "--lora", value],
               timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--lora=" in lines[0] and rule in lines[0], lines[0]
    assert not out.exists() or not os.listdir(out)


def test_window_size_is_wan_only():
    """HunyuanVideo-1.5's joint attention appends text tokens: no 1-D window there."""
    import argparse

    from engine.run.config import check_attention_options
    from engine.run.errors import UsageError
    from families import FAMILIES

    args = argparse.Namespace(window_size=8, k_smoothing=False, attention="splash")
    with pytest.raises(UsageError, match=r"--window_size=8: not supported for HunyuanVideo"):
        check_attention_options(args, FAMILIES["hunyuanvideo"])
    check_attention_options(args, FAMILIES["wan"])
