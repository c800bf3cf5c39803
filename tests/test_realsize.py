"""benchmarks/realsize.py: its real scale is the shipped Wan 2.1 T2V 1.3B, and at CPU scale it
runs end to end (our script in a subprocess against diffusers' eager WanPipeline) with float32
frames equal to diffusers' within summation-order rounding."""

import importlib.util
import json
import os
import subprocess
import sys

import accelerate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "realsize.py")


def _realsize_module():
    """benchmarks/realsize.py as a module (benchmarks/ is a folder of scripts)."""
    spec = importlib.util.spec_from_file_location("realsize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["realsize"] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_real_scale_is_the_shipped_1_3b_architecture():
    # On the meta device: the sizes without 6 GB of random weights.
    realsize = _realsize_module()
    with accelerate.init_empty_weights():
        pipe = realsize.build_pipeline(realsize.SCALES["real"])
    count = lambda m: sum(p.numel() for p in m.parameters())
    # 1.419 B and 126.9 M: Wan2.1-T2V-1.3B-Diffusers' transformer and VAE.
    assert round(count(pipe.transformer) / 1e6) == 1419
    assert round(count(pipe.vae) / 1e5) == 1269
    assert pipe.transformer.config.num_layers == 30
    assert pipe.text_encoder.config.d_model == pipe.transformer.config.text_dim == 4096
    assert pipe.text_encoder.config.num_layers == 1


def test_cpu_scale_run_matches_diffusers_in_float32(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--scale", "cpu", "--checkpoint", str(tmp_path / "ckpt"),
         "--output_dir", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "realsize.json") as f:
        result = json.load(f)
    (run,) = result["results"]  # float32 at 64x96x9 only: no --bf16, no --torch_compile
    assert (run["dtype"], run["frames"], run["height"], run["width"]) == ("float32", 9, 64, 96)
    parity = run["parity"]
    # Same math in float32 on both sides: max |diff| <= 1e-3 on [0, 1] frames, as
    # tests/test_pipeline_parity.py asks (measured here: 0.001 levels max, 1e-4 mean).
    assert parity["max_abs_levels"] <= 1e-3 * 255, parity
    assert parity["mean_abs_levels"] < 0.05, parity
    assert parity["reference_std"] > 0.01  # not a flat video, or parity would prove nothing
    ours, theirs = run["ours"], run["diffusers"]
    assert ours["device"].endswith("(cpu)") and theirs["device"].startswith("CPU (")
    assert ours["s_per_step"] > 0 and theirs["s_per_step"] > 0 and ours["cold_start_s"] > 0
    # A CPU reports no device memory; the table says n/a rather than a made-up zero.
    assert ours["peak_bytes"] is None and theirs["peak_bytes"] is None
    assert "| float32, 64x96x9, 4 steps | eager |" in proc.stdout
    assert result["checkpoint"]["transformer_params"] > 0


def test_scale_auto_takes_the_cpu_size_without_an_accelerator(monkeypatch):
    """No flags on a CPU host once built the real size and was killed by the OOM killer:
    ``--scale auto`` (the default) follows the platform ours would run on."""
    realsize = _realsize_module()
    pick = realsize.pick_scale
    assert pick("", "cpu") == "cpu" and pick("", None) == "cpu"  # no accelerator, or unknown
    assert pick("", "gpu") == "real" and pick("", "tpu") == "real"
    # JAX_PLATFORMS wins over the probe: its first entry is what ours gets.
    assert pick("cpu", "gpu") == "cpu" and pick("cuda,cpu", "cpu") == "real"
    assert pick(" tpu ", None) == "real"

    def no_probe():
        raise AssertionError("JAX_PLATFORMS is set: no probe")

    monkeypatch.setattr(realsize, "jax_backend", no_probe)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    args = realsize.parse_args([])
    assert (args.scale, args.height, args.width, args.frames) == ("cpu", 64, 96, 9)
    assert args.checkpoint.endswith("realsize-wan2.1-1.3b-cpu")
    # An explicit --scale is kept and asks nothing.
    assert realsize.parse_args(["--scale", "real"]).scale == "real"
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setattr(realsize, "jax_backend", lambda: "gpu")
    assert realsize.parse_args([]).checkpoint.endswith("realsize-wan2.1-1.3b")


def test_no_float32_needs_bf16(capsys):
    realsize = _realsize_module()
    args = realsize.parse_args(["--scale", "cpu", "--bf16", "--no_float32"])
    assert args.no_float32 and args.bf16
    try:
        realsize.parse_args(["--scale", "cpu", "--no_float32"])
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("--no_float32 without --bf16 was accepted")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["--no_float32: needs --bf16 (without it no run is left)"]
