"""HunyuanVideo-1.5 ``--lora``: official (Tencent) and diffusers/PEFT keys, fused at placement,
against diffusers' own ``load_lora_adapter`` + ``fuse_lora`` on the eager pipeline.

The official-key file is written here from the diffusers-named random LoRA by the INVERSE of
diffusers' conversion (huggingface/diffusers @ 9cc3601a3acdfdd0911ead713cb9e1eafc3a17de,
scripts/convert_hunyuan_video1_5_to_diffusers.py, ``convert_hyvideo15_transformer_to_diffusers``),
written out below on its own, not through ``families.hunyuan_lora``: a wrong entry in that
module's table sends a delta to the wrong weight and the frames leave diffusers'.
The official names are those of Tencent-Hunyuan/HunyuanVideo-1.5 @ 60783e7
(``HunyuanVideo_1_5_DiffusionTransformer``, hyvideo/models/transformers/); its train.py
trains ``LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")`` and saves
``get_peft_model_state_dict`` keys without a prefix, the config as ``lora_adapter_metadata``.
"""

import json
import os

import jax
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import generate_flax
from engine.pipeline import generate
from engine.run.errors import UsageError
from engine.weights import lora
from families import FAMILIES, hunyuan, hunyuan_lora

PROMPT = 'A sign that says "hello"'  # quoted: the ByT5 projection (context_embedder_2) runs
SHAPE = dict(height=48, width=80, frames=9)
STEPS, SEED, SCALE, RANK = 2, 3, 0.7, 4

# diffusers module -> official module ("{i}": block index), the conversion script read
# backwards. Not here: the refiner's to_q/to_k/to_v (one fused official self_attn_qkv,
# concatenated in _official below) and norm_out.linear (final_layer.adaLN_modulation.1 with
# its row halves swapped back, swap_scale_shift being its own inverse).
TO_OFFICIAL = {
    "time_embed.timestep_embedder.linear_1": "time_in.mlp.0",
    "time_embed.timestep_embedder.linear_2": "time_in.mlp.2",
    "context_embedder.time_text_embed.timestep_embedder.linear_1": "txt_in.t_embedder.mlp.0",
    "context_embedder.time_text_embed.timestep_embedder.linear_2": "txt_in.t_embedder.mlp.2",
    "context_embedder.time_text_embed.text_embedder.linear_1": "txt_in.c_embedder.linear_1",
    "context_embedder.time_text_embed.text_embedder.linear_2": "txt_in.c_embedder.linear_2",
    "context_embedder.proj_in": "txt_in.input_embedder",
    "context_embedder.token_refiner.refiner_blocks.{i}.attn.to_out.0":
        "txt_in.individual_token_refiner.blocks.{i}.self_attn_proj",
    "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.0.proj":
        "txt_in.individual_token_refiner.blocks.{i}.mlp.fc1",
    "context_embedder.token_refiner.refiner_blocks.{i}.ff.net.2":
        "txt_in.individual_token_refiner.blocks.{i}.mlp.fc2",
    "context_embedder.token_refiner.refiner_blocks.{i}.norm_out.linear":
        "txt_in.individual_token_refiner.blocks.{i}.adaLN_modulation.1",
    "context_embedder_2.linear_1": "byt5_in.fc1",
    "context_embedder_2.linear_2": "byt5_in.fc2",
    "context_embedder_2.linear_3": "byt5_in.fc3",
    "image_embedder.linear_1": "vision_in.proj.1",
    "image_embedder.linear_2": "vision_in.proj.3",
    "transformer_blocks.{i}.norm1.linear": "double_blocks.{i}.img_mod.linear",
    "transformer_blocks.{i}.norm1_context.linear": "double_blocks.{i}.txt_mod.linear",
    "transformer_blocks.{i}.attn.to_q": "double_blocks.{i}.img_attn_q",
    "transformer_blocks.{i}.attn.to_k": "double_blocks.{i}.img_attn_k",
    "transformer_blocks.{i}.attn.to_v": "double_blocks.{i}.img_attn_v",
    "transformer_blocks.{i}.attn.to_out.0": "double_blocks.{i}.img_attn_proj",
    "transformer_blocks.{i}.attn.add_q_proj": "double_blocks.{i}.txt_attn_q",
    "transformer_blocks.{i}.attn.add_k_proj": "double_blocks.{i}.txt_attn_k",
    "transformer_blocks.{i}.attn.add_v_proj": "double_blocks.{i}.txt_attn_v",
    "transformer_blocks.{i}.attn.to_add_out": "double_blocks.{i}.txt_attn_proj",
    "transformer_blocks.{i}.ff.net.0.proj": "double_blocks.{i}.img_mlp.fc1",
    "transformer_blocks.{i}.ff.net.2": "double_blocks.{i}.img_mlp.fc2",
    "transformer_blocks.{i}.ff_context.net.0.proj": "double_blocks.{i}.txt_mlp.fc1",
    "transformer_blocks.{i}.ff_context.net.2": "double_blocks.{i}.txt_mlp.fc2",
    "proj_out": "final_layer.linear",
}
REFINER_QKV = "context_embedder.token_refiner.refiner_blocks.{i}.attn.to_"


