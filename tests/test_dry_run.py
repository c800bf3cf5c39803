"""--dry_run: the real TPU compiler, no TPU, no weights, on a reduced 1.3B config."""

import glob
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dry_run_prints_per_chip_table_and_exits_by_fit(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"),
         "--model_id", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "--dry_run", "--topology", "v5e:2x2",
         "--dry_run_layers", "1", "--dry_run_skip_vae", "--height", "480", "--width", "832",
         "--frames", "21", "--flow_shift", "3.0", "--output_dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== Dry run: v5e:2x2 (4 chips)" in proc.stdout and "verdict: fits" in proc.stdout
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    report = json.loads(open(path).read())
    step = report["per_chip"][0]
    # One 1.3B block's bf16 weights split over tp=2 plus 1/2 of the replicated rest: well
    # under a v5e chip's 16 GiB; the compiler's own accounting must say so.
    assert step["program"] == "transformer step" and step["fits"]
    assert 0 < step["total_bytes"] < step["capacity_bytes"] == 16 * 2**30
    assert step["flops"] > 0 and report["mesh"] == {"dp": 2, "tp": 2, "sp": 1}
    assert report["tokens"] == 6 * 30 * 52 and report["fits"] is True


def test_dry_run_needs_a_topology(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--dry_run",
         "--output_dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--topology=None" in proc.stderr
