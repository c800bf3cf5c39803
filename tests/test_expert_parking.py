"""Expert parking (``engine.programs.experts.ExpertParking``): a two-expert model keeps its
idle expert sharded over every device and swaps at the boundary step. Checked against the
unparked run's frames and against per-device bytes computed from the arrays' shard shapes.
"""

import gc

import jax
import numpy as np
import pytest
from conftest import _build
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import generate_flax as gf
from engine.dry_run import fit as dry_run
from engine.files.checkpoint import read_component_config
from engine.pipeline import generate
from engine.programs import experts, parking
from engine.run import chips
from engine.run.mesh import MeshShape, make_mesh
from engine.weights import layout, placement
from engine.weights.layout import resident_weight_bytes, resolve_run_mesh
from families import FAMILIES

# UniPC's 4 timesteps at flow_shift 5.0 are [999, 937, 833, 625]: with boundary_ratio 0.9
# steps 0-1 run transformer and 2-3 transformer_2 (as tests/test_wan22.py).
BOUNDARY = 0.9


@pytest.fixture(scope="session")
def two_expert_8h(tmp_path_factory):
    """A tiny Wan 2.2 A14B-style checkpoint with 8 heads (Ulysses over sp4 divides them)."""
    return _build(tmp_path_factory, "make_tiny_checkpoint.py", "tiny-wan22-a14b-8h",
                  "--experts", "2", "--boundary_ratio", str(BOUNDARY), "--heads", "8",
                  "--head_dim", "12", "--ffn_dim", "64")


def _run(checkpoint, mode: str, iterations: int, memory: str = "auto"):
    args = gf.validate_args(gf.parse_args([
        "--park_memory", memory,
        "--model_id", checkpoint, "--dtype", "float32", "--seed", "7", "--flow_shift", "5",
        "--num_inference_steps", "4", "--num_iterations", str(iterations),
        "--warmup_steps", "0", "--height", "64", "--width", "128", "--frames", "5",
        "--attention", "xla", "--compilation_cache_dir", "none", "--dp", "2", "--tp", "1",
        "--sp", "4", "--park_weights", mode]))
    return generate(args, FAMILIES[args.model.family])


def test_parked_experts_give_the_unparked_frames(two_expert_8h):
    """dp2 x sp4 replicates every weight; with the idle expert parked the frames equal the
    unparked run's exactly (the same program on the same values), and a second video
    swaps back to the first expert at its step 0 and gives them again."""
    frames_off, report_off = _run(two_expert_8h, "off", 1)
    frames_on, report_on = _run(two_expert_8h, "on", 2)
    assert frames_off.std() > 0.01  # not a flat video
    np.testing.assert_array_equal(frames_on, frames_off)
    assert report_off["experts"]["parking"] == {"idle_expert_parked": False}
    swaps = report_on["experts"]["parking"]["swaps"]
    # Video 1: one swap, at the boundary. The decode parks everything and restores nothing,
    # so video 2 gathers transformer at its step 0 and transformer_2 at the boundary.
    assert [s["to"] for s in swaps] == ["transformer_2", "transformer", "transformer_2"]
    assert all(s["gathered_bytes_per_device"] > 0 for s in swaps)
    assert report_on["experts"]["steps"] == {"transformer": [0, 1], "transformer_2": [2, 3]}


def test_experts_parked_in_host_memory_give_the_unparked_frames(two_expert_8h):
    """--park_memory pinned_host: the idle expert's slices live in host memory; two videos
    give the unparked run's frames exactly, with the same three swaps."""
    frames_off, _ = _run(two_expert_8h, "off", 1)
    frames_host, report = _run(two_expert_8h, "on", 2, "pinned_host")
    np.testing.assert_array_equal(frames_host, frames_off)
    parking_report = report["experts"]["parking"]
    assert parking_report["memory"] == "pinned_host"
    assert [s["to"] for s in parking_report["swaps"]] == ["transformer_2", "transformer",
                                                          "transformer_2"]


