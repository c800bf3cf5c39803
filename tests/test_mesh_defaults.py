"""``resolve_mesh_shape``'s defaults (engine/run/mesh.py): the CFG pair over dp, heads over tp,
and Ulysses sequence parallelism where ``chips.prefers_ulysses`` says so for the chip and the
checkpoint's replicated weights."""

import pytest
import torch

from engine.pipeline.prologue import resolve_mesh
from engine.run import chips
from engine.run.errors import UsageError
from engine.run.mesh import MeshShape, resolve_mesh_shape
from engine.weights.layout import resident_weight_bytes
from families import FAMILIES

WAN14B = dict(num_heads=40, tokens=75600)


def test_default_splits_cfg_over_dp_and_heads_over_tp():
    assert resolve_mesh_shape(None, None, None, 8, batch=2, **WAN14B) == MeshShape(2, 4, 1)
    assert resolve_mesh_shape(None, None, None, 8, batch=1, **WAN14B) == MeshShape(1, 8, 1)
    # 12 heads over 8 devices with CFG: tp takes 2 of the 4 (12 % 4 == 0), the rest is sp.
    got = resolve_mesh_shape(None, None, None, 16, batch=2, num_heads=12, tokens=100)
    assert got == MeshShape(2, 4, 2)


def test_ulysses_chips_default_to_sequence_parallel():
    assert chips.ULYSSES_DEFAULT_CHIPS == ("tpu7x",)
    got = resolve_mesh_shape(None, None, None, 8, batch=2, prefer_sp=True, **WAN14B)
    assert got == MeshShape(2, 1, 4)
    assert resolve_mesh_shape(None, None, None, 16, batch=2, prefer_sp=True,
                              **WAN14B) == MeshShape(2, 1, 8)
    # sp 8 does not divide 12 heads: the head-sharded default stays.
    got = resolve_mesh_shape(None, None, None, 16, batch=2, num_heads=12, tokens=100,
                             prefer_sp=True)
    assert got == MeshShape(2, 4, 2)
    # A flag the user gives wins.
    got = resolve_mesh_shape(None, 4, None, 8, batch=2, prefer_sp=True, **WAN14B)
    assert got == MeshShape(2, 4, 1)
    got = resolve_mesh_shape(None, None, 2, 8, batch=2, prefer_sp=True, **WAN14B)
    assert got == MeshShape(2, 2, 2)


def test_family_default_sp_takes_sp_and_leaves_tp_at_least_two():
    # v6e-8 with CFG: dp2 x tp2 x sp2; v6e-16: dp2 x tp4 x sp2.
    assert resolve_mesh_shape(None, None, None, 8, batch=2, default_sp=2,
                              **WAN14B) == MeshShape(2, 2, 2)
    assert resolve_mesh_shape(None, None, None, 16, batch=2, default_sp=2,
                              **WAN14B) == MeshShape(2, 4, 2)
    # v6e-4: tp would be 1 (whole weights on every chip): the head-sharded default stays.
    assert resolve_mesh_shape(None, None, None, 4, batch=2, default_sp=2,
                              **WAN14B) == MeshShape(2, 2, 1)
    # Heads that tp * sp does not divide (12 over 8): the head-sharded default stays.
    assert resolve_mesh_shape(None, None, None, 16, batch=2, num_heads=12, tokens=100,
                              default_sp=2) == MeshShape(2, 4, 2)
    assert resolve_mesh_shape(None, None, None, 32, batch=2, num_heads=12, tokens=100,
                              default_sp=2) == MeshShape(2, 4, 4)
    # A flag the user gives wins; a Ulysses chip takes all of sp.
    assert resolve_mesh_shape(None, 4, None, 8, batch=2, default_sp=2,
                              **WAN14B) == MeshShape(2, 4, 1)
    assert resolve_mesh_shape(None, None, None, 8, batch=2, prefer_sp=True, default_sp=2,
                              **WAN14B) == MeshShape(2, 1, 4)


def test_bad_product_names_the_flags():
    with pytest.raises(UsageError, match="--dp/--tp/--sp"):
        resolve_mesh_shape(2, 2, 3, 8, batch=2, **WAN14B)


