"""tools/convert_hunyuan_sr.py: an official-layout (Tencent-named) SR transformer folder to a
diffusers ``HunyuanVideo15Transformer3DModel`` folder, and its one-line refusals.

The official-layout input is written by tools/make_tiny_hunyuan_sr.py from a tiny random
diffusers model with the SR DiT's 98 input channels, through that tool's own inverse of
diffusers' conversion script (huggingface/diffusers @ 9cc3601, scripts/
convert_hunyuan_video1_5_to_diffusers.py), not through ``families.hunyuan_keys``: a wrong table
entry puts a tensor in the wrong place and the forward leaves the original model's. Weights are
random; no real SR checkpoint is read here.
"""

import json
import os
import re
import shutil

import pytest
import torch
from conftest import load_tool
from diffusers import HunyuanVideo15Transformer3DModel
from safetensors.torch import load_file, save_file

from families import hunyuan_keys, hunyuan_lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = "720p_sr_distilled"
WEIGHTS = "diffusion_pytorch_model.safetensors"
PREFIX = "convert_hunyuan_sr.py: error: "


@pytest.fixture(scope="module")
def tools():
    return load_tool("make_tiny_hunyuan_sr"), load_tool("convert_hunyuan_sr")


@pytest.fixture(scope="module")
def official(tools, tmp_path_factory):
    """(official-layout folder, the diffusers model it was written from)."""
    builder, _ = tools
    model = builder.tiny_transformer(seed=11)
    folder = str(tmp_path_factory.mktemp("official") / VERSION)
    builder.write_official_transformer(model, folder, VERSION)
    return folder, model


def _inputs(image: bool, meanflow: bool) -> dict:
    """98-channel hidden states (latents 32 + I2V/T2V condition 33 + low-res condition 33),
    text and ByT5 tokens with padding, SigLIP tokens (zeros: the T2V path)."""
    g = torch.Generator().manual_seed(12)
    text_mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
    byt5_mask = torch.tensor([[1, 1, 0]])
    kwargs = dict(
        hidden_states=torch.randn(1, 98, 2, 4, 6, generator=g),
        timestep=torch.tensor([800.0]),
        encoder_hidden_states=torch.randn(1, 6, 16, generator=g),
        encoder_attention_mask=text_mask,
        encoder_hidden_states_2=torch.randn(1, 3, 1472, generator=g),
        encoder_attention_mask_2=byt5_mask,
        image_embeds=torch.randn(1, 4, 16, generator=g) if image else torch.zeros(1, 4, 16),
        return_dict=False)
    if meanflow:
        kwargs["timestep_r"] = torch.tensor([600.0])
    return kwargs


@pytest.mark.parametrize("meanflow", [False, True])
def test_round_trip_forward_equals_the_original_model(tools, tmp_path, meanflow):
    """official layout -> converter -> from_pretrained: same config, every tensor bit-equal,
    and the forward (float32, I2V and T2V inputs) exactly the original model's."""
    builder, convert = tools
    model = builder.tiny_transformer(seed=13, use_meanflow=meanflow)
    src, out = str(tmp_path / "official"), str(tmp_path / "diffusers")
    builder.write_official_transformer(model, src, VERSION)
    stored = load_file(os.path.join(src, WEIGHTS))
    # The input really is in the official names: the refiner's q/k/v fused (2 keys fewer per
    # q/k/v weight+bias, 2 blocks) and no diffusers name left.
    assert len(stored) == len(model.state_dict()) - 4 * 2
    assert not any(k.startswith(("transformer_blocks.", "context_embedder")) for k in stored)
    assert convert.main(["--input", src, "--output", out]) == 0
    assert sorted(os.listdir(out)) == ["config.json", WEIGHTS]
    loaded = HunyuanVideo15Transformer3DModel.from_pretrained(out).eval()
    def public(config):  # as JSON (tuples are lists there), without diffusers' own "_" keys
        return json.loads(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))

    assert public(loaded.config) == public(model.config)
    reference = model.state_dict()
    assert loaded.state_dict().keys() == reference.keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, reference[name]), name
    # from_pretrained leaves the tensors in safetensors' memory map, 8 bytes past a 64-byte
    # boundary here: CPU kernels vectorise by address, so the same bits summed there were
    # seen to differ by 1e-6. Fresh (aligned) copies of the same bits make the comparison exact.
    with torch.no_grad():
        for param in loaded.parameters():
            param.data = param.data.clone()
    for image in (True, False):
        kwargs = _inputs(image, meanflow)
        with torch.no_grad():
            expected, got = model(**kwargs)[0], loaded(**kwargs)[0]
        assert expected.shape == (1, 32, 2, 4, 6)
        assert torch.equal(got, expected), (image, (got - expected).abs().max())


