"""LTX-2 ``--lora``: diffusers/PEFT and Lightricks/ComfyUI keys, the transformer's deltas fused
at placement and the text connectors' at load, against diffusers' own ``load_lora_weights`` +
``fuse_lora`` on the eager ``LTX2Pipeline`` (float32, the tiny checkpoint of tests/test_ltx2.py,
its prompt, seed, size and CFG scales, 2 steps).

One random LoRA on every ``nn.Linear`` of the transformer (with ``lora_B.bias``) and on the
connectors' ``text_proj_in`` (no bias: the linear has none), written twice:

* diffusers/PEFT keys ``transformer.<module>.lora_A.weight`` / ``connectors.text_proj_in...``;
* Lightricks/ComfyUI keys, made here from the diffusers names by the INVERSE of diffusers'
  conversion (diffusers 0.42.1, loaders/lora_conversion_utils.py:2170-2216,
  ``_convert_non_diffusers_ltx2_lora_to_diffusers``: ``patchify_proj -> proj_in``, the
  ``av_ca_*`` tables, ``adaln_single. -> time_embed.`` at the start of a name, ...;
  ``text_embedding_projection.aggregate_embed`` -> ``connectors.text_proj_in``), written out
  below on its own (``TO_LIGHTRICKS``), not through ``families.ltx2.lora_state_dict``.

No ``lora_adapter_metadata``: diffusers then takes lora_alpha = r (factor = the scale).
"""

import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_ltx2 import _argv, _unpacked, diffusers_run, run_recorded

import generate_flax
from engine.files import embeddings_cache
from engine.weights import lora
from families import FAMILIES, ltx2

SCALE, RANK = 0.6, 4
# tests/test_ltx2.py's CFG case: one batch-2 pass, so the negative prompt's connector output
# (and its LoRA delta) enters the result too.
CFG = dict(guidance_scale=3.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=7.0,
           audio_stg_scale=0.0, audio_modality_scale=1.0)
# Measured max |ours - diffusers| on the 2-core CPU host, both key styles (LoRA at 0.6):
# frames 2.0e-6, waveform 1.0e-7, video latents 1.7e-6, audio latents 4.1e-6; the LoRA moves
# diffusers' frames by 0.47, its latents by 1.01 / 0.89 (waveform 8e-4); the connectors' part
# alone moves ours by 4.3e-4 (frames) .. 1.7e-3 (audio latents), > 20 x ATOL, so the parity
# also checks the connector fusing. Bound as tests/test_ltx2.py.
ATOL = 2e-5

# diffusers name fragment -> Lightricks name fragment: the converter's rename_dict read
# backwards, longest first (``audio_proj_in`` before ``proj_in``), applied once per name.
TO_LIGHTRICKS = (
    ("av_cross_attn_video_scale_shift", "av_ca_video_scale_shift_adaln_single"),
    ("av_cross_attn_video_a2v_gate", "av_ca_a2v_gate_adaln_single"),
    ("av_cross_attn_audio_scale_shift", "av_ca_audio_scale_shift_adaln_single"),
    ("av_cross_attn_audio_v2a_gate", "av_ca_v2a_gate_adaln_single"),
    ("audio_proj_in", "audio_patchify_proj"),
    ("proj_in", "patchify_proj"),
)
# Name starts: the converter's adaln_single / audio_adaln_single special case, backwards.
START_TO_LIGHTRICKS = (("audio_time_embed.", "audio_adaln_single."),
                       ("time_embed.", "adaln_single."))


def _lightricks_name(name: str) -> str:
    """diffusers transformer module name -> the Lightricks one (see TO_LIGHTRICKS)."""
    for new, old in START_TO_LIGHTRICKS:
        if name.startswith(new):
            return old + name[len(new):]
    for new, old in TO_LIGHTRICKS:
        if new in name:
            return name.replace(new, old)
    return name


