"""Our Splash kernel's cost from libtpu's static profile (ESTIMATE): the profiled deviceless
compiles on tiny grids (``kernel_cycles``, ``grid_cost``, ``reduced_q_cost``, ``masked_cost``),
the cost model a recorded call is charged with (``call_cycles``), and the profiling
subprocess (``python -m engine.dry_run.price_kernel``: libtpu reads the profile flag once,
when it loads, so the profiles run in their own process). See ``engine.dry_run.estimate``."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import glob
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from custom_splash_attention import (
    KERNEL_NAME,
    AttentionOptions,
    BlockSizes,
    LocalMask,
    splash_attention,
)
from engine.dry_run import masked_cost as masked_cost_mod
from engine.dry_run.hlo import (
    read_profile,
)
from engine.run import runtime
from splash import svg
from splash.blocks import fit_block_sizes, vmem_limit_bytes
from splash.mask_info import InfoLayout

PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"


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


def main() -> int:
    """Subprocess entry: a JSON request on stdin, the worker's JSON as the last stdout line."""
    request = json.loads(sys.stdin.read())
    result = profile_worker(request)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
