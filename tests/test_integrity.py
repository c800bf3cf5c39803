"""The checkpoint check (engine/files/integrity.py) on valid checkpoints of both families, on the
shipped real configs, on an extra tensor (a warning, and the run goes on), and the report's
record of it. Damaged checkpoints are rows of tests/test_cli.py's DAMAGED table."""

import glob
import json
import logging
import shutil

import pytest

import generate_flax as gf
from engine.files import integrity
from families import FAMILIES


def _config(model_id, *flags):
    return gf.validate_args(gf.parse_args(["--model_id", str(model_id), *flags]))


@pytest.mark.parametrize("which", ["tiny_checkpoint", "hunyuan_checkpoint"])
def test_valid_checkpoints_pass_without_a_warning(request, which, caplog, tmp_path):
    model_id = request.getfixturevalue(which)
    config = _config(model_id, "--output_dir", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        result = integrity.check_checkpoint(config, FAMILIES[config.model.family])
    assert not caplog.records, caplog.text
    assert result["ran"] and result["weights"] and result["seconds"] > 0
    comps = result["components"]
    # Every safetensors folder the pipeline holds is checked, each tensor of it counted.
    want = sorted(p.split("/")[-2] for p in glob.glob(f"{model_id}/*/*.safetensors"))
    assert sorted(comps) == want
    from safetensors import safe_open

    for sub, got in comps.items():
        with safe_open(glob.glob(f"{model_id}/{sub}/*.safetensors")[0], "pt") as f:
            assert got["tensors"] == len(f.keys()) and got["files"] == 1, sub
        assert got["unexpected"] == []
    # The text encoders' classes come from model_index.json, as from_pretrained reads them.
    index = json.loads(open(f"{model_id}/model_index.json").read())
    assert all(got["cls"] == index[sub][1] for sub, got in comps.items())


@pytest.mark.parametrize("stage,want", [("encode", ["text_encoder"]),
                                        ("denoise", ["transformer"]), ("decode", ["vae"])])
def test_each_stage_checks_only_what_it_loads(tiny_checkpoint, tmp_path, stage, want):
    config = _config(tiny_checkpoint, "--stage", stage, "--output_dir", str(tmp_path))
    assert sorted(integrity.check_checkpoint(config, FAMILIES["wan"])["components"]) == want


@pytest.mark.parametrize("model_id", [c for f in FAMILIES.values()
                                      for c in f.checkpoint.shipped_configs
                                      # a family that refuses --dry_run yet (LTX-2)
                                      if "dry_run" not in [r[0] for r in f.flags.refused]])
def test_dry_run_checks_the_shipped_real_configs(model_id, tmp_path):
    """Configs only (no weights): the real 14B / 8.3B configs parse and their models build."""
    config = _config(model_id, "--dry_run", "--topology", "v6e:2x4", "--output_dir",
                     str(tmp_path))
    result = integrity.check_checkpoint(config, FAMILIES[config.model.family])
    assert result["ran"] and not result["weights"]
    # A two-expert model's transformer_2 config is checked too (Wan 2.2 A14B).
    experts = ["transformer", "transformer_2"] if "A14B" in model_id else ["transformer"]
    assert sorted(result["components"]) == experts + ["vae"]


def test_hub_id_without_local_files_is_not_checked(tmp_path):
    config = _config("Wan-AI/Wan2.1-T2V-14B-Diffusers", "--output_dir", str(tmp_path))
    assert integrity.check_checkpoint(config, FAMILIES["wan"])["ran"] is False


def test_truncated_file_is_found_by_its_size_alone(tiny_checkpoint, tmp_path):
    """The rule is the header's byte ranges against the file size: cutting even the last
    byte is caught, and safetensors agrees the cut file is unreadable."""
    from safetensors import safe_open

    path = tmp_path / "vae.safetensors"
    shutil.copy(f"{tiny_checkpoint}/vae/diffusion_pytorch_model.safetensors", path)
    size = path.stat().st_size
    assert integrity.read_header(str(path))
    with open(path, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(integrity.CheckpointError, match=f"but the file holds .* \\({size - 1} in "
                                                        "all\\)"):
        integrity.read_header(str(path))
    with pytest.raises(Exception, match="incomplete metadata"):
        safe_open(str(path), "pt")


def test_extra_tensor_warns_and_the_run_goes_on(tiny_checkpoint, tmp_path, capsys, caplog):
    import torch
    from safetensors.torch import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, ck)
    path = ck / "transformer" / "diffusion_pytorch_model.safetensors"
    state = load_file(str(path))
    state["blocks.0.extra_adapter.weight"] = torch.ones(3, 4)
    save_file(state, str(path), metadata={"format": "pt"})
    out = tmp_path / "out"
    with caplog.at_level(logging.WARNING, logger="engine.files.integrity"):
        code = gf.cli(["--model_id", str(ck), "--height", "32", "--width", "48", "--frames",
                       "5", "--num_inference_steps", "1", "--warmup_steps", "0",
                       "--compilation_cache_dir", "none", "--output_dir", str(out)])
    assert code == 0, capsys.readouterr().err[-2000:]
    warnings = [r.getMessage() for r in caplog.records if r.name == "engine.files.integrity"]
    assert warnings == ["transformer: 1 tensor(s) in the checkpoint that WanTransformer3DModel "
                        "does not use, ignored as from_pretrained ignores them: "
                        "blocks.0.extra_adapter.weight"]
    (report,) = glob.glob(str(out / "*.json"))
    check = json.loads(open(report).read())["checkpoint_check"]
    assert check["ran"] and check["seconds"] > 0
    assert check["components"]["transformer"]["unexpected"] == ["blocks.0.extra_adapter.weight"]
    assert len(glob.glob(str(out / "*.mp4"))) == 1
