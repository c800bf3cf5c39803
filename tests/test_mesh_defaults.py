"""``resolve_mesh_shape``'s defaults (engine/run/mesh.py): the CFG pair over dp, heads over tp,
and on the chips of ``chips.ULYSSES_DEFAULT_CHIPS`` Ulysses sequence parallelism instead."""

import pytest

from engine.run import chips
from engine.run.errors import UsageError
from engine.run.mesh import MeshShape, resolve_mesh_shape

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


def test_v6e_default_is_dp2_tp2_sp2_for_wan_and_dp2_tp4_for_hunyuan():
    # The families' default_sp, through the script's own resolution (configs/ ships both).
    import generate_flax as gf
    from families import FAMILIES

    v6e, v5e = chips.CHIPS["v6e"], chips.CHIPS["v5e"]
    for model_id, family, on_v6e in (
            ("Wan-AI/Wan2.1-T2V-14B-Diffusers", "wan2.1", MeshShape(2, 2, 2)),
            ("Wan-AI/Wan2.2-T2V-A14B-Diffusers", "wan2.1", MeshShape(2, 2, 2)),
            ("hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-720p_t2v", "hunyuanvideo1.5",
             MeshShape(2, 4, 1))):
        config = gf.validate_args(gf.parse_args(["--model_id", model_id, "--dry_run",
                                                 "--topology", "v6e:2x4"]))
        assert gf.resolve_mesh(config, FAMILIES[family], 8, v6e) == on_v6e, model_id
        assert gf.resolve_mesh(config, FAMILIES[family], 8, v5e) == MeshShape(2, 4, 1)