def _config(checkpoint) -> dict:
    with open(os.path.join(checkpoint, "transformer", "config.json")) as f:
        return json.load(f)


def _linears(cfg) -> dict:
    """{diffusers module: (out, in)} of every nn.Linear of the transformer (all-linear)."""
    model = hunyuan.empty_transformer(cfg, torch.float32)
    return {n: tuple(m.weight.shape) for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)}


def _random_lora(cfg, seed=1, std=0.6) -> dict:
    """{diffusers module: (A (r, in), B (out, r), lora_B.bias (out,))} on every linear; the
    refiner's q, k and v share one A, as the one official fused linear they come from."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (o, i) in _linears(cfg).items():
        a = torch.randn(RANK, i, generator=g) * (std / i ** 0.5)
        if ".token_refiner." in name and name.endswith(("attn.to_k", "attn.to_v")):
            a = out[name[:-1] + "q"][0].clone()
        out[name] = (a, torch.randn(o, RANK, generator=g) * (std / RANK ** 0.5),
                     torch.randn(o, generator=g) * 0.05)
    return out


def _metadata(targets) -> str:
    """A PEFT LoraConfig as diffusers' save_lora_adapter writes it: lora_alpha / r = 2."""
    from peft import LoraConfig

    cfg = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=sorted(targets),
                     lora_bias=True).to_dict()
    return {k: sorted(v) if isinstance(v, set) else v for k, v in cfg.items()}


def _write_peft(path, pairs, prefix="transformer."):
    """diffusers/PEFT keys; the metadata packed under "transformer." (diffusers' pipeline-level
    save_lora_weights) when prefixed, plain (the model-level save_lora_adapter) when not."""
    tensors = {}
    for name, (a, b, bias) in pairs.items():
        tensors.update({f"{prefix}{name}.lora_A.weight": a, f"{prefix}{name}.lora_B.weight": b,
                        f"{prefix}{name}.lora_B.bias": bias})
    meta = _metadata(pairs)
    if prefix:
        meta = {f"{prefix}{k}": v for k, v in meta.items()}
    save_file(tensors, path, metadata={"lora_adapter_metadata": json.dumps(meta)})


def _official(pairs) -> dict:
    """{official module: (A, B, bias)}: the conversion script inverted."""
    out = {}
    for name, (a, b, bias) in pairs.items():
        i = name.split(".")[1] if name.startswith("transformer_blocks.") else (
            name.split(".")[3] if ".refiner_blocks." in name else None)
        generic = name.replace(f".{i}.", ".{i}.", 1) if i is not None else name
        if generic in TO_OFFICIAL:
            out[TO_OFFICIAL[generic].format(i=i)] = (a, b, bias)
        elif generic == "norm_out.linear":  # (scale, shift) -> the original (shift, scale)
            half = b.shape[0] // 2
            out["final_layer.adaLN_modulation.1"] = (
                a, torch.cat([b[half:], b[:half]]), torch.cat([bias[half:], bias[:half]]))
        elif generic.startswith(REFINER_QKV) and generic.endswith("q"):
            qkv = [pairs[generic.format(i=i)[:-1] + p] for p in "qkv"]
            out[f"txt_in.individual_token_refiner.blocks.{i}.self_attn_qkv"] = (
                a, torch.cat([x[1] for x in qkv]), torch.cat([x[2] for x in qkv]))
        elif not generic.startswith(REFINER_QKV):
            raise AssertionError(f"no official name for {name}")
    return out


