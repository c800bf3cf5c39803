"""--park_weights: the transformer's replicated weights are sharded over every device while the
VAE decodes, and put back exactly afterwards (``engine.programs.parking``)."""

import gc

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import generate_flax as gf
from engine.dry_run import fit as dry_run
from engine.pipeline import generate
from engine.programs import parking
from engine.run.mesh import MeshShape, make_mesh
from engine.weights import placement
from families import FAMILIES


def test_parked_spec_adds_the_unused_axes_to_a_dimension_they_divide():
    mesh = make_mesh(MeshShape(2, 2, 2))
    # Replicated: dp and sp go to the largest dimension.
    assert parking.parked_spec(P(), (32, 64), mesh) == P(None, ("dp", "tp", "sp"))
    # tp-sharded rows: the free axes join the dimension that still divides by 2 x 4.
    assert parking.parked_spec(P("tp", None), (64, 12), mesh) == P(("tp", "dp", "sp"), None)
    assert parking.parked_spec(P(None, "tp"), (12, 64), mesh) == P(None, ("tp", "dp", "sp"))
    # Nothing divides by 4 beside tp's 2 (6 = 2 x 3; 12 / (2 x 4) is not whole): unchanged.
    assert parking.parked_spec(P(None, "tp"), (6, 12), mesh) == P(None, "tp")
    assert parking.parked_spec(P(), (7,), mesh) == P()
    # Size-1 axes are not "free": dp2 x tp1 x sp4 adds dp and sp only.
    mesh = make_mesh(MeshShape(2, 1, 4))
    assert parking.parked_spec(P(), (40, 64, 32), mesh) == P(None, ("dp", "sp"), None)


def test_should_park_rule():
    assert parking.should_park("on", 0, 0, None)
    assert not parking.should_park("off", 10, 5, 1)
    assert not parking.should_park("auto", 10, 5, None)  # CPU: no capacity known
    assert parking.should_park("auto", 11, 5, 10)
    assert not parking.should_park("auto", 10, 5, 10)  # fits exactly
    assert not parking.should_park("auto", 11, 0, 10)  # nothing to save (all sharded)


def test_decode_memory_rule():
    # (mode, memory, need, weights, parked, capacity) -> where the weights go while decoding.
    cases = [
        (("off", "auto", 50, 20, 5, 10), None),
        (("auto", "auto", 10, 20, 5, 10), None),  # fits as it is
        (("auto", "auto", 12, 20, 5, 10), "device"),  # sharding saves 15: 12 - 15 fits
        (("auto", "auto", 30, 20, 5, 10), "pinned_host"),  # 30 - 15 does not; 30 - 20 does
        (("auto", "auto", 30, 20, 20, 10), "pinned_host"),  # one chip: sharding saves 0
        (("auto", "device", 30, 20, 20, 10), None),  # HBM asked for, nothing to save there
        (("auto", "device", 30, 20, 5, 10), "device"),  # asked for: parks though it won't fit
        (("auto", "pinned_host", 12, 20, 5, 10), "pinned_host"),
        (("on", "auto", 0, 20, 5, None), "device"),  # CPU, several devices
        (("on", "auto", 0, 20, 20, None), "pinned_host"),  # CPU, one device
        (("auto", "auto", 30, 20, 5, None), None),  # CPU: auto never parks
        (("auto", "auto", 30, 0, 0, 10), None),  # nothing in HBM to move
    ]
    for args, want in cases:
        assert parking.decode_memory(*args) == want, args


def test_one_device_decode_parks_the_weights_in_host_memory():
    """One device: sharding saves nothing, so --park_memory auto moves the weights to host
    memory while the VAE decodes (no HBM left) and back, equal, afterwards."""
    mesh = make_mesh(MeshShape(1, 1, 1), jax.devices()[:1])
    home = NamedSharding(mesh, P())
    host_a = np.arange(64 * 32, dtype=np.float32).reshape(64, 32)
    weights = {"params": {"a": jax.device_put(host_a, home)}, "buffers": {}}
    seen = {}

    class Decoder:
        def memory(self):
            return dict(peak_bytes=0)

        def __call__(self, z):
            seen["kind"] = weights["params"]["a"].sharding.memory_kind
            seen["hbm"] = parking.weights_bytes([weights])[0]
            return z + 1

    decoder = parking.ParkingDecoder(Decoder(), [weights], "on", None, "auto")
    z = jax.device_put(np.zeros(3, np.float32), jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(decoder(z)), np.ones(3))
    assert seen == {"kind": "pinned_host", "hbm": 0}
    assert decoder.decision["memory"] == "pinned_host"
    assert decoder.decision["parked_bytes_per_device"] == 0
    assert decoder.decision["weights_bytes_per_device"] == host_a.nbytes
    restored = weights["params"]["a"]
    assert restored.sharding.is_equivalent_to(home, 2) and not placement.on_host(restored)
    np.testing.assert_array_equal(np.asarray(restored), host_a)
    with pytest.raises(ValueError, match="park_memory: expected one of"):
        parking.ParkingDecoder(Decoder(), [weights], "on", None, "disk")


