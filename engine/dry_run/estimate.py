"""``--dry_run --estimate``: seconds per denoising step from static TPU cost models.

ESTIMATE ONLY, never a measurement, never checked on hardware. Nothing here runs on a TPU:
libtpu compiles for a described chip on a CPU host (deviceless) and its cost models are read.

How a step is put together (per chip; see the project's shared notes, tpu-static-profile):

* **Attention** (our Splash kernel): libtpu's static profile. With
  ``--xla_jf_dump_static_llo_profile_to=DIR`` in ``LIBTPU_INIT_ARGS`` libtpu simulates the
  final VLIW bundle schedule of every op it compiles and writes its ``estimated_cycles``
  (one ``*_static_llo_profile.textproto`` per op). The flag is read once, when libtpu
  loads, so the kernel is profiled in a subprocess (``python -m engine.dry_run.estimate``), on a
  tiny grid (1 head, at most 2 x 2 blocks) at the call's real fitted block sizes, head_dim
  and dtype. Cycles per grid step x the real per-chip grid (batch x heads x q blocks x kv
  steps, read from the kernel's own ``grid`` as the sharded wrapper builds it in the
  compiled block) / the assumed clock. Cycles per step do not depend on the grid's size
  (the tests' 1x2 against 2x2x2 check); the tiny grid over-weights the per-q-block init
  and finish slightly. One exception (``reduced_q_cost``): a kernel comparing segment ids
  in every kv block at a block_q above ``MASKED_PROFILE_MAX_BLOCK_Q`` (HunyuanVideo-1.5's
  last kv block at v6e's default blocks) is profiled at two smaller block_q and
  extrapolated linearly, since libtpu's profile of it at the real block_q outgrows the host.
* **Everything else in a block** (linear layers, norms, modulation, RoPE, copies): ONE
  transformer block compiled at the real per-chip shapes (the inputs the model hands its
  first block, laid out as between blocks), the kernel replaced by a no-op Pallas call of
  the same operands. Linear layers (ops with a convolution or dot): per op,
  max(FLOPs / MXU peak, HBM bytes / HBM bandwidth). Other ops: HBM bytes / HBM bandwidth.
  Not libtpu's profile: on this block libtpu 0.0.42.1's static profiler grew past 14 GB
  of host memory (on the RoPE de-interleave fusions) and aborted on the whole model at
  small sizes ("Unsupported DMA direction"). Why bytes for the other ops: on a Wan-sized
  layer norm (bf16 18,900 x 5,120, v6e; ``benchmarks/elementwise_cycles.py``) libtpu's
  profile gives 94k / 159k / 244k cycles for its three fusions, the bytes take 207k /
  207k / 413k, and XLA's own fusion cost model (``estimated_cycles`` in the compiled HLO)
  says 843k / 844k / 1,033k: 4x the profile. max(profile, bytes) is the bytes there. The
  step with XLA's figures (max with the bytes) is reported beside, as a pessimistic
  variant. Ops inside a ``while`` body count x its trip count. x blocks.
* **Collectives** (no cost in either model): the bytes each chip sends for every
  all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute of the
  compiled block (ring algorithms: all-reduce 2(n-1)/n of its operand, all-gather and
  all-to-all (n-1)/n of the gathered / exchanged array, reduce-scatter (n-1)/n of its
  operand), divided by the chip's ICI egress, ``ICI_EGRESS_GBPS``. Added serially: overlap
  with compute, which XLA's async collectives allow, is not credited.
* Work outside the blocks (patch embedding, RoPE tables, time embedding, output
  projection; well under 1% of Wan's FLOPs) is left out.

The clock is an assumption, not a value read from libtpu: the published bf16 peak divided
by the MXU FLOPs per cycle (v6e 918 TFLOP/s / (4 x 256^2 x 2) = 1.75 GHz; v5e 197 /
(4 x 128^2 x 2) = 1.5 GHz).

The profile and HLO text parsers are ``engine.dry_run.hlo``; the kernel's calls are seen
(and stubbed) through its public hook, ``custom_splash_attention.describe_calls``.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torchax import interop
from torchax.ops import mappings

from custom_splash_attention import (
    KERNEL_NAME,
    AttentionOptions,
    BlockSizes,
    LocalMask,
    describe_calls,
    splash_attention,
)
from engine.dry_run import masked_cost as masked_cost_mod
from engine.dry_run.abstract import abstract_inputs, abstract_transformer
from engine.dry_run.hlo import (  # noqa: F401 (parse_textproto, profile_ops: estimate's API)
    COLLECTIVES,
    collectives,
    hlo_computations,
    hlo_multipliers,
    hlo_op_bytes,
    instruction_flops,
    matmul_flops,
    matmul_operand_types,
    parse_textproto,
    profile_ops,
    read_profile,
)
from engine.files.checkpoint import PROJECT_ROOT, read_component_config
from engine.run import chips, runtime
from engine.weights import sharding as sharding_mod
from splash import sdpa, svg
from splash.blocks import fit_block_sizes, vmem_limit_bytes
from splash.mask_info import InfoLayout

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


# ---------------------------------------------------------------------------------------
# Profiled compiles (only in a process whose libtpu was loaded with PROFILE_FLAG)
# ---------------------------------------------------------------------------------------


def setup_profile_environment(profile_dir: str | None = None) -> str:
    """Start a profiling process: put ``PROFILE_FLAG`` and the deviceless libtpu variables in
    the environment (``runtime.apply_process_env``), before libtpu loads; returns the
    profile directory (the flag's, if one was already set)."""
    m = re.search(PROFILE_FLAG + r"=(\S+)", os.environ.get("LIBTPU_INIT_ARGS", ""))
    profile_dir = m.group(1) if m else profile_dir or tempfile.mkdtemp(prefix="static_profile_")
    runtime.apply_process_env(runtime.ProcessEnv(
        libtpu_args=(f"{PROFILE_FLAG}={profile_dir}",),
        defaults=(("TPU_ACCELERATOR_TYPE", "v6e-8"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                  ("TPU_SKIP_MDS_QUERY", "1"), ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                  ("JAX_PLATFORMS", "cpu"))))
    os.makedirs(profile_dir, exist_ok=True)
    return profile_dir


def profile_dir() -> str:
    """The directory libtpu writes profiles to in this process.

    Raises:
        RuntimeError: the flag is not set (libtpu would write nothing).
    """
    m = re.search(PROFILE_FLAG + r"=(\S+)", os.environ.get("LIBTPU_INIT_ARGS", ""))
    if not m:
        raise RuntimeError(f"{PROFILE_FLAG} is not in LIBTPU_INIT_ARGS; call "
                           "setup_profile_environment() before JAX loads libtpu")
    return m.group(1)


def clear_profile() -> str:
    path = profile_dir()
    for p in glob.glob(os.path.join(path, "*")):
        shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    return path


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


def topology_device(topology: str):
    """Device 0 of a described TPU slice (deviceless)."""
    return runtime.topology_desc(topology).devices[0]


def kernel_cycles(topology: str, block_sizes, *, head_dim: int = 128, heads: int = 1,
                  q_blocks: int = 2, kv_blocks: int = 2, q_len: int | None = None,
                  kv_len: int | None = None, dtype="bfloat16", segment_ids: bool = False,
                  window_size: int | None = None,
                  real_keys_before: int = 0) -> tuple[int, int]:
    """(estimated cycles of our Splash kernel, its grid steps) from one profiled deviceless
    compile on device 0 of ``topology``, batch 1. An estimate from libtpu's static model.

    ``block_sizes`` are fitted to the sequences as the kernel fits them; by default the
    sequences are ``q_blocks`` and ``kv_blocks`` whole blocks. ``segment_ids`` adds all-ones
    ids (the masked variant the sequence-parallel padding uses); ``window_size`` a
    ``LocalMask``; ``real_keys_before`` as ``splash_attention``'s.
    """
    bs = block_sizes if isinstance(block_sizes, BlockSizes) else BlockSizes(*block_sizes)
    q_len = q_len or q_blocks * bs.block_q
    kv_len = kv_len or kv_blocks * bs.block_kv
    fitted = fit_block_sizes(bs, q_len, kv_len)
    steps = heads * -(-q_len // fitted.block_q) * -(-kv_len // fitted.block_kv)
    rep = NamedSharding(Mesh(np.array([topology_device(topology)]), ("x",)), P())
    dt = getattr(jnp, dtype) if isinstance(dtype, str) else dtype
    args = [jax.ShapeDtypeStruct((1, heads, n, head_dim), dt, sharding=rep)
            for n in (q_len, kv_len, kv_len)]

    # The profile flag's own VMEM buffers sit beside the kernel's scoped VMEM: a run's request
    # (twice the kernel's estimated need, 91 MiB at 3328/3072/1024) left too little for them
    # (a 2 x 3 grid with segment ids: 130.4 of 127.9 MiB), so profiles ask for the estimated
    # need itself, 1.5-2x Mosaic's. The cycles do not depend on it (73,659 either way, v6e,
    # 3328/3072/1024, 2 x 2).
    vmem = vmem_limit_bytes(fitted, head_dim, jnp.dtype(dt).itemsize, margin=1)

    options = AttentionOptions(block_sizes=bs, mask=None if window_size is None
                               else LocalMask(window_size))

    def fn(q, k, v):
        seg = None
        if segment_ids:
            seg = (jnp.ones((1, q_len), jnp.int32), jnp.ones((1, kv_len), jnp.int32))
        return splash_attention(q, k, v, options=options, segment_ids=seg,
                                vmem_limit_bytes=vmem, real_keys_before=real_keys_before)

    path = clear_profile()
    jax.jit(fn).lower(*args).compile()
    cycles = sum(op["cycles"] for op in read_profile(path) if KERNEL_NAME in op["name"])
    release_compile_memory()
    if not cycles:
        raise RuntimeError(f"no {KERNEL_NAME} op in the static profile of {path}")
    return cycles, steps


def profiled_cycles(device, bs: BlockSizes, *, q_blocks: int, kv_blocks: int, mask, cls,
                    head_dim: int = 128, dtype=jnp.bfloat16) -> int:
    """Cycles of our kernel on a ``q_blocks`` x ``kv_blocks`` grid (batch 1, 1 head) on
    ``device`` (a deviceless TPU device) from libtpu's static profile: unmasked (``mask``
    None, the dense path) or with ``mask`` and every sub-tile's class ``cls`` made static
    (None: read from the table, as it runs). The process must have the profile flag set
    (``setup_profile_environment``).

    Raises:
        RuntimeError: no kernel op in the profile.
    """
    q_len, kv_len = q_blocks * bs.block_q, kv_blocks * bs.block_kv
    if fit_block_sizes(bs, q_len, kv_len) != bs:
        raise ValueError(f"blocks {bs} are not fitted blocks of a {q_len} x {kv_len} grid")
    rep = NamedSharding(Mesh(np.array([device]), ("x",)), P())
    args = [jax.ShapeDtypeStruct((1, 1, n, head_dim), dtype, sharding=rep)
            for n in (q_len, kv_len, kv_len)]
    vmem = vmem_limit_bytes(bs, head_dim, jnp.dtype(dtype).itemsize, margin=1)
    options = AttentionOptions(block_sizes=bs, mask=mask)

    def fn(q, k, v):
        return splash_attention(q, k, v, options=options, vmem_limit_bytes=vmem)

    static = (contextlib.nullcontext() if cls is None
              else mock.patch.object(InfoLayout, "tile_class", lambda *a, **k: cls))
    path = clear_profile()
    with static:
        jax.jit(fn).lower(*args).compile()
    cycles = sum(op["cycles"] for op in read_profile(path) if KERNEL_NAME in op["name"])
    release_compile_memory()
    if not cycles:
        raise RuntimeError(f"no {KERNEL_NAME} op in the static profile of {path}")
    return cycles


def masked_cost(device, bs: BlockSizes, mask, *, head_dim: int = 128,
                dtype=jnp.bfloat16) -> dict:
    """``masked_cost_mod.class_costs`` of ``mask``'s masked path at fitted blocks ``bs`` from the
    ``class_profiles(mask)`` on ``device`` (five deviceless compiles and one per edge mask;
    PARTIAL and the edges on one q block, see ``masked_cost_mod.class_costs``), with the
    profiles' cycles under "profiles"."""
    profiles = {f"{name} {q}x{k}": profiled_cycles(device, bs, q_blocks=q, kv_blocks=k,
                                                   mask=mask, cls=cls, head_dim=head_dim,
                                                   dtype=dtype)
                for name, cls, q, k in masked_cost_mod.class_profiles(mask)}
    cost = masked_cost_mod.class_costs(profiles, bs.block_kv // bs.block_kv_compute,
                                       bs.block_q)
    return dict(cost, profiles=profiles)


def release_compile_memory() -> None:
    """Hand a profiled compile's host memory back to the OS before the next one.

    Without it the profiling worker's RSS grew from profile to profile: six kernel profiles
    in one process (HunyuanVideo-1.5, 720p, v6e default blocks) peaked at 5.3 GB, against
    3.6 GB for the largest of them alone. Dropping JAX's caches and glibc's free lists
    (``malloc_trim``) after each brought the process back to 0.9 GB between profiles and
    its peak to 3.6 GB. Not glibc: the trim is skipped."""
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _recorded(call) -> dict:
    """A ``splash.kernel.KernelCall`` as the JSON-able dict the estimate passes around (the
    profiling worker rebuilds the kernel from it): ``window_size`` for a ``LocalMask``,
    ``band_window`` and ``band_anchor`` for ``splash.svg.AnchoredBandMask`` (the sparse
    path's mask, costed per tile class: ``masked_cost``), else None.

    Raises:
        ValueError: any other mask (its cost would be the profile's blind spot)."""
    bs, mask = call.block_sizes, call.mask
    if mask is not None and not isinstance(mask, (LocalMask, svg.AnchoredBandMask)):
        raise ValueError(f"--estimate cannot cost a kernel call with mask {type(mask).__name__}"
                         " (only LocalMask and the sparse path's band)")
    band = isinstance(mask, svg.AnchoredBandMask)
    return dict(grid=list(call.grid), head_dim=call.head_dim, dtype=call.dtype,
                q_len=call.q_len, kv_len=call.kv_len,
                block_sizes=[bs.block_q, bs.block_kv, bs.block_kv_compute],
                segment_ids=call.segment_ids,
                window_size=mask.window_size if isinstance(mask, LocalMask) else None,
                band_window=mask.window if band else None,
                band_anchor=mask.anchor if band else None,
                real_kv_blocks=call.real_kv_blocks)


def _stub_kernel(call, inputs):
    """A no-op Pallas call over the kernel's operands (so their producers, the q scaling
    and the V transpose, stay in the program) whose output aliases q (``inputs[0]``)."""
    arrays = [a for a in inputs if a is not None]
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        lambda *refs: None, out_shape=call.out_shape, name=STUB_NAME,
        in_specs=[any_spec] * len(arrays), out_specs=any_spec,
        input_output_aliases={0: 0})(*arrays)


@contextlib.contextmanager
def stub_attention_kernel(calls: list):
    """Within: our kernel is a no-op (``_stub_kernel``) and each call traced is appended to
    ``calls`` (``_recorded``), through the kernel's public hook ``describe_calls``."""

    def hook(call, inputs):
        calls.append(_recorded(call))
        return _stub_kernel(call, inputs)

    with describe_calls(hook):
        yield


def _block_calls(config, family, cfg: dict, mesh, placed) -> list:
    """Every call of the first block in one traced step, as dicts of ``args`` and ``kwargs``
    (tensors as abstract shapes and dtypes, other values as given), ``order`` (the keywords
    in call order) and ``count``, equal calls merged. One call per model pass the step
    runs: a CFG pair is one call of batch 2, and a step with more guidance passes (LTX-2's
    spatio-temporal and modality-isolation passes, batch 1 each, with their own flags) calls
    the block once per pass. The step is traced
    (``jax.eval_shape``, no compile) with a hook that records them."""
    vae_cfg = read_component_config(config.model.model_id, "vae")
    latents, t, inputs = abstract_inputs(config, family, cfg, vae_cfg, mesh)
    seen = []

    def abstract(x):
        return jax.ShapeDtypeStruct(tuple(x.shape), mappings.t2j_dtype(x.dtype)) \
            if isinstance(x, torch.Tensor) else x

    def record(_module, args, kwargs):
        # Under the sparse scope, sequence parallelism's padding declaration too (the band
        # runs on the real tokens; the dense estimate keeps its unmasked padded keys).
        pad = sdpa.declared_key_padding() if svg.active_scope() is not None else None
        seen.append((*jax.tree.map(abstract, (args, kwargs)), list(kwargs), pad))

    blocks = getattr(placed["module"]._model, family.transformer.block_stack.attr)
    handle = blocks[0].register_forward_pre_hook(record, with_kwargs=True)
    try:
        jax.eval_shape(interop.jax_view(family.transformer.step_fn(placed["module"], config)),
                       placed["params"], placed["buffers"], latents, t, inputs)
    finally:
        handle.remove()
    calls = {}
    for args, kwargs, order, pad in seen:
        leaves, tree = jax.tree.flatten((args, kwargs))
        key = repr((tree, leaves, order, pad))
        calls.setdefault(key, dict(args=args, kwargs=kwargs, order=order, padding=pad,
                                   count=0))["count"] += 1
    return list(calls.values())


def _residual(call: dict, stack):
    """The call's residual stream (batch, tokens, dim): its first positional argument, or
    for a block called by keyword the first name of ``stack.token_kwargs``."""
    return call["kwargs"][stack.token_kwargs[0][0]] if stack.token_kwargs else call["args"][0]


def _compile_block(config, family, mesh, shape, placed, call: dict) -> tuple:
    """(compiled, seconds, kernel calls) of ONE transformer block at the real per-chip
    shapes, called as ``call`` (``_block_calls``): batch over "dp" and, with sequence
    parallelism, tokens over "sp" (as the residual stream is laid out between blocks);
    values that are not tensors (a pass's flags) stay static.

    Only a block, not the whole model: libtpu 0.0.42.1's static profiler exhausted this
    host's memory (over 14 GB) on the whole model's program and aborted on a tiny one
    ("Unsupported DMA direction"), in ops outside the blocks (patch embedding)."""
    stack = family.transformer.block_stack
    batch, tokens = _residual(call, stack).shape[:2]
    axes = sharding_mod.residual_token_axes(mesh, config.layout.megatron_sp)
    shards = math.prod(mesh.shape[a] for a in axes)

    def sharding(x):
        if x.ndim >= 2 and x.shape[0] == batch and batch % shape.dp == 0 and batch > 1:
            spec = ["dp"] + [None] * (x.ndim - 1)
        else:
            spec = [None] * x.ndim
        if axes and x.ndim >= 3 and x.shape[1] == tokens and tokens % shards == 0:
            spec[1] = axes if len(axes) > 1 else axes[0]
        return NamedSharding(mesh, P(*spec))

    leaves, tree = jax.tree.flatten((call["args"], call["kwargs"]))
    arrays = [i for i, x in enumerate(leaves) if isinstance(x, jax.ShapeDtypeStruct)]
    sharded = [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype,
                                    sharding=sharding(leaves[i])) for i in arrays]
    jm = placed["module"]

    def block(params, buffers, *values):
        full = list(leaves)
        for i, v in zip(arrays, values, strict=True):
            full[i] = v
        args, kwargs = jax.tree.unflatten(tree, full)
        return jm.functional_call(lambda model, *a, **k: getattr(model, stack.attr)[0](*a, **k),
                                  params, buffers, *args, **kwargs)

    # The carried streams (the first ``carry`` arguments, positional or keyword in call
    # order: HunyuanVideo-1.5 and LTX-2 carry two) come out laid out as they went in.
    carried = [*call["args"], *(call["kwargs"][k] for k in call["order"])][:stack.carry]
    out_sh = [next(x.sharding for i, x in zip(arrays, sharded, strict=True)
                   if leaves[i] is c) for c in carried]
    out_sh = out_sh[0] if stack.carry == 1 else tuple(out_sh)

    param_sh = {k: NamedSharding(mesh, s) for k, s in placed["specs"].items()}
    calls, pad = [], call.get("padding")
    with stub_attention_kernel(calls), _declared(pad):
        t0 = time.perf_counter()
        def estimate_block(*a):  # names the module, for the HLO dump (``block_hlo_text``)
            return interop.jax_view(block)(*a)

        compiled = jax.jit(estimate_block, in_shardings=(
            param_sh, NamedSharding(mesh, P()), *[x.sharding for x in sharded]),
            out_shardings=out_sh).lower(
            placed["params"], placed["buffers"], *sharded).compile()
    return compiled, time.perf_counter() - t0, calls


@contextlib.contextmanager
def _declared(pad):
    """Within: ``pad`` (a ``KeyPadding`` or None) declared as the step declares it."""
    token = None if pad is None else sdpa.pad_self_attention_keys(*pad)
    try:
        yield
    finally:
        if token is not None:
            sdpa.unpad_self_attention_keys(token)


_SUMMED = ("linear_s", "other_s", "other_hbm_floor_s", "hbm_bound_s", "flops",
           "eight_bit_flops", "eight_bit_ops", "bytes", "ops", "collective_sent_bytes")


def _first_block(config, family, cfg: dict, mesh, shape, chip: str) -> dict:
    """``program_summary`` of the first block's work in one step, with its ``kernel_calls``,
    ``compile_s`` and ``passes``: each distinct call the step makes (``_block_calls``: one per
    model pass) compiled once and counted as often as the step makes it. ``passes``: per
    distinct call, its batch (samples), how many times a step makes it and its compile
    seconds; a step of a CFG pair alone is one call of batch 2."""
    cfg = dict(cfg, num_layers=1)
    unrolled = config.replace(scan_layers=False)
    placed = abstract_transformer(unrolled, family, cfg, mesh)
    stack = family.transformer.block_stack
    out = dict({k: 0.0 for k in _SUMMED}, source={}, collectives={}, top_ops=[],
               kernel_calls=[], compile_s=0.0, passes=[])
    for call in _block_calls(unrolled, family, cfg, mesh, placed):
        compiled, seconds, kernel_calls = _compile_block(unrolled, family, mesh, shape,
                                                         placed, call)
        one, n = program_summary(block_hlo_text(compiled), chip), call["count"]
        for k in _SUMMED:
            out[k] += n * one[k]
        for k, v in one["source"].items():
            out["source"][k] = out["source"].get(k, 0) + n * v
        for kind, c in one["collectives"].items():
            agg = out["collectives"].setdefault(kind, dict(calls=0, sent_bytes=0.0))
            agg["calls"] += n * c["calls"]
            agg["sent_bytes"] += n * c["sent_bytes"]
        out["top_ops"] = sorted(out["top_ops"] + one["top_ops"], key=lambda op: -op["seconds"])[:8]
        out["kernel_calls"] += kernel_calls * n
        out["compile_s"] += seconds
        out["passes"].append(dict(batch=_residual(call, stack).shape[0], count=n,
                                  compile_s=seconds))
    return out


def kernel_cost(topology: str, block_sizes, *, kv_steps: int, **kw) -> dict:
    """Cost model of our kernel at one configuration (an ESTIMATE from libtpu's static
    model): cycles of a call with grid (batch, heads, Q, K) = ``per_step`` x grid steps +
    ``per_q_block`` x batch x heads x Q. ``block_sizes``: the fitted (block_q, block_kv,
    block_kv_compute); ``kw`` goes to ``kernel_cycles``.

    Profiled at the real blocks (``grid_cost``), except a kernel comparing segment ids in
    every block at a block_q above ``MASKED_PROFILE_MAX_BLOCK_Q``, whose profile would need
    more host memory than a user's machine may have: that one is profiled at two smaller
    block_q and extrapolated (``reduced_q_cost``). So is a kernel with segment ids (masked,
    or with every block declared real) whose own 2 x 2 profile overflows VMEM under the
    profile flag, one ``REDUCED_Q_SPAN`` lower: on tpu7x (64 MiB of VMEM) the kernel at its
    default 3328/2048/1024 asked for 65.6 MiB (masked) and 64.8 MiB (all real) under the
    profile flag, though the step at those blocks compiles (HunyuanVideo-1.5 at 1072 x 1904
    x 121 on tpu7x:2x2x1 stopped the estimate).
    """
    bs = block_sizes if isinstance(block_sizes, BlockSizes) else BlockSizes(*block_sizes)
    masked = kw.get("segment_ids") and not kw.get("real_keys_before")
    if masked and bs.block_q > MASKED_PROFILE_MAX_BLOCK_Q:
        return reduced_q_cost(topology, block_sizes, kv_steps=kv_steps, **kw)
    try:
        return grid_cost(topology, block_sizes, kv_steps=kv_steps, **kw)
    except Exception as e:  # noqa: BLE001 - only a VMEM overflow is handled
        hi = bs.block_q - REDUCED_Q_SPAN
        if not (kw.get("segment_ids") and "vmem" in str(e).lower() and hi - REDUCED_Q_SPAN > 0):
            raise
        return reduced_q_cost(topology, block_sizes, kv_steps=kv_steps, hi=hi, **kw)


# The largest block_q at which a kernel comparing segment ids in every kv block is profiled
# as it is. libtpu 0.0.42.1's static profile of that kernel (v6e, block_kv 2048/1024, 2 q
# blocks) is cheap up to here and explodes above it: 2 x 3 grids peak at 3.0 GB (block_q
# 2304) and 3.7 GB (3328) of host RSS in 20-35 s, the 2 x 2 grid at 4736 passed 8.4 GB in
# 111 s (stopped) and in a full estimate grew past 20 GB without finishing, while 4736 with
# every block declared real (2.6 GB) or with no ids (3.6 GB for 2 x 3) stays small; so does
# 4736 on one q block (1.4 GB for 1 x 3). The cause is inside libtpu's profiler; what it
# profiles above the bound is extrapolated (``reduced_q_cost``).
MASKED_PROFILE_MAX_BLOCK_Q = 3328
# The second, smaller block_q of the extrapolation: one 1024-row step below the first.
REDUCED_Q_SPAN = 1024


def reduced_q_cost(topology: str, block_sizes, *, kv_steps: int, hi: int | None = None,
                   **kw) -> dict:
    """``grid_cost`` at block_q = ``hi`` (None: ``MASKED_PROFILE_MAX_BLOCK_Q``) and 1024
    rows below (same block_kv and block_kv_compute), extrapolated linearly in block_q to the
    real one, for per_step and per_q_block alike (an ESTIMATE). Why linear: a grid step's
    work is its block_kv x block_q score tile, q along lanes, so cycles per step are a
    fixed part plus a part proportional to block_q. Checked where the real blocks' profile
    fits (v6e, libtpu 0.0.42.1, benchmarks/dry_run_results.md): see
    ``tests/test_estimate.py``.

    Returns:
        ``grid_cost``'s dict, its ``profiles`` keyed "bq<block_q> QxK", with
        ``reduced_block_q`` (the two block_q profiled) and a ``note`` saying so.
    """
    bs = block_sizes if isinstance(block_sizes, BlockSizes) else BlockSizes(*block_sizes)
    hi = MASKED_PROFILE_MAX_BLOCK_Q if hi is None else hi
    lo = hi - REDUCED_Q_SPAN
    costs = {b: grid_cost(topology, (b, bs.block_kv, bs.block_kv_compute),
                          kv_steps=kv_steps, **kw) for b in (lo, hi)}
    frac = (bs.block_q - lo) / (hi - lo)

    def at(field):
        return costs[lo][field] + frac * (costs[hi][field] - costs[lo][field])

    notes = [c["note"] for c in costs.values() if c["note"]]
    note = (f"block_q {bs.block_q} extrapolated linearly from profiles at block_q {lo} and "
            f"{hi} (a profile comparing segment ids at the real block_q needs more host "
            "memory than allowed, or more VMEM under the profile flag)"
            + "".join(f"; {n}" for n in notes))
    return dict(per_step=at("per_step"), per_q_block=at("per_q_block"),
                profiles={f"bq{b} {g}": c for b in (lo, hi)
                          for g, c in costs[b]["profiles"].items()},
                reduced_block_q=[lo, hi], note=note)


def grid_cost(topology: str, block_sizes, *, kv_steps: int, **kw) -> dict:
    """``kernel_cost`` from two profiled tiny grids at ``block_sizes`` themselves.

    A q block's first and last kv step also run ``_init`` and ``_finish``; on a 2 x 2 grid
    they weigh ~12x more than on the 720p grid (25 kv steps per q block), so one tiny grid's
    cycles per step overstate the real grid's. The profiles are 2 x k1 and 2 x k2 (q blocks x
    kv blocks) with k1 = min(K, 2) and k2 = min(K, 3): their difference is the per-step
    slope, the rest is per q block. Both have two q blocks because a one-q-block grid costs
    less per step (libtpu 0.0.42.1, v6e, 3328/3072/1024: 16,330 cycles per step on 1 x N
    grids against 17,272 between 2 x 2 and 2 x 3). ``kw`` goes to ``kernel_cycles``.

    With libtpu's profile flag, VMEM use grows with the grid (~0.25 MiB per step at
    3328/3072/1024) beside the kernel's scoped VMEM. ``kernel_cycles`` therefore asks for
    the kernel's estimated need rather than a run's 2x; with the 2x request the 2 x 3 grid
    with segment ids overflowed on v6e. Should the 2 x k2 grid still overflow, the 2 x k1
    grid alone gives the per-step figure (an overestimate) and ``note`` says so.

    Returns:
        {"per_step", "per_q_block": cycles, "profiles": {"QxK": cycles}, "note": str|None}.
    """
    k1, k2 = min(kv_steps, 2), min(kv_steps, 3)
    cycles = {k1: kernel_cycles(topology, block_sizes, q_blocks=2, kv_blocks=k1, **kw)[0]}
    note = None
    if k2 > k1:
        try:
            cycles[k2] = kernel_cycles(topology, block_sizes, q_blocks=2, kv_blocks=k2, **kw)[0]
        except Exception as e:  # noqa: BLE001 - only a VMEM overflow is expected here
            if "vmem" not in str(e).lower():
                raise
            # The profile flag's own VMEM grows with the grid (a real compile of the same
            # blocks fits): keep the 2 x k1 grid alone, which charges _init and _finish
            # every k1 steps, an overestimate.
            note = f"2x{k2} overflowed VMEM under the profile flag: per step from 2x{k1} alone"
    if k2 in cycles and k2 > k1:
        per_step = (cycles[k2] - cycles[k1]) / (2 * (k2 - k1))
    else:
        per_step = cycles[k1] / (2 * k1)
    return dict(per_step=per_step, per_q_block=cycles[k1] / 2 - per_step * k1,
                profiles={f"2x{k}": c for k, c in cycles.items()}, note=note)


def call_cycles(call: dict, cost: dict) -> float:
    """Estimated cycles of one recorded kernel call (grid [batch, heads, Q, K]).

    A call with segment ids whose first ``call["real_kv_blocks"]`` kv blocks are declared
    all real (``splash_attention(real_keys_before=...)``) charges those steps at
    ``cost["all_real"]["per_step"]`` (the profile of the same kernel with every block
    declared real), the rest at ``cost["per_step"]``. A call with the sparse path's band
    (``_band``) is costed per tile class (``masked_cost_mod.sparse_call_cycles``: ``cost``
    is ``masked_cost``'s model) with the sub-tile counts of its own host table."""
    batch, heads, q_blocks, kv_steps = call["grid"]
    if _band(call) is not None:
        return masked_cost_mod.sparse_call_cycles(_band_counts(call), cost, batch=batch,
                                                  heads=heads)
    fast = min(call.get("real_kv_blocks", 0), kv_steps) if "all_real" in cost else 0
    return (batch * heads * q_blocks * (cost["per_step"] * (kv_steps - fast)
                                        + (cost["all_real"]["per_step"] * fast if fast else 0))
            + cost["per_q_block"] * batch * heads * q_blocks)


def _band_counts(call: dict) -> masked_cost_mod.TileCounts:
    """The tile counts of a band call's host table (``masked_cost_mod.tile_counts``)."""
    return masked_cost_mod.tile_counts(_band(call), call["q_len"],
                                       BlockSizes(*call["block_sizes"]), call["kv_len"])


def worker_failure(returncode: int, stderr: str, calls: list) -> str:
    """The one-line reason the kernel-profiling subprocess failed: its last stderr lines, or,
    killed by a signal with nothing to say (Linux's out-of-memory killer sends SIGKILL),
    which signal and the blocks it was profiling. libtpu's profile of HunyuanVideo-1.5's
    kernel with segment ids at 4736/2048/1024 held 20 GB of host RAM on this project's
    24 GB machine (now profiled at smaller block_q, ``reduced_q_cost``); smaller blocks
    profile in less."""
    said = " | ".join(stderr.strip().splitlines()[-5:])
    if returncode < 0 and not said:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() \
            else str(-returncode)
        blocks = sorted({"/".join(str(b) for b in c["block_sizes"]) for c in calls})
        said = (f"killed by {name}" + (" (most likely out of host memory: libtpu's profile of "
                                       f"blocks {', '.join(blocks)} needs more RAM than is "
                                       "free; smaller --bq/--bkv profile in less)"
                                       if name == "SIGKILL" else ""))
    return "--estimate: the kernel-profiling subprocess failed: " + (said or
                                                                     f"exit {returncode}")


def profile_worker(request: dict) -> dict:
    """The profiled half of ``estimate``, in its own process (``main``): the cost model
    (``kernel_cost``) of each distinct kernel configuration in ``request["kernel_calls"]``."""
    setup_profile_environment()
    kernels = {}
    for c in request["kernel_calls"]:
        key = _kernel_key(c)
        if key in kernels:
            continue
        kv_steps = max(x["grid"][3] for x in request["kernel_calls"] if _kernel_key(x) == key)
        t0 = time.perf_counter()
        if _band(c) is not None:  # the masked path: per tile class (the profile's blind spot)
            cost = masked_cost(topology_device(request["topology"]),
                               BlockSizes(*c["block_sizes"]), _band(c),
                               head_dim=c["head_dim"], dtype=c["dtype"])
            kernels[key] = dict(cost, block_sizes=c["block_sizes"], head_dim=c["head_dim"],
                                dtype=c["dtype"], segment_ids=c["segment_ids"],
                                compile_s=time.perf_counter() - t0)
            print(f"estimate: kernel {key}: per tile class (cycles): FULL sub-tile "
                  f"{cost['full']:,.0f}, PARTIAL {cost['partial']:,.0f}, edges "
                  f"{', '.join(f'{e:,.0f}' for e in cost['edges'])}, grid step "
                  f"{cost['step']:,.0f}, q block {cost['per_q_block']:,.0f}",
                  file=sys.stderr, flush=True)
            continue
        cost = kernel_cost(request["topology"], c["block_sizes"], kv_steps=kv_steps,
                           head_dim=c["head_dim"], dtype=c["dtype"],
                           segment_ids=c["segment_ids"], window_size=c["window_size"])
        if any(x.get("real_kv_blocks") for x in request["kernel_calls"]
               if _kernel_key(x) == key):
            # The same kernel with every kv block declared real: the steps before the
            # declared padding position (issue #26).
            cost["all_real"] = kernel_cost(
                request["topology"], c["block_sizes"], kv_steps=kv_steps,
                head_dim=c["head_dim"], dtype=c["dtype"], segment_ids=True,
                real_keys_before=1 << 30)
        kernels[key] = dict(cost, cycles_per_step=cost["per_step"],
                            block_sizes=c["block_sizes"], head_dim=c["head_dim"],
                            dtype=c["dtype"], segment_ids=c["segment_ids"],
                            compile_s=time.perf_counter() - t0)
        print(f"estimate: kernel {key}: {cost['per_step']:,.0f} cycles/step + "
              f"{cost['per_q_block']:,.0f}/q block"
              + (f"; all-real kv blocks {cost['all_real']['per_step']:,.0f} cycles/step"
                 if "all_real" in cost else ""), file=sys.stderr, flush=True)
    return kernels


def _kernel_key(call: dict) -> str:
    bq, bkv, bkc = call["block_sizes"]
    return (f"{bq}/{bkv}/{bkc} d{call['head_dim']} {call['dtype']}"
            + (" masked" if call["segment_ids"] else "")
            + (f" window{call['window_size']}" if call["window_size"] is not None else "")
            + (f" band{call['band_window']}+{call['band_anchor']}"
               if call.get("band_window") is not None else ""))


def _band(call: dict):
    """The call's ``AnchoredBandMask``, or None."""
    if call.get("band_window") is None:
        return None
    return svg.AnchoredBandMask(call["band_window"], call["band_anchor"])


# ---------------------------------------------------------------------------------------
# The estimate (parent process)
# ---------------------------------------------------------------------------------------


def _kernel_seconds(calls: list, kernels: dict, hz: float) -> dict:
    """Seconds and grid steps of the kernel calls of one program, self vs cross."""
    out = {k: dict(seconds=0.0, grid_steps=0, flops=0.0) for k in ("self", "cross")}
    for c in calls:
        # A masked call is self-attention even when its keys end early (the sparse band
        # leaves sequence parallelism's padded keys out by valid_kv_len).
        masked = c.get("band_window") is not None or c.get("window_size") is not None
        kind = "self" if c["q_len"] == c["kv_len"] or masked else "cross"
        steps = math.prod(c["grid"])
        out[kind]["seconds"] += call_cycles(c, kernels[_kernel_key(c)]) / hz
        out[kind]["grid_steps"] += steps
        bq, bkv, bkc = c["block_sizes"]
        if _band(c) is not None:  # the computed sub-tiles only
            n = _band_counts(c)
            subs = c["grid"][0] * c["grid"][1] * (n.full_subs + n.partial_subs
                                                  + sum(n.edge_subs))
            out[kind]["flops"] += 4.0 * subs * bq * bkc * c["head_dim"]
        else:
            out[kind]["flops"] += 4.0 * steps * bq * bkv * c["head_dim"]
    return out


def combine(block: dict, kernels: dict, *, chip: str, layers: int,
            model_flops_per_chip: float) -> dict:
    """The step estimate: ``layers`` x (one block's ops, collectives and kernel calls).

    Args:
        block: ``program_summary`` of one block, with its ``kernel_calls`` (as the stub
            recorded them) and ``compile_s``.
        kernels: {``_kernel_key``: ``kernel_cost``'s model} of the profiled kernel.
        model_flops_per_chip: the family's analytic FLOPs of a step / chips, for MXU use.
    """
    hz = clock_hz(chip)
    attn = _kernel_seconds(block["kernel_calls"], kernels, hz)
    attn = {kind: {f: layers * v for f, v in a.items()} for kind, a in attn.items()}
    coll_bytes = layers * block["collective_sent_bytes"]
    parts = dict(
        self_attention_s=attn["self"]["seconds"], cross_attention_s=attn["cross"]["seconds"],
        linear_s=layers * block["linear_s"],
        elementwise_and_other_s=layers * block["other_hbm_floor_s"],
        collectives_s=coll_bytes / device_ici_bytes_per_s(chip))
    total = sum(parts.values())
    xla = total - parts["elementwise_and_other_s"] + layers * block["other_s"]
    peak = device_peak_flops(chip)
    for a in attn.values():
        a["kernel_mxu_use"] = (a["flops"] / (MXU_FLOPS_PER_CYCLE[chip] * a["seconds"] * hz)
                               if a["seconds"] else None)
    return dict(
        label=label(chip), chip=chip, clock_hz=hz,
        clock_source="published bf16 peak / MXU FLOPs per cycle (an assumption)",
        hbm_gbps=device_hbm_bytes_per_s(chip) / 1e9,
        ici_egress_gbps=device_ici_bytes_per_s(chip) / 1e9,
        ici_source=ICI_SOURCE, seconds_per_step=total, parts=parts,
        elementwise_xla_cost_model_s=layers * block["other_s"],
        seconds_per_step_elementwise_by_xla_cost_model=xla,
        mxu_use=model_flops_per_chip / (peak * total) if total else None,
        model_flops_per_chip=model_flops_per_chip,
        collective_gb_per_chip=coll_bytes / 1e9,
        collectives={k: dict(calls=layers * v["calls"], sent_bytes=layers * v["sent_bytes"])
                     for k, v in block["collectives"].items()},
        attention=attn, kernels=kernels,
        passes=block.get("passes", []),
        samples_per_step=sum(p["batch"] * p["count"] for p in block.get("passes", [])),
        layers=layers, block=dict(compile_s=block["compile_s"], ops=block["ops"],
                                  cycle_sources=block["source"], top_ops=block["top_ops"],
                                  linear_flops=block["flops"],
                                  eight_bit_flops=block.get("eight_bit_flops", 0.0),
                                  eight_bit_ops=block.get("eight_bit_ops", 0)),
        method=METHOD)


METHOD = ("attention: our kernel's cycles per grid step and per q block, fitted to libtpu's "
          "static profiles of two tiny grids at the real block sizes (a kernel comparing "
          "segment ids in every block above block_q 3328: at two smaller block_q, "
          "extrapolated linearly), x the real per-chip grid; linear layers: FLOPs / MXU peak "
          "(roofline) or HBM bytes / bandwidth, whichever is larger, per op of one compiled "
          "block; elementwise: HBM bytes / bandwidth (libtpu's profile of a 14B-sized layer "
          "norm is below it; XLA's fusion cost model, 4x above the profile there, is given "
          "apart); x blocks; collectives: ring bytes / ICI "
          "egress, serial; work outside the blocks (patch embedding, RoPE tables, output "
          "projection) left out")


def estimate(config, family, cfg: dict, mesh, mesh_shape, chip: str, attention: str) -> dict:
    """Estimated seconds per denoising step on ``config.dry.topology``, with its breakdown.

    One block is compiled here at the real per-chip shapes with the kernel stubbed out; the
    kernel's cycles per grid step come from a subprocess (the profile flag must be set
    before libtpu loads). ``cfg`` is the transformer config with its real ``num_layers``.
    Every figure is an ESTIMATE (assumed clock, static models); nothing is measured.

    Raises:
        ValueError: the chip has no clock assumption here, or the attention backend is one
            whose cost the profile cannot see (JAX's stock splash kernel).
        RuntimeError: the profiling subprocess failed (its last stderr lines are included).
    """
    clock_hz(chip)
    if attention == "stock_splash":
        raise ValueError("--estimate profiles our Splash kernel or XLA attention; JAX's stock "
                         "splash kernel gates its work on mask data the profile undercounts")
    t0 = time.perf_counter()
    block = _first_block(config, family, cfg, mesh, mesh_shape, chip)
    sparse_blocks = _sparse_blocks(config, family, cfg, mesh, mesh_shape, chip)
    calls = block["kernel_calls"] + [c for b in sparse_blocks.values()
                                     for c in b["kernel_calls"]]
    kernels = {}
    if calls:
        request = dict(topology=config.dry.topology, kernel_calls=calls)
        env = dict(os.environ)
        env.pop("LIBTPU_INIT_ARGS", None)  # the worker sets its own flags
        proc = subprocess.run([sys.executable, "-m", "engine.dry_run.estimate"],
                              input=json.dumps(request), capture_output=True, text=True,
                              cwd=PROJECT_ROOT, env=env)
        if proc.returncode != 0:
            raise RuntimeError(worker_failure(proc.returncode, proc.stderr, calls))
        kernels = json.loads(proc.stdout.strip().splitlines()[-1])
    chips_in_mesh = mesh_shape.dp * mesh_shape.tp * mesh_shape.sp
    out = combine(block, kernels, chip=chip, layers=cfg["num_layers"],
                  model_flops_per_chip=family.transformer.flops(cfg, config) / chips_in_mesh)
    if sparse_blocks:
        out["sparse"] = sparse_steps(block, sparse_blocks, kernels, chip=chip,
                                     layers=cfg["num_layers"], sparse_layers=config.sparse.layers)
    out["elapsed_s"] = time.perf_counter() - t0
    return out


def _sparse_blocks(config, family, cfg: dict, mesh, shape, chip: str) -> dict:
    """{sparse program key: ``_first_block`` traced under its ``splash.svg.sparse_scope``}
    for a run with ``config.sparse`` (one per distinct expert density), else {}. The first
    block stands for every sparse layer: unrolled, each block's self-attention is sparse
    under the scope (the layer range is the scan's split, ``splash.svg.layer_segments``),
    so its routing, permutations and band-masked kernel call are all in the program."""
    out = {}
    sparse = config.sparse
    for e in range(len(sparse.densities) if sparse is not None else 0):
        key = sparse.key(e)
        if key not in out:
            with svg.sparse_scope(sparse.scope(e)):
                out[key] = _first_block(config, family, cfg, mesh, shape, chip)
    return out


def sparse_steps(block: dict, sparse_blocks: dict, kernels: dict, *, chip: str, layers: int,
                 sparse_layers: tuple[int, int]) -> dict:
    """{key: the sparse step's estimate}: ``layers`` blocks of which those in
    ``sparse_layers`` ([start, stop), clipped to ``layers``) run the sparse block of
    ``sparse_blocks[key]`` and the rest the dense ``block``; each with ``seconds_per_step``,
    the per-layer ``parts`` of both kinds (seconds) and the layer counts. The routing and
    the permutations are XLA ops of the sparse block, in its linear and elementwise parts."""
    n = max(0, min(sparse_layers[1], layers) - max(sparse_layers[0], 0))
    dense = combine(block, kernels, chip=chip, layers=1, model_flops_per_chip=0.0)
    out = {}
    for key, sb in sparse_blocks.items():
        one = combine(sb, kernels, chip=chip, layers=1, model_flops_per_chip=0.0)
        out[key] = dict(
            seconds_per_step=(layers - n) * dense["seconds_per_step"]
            + n * one["seconds_per_step"], sparse_layers=n, dense_layers=layers - n,
            sparse_layer_s=one["seconds_per_step"], dense_layer_s=dense["seconds_per_step"],
            sparse_layer_parts=one["parts"], sparse_layer_attention=one["attention"],
            sparse_layer_top_ops=sb["top_ops"], sparse_layer_collectives=one["collectives"],
            dense_layer_parts=dense["parts"], compile_s=sb["compile_s"])
    return out


def decode_floor(program_calls: list, chip: str) -> dict:
    """A lower bound on the VAE decode's seconds per video on ``chip`` (ESTIMATE): per
    compiled program, max(XLA's FLOPs / the bf16 MXU peak, XLA's bytes accessed / HBM
    bandwidth), x its calls per decode (``program_calls``: [(compiled, calls)], the
    decoder's ``program_calls()``), summed. XLA's whole-program ``cost_analysis`` of the
    per-device program. A floor, not a prediction: convolutions with few channels fill the
    MXU partly, float32 ones take several passes, and collectives (the width halos) are not
    counted. Returns dict(seconds, flops, bytes, programs, calls, label, method).

    Raises:
        ValueError: a program without XLA cost figures.
    """
    peak, hbm = device_peak_flops(chip), device_hbm_bytes_per_s(chip)
    out = dict(seconds=0.0, flops=0.0, bytes=0.0, programs=len(program_calls), calls=0)
    for compiled, calls in program_calls:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        if not cost or "flops" not in cost:
            raise ValueError("a decode program has no XLA cost analysis")
        flops, nbytes = float(cost["flops"]), float(cost.get("bytes accessed", 0.0))
        out["seconds"] += calls * max(flops / peak, nbytes / hbm)
        out["flops"] += calls * flops
        out["bytes"] += calls * nbytes
        out["calls"] += calls
    out.update(label=label(chip), method="floor: per program max(FLOPs / bf16 peak, bytes / "
               "HBM bandwidth) from XLA's cost analysis, x calls; collectives not counted")
    return out


def print_estimate(est: dict) -> None:
    """The estimate as the dry-run table's footer."""
    p = est["parts"]
    print(f"\n== Estimated step time ({est['label']}) ==")
    if not est["kernels"]:
        print("(no Splash kernel call: attention is XLA ops, in the linear and elementwise rows)")
    for kind in ("self", "cross"):
        print(f"{kind + '-attention':<26}{p[kind + '_attention_s']:8.3f} s   "
              f"(kernel MXU use {_pct(est['attention'][kind]['kernel_mxu_use'])})")
    b = est["block"]
    eight = (f"   ({b['eight_bit_ops']} 8-bit matmuls per block: "
             f"{b['eight_bit_flops'] / b['linear_flops']:.1%} of the FLOPs at the 8-bit rate)"
             if b.get("eight_bit_ops") else "")
    print(f"{'linear layers':<26}{p['linear_s']:8.3f} s{eight}")
    print(f"{'elementwise and other':<26}{p['elementwise_and_other_s']:8.3f} s   "
          "(HBM bytes / bandwidth)")
    print(f"{'collectives':<26}{p['collectives_s']:8.3f} s   "
          f"({est['collective_gb_per_chip']:.2f} GB sent per chip at "
          f"{est['ici_egress_gbps']:.0f} GB/s ICI egress)")
    print(f"{'total per denoising step':<26}{est['seconds_per_step']:8.3f} s   "
          f"(MXU use {_pct(est['mxu_use'])} of the model's FLOPs)")
    passes = est.get("passes") or []
    if sum(p["count"] for p in passes) > 1:
        print(f"{'model passes per step':<26}{sum(p['count'] for p in passes):8d}     ("
              + ", ".join(f"{p['count']} x batch {p['batch']}" for p in passes)
              + f": {est['samples_per_step']} samples, each block compiled per distinct pass)")
    print(f"{'  by XLA cost model':<26}"
          f"{est['seconds_per_step_elementwise_by_xla_cost_model']:8.3f} s   (elementwise "
          f"{est['elementwise_xla_cost_model_s']:.3f} s by XLA's fusion cost model: pessimistic)")
    print(f"ICI figure: {est['ici_source']}; {est['elapsed_s']:.0f} s to estimate")
    for key, sp in (est.get("sparse") or {}).items():
        p = sp["sparse_layer_parts"]
        print(f"sparse step ({key}){'':<9}{sp['seconds_per_step']:8.3f} s   ({sp['dense_layers']}"
              f" dense + {sp['sparse_layers']} sparse blocks; a sparse block "
              f"{sp['sparse_layer_s'] * 1e3:.1f} ms: self-attention "
              f"{p['self_attention_s'] * 1e3:.1f}, linear {p['linear_s'] * 1e3:.1f}, "
              f"elementwise {p['elementwise_and_other_s'] * 1e3:.1f} (routing, permutations), "
              f"against {sp['dense_layer_s'] * 1e3:.1f} ms dense)")
    if "average_seconds_per_step" in est:
        print(f"{'average per step':<26}{est['average_seconds_per_step']:8.3f} s   "
              f"({est['sparse_plan']}; "
              f"{est['seconds_per_step'] / est['average_seconds_per_step']:.2f}x faster than "
              "dense steps throughout)")
    if "cache" in est:
        c = est["cache"]
        print(f"{c['kind']}: {c['full_steps']} full x {c['full_step_s']:.3f} s + "
              f"{c['cached_steps']} cached x {c['cached_step_s']:.3f} s = {c['denoise_s']:.1f} s "
              f"of denoising, against {c['denoise_s_without_cache']:.1f} s without a cache "
              f"({c['speedup']:.2f}x; estimated, blocks only)")


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def main() -> int:
    """Subprocess entry: a JSON request on stdin, the worker's JSON as the last stdout line."""
    request = json.loads(sys.stdin.read())
    result = profile_worker(request)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