def _write_official(path, pairs, prefix=""):
    official = _official(pairs)
    tensors = {}
    for name, (a, b, bias) in official.items():
        tensors.update({f"{prefix}{name}.lora_A.weight": a, f"{prefix}{name}.lora_B.weight": b,
                        f"{prefix}{name}.lora_B.bias": bias})
    save_file(tensors, path,
              metadata={"lora_adapter_metadata": json.dumps(_metadata(official))})
    return tensors


@pytest.fixture(scope="module")
def files(hunyuan_checkpoint, tmp_path_factory):
    """{"pairs", "peft", "official"}: one random all-linear LoRA in both key formats."""
    folder = tmp_path_factory.mktemp("hunyuan-lora")
    pairs = _random_lora(_config(hunyuan_checkpoint))
    out = {"pairs": pairs, "peft": str(folder / "peft.safetensors"),
           "official": str(folder / "official.safetensors")}
    _write_peft(out["peft"], pairs)
    _write_official(out["official"], pairs)
    return out


def _reference(checkpoint, peft_path):
    """diffusers' eager HunyuanVideo15Pipeline: (frames with the LoRA loaded by
    ``transformer.load_lora_adapter`` and fused at SCALE, frames without it)."""
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(checkpoint, use_safetensors=True)
    pipe.set_progress_bar_config(disable=True)

    def run():
        with torch.no_grad():
            return pipe(prompt=PROMPT, num_frames=SHAPE["frames"], height=SHAPE["height"],
                        width=SHAPE["width"], num_inference_steps=STEPS, output_type="np",
                        generator=torch.Generator("cpu").manual_seed(SEED)).frames[0]

    plain = run()
    # use_safetensors=True, as the official generate.py passes it: without it diffusers reads
    # no lora_adapter_metadata (lora_alpha would default to r). low_cpu_mem_usage=False: every
    # PEFT tensor materialised (see test_pipeline_parity).
    pipe.transformer.load_lora_adapter(peft_path, prefix="transformer", use_safetensors=True,
                                       low_cpu_mem_usage=False)
    pipe.transformer.fuse_lora(lora_scale=SCALE)
    return run(), plain


def _ours(checkpoint, lora_value, *extra, devices=None):
    config = generate_flax.validate_args(generate_flax.parse_args([
        "--model_id", checkpoint, "--prompt", PROMPT, "--dtype", "float32",
        "--seed", str(SEED), "--num_inference_steps", str(STEPS), "--num_iterations", "1",
        "--warmup_steps", "0", "--height", str(SHAPE["height"]), "--width",
        str(SHAPE["width"]), "--frames", str(SHAPE["frames"]), "--attention", "xla",
        "--compilation_cache_dir", "none", "--lora", lora_value, *extra]))
    return generate(config, FAMILIES[config.model.family], devices=devices)


def test_official_and_peft_loras_match_diffusers_fuse_lora(hunyuan_checkpoint, files):
    """All-linear rank-4 LoRA (lora_alpha / r = 2, lora_B biases) at scale 0.7: the official-
    key file on one device and the PEFT-key file on dp1 x tp2 (q/k/v, MLP and modulation
    rows split) against diffusers' eager load_lora_adapter + fuse_lora(lora_scale=0.7)."""
    ref, plain = _reference(hunyuan_checkpoint, files["peft"])
    assert np.abs(ref - plain).max() > 0.1  # the LoRA moves the video far beyond 1e-3
    official, report = _ours(hunyuan_checkpoint, f"{files['official']}:{SCALE}",
                             devices=jax.devices()[:1])
    np.testing.assert_allclose(official, ref, atol=1e-3, rtol=0)
    (entry,) = report["loras"]
    n_linear = len(files["pairs"])
    # One weight and one bias per diffusers linear; the file has six keys fewer per refiner
    # block (one fused qkv for three modules: 3 keys instead of 9).
    assert entry["matched_weights"] == 2 * n_linear
    assert entry["keys"] == 3 * n_linear - 6 * 2 and entry["converted_keys"] == 3 * n_linear
    peft, _ = _ours(hunyuan_checkpoint, f"{files['peft']}:{SCALE}", "--dp", "1", "--tp", "2",
                    "--sp", "1", devices=jax.devices()[:2])
    np.testing.assert_allclose(peft, ref, atol=1e-3, rtol=0)