def test_1080p_target_size_comes_from_the_sr_size_map(tools, tmp_path):
    """ideal_resolution 1080p -> target_size 1440 (the SR pipeline's SizeMap)."""
    builder, convert = tools
    model = builder.tiny_transformer(seed=14, version="1080p_sr_distilled")
    src, out = str(tmp_path / "official"), str(tmp_path / "diffusers")
    builder.write_official_transformer(model, src, "1080p_sr_distilled")
    assert convert.main(["--input", src, "--output", out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["target_size"] == model.config.target_size == 1440


def _edit_config(folder, **fields):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump({**config, **fields}, f)


def _edit_weights(folder, drop=(), **tensors):
    path = os.path.join(folder, WEIGHTS)
    state = load_file(path)
    for key in drop:
        del state[key]
    save_file({**state, **{k.replace("__", "."): v for k, v in tensors.items()}}, path)


def _truncate(folder):
    path = os.path.join(folder, WEIGHTS)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 1000)


# (case, how the official folder is damaged, what the one line says)
REFUSALS = [
    ("no folder", lambda d: shutil.rmtree(d), "not a folder"),
    ("config not JSON", lambda d: open(os.path.join(d, "config.json"), "w").write("{"),
     "config.json unreadable"),
    ("truncated weights", _truncate, "not a readable safetensors file"),
    ("pickle", lambda d: open(os.path.join(d, "diffusion_pytorch_model.bin"), "wb").close(),
     "pickle weights (diffusion_pytorch_model.bin); refusing them: safetensors only"),
    ("no weights", lambda d: os.remove(os.path.join(d, WEIGHTS)),
     "no diffusion_pytorch_model*.safetensors"),
    ("guidance_embed", lambda d: _edit_config(d, guidance_embed=True),
     "guidance_embed=True: expected False (diffusers' class has no guidance embedder"),
    ("single blocks", lambda d: _edit_config(d, mm_single_blocks_depth=2),
     "mm_single_blocks_depth=2: expected 0"),
    ("unknown field", lambda d: _edit_config(d, sr_extra_channels=33),
     "sr_extra_channels=33: not a field of HunyuanVideo_1_5_DiffusionTransformer"),
    ("sparse attention", lambda d: _edit_config(d, attn_mode="flex-block-attn"),
     "attn_mode='flex-block-attn': sparse (SSTA) attention"),
    ("unmasked refiner", lambda d: _edit_config(d, use_attention_mask=False),
     "use_attention_mask=False: expected True"),
    ("channels disagree", lambda d: _edit_config(d, in_channels=97),
     "img_in.proj.weight has 98 input channels; config.json in_channels=97"),
    ("leftover official key", lambda d: _edit_weights(d, guidance_in__mlp__0__weight=torch.ones(
        32, 256)), "1 official tensor(s) diffusers' class has no place for "
        "(guidance_in.mlp.0.weight); refusing rather than dropping them"),
    ("MeanFlow tensor, no use_meanflow", lambda d: _edit_weights(
        d, time_r_in__mlp__0__weight=torch.ones(32, 256)),
     "(time_r_in.mlp.0.weight -> time_embed.timestep_embedder_r.linear_1.weight)"),
    ("missing parameter", lambda d: _edit_weights(d, drop=["double_blocks.1.img_attn_k_norm."
                                                           "weight"]),
     "1 diffusers parameter(s) no official tensor fills (transformer_blocks.1.attn.norm_k."
     "weight)"),
    ("shape mismatch", lambda d: _edit_weights(d, txt_in__input_embedder__weight=torch.ones(
        32, 17)), "txt_in.input_embedder.weight gives context_embedder.proj_in.weight the "
        "shape (32, 17), the config's model has (32, 16)"),
    ("fused qkv rows", lambda d: _edit_weights(
        d, txt_in__individual_token_refiner__blocks__0__self_attn_qkv__weight=torch.ones(
            97, 32)), "rows do not split into 3 equal blocks"),
]


@pytest.mark.parametrize("case,damage,says", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_are_one_line_and_write_nothing(tools, official, tmp_path, capsys, case,
                                                 damage, says):
    _, convert = tools
    src, out = str(tmp_path / "official"), str(tmp_path / "diffusers")
    shutil.copytree(official[0], src)
    damage(src)
    capsys.readouterr()
    assert convert.main(["--input", src, "--output", out]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(PREFIX), err
    assert says in lines[0], lines[0]
    assert not os.path.exists(out)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".convert-hunyuan-sr-")]


def _shard(src, dst):
    """The official file split in two shards with diffusers' index, as large checkpoints are."""
    os.makedirs(dst)
    shutil.copy(os.path.join(src, "config.json"), dst)
    state = load_file(os.path.join(src, WEIGHTS))
    keys = sorted(state)
    names = [f"diffusion_pytorch_model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    weight_map = {}
    for name, part in zip(names, (keys[::2], keys[1::2]), strict=True):
        save_file({k: state[k] for k in part}, os.path.join(dst, name))
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(dst, f"{WEIGHTS}.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return names


def test_sharded_input_converts_to_the_same_file(tools, official, tmp_path, capsys):
    """Shards + index give the single file's result; a shard missing from the folder is
    refused in one line."""
    _, convert = tools
    sharded = str(tmp_path / "sharded")
    names = _shard(official[0], sharded)
    single, out = str(tmp_path / "single"), str(tmp_path / "out")
    assert convert.main(["--input", official[0], "--output", single]) == 0
    assert convert.main(["--input", sharded, "--output", out]) == 0
    a, b = load_file(os.path.join(single, WEIGHTS)), load_file(os.path.join(out, WEIGHTS))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    os.remove(os.path.join(sharded, names[1]))
    capsys.readouterr()
    assert convert.main(["--input", sharded, "--output", str(tmp_path / "none")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(PREFIX) and f"{WEIGHTS}.index.json lists" in line, line


def test_output_that_is_not_empty_is_refused(tools, official, tmp_path, capsys):
    _, convert = tools
    out = tmp_path / "diffusers"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert.main(["--input", official[0], "--output", str(out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"{PREFIX}--output={str(out)!r}: exists and is not an empty folder"
    assert os.listdir(out) == ["keep.txt"]


@pytest.mark.parametrize("in_channels,concat,reshape,out_channels,width", [
    (32, True, False, 32, 65),    # the base models: latents + condition + mask
    (65, True, True, 32, 98),     # n + n // 2 + 1
    (98, False, False, 32, 98),   # the tiny SR layout's own reading
    (32, True, False, None, 65),  # out_channels None: in_channels (the official rule)
])
def test_input_width_follows_the_official_patch_embed_rule(tools, in_channels, concat, reshape,
                                                           out_channels, width):
    """embed_layers.py:56-62: the width the config implies equals the weight's, or refusal."""
    from engine.run.errors import UsageError

    _, convert = tools
    config = {**convert.OFFICIAL_DEFAULTS, "in_channels": in_channels,
              "concat_condition": concat, "is_reshape_temporal_channels": reshape,
              "out_channels": out_channels}
    out = in_channels if out_channels is None else out_channels
    shapes = {"img_in.proj.weight": ("f", (8, width, 1, 1, 1)),
              "final_layer.linear.weight": ("f", (out, 8))}
    assert convert._channels(config, shapes, 1) == (width, out)
    shapes["img_in.proj.weight"] = ("f", (8, width + 1, 1, 1, 1))
    with pytest.raises(UsageError, match=f"has {width + 1} input channels"):
        convert._channels(config, shapes, 1)


def test_table_kinds_match_diffusers_modules_and_lora_uses_the_linear_rows(tools):
    """Each row's kind is the diffusers module's type (so LoRA gets exactly the nn.Linear
    rows), and every parameter of a MeanFlow model comes from exactly one row."""
    builder, _ = tools
    model = builder.tiny_transformer(seed=15, use_meanflow=True)
    modules = dict(model.named_modules())
    types = {hunyuan_keys.LINEAR: torch.nn.Linear, hunyuan_keys.CONV: torch.nn.Conv3d,
             hunyuan_keys.EMBEDDING: torch.nn.Embedding}
    covered = set()
    for official_module, (targets, _, kind) in hunyuan_keys.MODULES.items():
        for target in targets:
            module = modules[target.format(i=1)]
            if kind == hunyuan_keys.NORM:
                assert "Norm" in type(module).__name__, (official_module, type(module))
            else:
                assert type(module) is types[kind], (official_module, type(module))
            for name, _ in module.named_parameters():
                covered.add(f"{target.format(i=1)}.{name}")
    in_block = re.compile(r"(?:transformer_blocks|refiner_blocks)\.(\d+)\.")
    assert covered == {k for k in model.state_dict()
                       if (m := in_block.search(k)) is None or m[1] == "1"}
    linear = {m: (t, op) for m, (t, op, kind) in hunyuan_keys.MODULES.items()
              if kind == hunyuan_keys.LINEAR}
    for module, expected in linear.items():
        assert hunyuan_lora._official(module.format(i=1)) == (
            tuple(t.format(i=1) for t in expected[0]), expected[1])
    assert hunyuan_lora._official("img_in.proj") is None  # a Conv3d: no LoRA