def _linears(checkpoint) -> dict:
    """{(component, module): (out, in, has bias)}: every transformer linear, connectors'
    text_proj_in."""
    with open(os.path.join(checkpoint, "transformer", "config.json")) as f:
        cfg = json.load(f)
    model = ltx2.empty_transformer(cfg, torch.float32)
    out = {("transformer", n): (*m.weight.shape, m.bias is not None)
           for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    (shape,) = [s for n, s in ltx2.lora_host_components(checkpoint, torch.float32)[
        "connectors"].items() if n == "text_proj_in.weight"]
    out[("connectors", "text_proj_in")] = (*shape, False)
    return out


def _random_lora(checkpoint, seed=1, std=0.6) -> dict:
    """{(component, module): (A (r, in), B (out, r), lora_B.bias (out,) or None)}."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key, (o, i, bias) in _linears(checkpoint).items():
        out[key] = (torch.randn(RANK, i, generator=g) * (std / i ** 0.5),
                    torch.randn(o, RANK, generator=g) * (std / RANK ** 0.5),
                    torch.randn(o, generator=g) * 0.05 if bias else None)
    return out


def _write(path, pairs, style) -> dict:
    tensors = {}
    for (component, name), (a, b, bias) in pairs.items():
        if style == "peft":
            pre = f"{component}.{name}"
        elif component == "connectors":  # only text_proj_in has a Lightricks name
            pre = "text_embedding_projection." + name.replace("text_proj_in", "aggregate_embed")
        else:
            pre = "diffusion_model." + _lightricks_name(name)
        tensors.update({f"{pre}.lora_A.weight": a, f"{pre}.lora_B.weight": b})
        if bias is not None:
            tensors[f"{pre}.lora_B.bias"] = bias
    save_file(tensors, path)
    return tensors


@pytest.fixture(scope="module")
def files(ltx2_checkpoint, tmp_path_factory):
    """{"pairs", "peft", "lightricks"}: one random LoRA in both key styles."""
    folder = tmp_path_factory.mktemp("ltx2-lora")
    pairs = _random_lora(ltx2_checkpoint)
    out = {"pairs": pairs}
    for style in ("peft", "lightricks"):
        out[style] = str(folder / f"{style}.safetensors")
        out[style + "_keys"] = set(_write(out[style], pairs, style))
    return out


def _run_diffusers(pipe):
    """(frames, waveform, video latents, audio latents) of the CFG case."""
    return diffusers_run(pipe, CFG)


@pytest.fixture(scope="module")
def reference(ltx2_checkpoint, files):
    """diffusers' eager LTX2Pipeline: {"lora": outputs with the PEFT file loaded by
    ``load_lora_weights`` and fused by ``fuse_lora(components=["transformer", "connectors"],
    lora_scale=SCALE)``, "plain": without it}."""
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(ltx2_checkpoint, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    plain = _run_diffusers(pipe)
    pipe.load_lora_weights(files["peft"], low_cpu_mem_usage=False)
    pipe.fuse_lora(components=["transformer", "connectors"], lora_scale=SCALE)
    return {"lora": _run_diffusers(pipe), "plain": plain}


def _ours(checkpoint, lora_value):
    """(frames, waveform, video latents, audio latents, report) on one device, XLA
    attention."""
    config = generate_flax.validate_args(generate_flax.parse_args(
        _argv(checkpoint, CFG, "--attention", "xla", "--lora", lora_value)))
    run, frames, recorder = run_recorded(config, jax.devices()[:1])
    video_latents, audio_latents = _unpacked(recorder.latents)
    return (frames, np.asarray(run.programs.vae_decode.audio.waveform), video_latents,
            audio_latents, run.finish())


def _max_diff(ours, want) -> list:
    return [float(np.abs(np.asarray(o) - w).max()) for o, w in zip(ours[:4], want, strict=True)]


@pytest.mark.parametrize("style", ["peft", "lightricks"])
def test_loras_match_diffusers_fuse_lora(ltx2_checkpoint, files, reference, style):
    """Rank-4 LoRA on every transformer linear (with lora_B biases) and on the connectors'
    text_proj_in at scale 0.6: frames, waveform and both modalities' final latents equal
    diffusers' eager load_lora_weights + fuse_lora (bound ATOL), and the LoRA moves the
    frames and both latents beyond 100 x ATOL (measured in the log)."""
    want, plain = reference["lora"], reference["plain"]
    moved = _max_diff(want, plain)
    print(f"LoRA moves diffusers' frames/wave/video latents/audio latents by {moved}")
    for i in (0, 2, 3):
        assert moved[i] > 100 * ATOL, moved
    ours = _ours(ltx2_checkpoint, f"{files[style]}:{SCALE}")
    diffs = _max_diff(ours, want)
    print(f"{style}: max |ours - diffusers| frames/wave/video latents/audio latents {diffs}")
    for o, w in zip(ours[:4], want, strict=True):
        np.testing.assert_allclose(o, w, atol=ATOL, rtol=0)
    (entry,) = ours[4]["loras"]
    n_bias = sum(bias is not None for _, _, bias in files["pairs"].values())
    assert entry["matched_weights"] == len(files["pairs"]) + n_bias
    assert entry["keys"] == entry["converted_keys"] == len(files[style + "_keys"])
    assert entry["scale"] == SCALE


def test_lightricks_keys_convert_to_the_same_deltas(ltx2_checkpoint, files):
    """The Lightricks file carries the original names (patchify_proj, adaln_single, the
    av_ca_* tables, aggregate_embed) and loads to exactly the PEFT file's deltas, transformer
    and connectors; every linear of the LoRA is matched."""
    keys = files["lightricks_keys"]
    for needle in ("diffusion_model.patchify_proj.", "diffusion_model.audio_patchify_proj.",
                   "diffusion_model.adaln_single.", "diffusion_model.audio_adaln_single.",
                   "diffusion_model.av_ca_a2v_gate_adaln_single.",
                   "text_embedding_projection.aggregate_embed."):
        assert any(k.startswith(needle) for k in keys), needle
    shapes = lora.transformer_shapes(ltx2.empty_transformer(
        json.load(open(os.path.join(ltx2_checkpoint, "transformer", "config.json"))),
        torch.float32))
    host = ltx2.lora_host_components(ltx2_checkpoint, torch.float32)
    peft, light = (lora.load(files[s], SCALE, shapes, ltx2.lora_state_dict, "--lora", host)
                   for s in ("peft", "lightricks"))
    assert set(light.host) == {"connectors"}
    for x in (peft, light):
        assert set(x.weights) == {f"{n}.weight" for c, n in files["pairs"] if c == "transformer"}
        assert set(x.host["connectors"][0]) == {"text_proj_in.weight"}
    for (component, name), (a, b, bias) in files["pairs"].items():
        table = light.weights if component == "transformer" else light.host[component][0]
        la, lb, factor = table[f"{name}.weight"]
        assert torch.equal(la, a) and torch.equal(lb, b) and factor == SCALE
        if bias is not None:
            assert torch.equal(light.biases[f"{name}.bias"][0], bias)


def _one_line_refusal(capsys, argv, out, needle):
    code = generate_flax.cli([*argv, "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], err
    assert lines[0].startswith("generate_flax.py: error: --lora="), lines[0]
    assert not out.exists() or not os.listdir(out)


def test_bad_lora_files_are_one_line_before_loading(ltx2_checkpoint, files, tmp_path, capsys):
    """A Lightricks key that names no module (a fused to_qkv), a pickle suffix and a file
    that is not safetensors: exit 2, one line naming --lora, the file and the rule; nothing
    written."""
    base = ["--model_id", ltx2_checkpoint]
    bad = str(tmp_path / "bad.safetensors")
    save_file({"diffusion_model.transformer_blocks.0.attn1.to_qkv.lora_A.weight":
               torch.zeros(RANK, 32)}, bad)
    _one_line_refusal(capsys, [*base, "--lora", bad], tmp_path / "o1",
                      "1 key(s) match no transformer or connectors weight (transformer."
                      "transformer_blocks.0.attn1.to_qkv.lora_A.weight)")
    pickle = str(tmp_path / "lora.pt")
    with open(pickle, "wb") as f:  # refused by its suffix, never opened
        f.write(b"\x80\x04")
    _one_line_refusal(capsys, [*base, "--lora", pickle], tmp_path / "o2",
                      "pickled checkpoints are refused")
    garbage = str(tmp_path / "garbage.safetensors")
    with open(garbage, "wb") as f:
        f.write(b"not a safetensors file")
    _one_line_refusal(capsys, [*base, "--lora", garbage], tmp_path / "o3",
                      "not a readable safetensors file")


def test_embeddings_cache_key_names_a_connector_lora(ltx2_checkpoint, files):
    """A LoRA that changes the connectors changes the texts' embeddings, so the prompt cache
    key carries its sha256 and scale; without a LoRA the key has no such field (earlier
    entries still hit)."""
    def parts(*extra):
        config = generate_flax.validate_args(generate_flax.parse_args(
            _argv(ltx2_checkpoint, CFG, *extra)))
        cache = embeddings_cache.EmbeddingsCache(None, FAMILIES["ltx2"], "digest")
        return cache.key_parts(config, "a prompt")

    plain = parts()
    assert "host_loras" not in plain
    with_lora = parts("--lora", f"{files['peft']}:{SCALE}")
    (entry,) = with_lora.pop("host_loras")
    assert entry[1] == SCALE and len(entry[0]) == 64 and with_lora == plain