def _experts_on(mesh, seed: int, memory: str | None = None):
    """Two placed-expert dicts on ``mesh`` as ``place_module`` returns them: params at their
    home specs (one tp-less replicated matrix, one 3-D weight, one small bias that no
    parking divides), a replicated buffer; and their host values. transformer_2's params
    are parked in ``memory`` (None: the devices')."""
    rng = np.random.default_rng(seed)
    specs = {"w": P(), "stack": P(), "bias": P()}
    shapes = {"w": (64, 48), "stack": (2, 40, 16), "bias": (7,)}
    host = [{k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
            for _ in range(2)]
    placed = []
    for i, values in enumerate(host):
        params = {}
        for k, v in values.items():
            home = NamedSharding(mesh, specs[k])
            target = placement.parked_sharding(jax.ShapeDtypeStruct(v.shape, v.dtype,
                                                                    sharding=home), memory)
            params[k] = jax.device_put(v, home if i == 0 else target)  # transformer_2 parked
        placed.append(dict(params=params, specs=specs,
                           buffers={"rope": jax.device_put(np.arange(24, dtype=np.float32) + i,
                                                           NamedSharding(mesh, P()))}))
    return placed, host


def _device_bytes(host: bool = False) -> dict:
    """{device: bytes} of every live ``jax.Array``'s buffers in the devices' own memory
    (``host``: in their host memory instead), each buffer counted once: on the CPU backend a
    reshard leaves single-device views of the source's shards in ``jax.live_arrays()`` that
    alias its buffers (they would count the source twice). Garbage is collected first: an
    earlier test's arrays that only a reference cycle keeps would otherwise be freed by a
    collection mid-test and change the baseline (pytest-randomly found that: 17,532 bytes
    per device gone between two samples)."""
    gc.collect()
    buffers = {}
    for arr in jax.live_arrays():
        if arr.is_deleted() or placement.on_host(arr) != host:
            continue
        for shard in arr.addressable_shards:
            key = (shard.device, shard.data.unsafe_buffer_pointer())
            buffers[key] = shard.data.nbytes
    totals: dict = {}
    for (device, _), n in buffers.items():
        totals[device] = totals.get(device, 0) + n
    return totals


def test_swap_bytes_per_device_before_during_and_after():
    """Per device, from ``jax.live_arrays()``: before the swap one expert whole and the other
    parked; during it never more than that plus the largest weight's parked slice; after,
    the roles exchanged. Shard shapes as designed, values exactly the host's, and the dry
    run's model of the swap (``_expert_parking``) gives the same bytes."""
    mesh = make_mesh(MeshShape(2, 1, 4))
    base = _device_bytes()  # live arrays of other tests count in all three
    placed, host = _experts_on(mesh, 0)
    n = 8
    whole = sum(v.nbytes for v in host[0].values()) + 24 * 4
    # w (64, 48) parks its 64 rows over 8; stack (2, 40, 16) its 40; bias (7,) stays whole.
    parked = 64 * 48 * 4 // n + 2 * 40 * 16 * 4 // n + 7 * 4 + 24 * 4 // n
    assert experts.expert_bytes([*placed[0]["params"].values(),
                                 *placed[0]["buffers"].values()]) == (whole, parked)
    # transformer_2's buffer was placed whole (placement parks params only): it parks at
    # the first swap that parks transformer_2.
    before = {d: base.get(d, 0) + 2 * whole - (whole - parked) + (24 * 4 - 24 * 4 // n)
              for d in jax.devices()}
    assert _device_bytes() == before
    samples = []
    swap = experts.ExpertParking(placed, on_move=lambda: samples.append(
        _device_bytes()))
    swap.ensure(0)  # already whole: no move
    assert samples == [] and swap.swaps == []
    swap.ensure(1)
    after = {d: base.get(d, 0) + whole + parked for d in jax.devices()}
    assert _device_bytes() == after
    largest = 64 * 48 * 4 // n
    peak = {d: max(s[d] for s in samples) for d in jax.devices()}
    assert all(peak[d] <= max(before[d], after[d]) + largest for d in jax.devices())
    assert all(peak[d] > max(before[d], after[d]) for d in jax.devices())  # the transient
    for k, v in host[1].items():
        arr = placed[1]["params"][k]
        assert arr.sharding.is_equivalent_to(NamedSharding(mesh, P()), arr.ndim)
        np.testing.assert_array_equal(np.asarray(arr), v)
    shapes = {k: {s.data.shape for s in a.addressable_shards}
              for k, a in placed[0]["params"].items()}
    assert shapes == {"w": {(8, 48)}, "stack": {(2, 5, 16)}, "bias": {(7,)}}
    swap.ensure(0)  # and back: transformer's values exactly as placed
    for k, v in host[0].items():
        np.testing.assert_array_equal(np.asarray(placed[0]["params"][k]), v)
    assert [s["to"] for s in swap.swaps] == ["transformer_2", "transformer"]
    # The first swap gathers transformer_2's params only (its buffer was placed whole).
    assert [s["gathered_bytes_per_device"] for s in swap.swaps] == \
        [whole - parked - (24 * 4 - 24 * 4 // n), whole - parked]
    # The dry run charges the same swap from shardings alone.
    structs = {g: {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                   for k, a in placed[0][g].items()} for g in ("params", "buffers")}
    model = dry_run._expert_parking(structs, {}, dict(params={}, buffers={}),
                                    jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(
                                        mesh, P())), "on", chips.CHIPS["v6e"])
    assert model["parked"] and model["whole_bytes_per_device"] == whole
    assert model["swap_peak_bytes"] == 16 + whole + parked + largest
    assert model["gather_bytes_per_device"] == whole - parked
    assert model["gather_s_estimate"] == pytest.approx((whole - parked) / 400e9)


def test_park_rule_and_dry_run_rows():
    assert experts.park_idle_expert("on", 10, 2, None)
    assert not experts.park_idle_expert("off", 10, 2, 1)
    assert not experts.park_idle_expert("auto", 10, 2, None)  # CPU: no capacity known
    assert not experts.park_idle_expert("on", 10, 10, None)  # nothing to save
    # auto: two whole experts against 87.5% of the capacity.
    assert experts.park_idle_expert("auto", 10, 2, 22)
    assert not experts.park_idle_expert("auto", 10, 2, 23)
    mesh = make_mesh(MeshShape(2, 1, 4))

    def struct(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    placed = dict(params={"w": struct((64, 32), P())}, buffers={})  # 8 KiB, replicated
    vae = dict(params={"v": struct((16,), P())}, buffers={})  # 64 B
    swap = dict(parked=True, parked_bytes_per_device=1024, idle_hbm_bytes_per_device=1024,
                swap_peak_bytes=5000)
    rows = [dict(program="transformer step", total_bytes=0, fits=True, capacity_bytes=10000),
            dict(program="VAE decode (3 programs, peak)", total_bytes=0, fits=True,
                 capacity_bytes=10000)]
    dry_run._add_resident(rows, placed, vae, {}, 0, 2, "off", swap)
    assert [r["program"] for r in rows][-1] == "expert swap (transient)"
    # step: the VAE and the parked expert; decode: one whole, one parked; the swap row.
    assert [r["resident_bytes"] for r in rows] == [64 + 1024, 8192 + 1024, 5000]
    assert all(r["fits"] for r in rows)
    unparked = [dict(r, total_bytes=0, fits=True) for r in rows[:2]]
    dry_run._add_resident(unparked, placed, vae, {}, 0, 2, "off")
    assert [r["resident_bytes"] for r in unparked] == [64 + 8192, 2 * 8192]
    assert not unparked[1]["fits"]
    # --park_memory pinned_host: the idle expert holds no HBM in the step nor in the decode.
    host = [dict(r, total_bytes=0, fits=True) for r in rows[:2]]
    dry_run._add_resident(host, placed, vae, {}, 0, 2, "off",
                          dict(swap, idle_hbm_bytes_per_device=0, swap_peak_bytes=4000))
    assert [r["resident_bytes"] for r in host] == [64, 8192, 4000]


def test_resident_weight_bytes_count_the_idle_expert_parked(two_expert_8h):
    cfg = read_component_config(two_expert_8h, "transformer")
    both = resident_weight_bytes(FAMILIES["wan"], two_expert_8h, cfg, "bfloat16")
    one = both // 2
    assert resident_weight_bytes(FAMILIES["wan"], two_expert_8h, cfg, "bfloat16", 8) == \
        one + -(-one // 8)
    assert parking.parked_spec is placement.parked_spec  # one rule for the decode and experts


@pytest.mark.parametrize("model_id", ["Wan-AI/Wan2.2-T2V-A14B-Diffusers",
                                      "Wan-AI/Wan2.2-I2V-A14B-Diffusers"])
def test_v6e_layout_counts_the_idle_expert_parked(model_id):
    """From the shipped configs: an A14B pair takes Ulysses on v6e-16 (one expert whole and
    1/16 of the other in HBM: 28.34 GiB; the dry run's step fits at 30.30 of 31.25), and on
    v6e-8 with the idle expert in host memory (26.67 GiB, --park_memory auto); parked in HBM
    there it keeps dp2 x tp2 x sp2 (30.00 GiB; the dry run's step needs 32.12); with
    --park_weights off both experts count whole (53.3 GiB: tp on both)."""
    v6e = chips.CHIPS["v6e"]
    cfg = read_component_config(model_id, "transformer")
    extra = ["--image", "tests/data/first_frame.png"] if "I2V" in model_id else []
    for park, memory, n, want in (("auto", "auto", 16, MeshShape(2, 1, 8)),
                                  ("auto", "auto", 8, MeshShape(2, 1, 4)),
                                  ("auto", "device", 8, MeshShape(2, 2, 2)),
                                  ("off", "auto", 16, MeshShape(2, 4, 2))):
        config = gf.validate_args(gf.parse_args(["--model_id", model_id, "--park_weights",
                                                 park, "--park_memory", memory, *extra]))
        assert resolve_run_mesh(config, FAMILIES["wan"], cfg, n, v6e) == want
    one = resident_weight_bytes(FAMILIES["wan"], model_id, cfg, "bfloat16")
    # auto picks host memory on v6e-8 only: on v6e-16 the HBM-parked layout already fits.
    assert layout.idle_expert_memory("auto", v6e, one // 2, one // 16) == "pinned_host"
    assert layout.idle_expert_memory("auto", v6e, one // 2, one // 32) == "device"
    assert layout.idle_expert_memory("auto", None, one // 2, one // 16) == "device"
    assert layout.idle_expert_memory("pinned_host", None, 1, 1) == "pinned_host"


def test_swap_bytes_per_device_with_the_idle_expert_in_host_memory():
    """--park_memory pinned_host, per device: the idle expert's parked slices are in host
    memory before and after a swap (its HBM holds one expert whole and nothing of the
    other), the values come back exactly, and the dry run's model charges no HBM for it."""
    mesh = make_mesh(MeshShape(2, 1, 4))
    base, base_host = _device_bytes(), _device_bytes(host=True)
    placed, host = _experts_on(mesh, 1, "pinned_host")
    n = 8
    whole = sum(v.nbytes for v in host[0].values()) + 24 * 4
    parked = 64 * 48 * 4 // n + 2 * 40 * 16 * 4 // n + 7 * 4 + 24 * 4 // n
    # transformer_2's buffer was placed whole on the devices (placement parks params only).
    assert _device_bytes() == {d: base.get(d, 0) + whole + 24 * 4 for d in jax.devices()}
    assert _device_bytes(host=True) == {d: base_host.get(d, 0) + parked - 24 * 4 // n
                                        for d in jax.devices()}
    samples = []
    swap = experts.ExpertParking(placed, on_move=lambda: samples.append(_device_bytes()),
                                 memory="pinned_host")
    swap.ensure(1)
    assert _device_bytes() == {d: base.get(d, 0) + whole for d in jax.devices()}
    assert _device_bytes(host=True) == {d: base_host.get(d, 0) + parked for d in jax.devices()}
    largest = 64 * 48 * 4 // n
    assert all(max(s[d] for s in samples) <= base.get(d, 0) + whole + 24 * 4 + largest
               for d in jax.devices())
    for k, v in host[1].items():
        np.testing.assert_array_equal(np.asarray(placed[1]["params"][k]), v)
    assert all(placement.on_host(a) for a in placed[0]["params"].values())
    swap.ensure(0)
    for k, v in host[0].items():
        np.testing.assert_array_equal(np.asarray(placed[0]["params"][k]), v)
    assert swap.report()["memory"] == "pinned_host"
    structs = {g: {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                   for k, a in placed[0][g].items()} for g in ("params", "buffers")}
    model = dry_run._expert_parking(structs, {}, dict(params={}, buffers={}),
                                    jax.ShapeDtypeStruct((4,), np.float32, sharding=NamedSharding(
                                        mesh, P())), "on", chips.CHIPS["v6e"], "pinned_host")
    assert model["memory"] == "pinned_host" and model["idle_hbm_bytes_per_device"] == 0
    assert model["host_bytes_per_device"] == parked
    assert model["swap_peak_bytes"] == 16 + whole + largest
