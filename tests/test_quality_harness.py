"""benchmarks/quality.py, the quality harness (issue 53, item 6).

On the tiny random Wan checkpoint (2 steps, 64x96x9, one prompt of the shipped VBench list,
one seed) it runs the exact setting, the exact setting again and ``--quantize int8`` as
generate_flax.py subprocesses. The references are independent of the harness: PSNR from
NumPy (10 log10(1 / MSE) per frame, float64) on the saved frames; a rerun of the exact
setting must give equal frames (PSNR inf, SSIM 1.0), int8 must not. SSIM is Wang et al.
2004's on BT.601 luma: on a fixed pair it equals that paper's formula computed here in NumPy,
not scikit-image's default figure. The figures come from random weights: they prove the
harness, not int8's quality.
"""

import importlib.util
import io
import json
import math
import os
import subprocess
import sys
from contextlib import redirect_stdout

import numpy as np
import pytest
from safetensors.numpy import load_file
from serve_util import cpu_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "quality.py")
# scikit-image subtracts and squares float32 frames in float32 (the mean in float64); NumPy
# here does all of it in float64. Each float32 operation is within 2^-24 relative, so the MSEs
# agree within 3 * 2^-24 relative and the PSNRs within 10 log10(e) * 1.8e-7 = 7.8e-7 dB.
PSNR_TOL_DB = 1e-6
FLAGS = ("--height 64 --width 96 --frames 9 --num_inference_steps 2 --dtype float32 "
         "--attention xla --warmup_steps 1 --no_plots")


