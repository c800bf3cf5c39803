"""``--estimate``'s whole video (engine/dry_run/whole_video.py): the parts a user waits for,
each with its kind, adding up; the host's matmul rate is a timed measurement; the encoder
FLOPs equal a hand count. Deviceless libtpu compiles on the tiny random checkpoints; every
figure is an estimate or a measurement on this host, nothing is checked on a TPU."""

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from engine.dry_run import price_host, price_text, whole_video
from engine.files.checkpoint import read_component_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def umt5_flops(cfg: dict, tokens: int) -> int:
    """A UMT5 encoder's matmul FLOPs on ``tokens`` tokens, by hand from its config: per layer
    q, k, v and o (d_model x heads*d_kv each), the scores and their product with V
    (tokens^2 x heads*d_kv each), the gated-GELU FFN's two input projections and its output
    (d_model x d_ff each); 2 FLOPs per multiply-add."""
    t, d, inner, ff = tokens, cfg["d_model"], cfg["num_heads"] * cfg["d_kv"], cfg["d_ff"]
    per_layer = 4 * 2 * t * d * inner + 2 * 2 * t * t * inner + 3 * 2 * t * d * ff
    return cfg["num_layers"] * per_layer


def test_encoder_flops_equal_a_hand_count(tiny_checkpoint):
    cfg = read_component_config(tiny_checkpoint, "text_encoder")
    for tokens in (16, 40):
        call = dict(folder="text_encoder", lib="transformers", cls="UMT5EncoderModel",
                    cfg=cfg, kind="text", tokens=tokens, per_video=True)
        assert price_text.encoder_flops(call) == umt5_flops(cfg, tokens)
    assert umt5_flops(cfg, 16) == 720_896  # d 32, 4 x 8 heads, d_ff 64, 2 layers


def test_host_matmul_rate_is_a_timed_measurement():
    out = price_host.matmul_rate(96, 128, 256, dtype=torch.bfloat16, seconds=0.3)
    assert out["kind"] == "host measurement" and out["calls"] >= 1
    assert out["seconds"] >= 0.3 and out["rows_measured"] <= 96
    # The rate is the FLOPs done over the time they took: nothing else enters it.
    done = 2 * out["rows_measured"] * 128 * 256 * out["calls"]
    assert out["flops_per_s"] == pytest.approx(done / out["seconds"], rel=1e-12)
    assert out["flops_per_s"] > 0 and out["host"]["cpus"] >= 1


def dry_run(checkpoint: str, tmp_path, *flags) -> tuple:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id", checkpoint,
         "--dry_run", "--estimate", "--topology", "v5e:2x2", "--dry_run_layers", "1",
         "--attention", "xla", "--output_dir", str(tmp_path), "--no_plots", *flags],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    return proc, json.loads(open(path).read())


WAN = ("tiny_checkpoint", ["--height", "32", "--width", "32", "--frames", "5",
                           "--num_inference_steps", "3"], 5, 32, 32)
FAMILIES = [
    pytest.param(*WAN, id="wan"),
    pytest.param("hunyuan_checkpoint", ["--height", "32", "--width", "32", "--frames", "5",
                                        "--num_inference_steps", "2"], 5, 32, 32,
                 id="hunyuan", marks=pytest.mark.slow),
    pytest.param("ltx2_checkpoint", ["--height", "64", "--width", "96", "--frames", "9",
                                     "--num_inference_steps", "2"], 9, 64, 96,
                 id="ltx2", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("fixture,flags,frames,height,width", FAMILIES)
def test_whole_video_is_the_sum_of_its_labelled_parts(request, tmp_path, fixture, flags,
                                                      frames, height, width):
    checkpoint = request.getfixturevalue(fixture)
    proc, report = dry_run(checkpoint, tmp_path, *flags)
    est = report["estimate"]
    parts = est["whole_video_parts"]
    assert est["whole_video_missing"] == []
    assert list(parts) == ["text_encode", "denoise", "decode", "postprocess_and_mp4"]
    assert all(p["kind"] in whole_video.KINDS and p["seconds"] > 0 for p in parts.values())
    assert est["whole_video_seconds"] == pytest.approx(
        sum(p["seconds"] for p in parts.values()), abs=1e-9)
    assert parts["text_encode"]["kind"] == parts["postprocess_and_mp4"]["kind"] == \
        "host measurement"
    assert parts["denoise"]["kind"] == "compiled estimate"
    assert parts["decode"]["kind"] in ("compiled estimate", "floor")
    assert parts["decode"]["seconds"] >= parts["decode"]["floor_s"]
    # Denoising: the run's steps x the step estimate (no sparse plan, no cache, one expert).
    steps = int(flags[flags.index("--num_inference_steps") + 1])
    assert parts["denoise"]["seconds"] == pytest.approx(steps * est["seconds_per_step"],
                                                        rel=1e-12)
    # The text encode on the host: every per-video call's FLOPs / its shape's measured rate;
    # on the mesh it replaces the host's in the other total.
    calls = [e for e in est["text_encoders"] if e["per_video"]]
    rates = parts["text_encode"]["rates"]
    assert calls and all(r["calls"] >= 1 and r["seconds"] >= 1.0 for r in rates.values())
    assert parts["text_encode"]["seconds"] == pytest.approx(
        sum(e["flops"] / rates[e["host_rate"]]["flops_per_s"] for e in calls), rel=1e-12)
    mesh = est["text_encode_mesh"]
    assert mesh["kind"] == "compiled estimate" and mesh["seconds"] > 0
    assert est["text_encoder_device"] == "cpu"  # the default: the host part is in the total
    assert est["whole_video_seconds_mesh_encoders"] == pytest.approx(
        est["whole_video_seconds"] - parts["text_encode"]["seconds"] + mesh["seconds"],
        abs=1e-9)
    assert est["whole_video_seconds_host_encoders"] == pytest.approx(est["whole_video_seconds"],
                                                                    abs=1e-9)
    # The mp4 measured at the run's own size and frame count.
    write = parts["postprocess_and_mp4"]
    assert (write["frames"], write["height"], write["width"]) == (frames, height, width)
    assert write["seconds"] == pytest.approx(write["uint8_s"] + write["write_s"], abs=1e-12)
    assert "whole video" in proc.stdout and "host measurement" in proc.stdout
    if fixture == "tiny_checkpoint":  # the UMT5 call at the pipeline's 512 tokens
        cfg = read_component_config(checkpoint, "text_encoder")
        (call,) = calls
        assert (call["tokens"], call["flops"]) == (512, umt5_flops(cfg, 512))
    if fixture == "ltx2_checkpoint":  # the sound is muxed, the connectors priced too
        assert write["audio"] and {e["kind"] for e in calls} == {"text", "connector"}