def test_prefers_ulysses_by_chip_and_replicated_weights():
    v6e, v5e, tpu7x = chips.CHIPS["v6e"], chips.CHIPS["v5e"], chips.CHIPS["tpu7x"]
    limit = chips.ULYSSES_WEIGHT_FRACTION["v6e"] * v6e.usable_hbm_bytes
    assert chips.prefers_ulysses(v6e, int(limit))
    assert not chips.prefers_ulysses(v6e, int(limit) + 1)
    assert not chips.prefers_ulysses(v6e, None)  # unknown weights: the family's default_sp
    assert chips.prefers_ulysses(tpu7x, None) and chips.prefers_ulysses(tpu7x, 10**12)
    assert not chips.prefers_ulysses(v5e, 1) and not chips.prefers_ulysses(None, 1)


def test_v6e_default_is_ulysses_where_the_replicated_weights_fit():
    # Through the script's own resolution, from the configs/ the repo ships: Ulysses (tp 1)
    # where the replicated weights leave room on v6e (Wan 2.1 T2V 14B 26.67 GiB,
    # HunyuanVideo-1.5 15.51; an A14B pair 26.67 with its idle expert parked in host memory,
    # --park_memory auto; Wan 2.1 I2V 14B 27.66 with its image cross-attention split over
    # sp4), the family's default_sp where they do not (an A14B pair parked in HBM,
    # 26.67 + 3.33), and head-sharded tp on v5e.
    import generate_flax as gf

    v6e, v5e = chips.CHIPS["v6e"], chips.CHIPS["v5e"]
    for model_id, family, on_v6e in (
            ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan", MeshShape(2, 1, 4)),
            ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "wan", MeshShape(2, 1, 4)),
            ("Wan-AI/Wan2.2-TI2V-5B-Diffusers", "wan", MeshShape(2, 1, 4)),
            ("Wan-AI/Wan2.1-I2V-14B-720P-Diffusers", "wan", MeshShape(2, 1, 4)),
            ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan", MeshShape(2, 1, 4)),
            ("Wan-AI/Wan2.2-I2V-A14B-Diffusers", "wan", MeshShape(2, 1, 4)),
            ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v", "hunyuanvideo",
             MeshShape(2, 1, 4)),
            ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_i2v", "hunyuanvideo",
             MeshShape(2, 1, 4))):
        config = gf.validate_args(gf.parse_args(["--model_id", model_id, "--dry_run",
                                                 "--topology", "v6e:2x4"]))
        assert resolve_mesh(config, FAMILIES[family], 8, v6e) == on_v6e, model_id
        assert resolve_mesh(config, FAMILIES[family], 8, v5e) == MeshShape(2, 4, 1)
    for model_id in ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "Wan-AI/Wan2.2-I2V-A14B-Diffusers"):
        config = gf.validate_args(gf.parse_args(["--model_id", model_id, "--dry_run",
                                                 "--topology", "v6e:2x4", "--park_memory",
                                                 "device"]))
        assert resolve_mesh(config, FAMILIES["wan"], 8, v6e) == MeshShape(2, 2, 2), model_id


@pytest.mark.parametrize("family", ["wan", "hunyuanvideo"])
def test_resident_weight_bytes_equals_the_loaded_transformer(family, tiny_checkpoint,
                                                             hunyuan_checkpoint):
    # The meta-device count against the transformer diffusers loads from the checkpoint's
    # safetensors in bfloat16, Wan's float32-kept parameters (norms, scale_shift_table)
    # included.
    from engine.files.checkpoint import read_component_config

    path = tiny_checkpoint if family == "wan" else hunyuan_checkpoint
    params = list(loaded_transformer(path, "transformer").parameters())
    kept = {torch.bfloat16, torch.float32} if family == "wan" else {torch.bfloat16}
    assert {p.dtype for p in params} == kept
    cfg = read_component_config(path, "transformer")
    assert resident_weight_bytes(FAMILIES[family], path, cfg, "bfloat16") == sum(
        p.numel() * p.element_size() for p in params)


def loaded_transformer(path: str, subfolder: str):
    """``subfolder``'s model as diffusers' ``from_pretrained`` loads it in bfloat16."""
    import diffusers

    from engine.files.checkpoint import read_model_index

    cls = getattr(diffusers, read_model_index(path)[subfolder][1])
    return cls.from_pretrained(path, subfolder=subfolder, torch_dtype=torch.bfloat16,
                               use_safetensors=True)
