"""Pricing one compiled program's ops on a TPU chip (ESTIMATE, never a measurement): the
chips' assumed clocks, MXU widths, HBM and ICI figures, the per-op rule max(cycles / clock,
HBM bytes / bandwidth) (``program_summary``) and reading a compiled program's HLO back
(``block_hlo_text``). Every stage's price uses it: the step's block
(``engine.dry_run.price_step``), the decode (``price_decode``) and the text encoders on the
mesh (``price_text``). See ``engine.dry_run.estimate`` for the method and its sources."""

from __future__ import annotations

import glob
import os
import re
import tempfile

from custom_splash_attention import (
    KERNEL_NAME,
)
from engine.dry_run.hlo import (
    COLLECTIVES,
    collectives,
    hlo_computations,
    hlo_multipliers,
    hlo_op_bytes,
    instruction_flops,
    matmul_flops,
    matmul_operand_types,
)
from engine.run import chips, runtime

# MXU bf16 FLOPs per cycle per TensorCore, as libtpu's cycle counts imply. v5e: 4 MXUs of
# 128^2 (Google Cloud's v5e page) x 2. v6e: Google's v6e page lists two 256^2 MXUs per
# TensorCore, which at the published 918 TFLOP/s would need 3.5 GHz; libtpu's static profile
# of a large bf16 matmul does ~0.94 x 524,288 FLOPs per cycle (tests/test_estimate.py), so
# 524,288 (= 4 x 256^2 x 2, the shared notes' figure) is the one consistent with its cycles,
# and the clock follows from it. tpu7x: libtpu 0.0.52 profiles a 4096^3 bf16 matmul on one
# TensorCore at 280,971 cycles against v6e's 278,977 (shared notes, estimate-calibration), so
# the same 524,288 per TensorCore; with two TensorCores per chip the published 2,307 TFLOP/s
# per chip gives 2.2 GHz.
MXU_FLOPS_PER_CYCLE = {"v5e": 4 * 128 * 128 * 2, "v6e": 4 * 256 * 256 * 2,
                       "tpu7x": 4 * 256 * 256 * 2}
assert set(MXU_FLOPS_PER_CYCLE) == set(chips.ESTIMATE_CHIPS)
# HLO element types of an 8-bit matmul (``--quantize``): ``chips.Chip.eight_bit`` runs those
# with both operands of its type at twice the bf16 rate (Google Cloud's pages: v5e 394 int8
# TOPS against 197 bf16, v6e 1,836 against 918, TPU7x 4,614 fp8 TFLOP/s against 2,307).
EIGHT_BIT_HLO = {"int8": "s8", "fp8": "f8e4m3fn"}


def mxu_rate(chip: str, operand_types: set) -> float:
    """The MXU's rate for these matmul operands relative to bf16: 2 where every one is an
    8-bit matmul of the chip's 8-bit type, else 1."""
    eight = chips.CHIPS[chip].eight_bit
    hlo = EIGHT_BIT_HLO.get(eight)
    return 2.0 if hlo and operand_types == {(hlo, hlo)} else 1.0
# ICI egress per chip, GB/s: half of the "bidirectional inter-chip interconnect bandwidth
# per chip" of Google Cloud's TPU v5e (400 GB/s), v6e (800 GB/s) and TPU7x (1,200 GB/s)
# pages. It assumes every ICI port carries the collective, so collective times are lower
# bounds. A tpu7x chip's two TensorCores (two JAX devices) share its ports: each gets half.
ICI_EGRESS_GBPS = {"v5e": 200.0, "v6e": 400.0, "tpu7x": 600.0}
ICI_SOURCE = ("half the bidirectional per-chip ICI bandwidth of Google Cloud's TPU pages "
              "(v5e 400 GB/s, v6e 800 GB/s, TPU7x 1,200 GB/s; shared by a chip's "
              "TensorCores): all ports in use, no overlap with compute")
STUB_NAME = "estimate_attention_stub"
# The one-block program's name (``jit_estimate_block``): what the HLO dump is filtered by.
BLOCK_NAME = "estimate_block"
PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"


def clock_hz(chip: str) -> float:
    """Assumed TensorCore clock, Hz: published bf16 peak per TensorCore / MXU FLOPs per cycle.

    Raises:
        ValueError: a chip without an MXU figure here (v5e, v6e and tpu7x have one).
    """
    if chip not in MXU_FLOPS_PER_CYCLE:
        raise ValueError(f"no clock assumption for {chip!r}; --estimate knows "
                         f"{', '.join(MXU_FLOPS_PER_CYCLE)}")
    return device_peak_flops(chip) / MXU_FLOPS_PER_CYCLE[chip]


def device_peak_flops(chip: str) -> float:
    """Published dense bf16 peak of one JAX device (a TensorCore on tpu7x), FLOP/s."""
    c = chips.CHIPS[chip]
    return c.peak_bf16_tflops * 1e12 / c.devices_per_chip