def test_converter_covers_every_linear_and_each_format(hunyuan_checkpoint, files, tmp_path):
    """The official all-linear file maps every key to a diffusers linear, covering all of
    them, with the deltas of the diffusers-named LoRA; prefixed official keys and unprefixed
    diffusers keys convert the same; a MeanFlow checkpoint's time_r_in maps too."""
    cfg = _config(hunyuan_checkpoint)
    shapes = lora.transformer_shapes(hunyuan.empty_transformer(cfg, torch.float32))
    official = lora.load(files["official"], 1.0, shapes, hunyuan_lora.lora_state_dict)
    linears = {f"{n}.weight" for n in files["pairs"]}
    assert set(official.weights) == linears
    assert set(official.biases) == {n[:-len("weight")] + "bias" for n in linears}
    for name, (a, b, bias) in files["pairs"].items():
        oa, ob, factor = official.weights[f"{name}.weight"]
        torch.testing.assert_close(ob @ oa, b @ a, rtol=0, atol=0)
        torch.testing.assert_close(official.biases[f"{name}.bias"][0], bias, rtol=0, atol=0)
        assert factor == 2.0  # lora_alpha / r from the unprefixed (model-level) metadata
    peft = lora.load(files["peft"], 1.0, shapes, hunyuan_lora.lora_state_dict)
    assert {f for _, _, f in peft.weights.values()} == {2.0}  # metadata under "transformer."
    for kind, write, prefix in (("official", _write_official, "base_model.model."),
                                ("peft", _write_peft, "")):
        path = str(tmp_path / f"{kind}.safetensors")
        write(path, files["pairs"], prefix=prefix)
        other = lora.load(path, 1.0, shapes, hunyuan_lora.lora_state_dict)
        assert other.weights.keys() == official.weights.keys(), kind
        for name, (a, b, f) in other.weights.items():
            oa, ob, of = official.weights[name]
            assert torch.equal(b @ a, ob @ oa) and f == of, (kind, name)
    meanflow = hunyuan.empty_transformer({**cfg, "use_meanflow": True}, torch.float32)
    names = {n for n, _ in meanflow.named_parameters()}
    g = torch.Generator().manual_seed(0)
    converted = hunyuan_lora.lora_state_dict({
        f"time_r_in.mlp.{j}.lora_{p}.weight": torch.randn(2, 2, generator=g)
        for j in (0, 2) for p in "AB"})
    assert {k.removeprefix("transformer.").rsplit(".lora_", 1)[0] + ".weight"
            for k in converted} == {f"time_embed.timestep_embedder_r.linear_{j}.weight"
                                    for j in (1, 2)} <= names


def test_key_outside_the_table_is_one_line_before_loading(hunyuan_checkpoint, tmp_path,
                                                         capsys):
    """HunyuanVideo 1.0's fused img_attn_qkv is no 1.5 module: the CLI's exit 2, one line
    naming --lora, the file and the key; no output written."""
    pairs = _random_lora(_config(hunyuan_checkpoint))
    path = str(tmp_path / "bad.safetensors")
    tensors = _write_official(path, pairs)
    tensors["double_blocks.0.img_attn_qkv.lora_A.weight"] = torch.zeros(RANK, 32)
    save_file(tensors, path)
    out = tmp_path / "out"
    code = generate_flax.cli(["--model_id", hunyuan_checkpoint, "--output_dir", str(out),
                              "--lora", path])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"generate_flax.py: error: --lora={path!r}: "), lines[0]
    assert "1 key(s) match no transformer weight (double_blocks.0.img_attn_qkv.lora_A." \
        "weight)" in lines[0], lines[0]
    assert not out.exists() or not os.listdir(out)


def test_family_without_a_converter_refuses_lora(hunyuan_checkpoint):
    """The engine's refusal for a family whose ``lora_state_dict`` is None still works."""
    import dataclasses

    family = FAMILIES["hunyuanvideo"]
    bare = dataclasses.replace(family, transformer=dataclasses.replace(
        family.transformer, lora_state_dict=None))
    with pytest.raises(UsageError, match="LoRAs are not supported for HunyuanVideo-1.5 yet"):
        lora.validate(["x.safetensors"], bare, hunyuan_checkpoint, "float32")
