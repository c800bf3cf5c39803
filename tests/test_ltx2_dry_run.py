"""``--dry_run --estimate`` for LTX-2 (families/ltx2.py) on the tiny random checkpoint
(tools/make_tiny_ltx2_checkpoint.py; our weights are random; deviceless libtpu compiles, no
TPU, nothing measured on hardware).

The references are diffusers' own modules loaded from the checkpoint (``from_pretrained``):
the bytes the dry run places per chip are the tiny model's, and the decode's meta model
(``ltx2.empty_vae``) is the run's ``AudioVideoDecode`` parameter for parameter.
"""

import glob
import json
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import generate_flax
from engine.files.checkpoint import read_component_config
from families import ltx2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZE = dict(height=64, width=96, frames=9)  # 2 latent frames x 2 x 3 = 12 video tokens
# The Megatron split (families/ltx2.py's rules, written out here from diffusers' module
# names): q/k/v and the MLP up projection by rows, out and down projections by columns.
_BLOCK = r"transformer_blocks\.\d+\."
_ATTN = _BLOCK + r"(attn1|attn2|audio_attn1|audio_attn2|audio_to_video_attn|video_to_audio_attn)"
SPLIT = re.compile(rf"{_ATTN}\.(to_q|to_k|to_v)\.(weight|bias)$|{_ATTN}\.to_out\.0\.weight$|"
                   rf"{_BLOCK}(ff|audio_ff)\.net\.0\.proj\.(weight|bias)$|"
                   rf"{_BLOCK}(ff|audio_ff)\.net\.2\.weight$")


def _bytes(module, keep=lambda name: True) -> int:
    return sum(t.numel() * t.element_size() for name, t in
               [*module.named_parameters(), *module.named_buffers()] if keep(name))


def _defaults_config(**video):
    """The parts of a ``RunConfig`` the LTX-2 functions read, at the family's defaults."""
    options = {name: default for name, (default, _) in ltx2.OPTIONS.items()}
    return types.SimpleNamespace(
        video=types.SimpleNamespace(guidance_scale=ltx2.DEFAULTS["guidance_scale"],
                                    options=options, fps=ltx2.DEFAULTS["fps"], **video),
        model=types.SimpleNamespace(dtype="bfloat16", model_id=None),
        upscale=None)  # no --sr 2x


def _decode_parts(checkpoint):
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    return [cls.from_pretrained(checkpoint, subfolder=sub).float() for cls, sub in (
        (AutoencoderKLLTX2Video, "vae"), (AutoencoderKLLTX2Audio, "audio_vae"),
        (LTX2Vocoder, "vocoder"))]


def test_decode_meta_model_is_the_runs_decode(ltx2_checkpoint):
    """``empty_vae`` builds, with no weights, the module a run loads and compiles: the same
    parameters and buffers (names, shapes, float32) as diffusers' ``from_pretrained`` of the
    three components, laid out for the run's video size."""
    config = _defaults_config(**SIZE)
    meta = ltx2.empty_vae(ltx2_checkpoint, config)
    for name, real in zip(("video", "audio", "vocoder"), _decode_parts(ltx2_checkpoint),
                          strict=True):
        got = {k: (tuple(v.shape), v.dtype) for k, v in getattr(meta, name).state_dict().items()}
        assert got == {k: (tuple(v.shape), v.dtype) for k, v in real.state_dict().items()}
    assert meta.geometry == ltx2.run_layout(ltx2_checkpoint, **SIZE)
    assert meta.geometry["video_tokens"] == 12 and meta.run_dtype == torch.bfloat16