def _quality_module():
    """benchmarks/quality.py as a module (benchmarks/ is a folder of scripts)."""
    spec = importlib.util.spec_from_file_location("quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["quality"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


quality = _quality_module()


def _numpy_psnr(exact: np.ndarray, other: np.ndarray) -> float:
    """Mean over frames of 10 log10(1 / MSE), float64: the harness's PSNR, independently."""
    diff = exact.astype(np.float64) - other.astype(np.float64)
    mse = (diff ** 2).reshape(len(diff), -1).mean(axis=1)
    return float(np.mean(10 * np.log10(1.0 / mse)))


@pytest.fixture(scope="module")
def harness(tiny_checkpoint, tmp_path_factory):
    """One harness run: exact, the exact setting again, int8; (exit code, stdout, JSON)."""
    tmp = tmp_path_factory.mktemp("quality")
    prompts = tmp / "prompts.txt"
    # The shipped list's first prompt: the default file parses as the harness reads it.
    prompts.write_text(quality.read_prompts(quality.DEFAULT_PROMPTS)[0] + "\n")
    argv = ["--model_id", tiny_checkpoint, "--prompts", str(prompts), "--seeds", "7",
            "--flags", FLAGS, "--setting", "again=", "--setting", "int8=--quantize int8",
            "--output_dir", str(tmp / "out")]
    with pytest.MonkeyPatch.context() as mp:  # the runs: one fast-compiling CPU device
        mp.setenv("XLA_FLAGS", cpu_xla_flags(1))
        mp.setenv("JAX_PLATFORMS", "cpu")
        out = io.StringIO()
        with redirect_stdout(out):
            code = quality.main(argv)
    (path,) = (tmp / "out").glob("*/quality.json")
    return code, out.getvalue(), json.loads(path.read_text())


def _row(result, setting):
    (row,) = [r for r in result["videos"] if r["setting"] == setting]
    return row


def test_exact_rerun_gives_infinite_psnr_and_ssim_one(harness):
    code, stdout, result = harness
    assert code == 0
    row = _row(result, "again")
    assert row["psnr_db"] == "inf"  # JSON has no infinity: the string "inf"
    assert row["ssim"] == 1.0
    assert row["identical_frames"] == row["frames"] == 9
    assert result["settings"]["again"]["psnr_db_min"] == "inf"
    assert "| again | " in stdout and "| inf |" in stdout
    # The output says where its figures come from.
    assert "random weights" in stdout and "measured by users" in stdout
    assert result["note"] == quality.NOTE
    # The table and the JSON name the SSIM variant (Wang et al. 2004 on BT.601 luma).
    assert "SSIM (Wang 2004, Y)" in stdout and quality.SSIM_VARIANT in stdout
    assert result["ssim_variant"] == quality.SSIM_VARIANT


def test_int8_differs_and_its_psnr_equals_numpy(harness):
    _, _, result = harness
    row = _row(result, "int8")
    exact_run, int8_run = result["settings"]["exact"], result["settings"]["int8"]
    assert int8_run["flags"] == ["--quantize", "int8"]
    frames = {}
    for name, run in (("exact", exact_run), ("int8", int8_run)):
        folder = os.path.dirname(run["report"])
        (path,) = [p for p in os.listdir(folder) if p.endswith(".frames.safetensors")]
        frames[name] = load_file(os.path.join(folder, path))["frames"]
    assert frames["exact"].shape == (9, 64, 96, 3)
    assert not np.array_equal(frames["exact"], frames["int8"])
    assert row["identical_frames"] == 0
    assert math.isfinite(row["psnr_db"]) and 20 < row["psnr_db"] < 90
    assert row["psnr_db"] == pytest.approx(_numpy_psnr(frames["exact"], frames["int8"]),
                                           abs=PSNR_TOL_DB)
    assert 0 < row["ssim"] < 1
    # The times come from each run's JSON report.
    with open(int8_run["report"]) as f:
        report = json.load(f)
    assert int8_run["steady_s_per_step"] == report["timings"]["steady_s_per_step"] > 0
    assert row["denoise_s"] == report["videos"][0]["runs"][-1]["denoise_s"]
    assert int8_run["speedup_vs_exact"] == pytest.approx(
        exact_run["steady_s_per_step"] / int8_run["steady_s_per_step"])


def test_metrics_against_numpy_on_fixed_frames():
    rng = np.random.default_rng(0)
    exact = rng.random((3, 16, 16, 3), dtype=np.float32)
    other = exact.copy()
    # Unequal noise per frame: a mean of per-frame PSNRs differs from one PSNR of the video.
    for i, sigma in ((1, 0.02), (2, 0.1)):
        other[i] = np.clip(other[i] + rng.normal(0, sigma, other[i].shape), 0, 1)
    m = quality.video_metrics(exact, other)
    # Frame 0 is equal: infinite PSNR, left out of the mean; frames 1-2 from NumPy.
    assert m["psnr_db_frames"][0] == math.inf and m["identical_frames"] == 1
    assert m["psnr_db"] == pytest.approx(_numpy_psnr(exact[1:], other[1:]),
                                          abs=PSNR_TOL_DB)
    assert m["ssim_frames"][0] == 1.0 and all(0 < s < 1 for s in m["ssim_frames"][1:])
    assert quality.video_metrics(exact, exact)["psnr_db"] == math.inf
    assert quality.jsonable({"a": [math.inf, 1.5]}) == {"a": ["inf", 1.5]}
    with pytest.raises(quality.GenerationError, match="shapes differ"):
        quality.video_metrics(exact, exact[:2])


def _wang_ssim(x: np.ndarray, y: np.ndarray, data_range: float = 1.0) -> float:
    """Wang et al. 2004's mean SSIM of two (H, W) float64 images, straight from the paper's
    formulas: an 11x11 Gaussian window (sigma 1.5, normalised to sum 1), weighted means,
    population (co)variances sum w (x - mu_x)(y - mu_y), C1 = (0.01 L)^2, C2 = (0.03 L)^2,
    averaged over every window position wholly inside the image. That is scikit-image's
    border handling: it filters the whole image, then crops (11 - 1) // 2 = 5 pixels from
    each side of the SSIM map before the mean, leaving exactly these positions."""
    r = np.arange(-5, 6, dtype=np.float64)
    g = np.exp(-r ** 2 / (2 * 1.5 ** 2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    values = []
    for i in range(x.shape[0] - 10):
        for j in range(x.shape[1] - 10):
            px, py = x[i:i + 11, j:j + 11], y[i:i + 11, j:j + 11]
            mx, my = (w * px).sum(), (w * py).sum()
            vx, vy = (w * (px - mx) ** 2).sum(), (w * (py - my) ** 2).sum()
            cxy = (w * (px - mx) * (py - my)).sum()
            values.append((2 * mx * my + c1) * (2 * cxy + c2)
                          / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    return float(np.mean(values))


def _pattern_pair() -> tuple[np.ndarray, np.ndarray]:
    """A deterministic 16x16 RGB pattern in [0, 1] (float32) and a perturbed copy: a
    different perturbation per channel, so luma and per-channel SSIM disagree."""
    i, j, c = np.meshgrid(np.arange(16), np.arange(16), np.arange(3), indexing="ij")
    exact = 0.5 + 0.4 * np.sin(0.7 * i + 0.3 * j + c)
    other = np.clip(exact + 0.3 * np.cos(2.1 * i - 1.7 * j + 2.0 * c) * (c + 1) / 3, 0, 1)
    return exact.astype(np.float32), other.astype(np.float32)


def test_ssim_is_wang_2004_on_bt601_luma():
    from skimage.metrics import structural_similarity

    exact, other = _pattern_pair()
    # BT.601 luma, computed here apart from the harness (which takes skimage's rgb2yuv).
    luma = [f.astype(np.float64) @ np.array([0.299, 0.587, 0.114]) for f in (exact, other)]
    want = _wang_ssim(*luma)
    got = quality.video_metrics(exact[None], other[None])["ssim"]
    print(f"Wang 2004 on Y: harness {got!r}, NumPy {want!r}")
    assert got == pytest.approx(want, abs=1e-6)  # float64 on both sides: measured ~1e-16
    assert 0.5 < want < 0.99  # the pair is neither equal nor unrelated (measured 0.9527)
    assert quality.frame_ssim(exact, exact) == 1.0
    # The old figure (scikit-image's defaults: 7x7 uniform window, sample covariance, per RGB
    # channel) is another number: a harness still computing it fails the 1e-6 above.
    # Measured: Wang 2004 on Y 0.95273, the old figure 0.88213; each ingredient alone also
    # moves it: the 7x7 uniform window on the same Y 0.96316, the Gaussian window per RGB
    # channel 0.84996.
    old = structural_similarity(exact, other, channel_axis=-1, data_range=1.0)
    assert abs(old - want) > 1e-2, (old, want)
    uniform_on_y = structural_similarity(*luma, data_range=1.0)
    gaussian_on_rgb = structural_similarity(exact, other, channel_axis=-1, data_range=1.0,
                                            gaussian_weights=True, sigma=1.5,
                                            use_sample_covariance=False)
    assert abs(uniform_on_y - want) > 5e-3 and abs(gaussian_on_rgb - want) > 5e-2
    # The output names the variant.
    assert "Wang et al. 2004" in quality.METRIC and "BT.601" in quality.METRIC
    assert "gaussian_weights=True, sigma=1.5, use_sample_covariance=False" in quality.METRIC
    with pytest.raises(quality.GenerationError, match="smaller than SSIM's 11x11 window"):
        quality.frame_ssim(exact[:10], other[:10])


@pytest.mark.parametrize("extra, flag, words", [
    (["--model_id", "/no/such/folder"], "--model_id", "no such folder"),
    (["--prompts", "EMPTY"], "--prompts", "holds no prompt"),
    (["--seeds", "1,x"], "--seeds", "comma-separated integers"),
    (["--setting", "int8"], "--setting", "NAME=FLAGS"),
    (["--setting", "exact=--quantize int8"], "--setting", "reference run"),
    (["--setting", "a=--seed 3"], "--setting", "sets --seed"),
    (["--setting", "a=--bogus 1"], "--setting", "unrecognized arguments: --bogus"),
    (["--setting", "a=--cache deepcache"], "--setting", "--cache_start_step=11"),
    (["--setting", "a=--height 32"], "--setting", "makes 9x32x96 videos"),
    (["--setting", "a=", "--setting", "a=--quantize int8"], "--setting", "names two"),
    (["--flags", "--output_dir x"], "--flags", "sets --output_dir"),
    (["--flags", "--frames 8"], "--flags", "--frames"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_checkpoint, tmp_path, capsys, extra, flag,
                                          words):
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n\n")
    extra = [str(empty) if e == "EMPTY" else e for e in extra]
    out = tmp_path / "out"
    argv = ["--model_id", tiny_checkpoint, "--flags", FLAGS, "--output_dir", str(out), *extra]
    if "--flags" in extra:  # the case's own --flags replaces the default
        argv = ["--model_id", tiny_checkpoint, "--output_dir", str(out), *extra]
    assert quality.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"quality.py: error: {flag}")
    assert words in err
    assert not out.exists()  # nothing written, nothing run


def test_checks_start_no_jax_backend(tiny_checkpoint):
    # Each run's process must get the accelerator alone (a TPU belongs to one process): the
    # harness's own checks, generate_flax.py's parser and validate_args, start no backend.
    code = (f"import sys; sys.argv = ['quality']; sys.path.insert(0, {ROOT!r}); "
            "import importlib.util as u; "
            f"s = u.spec_from_file_location('quality', {SCRIPT!r}); q = u.module_from_spec(s); "
            "sys.modules['quality'] = q; s.loader.exec_module(q); "
            f"q.plan(q.parse_args(['--model_id', {tiny_checkpoint!r}, '--flags', {FLAGS!r}, "
            "'--setting', 'int8=--quantize int8'])); "
            "from jax._src import xla_bridge; print(xla_bridge.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
