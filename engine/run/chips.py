"""TPU chip facts in one table: bf16 peak, HBM and HBM bandwidth per chip.

Used by the run summary (MFU), the dry run (does it fit) and the benchmarks, so that they can
never disagree. Peak, HBM and bandwidth are per **chip**; a v7x chip has two TensorCores and
JAX shows each as its own device (libtpu's v4 topologies do too, while a megacore v4 VM
shows one device per chip), so FLOP/s are summed over chips, counted by their coordinates.

Sources: Google Cloud's TPU system-architecture pages (v4, v5e, v5p, v6e, TPU7x / Ironwood)
for peak dense bf16 FLOP/s, HBM capacity and bandwidth; ``usable_hbm_bytes`` is what
libtpu 0.0.42.1's compiler reports as "available HBM" in an over-size deviceless compile
(the HBM the runtime leaves to programs), read on this project's host.
"""

from __future__ import annotations

import dataclasses
import math

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation.

    Attributes:
        name: topology prefix as libtpu spells it ("v6e" in "v6e:2x4").
        device_kinds: ``jax.Device.device_kind`` strings of this generation.
        peak_bf16_tflops: dense bf16 peak of one chip, TFLOP/s.
        hbm_bytes: HBM of one chip, bytes (nominal).
        usable_hbm_bytes: HBM a compiled program may use on one JAX device, bytes, as
            libtpu's compiler reports it for a deviceless compile.
        hbm_gbps: HBM bandwidth of one chip, GB/s.
        devices_per_chip: JAX devices per chip in libtpu's topologies.
        topology_dims: 2 for the 2-D tori of v5e/v6e ("2x4"), 3 for the 3-D ones ("2x2x1").
        eight_bit: the 8-bit matmul type the MXU runs at twice the bf16 rate ("int8" on
            v5e, v5p and v6e: 394 / 918 / 1836 TOPS; "fp8" on TPU7x: 4614 TFLOP/s, which has
            no int8 rate; None on v4, whose int8 rate equals bf16's), from the same pages;
            ``--quantize`` must name it.
    """

    name: str
    device_kinds: tuple[str, ...]
    peak_bf16_tflops: float
    hbm_bytes: int
    usable_hbm_bytes: int
    hbm_gbps: float
    devices_per_chip: int
    topology_dims: int
    eight_bit: str | None = None


CHIPS = {
    c.name: c for c in (
        Chip("v4", ("TPU v4",), 275.0, 32 * GIB, int(15.25 * GIB), 1228.0, 2, 3),
        Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197.0, 16 * GIB, int(15.75 * GIB), 819.0, 1, 2,
             "int8"),
        Chip("v5p", ("TPU v5", "TPU v5p"), 459.0, 95 * GIB, int(95.74 * GIB), 2765.0, 1, 3,
             "int8"),
        Chip("v6e", ("TPU v6 lite", "TPU v6e"), 918.0, 32 * GIB, int(31.25 * GIB), 1640.0, 1,
             2, "int8"),
        # TPU7x (Ironwood): two TensorCores per chip, each its own JAX device with half the
        # chip's 192 GB.
        Chip("tpu7x", ("TPU7x", "TPU v7x", "TPU v7"), 2307.0, 192 * 10**9,
             int(94.75 * GIB), 7370.0, 2, 3, "fp8"),
    )
}

# Chips whose MXU width and clock ``--estimate`` knows (engine/dry_run/estimate.py).
ESTIMATE_CHIPS = ("v5e", "v6e", "tpu7x")
# Chips whose default layout is Ulysses sequence parallelism (tp 1, sp = what dp leaves)
# rather than head-sharded tp, for every checkpoint: tpu7x (issue #33), where Wan 14B 720p x 81
# on tpu7x:2x2x1 is 2.34 s/step at dp2 x sp4 against 2.94 at dp2 x tp4 (estimates,
# docs/dry_run.md) and 94.75 GiB per TensorCore hold even a Wan 2.2 A14B pair replicated.
ULYSSES_DEFAULT_CHIPS = ("tpu7x",)
# Chips whose default is Ulysses when the replicated transformer weights (every resident
# expert) take at most this fraction of a device's usable HBM. v6e: Ulysses wins on every
# family by the estimate (Wan 14B 720p dp2 x sp4 2.98 s/step against 3.21 at dp2 x tp2 x sp2,
# HunyuanVideo-1.5 720p x 121 3.39 against 3.59 at dp2 x tp4), but 31.25 GiB leave little
# room: Wan 2.1 T2V 14B's 26.67 GiB (85%) fit with the activations (step 28.79 GiB on
# v6e:2x4 by the dry run), Wan 2.1 I2V 14B's 30.59 GiB (98%) do not (32.44), nor do a
# Wan 2.2 A14B pair's 53.3. With the idle expert parked (engine.programs.experts) a pair
# holds 26.67 GiB + 1/devices of it: 30.00 (96%) on v6e:2x4, whose step needs 32.12; 28.34
# (90.7%) on v6e:4x4, whose step fits at 30.30 (dry runs, 2026-11-26,
# benchmarks/dry_run_results.md). 93% sits between those and leaves 2.2 GiB.
ULYSSES_WEIGHT_FRACTION = {"v6e": 0.93}


def prefers_ulysses(chip: Chip | None, weight_bytes: int | None) -> bool:
    """Whether the default layout on ``chip`` is Ulysses (tp 1, sp = what dp leaves).

    Args:
        chip: the run's chip (None off TPU: False).
        weight_bytes: the transformer weights one device holds when they are replicated,
            every resident expert included (``engine.weights.layout.resident_weight_bytes``), or
            None when unknown (then only ``ULYSSES_DEFAULT_CHIPS`` prefer it).
    """
    if chip is None:
        return False
    if chip.name in ULYSSES_DEFAULT_CHIPS:
        return True
    fraction = ULYSSES_WEIGHT_FRACTION.get(chip.name)
    return (fraction is not None and weight_bytes is not None
            and weight_bytes <= fraction * chip.usable_hbm_bytes)


def chip_for_device_kind(device_kind: str) -> Chip | None:
    """The ``Chip`` whose kinds match ``jax.Device.device_kind`` exactly, else None."""
    kind = device_kind.strip().lower()
    for chip in CHIPS.values():
        if kind in (k.lower() for k in chip.device_kinds):
            return chip
    return None


def chip_for_topology(topology: str) -> Chip | None:
    """The ``Chip`` of a topology name such as "v6e:2x4" or "tpu7x:2x2x1", else None."""
    return CHIPS.get(topology.split(":")[0])


def topology_name(devices) -> str | None:
    """libtpu's topology name for a list of TPU devices ("v6e:2x4"), or None off TPU.

    Built from the devices' kind and their chip ``coords``; this is what ``--dry_run
    --topology`` needs to predict a run on these devices.
    """
    devices = list(devices)
    chip = chip_for_device_kind(devices[0].device_kind) if devices else None
    coords = [getattr(d, "coords", None) for d in devices]
    if chip is None or any(c is None for c in coords):
        return None
    dims = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    dims = dims[:chip.topology_dims] + [1] * (chip.topology_dims - len(dims))
    return f"{chip.name}:" + "x".join(str(d) for d in dims)


def count_chips(devices) -> int:
    """Physical chips among ``devices``: distinct chip coordinates (two TensorCores of one
    v7x chip share them), else one chip per device."""
    devices = list(devices)
    coords = {tuple(c) for d in devices if (c := getattr(d, "coords", None)) is not None}
    return len(coords) if coords else len(devices)


def peak_flops(devices) -> float | None:
    """Dense bf16 peak of the chips behind ``devices`` (JAX devices), FLOP/s; None off TPU."""
    devices = list(devices)
    chip = chip_for_device_kind(devices[0].device_kind) if devices else None
    return None if chip is None else chip.peak_bf16_tflops * 1e12 * count_chips(devices)


def mfu(flops: float, seconds: float, devices) -> float | None:
    """Model FLOPs utilisation, nanoGPT's definition: achieved FLOP/s / peak FLOP/s.

    MFU = flops / seconds / (chips x per-chip dense bf16 peak), where ``flops`` are the
    analytic model FLOPs done in ``seconds`` on ``devices``. None off TPU.
    """
    peak = peak_flops(devices)
    if peak is None or not seconds > 0 or not math.isfinite(flops):
        return None
    return flops / seconds / peak