def test_dry_run_estimate_counts_every_guidance_pass(ltx2_checkpoint, tmp_path):
    """The tiny checkpoint's dry run with --estimate on v5e:2x2 at dp2 x tp2 (given: the
    default is dp1, ``test_default_layout_serves_the_batch_1_passes``), one block compiled,
    at the family's default scales (CFG + STG + modality isolation; the STG pass skipped:
    LTX-2.0's perturbed_attn false makes it the plain pass, ``ltx2.stg_perturbs``)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "generate_flax.py"), "--model_id", ltx2_checkpoint,
         "--dry_run", "--estimate", "--topology", "v5e:2x2", "--dry_run_layers", "1",
         "--dry_run_skip_vae", "--dp", "2", "--tp", "2", "--height", str(SIZE["height"]),
         "--width", str(SIZE["width"]),
         "--frames", str(SIZE["frames"]), "--output_dir", str(tmp_path), "--no_plots"],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = glob.glob(str(tmp_path / "*_dry_run.json"))
    report = json.loads(open(path).read())
    assert report["mesh"] == {"dp": 2, "tp": 2, "sp": 1} and report["tokens"] == 12
    assert "verdict: fits" in proc.stdout

    # Per step: the CFG pair (one call of batch 2) and the modality pass (batch 1): 3 samples,
    # as many as the family's own count (diffusers runs a 4th, the STG pass equal to the plain
    # one: tests/test_ltx2_recipes.py).
    est = report["estimate"]
    assert sorted((p["batch"], p["count"]) for p in est["passes"]) == [(1, 1), (2, 1)]
    assert est["samples_per_step"] == ltx2.sample_passes(_defaults_config()) == 3
    assert "model passes per step            2" in proc.stdout
    # Both blocks counted though one was compiled. Only the CFG pair reaches the kernel: a
    # batch-1 pass cannot split over dp=2 and takes XLA attention (as a run does), so per
    # block one kernel call of 1 sample x 2/2 heads x 1 q block x 1 kv block.
    assert est["layers"] == 2 and est["attention"]["self"]["grid_steps"] == 2
    assert est["seconds_per_step"] == pytest.approx(sum(est["parts"].values()))
    # The analytic FLOPs count all 3 samples; the report's are the one block compiled.
    cfg = json.load(open(os.path.join(ltx2_checkpoint, "transformer", "config.json")))
    config = _defaults_config(**SIZE)
    config.model.model_id = ltx2_checkpoint
    assert report["analytic_transformer_flops_per_step"] == pytest.approx(
        ltx2.transformer_flops(dict(cfg, num_layers=1), config))

    # The bytes placed are the tiny model's, as diffusers loads it: the transformer in bf16
    # (one block), the decode's weights in float32 (every weight but the two encoders).
    from diffusers import LTX2VideoTransformer3DModel

    transformer = LTX2VideoTransformer3DModel.from_pretrained(
        ltx2_checkpoint, subfolder="transformer", torch_dtype=torch.bfloat16)
    one_block = lambda name: not name.startswith("transformer_blocks.1.")  # noqa: E731
    total = _bytes(transformer, one_block)
    split = _bytes(transformer, lambda n: one_block(n) and bool(SPLIT.match(n)))
    assert 0 < split < total
    assert split == 2 * sum(report["sharding_rule_matches"].values())  # bf16, 2 bytes each
    video, audio, vocoder = _decode_parts(ltx2_checkpoint)
    decode = (_bytes(video, lambda n: not n.startswith("encoder."))
              + _bytes(audio, lambda n: not n.startswith("encoder.")) + _bytes(vocoder))
    step = report["per_chip"][0]
    assert step["program"] == "transformer step" and step["resident_bytes"] == decode
    # The one host reads every weight once; a chip holds half of each tp-split weight.
    assert report["hosts"]["weight_bytes"] == [total + decode]
    assert step["argument_bytes"] >= total - split // 2


@pytest.mark.parametrize("topology,chip,scales,want", [
    ("v6e:2x4", "v6e", [], (1, 8, 1)),  # defaults: CFG + STG + modality
    ("tpu7x:2x2x1", "tpu7x", [], (1, 1, 8)),
    ("tpu7x:2x2x1", "tpu7x", ["--stg_scale", "0", "--audio_stg_scale", "0", "--modality_scale",
                              "1", "--audio_modality_scale", "1"], (2, 1, 4)),  # CFG only
])
def test_default_layout_serves_the_batch_1_passes(topology, chip, scales, want):
    """The real LTX-2 config's default mesh: dp1 when a step runs batch-1 passes (STG,
    modality isolation), which on dp2 would run twice and miss the kernel's dp split (the
    static estimates in benchmarks/dry_run_results.md: tpu7x 0.434 -> 0.183 s/step, v6e
    0.496 -> 0.445); dp2 for the CFG pair alone, as for the other families."""
    from engine.run import chips
    from engine.weights.layout import resolve_run_mesh
    from families import FAMILIES

    config = generate_flax.validate_args(generate_flax.parse_args(
        ["--model_id", "Lightricks/LTX-2", "--dry_run", "--topology", topology, *scales]))
    cfg = read_component_config("Lightricks/LTX-2", "transformer")
    shape = resolve_run_mesh(config, FAMILIES["ltx2"], cfg, 8, chips.CHIPS[chip])
    assert (shape.dp, shape.tp, shape.sp) == want