def device_hbm_bytes_per_s(chip: str) -> float:
    """HBM bandwidth of one JAX device, bytes/s: the chip's, split over its TensorCores
    (each tpu7x TensorCore has its own half of the chip's HBM)."""
    c = chips.CHIPS[chip]
    return c.hbm_gbps * 1e9 / c.devices_per_chip


def device_ici_bytes_per_s(chip: str) -> float:
    """ICI egress of one JAX device, bytes/s (``ICI_EGRESS_GBPS`` over the chip's devices)."""
    return ICI_EGRESS_GBPS[chip] * 1e9 / chips.CHIPS[chip].devices_per_chip


def label(chip: str) -> str:
    """The words every estimated figure carries."""
    return (f"estimate from libtpu's static model and the roofline, assumed clock "
            f"{clock_hz(chip) / 1e9:.2f} GHz, not a measurement, not checked on hardware")


_NO_WORK = {"parameter", "get-tuple-element", "bitcast", "tuple", "constant", "partition-id",
            "replica-id", "after-all", "while", "conditional", "call", "opt-barrier"}
_INT64_MAX = 2**63 - 1
# On tpu7x libtpu moves layout copies to the SparseCore: async-start / async-update /
# async-done on the "sparsecore" thread around computations whose ``call`` reaches the copy
# itself, which the ``call`` rule below already charges. The wrappers are no further work:
# charging the async-update's tuple (the copy's input and output) as well counted each copy
# 2.5 times (0.158 + 0.105 ms for a 194 MB bf16 copy per Wan 14B 720p tpu7x device, 11 such
# copies per layer).
_SPARSECORE = 'async_execution_thread="sparsecore"'


def _sparsecore_wrappers(insts: list) -> set:
    """Names of a computation's SparseCore async-starts and the async-updates on them (an
    update names its start as its first operand and carries no thread of its own)."""
    starts = {name for name, _, opcode, rest in insts
              if opcode == "async-start" and _SPARSECORE in rest}
    updates = {name for name, _, opcode, rest in insts if opcode == "async-update"
               and re.match(r"\(?%?([\w.\-]+)", rest).group(1) in starts}
    return starts | updates


def _op_cycles(name: str, rest: str, flops: float, rate: float, chip: str, profile):
    """(cycles, source) of one op by ``program_summary``'s order of sources."""
    xla = re.search(r'"window_config":\{[^}]*?"estimated_cycles":"(\d+)"', rest)
    if profile is not None and name in profile:
        return profile[name], "profile"
    if flops:
        return flops / (MXU_FLOPS_PER_CYCLE[chip] * rate), "roofline"
    if xla and int(xla.group(1)) < _INT64_MAX:
        return int(xla.group(1)), "xla_cost_model"
    return 0, "bytes_only"


