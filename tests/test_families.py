"""Model families: detection from model_index.json, the registry, and the interface contract."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

import families
from engine.files.checkpoint import model_config_dir
from engine.run.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_shipped_config_detects_its_own_family():
    for key, family in families.FAMILIES.items():
        assert family.checkpoint.shipped_configs, key
        for hub_id in family.checkpoint.shipped_configs:
            assert model_config_dir(hub_id) is not None, hub_id
            assert families.detect_family(hub_id) == key


def test_tiny_checkpoints_detect_their_families(tiny_checkpoint, hunyuan_checkpoint):
    assert families.detect_family(tiny_checkpoint) == "wan"
    assert families.detect_family(hunyuan_checkpoint) == "hunyuanvideo"


def test_every_interface_field_is_set():
    """Every group is set, and so is every field of it without a default (a default of None,
    such as ``vae.encoder`` or a whole ``upscale`` group, says the family lacks that
    option)."""
    for family in families.FAMILIES.values():
        for field in dataclasses.fields(families.ModelFamily):
            group = getattr(family, field.name)
            assert group is not None or field.default is None, field.name
            if not dataclasses.is_dataclass(group):
                continue
            for sub in dataclasses.fields(group):
                if sub.default is dataclasses.MISSING and \
                        sub.default_factory is dataclasses.MISSING:
                    assert getattr(group, sub.name) is not None, f"{field.name}.{sub.name}"


def test_family_options_are_fields():
    """What a family supports is a field of its value, never a name test."""
    from custom_splash_attention import LocalMask

    wan, hunyuan = families.FAMILIES["wan"], families.FAMILIES["hunyuanvideo"]
    assert wan.transformer.masks == (LocalMask,) and hunyuan.transformer.masks == ()
    assert wan.transformer.lora_state_dict is not None
    assert hunyuan.transformer.lora_state_dict is not None  # families.hunyuan_lora
    assert wan.vae.encoder is not None and wan.vae.is_encode_weight is not None
    assert hunyuan.vae.encoder is None


def test_unknown_pipeline_class_is_one_line_listing_the_supported_ones(tmp_path):
    folder = tmp_path / "other"
    folder.mkdir()
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "FooPipeline"}))
    with pytest.raises(UsageError, match="pipeline class 'FooPipeline' is not supported "
                                         r"\(supported: WanPipeline, WanImageToVideoPipeline, "
                                         r"HunyuanVideo15Pipeline, "
                                         r"HunyuanVideo15ImageToVideoPipeline, LTX2Pipeline, "
                                         r"WanVACEPipeline, HeliosPipeline, "
                                         r"HeliosPyramidPipeline\)"):
        families.detect_family(str(folder))
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "generate_flax.py"),
                           "--model_id", str(folder), "--output_dir", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "FooPipeline" in lines[0] and "WanPipeline" in lines[0]