def test_decode_sees_one_eighth_of_the_weights_and_they_come_back_equal():
    mesh = make_mesh(MeshShape(2, 1, 4))
    replicated = NamedSharding(mesh, P())
    host_a = np.arange(40 * 64 * 32, dtype=np.float32).reshape(40, 64, 32)
    host_b = np.linspace(0, 1, 7, dtype=np.float32)
    weights = {"params": {"a": jax.device_put(host_a, replicated),
                          "b": jax.device_put(host_b, replicated)},
               "buffers": {}}
    before = weights["params"]["a"]
    seen = {}

    class Decoder:
        def memory(self):
            return dict(peak_bytes=0)

        def __call__(self, z):
            seen.update(placement.per_device_bytes())  # every live array, per device
            return z * 2

    z = jax.device_put(np.ones(3, np.float32), jax.devices()[0])
    decoder = parking.ParkingDecoder(Decoder(), [weights], "on", None)
    # Other tests' unreachable arrays (e.g. experts.ExpertParking's dict <-> parking cycle)
    # would otherwise be freed by the cyclic GC between the two readings.
    gc.collect()
    live = placement.per_device_bytes()  # other tests' live arrays count in both
    np.testing.assert_array_equal(np.asarray(decoder(z)), 2 * np.ones(3))
    # While decoding each device held 1/8 of "a" and all of the 7-float bias instead of the
    # whole copies (deleted, not merely unreferenced).
    one = host_a.nbytes // 8 + host_b.nbytes
    freed = host_a.nbytes + host_b.nbytes - one
    assert {d: live[d] - seen[d] for d in jax.devices()} == {d: freed for d in jax.devices()}
    assert before.is_deleted()
    assert decoder.decision["parked"] and decoder.decision["parked_bytes_per_device"] == one
    assert set(decoder.last) == {"park_s", "restore_s"}
    for name, host in (("a", host_a), ("b", host_b)):
        assert weights["params"][name].sharding.is_equivalent_to(replicated, host.ndim)
        np.testing.assert_array_equal(np.asarray(weights["params"][name]), host)
    # auto on a device of unknown HBM (CPU) never parks.
    decoder = parking.ParkingDecoder(Decoder(), [weights], "auto", None)
    decoder(z)
    assert not decoder.decision["parked"] and decoder.last == {}
    with pytest.raises(ValueError, match="park_weights: expected one of"):
        parking.ParkingDecoder(Decoder(), [weights], "sometimes", None)


def test_dry_run_parks_only_where_the_decode_would_not_fit():
    mesh = make_mesh(MeshShape(2, 1, 4))

    def struct(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    placed = dict(params={"w": struct((64, 32), P())}, buffers={})  # 8 KiB, replicated
    vae = dict(params={}, buffers={})
    for capacity, parked in ((9000, True), (9000 + 2048, False)):
        rows = [dict(program="VAE decode (3 programs, peak)", total_bytes=1000, fits=True,
                     capacity_bytes=capacity)]
        decision = dry_run._add_resident(rows, placed, vae, {}, 0, 1, "auto")
        assert decision["parked"] is parked
        assert rows[0]["total_bytes"] == 1000 + (1024 if parked else 8192)
        assert rows[0]["fits"]



def test_dry_run_parks_one_chip_in_host_memory():
    """One chip (Wan 14B int8 on v6e:1x1): the decode beside the weights does not fit and
    sharding saves nothing, so the dry run counts the weights in host memory: no HBM."""
    mesh = make_mesh(MeshShape(1, 1, 1), jax.devices()[:1])
    placed = dict(params={"w": jax.ShapeDtypeStruct((64, 32), np.float32,
                                                      sharding=NamedSharding(mesh, P()))},
                  buffers={})  # 8 KiB
    vae = dict(params={}, buffers={})
    for memory, parked in (("auto", True), ("pinned_host", True), ("device", False)):
        rows = [dict(program="VAE decode (3 programs, peak)", total_bytes=1000, fits=True,
                     capacity_bytes=4096)]
        decision = dry_run._add_resident(rows, placed, vae, {}, 0, 1, "auto", None, memory)
        assert decision["parked"] is parked, memory
        assert rows[0]["total_bytes"] == 1000 + (0 if parked else 8192)
        assert rows[0]["fits"] is parked
        assert decision["memory"] == ("pinned_host" if parked else None)
        assert decision["parked_bytes_per_device"] == (0 if parked else 8192)


def test_parked_decode_frames_equal_the_unparked_run(tiny_checkpoint_8h):
    # dp2 x sp4 replicates every weight over sp; the decode runs with them parked, and a
    # second timed run (the weights put back) must give the same frames again.
    flags = ["--model_id", tiny_checkpoint_8h, "--height", "64", "--width", "96", "--frames",
             "9", "--num_inference_steps", "2", "--warmup_steps", "1", "--dtype", "float32",
             "--attention", "xla", "--compilation_cache_dir", "none", "--dp", "2", "--tp", "1",
             "--sp", "4"]
    out = {}
    for mode, iterations in (("off", 1), ("on", 2)):
        args = gf.validate_args(gf.parse_args([*flags, "--park_weights", mode,
                                               "--num_iterations", str(iterations)]))
        out[mode] = generate(args, FAMILIES[args.model.family])
    (frames_off, _), (frames_on, report) = out["off"], out["on"]
    np.testing.assert_array_equal(frames_on, frames_off)
    assert report["settings"]["park_weights"] == "on"
    assert all("restore_s" in run for run in report["timings"]["runs"])
    assert report["park_weights"]["parked"]