def program_summary(hlo_text: str, chip: str, *, profile: dict | None = None,
                    exclude: tuple = (KERNEL_NAME, STUB_NAME)) -> dict:
    """Seconds of one compiled program's ops on ``chip`` per call (ESTIMATE), by the
    per-op rule max(cycles / clock, HBM bytes / HBM bandwidth), ops in ``while`` bodies x
    their trip count. Collectives are left to ``collectives``; ops whose name contains one
    of ``exclude`` (the attention kernel, counted apart) are left out.

    An op's cycles come from, first to last:
      * ``profile`` ({op name: estimated cycles} from libtpu's static profile), if given;
      * for ops with a convolution or dot (the linear layers), their FLOPs / MXU FLOPs per
        cycle (the roofline, which libtpu's profile reproduces to about 90% for large bf16
        matmuls, see the tests), twice as many per cycle for an 8-bit matmul of the chip's
        8-bit type (``mxu_rate``; ``--quantize``);
      * for the rest, XLA's own ``estimated_cycles`` in the op's backend config (its TPU
        fusion cost model; absent or unknown: 0, i.e. bytes / HBM bandwidth alone).

    Returns:
        dict: linear_s, other_s (seconds), other_hbm_floor_s (the other ops at HBM bytes /
        bandwidth alone, which ``combine`` uses: see the module docstring), hbm_bound_s
        (seconds of ops whose bytes term won), flops (of the linear ops), eight_bit_flops
        (of those, the ones at the 8-bit rate) and eight_bit_ops (such ops), bytes, ops,
        source (op counts per cycle source), top_ops (the 8 slowest), collective_sent_bytes
        and collectives (per kind).
    """
    hz, hbm = clock_hz(chip), device_hbm_bytes_per_s(chip)
    comps = hlo_computations(hlo_text)
    times, op_bytes = hlo_multipliers(hlo_text), hlo_op_bytes(hlo_text)
    control = {"ENTRY"}
    for insts in comps.values():
        for _, _, opcode, rest in insts:
            control.update(re.findall(r"(?:body|condition|branch_computations)=\{?%?([\w.\-]+)",
                                      rest))
            if opcode == "call":
                control.update(re.findall(r"to_apply=%?([\w.\-]+)", rest))
    out = dict(linear_s=0.0, other_s=0.0, other_hbm_floor_s=0.0, hbm_bound_s=0.0, flops=0.0,
               eight_bit_flops=0.0, eight_bit_ops=0, bytes=0.0, ops=0,
               source=dict(profile=0, roofline=0, xla_cost_model=0, bytes_only=0))
    top = []
    for comp in control:
        types = {name: result for name, result, _, _ in comps.get(comp, [])}
        sparsecore = _sparsecore_wrappers(comps.get(comp, []))
        for name, result, opcode, rest in comps.get(comp, []):
            kind = re.sub(r"-(start|done)$", "", opcode)
            if (opcode in _NO_WORK or opcode.endswith("-done") or kind in COLLECTIVES
                    or name in sparsecore
                    or any(x in name for x in exclude)
                    or any(x in rest for x in (f'"{KERNEL_NAME}', f'"{STUB_NAME}'))):
                continue
            n = times.get(name, 1)
            called = re.findall(r"calls=%?([\w.\-]+)", rest)
            flops = (matmul_flops(comps, called[0]) if called else 0.0) or instruction_flops(
                types, result, opcode, rest)
            rate = mxu_rate(chip, matmul_operand_types(comps, types, opcode, rest)) if flops else 1
            cycles, source = _op_cycles(name, rest, flops, rate, chip, profile)
            if rate > 1:
                out["eight_bit_flops"] += n * flops
                out["eight_bit_ops"] += 1
            nbytes = op_bytes.get(name, ("", 0.0))[1]
            compute, memory = n * cycles / hz, n * nbytes / hbm
            seconds = max(compute, memory)
            out["linear_s" if flops else "other_s"] += seconds
            out["other_hbm_floor_s"] += 0.0 if flops else memory
            out["hbm_bound_s"] += seconds if memory > compute else 0.0
            out["flops"] += n * flops
            out["bytes"] += n * nbytes
            out["ops"] += 1
            out["source"][source] += 1
            top.append((seconds, name, opcode, n, source))
    coll = collectives(hlo_text)
    out["collective_sent_bytes"] = sum(c["sent_bytes"] * c["count"] for c in coll)
    out["collectives"] = {}
    for c in coll:
        agg = out["collectives"].setdefault(c["kind"], dict(calls=0, sent_bytes=0.0))
        agg["calls"] += c["count"]
        agg["sent_bytes"] += c["sent_bytes"] * c["count"]
    out["top_ops"] = [dict(seconds=t[0], name=t[1], opcode=t[2], count=t[3], source=t[4])
                      for t in sorted(top, reverse=True)[:8]]
    return out



def dump_block_hlo() -> str:
    """Apply ``block_hlo_env`` to the process environment (before libtpu loads); returns the
    dump's directory."""
    path = tempfile.mkdtemp(prefix="estimate_hlo_")
    runtime.apply_process_env(block_hlo_env(path))
    return path


def block_hlo_env(path: str | None = None) -> runtime.ProcessEnv:
    """``XLA_FLAGS`` that have XLA write the one-block program's optimized HLO as text to
    ``path`` (None: a new temporary directory), as a ``runtime.ProcessEnv``.

    For tpu7x: jaxlib 0.10.2 cannot read back what libtpu 0.0.51 compiled
    (``compiled.as_text()``: "RET_CHECK failure ... async-update instruction should have 1
    operands but sees 3"), while libtpu's own dump is text from its own printer."""
    path = path or tempfile.mkdtemp(prefix="estimate_hlo_")
    return runtime.ProcessEnv(xla_flags=(f"--xla_dump_to={path}", "--xla_dump_hlo_as_text",
                                         f"--xla_dump_hlo_module_re=.*{BLOCK_NAME}.*"))


def block_hlo_text(compiled) -> str:
    """The compiled block's HLO text: ``compiled.as_text()``, else (a newer libtpu, see
    ``dump_block_hlo``) the newest ``*after_optimizations.txt`` of the block in the dump.

    Raises:
        RuntimeError: neither is available.
    """
    try:
        return compiled.as_text()
    except Exception as e:  # noqa: BLE001 - jaxlib's proto reader; the dump is the fallback
        m = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", ""))
        pattern = f"*{BLOCK_NAME}*.after_optimizations.txt"
        files = sorted(glob.glob(os.path.join(m.group(1), pattern)) if m else [],
                       key=os.path.getmtime)
        if not files:
            raise RuntimeError(f"the compiled block's HLO is unreadable "
                               f"({str(e).splitlines()[0][:160]}) and no HLO dump was "
                               "written") from None
        with open(files[-1]) as f:
            return f.read()

