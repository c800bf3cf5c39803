"""Sparse VideoGen (issue 53): static estimates of the sparse step, before the graph wiring.

Superseded by ``--dry_run --estimate --sparse svg`` (the compiled sparse step, which also
profiles the kernel's edge classes, ``splash.mask.EDGE``); kept for the record of how the
parts were priced. It predates the edge classes: it profiles none, so the sub-tiles the
kernel now runs as edges are charged at PARTIAL's cost here (an upper bound).

ESTIMATES ONLY: no TPU is used, and nothing here is a measurement. libtpu compiles for a
described chip on this CPU host (deviceless) and its static cost models are read, through
the machinery of ``engine/dry_run/estimate.py``:

* **The kernel call.** Wan 2.1 T2V 14B 720p x 81 at the default layout (dp2 x sp4, Ulysses,
  on v6e:2x4 and tpu7x:2x2x1): each device's self-attention call is q, k, v of
  (1, 10, 75,600, 128) bf16 (CFG batch 2 over dp2, 40 heads over sp4, whole sequences).
  The dense call is costed exactly as ``--estimate`` costs it (``estimate.kernel_cost``:
  two tiny profiled grids at the real fitted blocks, x the real grid). The sparse call
  (``svg_mask(s, 21, 3600)``) takes the kernel's masked path, which picks each sub-tile's
  work by a branch on its class read from the scalar-prefetched table. libtpu's static
  profile charges almost nothing under a branch on data (the masked kernel profiles at a
  few hundred cycles per grid step, far below its MXU floor: ``data`` below, and the
  window-mask defect in ``benchmarks/svg_results.md``), so each class is profiled with the
  class made static (``InfoLayout.tile_class`` patched to return it, in the profiling
  process only): ``EMPTY`` (a grid step's own overhead: a skip step), ``FULL`` and
  ``PARTIAL`` (the AnchoredBandMask predicate and the key tail). Call cycles = per q block x
  q blocks + grid steps x step overhead + FULL sub-tiles x their cost + PARTIAL sub-tiles x
  theirs, with the sub-tile counts read from the kernel's own host table
  (``build_mask_info``). The data-dependent branch itself (a scalar compare and jump per
  sub-tile) is not charged.
* **The permutation** (temporal heads' q, k, v to position-major and the output back, per
  head a ``jnp.where`` between the two orders) and **SVG's routing** (``splash.svg.route``:
  64 sampled rows per (batch, head) scored against all keys, full attention and both
  patterns): each compiled as its own XLA program at the per-device shapes; per op
  max(FLOPs / MXU peak, HBM bytes / bandwidth) (``estimate.program_summary``, the rule of
  the dry run's block). The routing's matmuls are float32 at HIGHEST precision, which
  the roofline charges at the bf16 rate; they come out HBM-bound (see the results).
  ``_permute_gather`` (one gather per tensor) is costed beside the ``jnp.where`` form.
* **The step.** sparse step = dense step - dense self-attention + layer 0's dense
  self-attention + 39 x (sparse call + permutation + routing); the dense figures are the
  recorded ``--estimate`` results (``benchmarks/dry_run_results.md``). Averages follow
  each checkpoint's published dense steps.

Usage::

    python benchmarks/svg_estimate.py --chips v6e,tpu7x --json /tmp/svg.json
    python benchmarks/svg_estimate.py --chips v6e --blocks 4864,2048,1024 --blocks 2432,2048,1024
    # the report from the recorded rows (benchmarks/svg_results.md), no compile: copy first,
    # since rows are appended to --jsonl
    cp benchmarks/svg_estimate_profiles.jsonl /tmp/rows.jsonl
    python benchmarks/svg_estimate.py --chips v6e --jsonl /tmp/rows.jsonl

Results and their reading: ``benchmarks/svg_results.md``.

One subprocess per chip for the profiles (the flag must be set before libtpu loads; tpu7x
profiles with libtpu ``runtime.PROFILE_LIBTPU_VERSION``), one at a time; one more for the
permutation and routing programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

from engine.dry_run.masked_cost import (  # noqa: E402, F401 (the tests read them here)
    TileCounts,
    class_costs,
    sparse_call_cycles,
    tile_counts,
)
from splash.blocks import BlockSizes, default_block_sizes, fit_block_sizes  # noqa: E402
from splash.mask import EMPTY, FULL, PARTIAL, Mask  # noqa: E402
from splash.svg import band_tokens, svg_mask  # noqa: E402

# Wan 2.1 T2V 14B / each Wan 2.2 A14B expert, 720p x 81: 21 latent frames of 45 x 80 / 2x2
# patches; 40 blocks; per device at dp2 x sp4 (Ulysses): batch 1 of the CFG pair, 10 of 40
# heads, whole sequences.
FRAMES, FRAME_SIZE = 21, 3600
SEQ = FRAMES * FRAME_SIZE
CALL = dict(batch=1, heads=10, seq=SEQ, head_dim=128, dtype="bfloat16")
LAYERS = 40
TOPOLOGY = {"v6e": "v6e:2x4", "tpu7x": "tpu7x:2x2x1"}
# The recorded dense ``--estimate`` figures (benchmarks/dry_run_results.md, dp2 x sp4,
# ``--dry_run_skip_vae --dry_run_layers 1``): seconds per step and its self-attention part.
DENSE = {"v6e": dict(step=2.886, self_attention=2.129, source="dry_run_results.md, Wan 14B "
                     "720p x 81 v6e:2x4 dp2 x sp4 (Wan's RoPE processor row); = Wan 2.2 "
                     "T2V-A14B's row (same expert architecture)"),
         "tpu7x": dict(step=2.307, self_attention=1.660, source="dry_run_results.md, "
                       "tpu7x:2x2x1 dp2 x sp4, libtpu 0.0.51, 2.20 GHz assumed")}
SPARSITIES = (0.3, 0.2, 0.5)
# Published dense warmups (issue 53; ../shared/notes/sparse-attention.md).
WAN21_STEPS, WAN21_DENSE_STEPS = 50, 10
A14B_STEPS, A14B_SPARSE = 40, (11, 40)
A14B_S = {0: 0.5, 1: 0.2}  # expert 0 (high noise) / 1 (low noise): maxdiffusion's moderate
DENSE_LAYERS = 1
# What the issue asks of the estimates.
GOALS = dict(sparse_step_v6e=1.8, average_v6e=2.1, average_tpu7x=1.70, a14b_speedup=1.25,
             routing_share=0.03, stop_rule_speedup=1.2)


# ---------------------------------------------------------------------------------------
# Host arithmetic (tested on CPU: tests/test_svg_estimate.py)
# ---------------------------------------------------------------------------------------


def score_density(mask, seq: int) -> float:
    """Exact fraction of the seq x seq scores ``mask`` (an ``AnchoredBandMask``) keeps."""
    i = np.arange(seq, dtype=np.int64)
    lo, hi = np.maximum(i - mask.window, 0), np.minimum(i + mask.window, seq - 1)
    anchor_outside = np.minimum(mask.anchor, lo)  # anchor keys left of the band
    return float(((hi - lo + 1) + anchor_outside).sum()) / seq**2


def sparse_step(dense_step: float, dense_self: float, sparse_layer: float,
                extra_layer: float, *, layers: int = LAYERS,
                dense_layers: int = DENSE_LAYERS) -> float:
    """Seconds of a sparse step: the dense step with the self-attention of all but
    ``dense_layers`` layers replaced by the sparse call plus its extras (permutation and
    routing), per layer. ``dense_self``: the dense step's self-attention seconds."""
    sparse_layers = layers - dense_layers
    return dense_step - dense_self * sparse_layers / layers + sparse_layers * (
        sparse_layer + extra_layer)


def average(step_seconds: list[float]) -> float:
    """The run's mean seconds per step."""
    return sum(step_seconds) / len(step_seconds)


def a14b_plan(experts: list[int], sparse: tuple[int, int], s_of_expert: dict) -> list:
    """Per step, the sparsity it runs (None: dense): sparse on steps [lo, hi), each step at
    its expert's s (maxdiffusion's moderate policy)."""
    lo, hi = sparse
    return [s_of_expert[e] if lo <= i < hi else None for i, e in enumerate(experts)]


def a14b_experts(steps: int = A14B_STEPS) -> list[int]:
    """Wan 2.2 T2V-A14B's expert per step (0: high noise) at ``steps``: the checkpoint's
    scheduler (configs/, UniPC, flow_shift 3.0) and boundary_ratio 0.875, by the engine's
    own rule (``engine.programs.experts.expert_schedule``)."""
    from diffusers import UniPCMultistepScheduler

    from engine.programs.experts import expert_schedule

    root = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "configs", "Wan-AI", "Wan2.2-T2V-A14B-Diffusers")
    sched = UniPCMultistepScheduler.from_pretrained(root, subfolder="scheduler")
    sched.set_timesteps(steps)
    with open(os.path.join(root, "model_index.json")) as f:
        ratio = json.load(f)["boundary_ratio"]
    return expert_schedule([float(t) for t in sched.timesteps], ratio,
                           sched.config.num_train_timesteps)


# ---------------------------------------------------------------------------------------
# Profiled compiles (a worker process whose libtpu loaded with the profile flag)
# ---------------------------------------------------------------------------------------


def _profiled_cycles(topology: str, bs: BlockSizes, *, q_blocks: int, kv_blocks: int, mask,
                     cls) -> int:
    """``estimate.profiled_cycles`` on device 0 of ``topology`` at the call's head_dim."""
    from engine.dry_run import estimate

    return estimate.profiled_cycles(estimate.topology_device(topology), bs, q_blocks=q_blocks,
                                    kv_blocks=kv_blocks, mask=mask, cls=cls,
                                    head_dim=CALL["head_dim"])


# (class, static class or None for the table's own, q blocks, kv blocks): what
# ``class_costs`` reads, then, at the first block size only, "data", the masked kernel as it
# runs (branches on the table), to show what the profile makes of it, and "edge" (below).
PROFILES = (("full", FULL, 2, 2), ("full", FULL, 2, 3), ("empty", EMPTY, 2, 2),
            ("full", FULL, 1, 2), ("partial", PARTIAL, 1, 2), ("data", None, 1, 2),
            ("edge", PARTIAL, 1, 2))


@dataclasses.dataclass(frozen=True)
class OneEdgeMask(Mask):
    """Not SVG's mask: the predicate of a sub-tile that crosses one boundary only (the band's
    left edge; one compare per score). Profiled as PARTIAL ("edge") to price a kernel with
    one masked class per edge, where today's PARTIAL evaluates the whole band-and-anchor
    predicate; the key-tail compare stays, as the kernel applies it to every PARTIAL."""

    window: int

    def tile_predicate(self, q_pos, kv_pos):
        return kv_pos >= q_pos - self.window


def profile_chip(chip: str, blocks: list, out: str) -> None:
    """Worker: for each block size, the dense cost model (``estimate.kernel_cost``) and
    the masked path's class profiles; one JSON line per profile appended to ``out`` (rows
    already there are kept, not profiled again)."""
    from engine.dry_run import estimate
    from engine.run import runtime

    runtime.use_deviceless_tpu(TOPOLOGY[chip], profile_libtpu=True)
    estimate.setup_profile_environment()
    mask = svg_mask(0.3, FRAMES, FRAME_SIZE)  # classes are static: only its predicate counts
    for b in blocks:
        bs = fit_block_sizes(b, SEQ, SEQ)
        key = f"{bs.block_q}/{bs.block_kv}/{bs.block_kv_compute}"
        done = {r["kind"] for r in read_rows(out) if r.get("chip") == chip
                and r.get("blocks") == key and "error" not in r}
        t0 = time.perf_counter()
        if "dense" not in done:
            dense = estimate.kernel_cost(TOPOLOGY[chip], bs, kv_steps=-(-SEQ // bs.block_kv),
                                         head_dim=CALL["head_dim"])
            _emit(out, dict(chip=chip, blocks=key, kind="dense", cost=dense,
                            wall_s=time.perf_counter() - t0))
        for name, cls, q, k in PROFILES:
            kind = f"{name} {q}x{k}"
            if kind in done or (name in ("data", "edge") and b is not blocks[0]):
                continue
            t0 = time.perf_counter()
            m = OneEdgeMask(mask.window) if name == "edge" else mask
            try:
                row = dict(cycles=_profiled_cycles(TOPOLOGY[chip], bs, q_blocks=q,
                                                   kv_blocks=k, mask=m, cls=cls))
            except Exception as e:  # noqa: BLE001 - a failed profile says why, the rest go on
                row = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            _emit(out, dict(chip=chip, blocks=key, kind=kind,
                            wall_s=time.perf_counter() - t0, **row))
            if name == "partial" and "vmem" in row.get("error", "").lower():
                _reduced_q_profiles(chip, bs, key, mask, done, out)


def _reduced_q_profiles(chip: str, bs: BlockSizes, key: str, mask, done: set,
                        out: str) -> None:
    """FULL and PARTIAL on 1 x 2 grids at block_q - 1024 and block_q - 2048 (same kv
    blocks), for ``class_costs``'s extrapolation of the mask's work."""
    for rows in (bs.block_q - 1024, bs.block_q - 2048):
        small = BlockSizes(rows, bs.block_kv, bs.block_kv_compute)
        for name, cls in (("full", FULL), ("partial", PARTIAL)):
            kind = f"{name} 1x2 q{rows}"
            if kind in done:
                continue
            t0 = time.perf_counter()
            try:
                row = dict(cycles=_profiled_cycles(TOPOLOGY[chip], small, q_blocks=1,
                                                   kv_blocks=2, mask=mask, cls=cls))
            except Exception as e:  # noqa: BLE001 - a failed profile says why
                row = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
            _emit(out, dict(chip=chip, blocks=key, kind=kind,
                            wall_s=time.perf_counter() - t0, **row))


def _emit(path: str, row: dict) -> None:
    print(json.dumps(row), file=sys.stderr, flush=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


# ---------------------------------------------------------------------------------------
# The sparse path's XLA work: permutation and routing (a worker without the profile flag)
# ---------------------------------------------------------------------------------------


def _permute(q, k, v, o, index):
    """The graph's permutation at one call: q, k, v of the temporal heads (``index`` == 1)
    to position-major, and (the call's output) ``o`` back to frame-major, per head a
    ``jnp.where`` between the two orders."""
    import jax.numpy as jnp

    from splash.svg import TEMPORAL, to_frame_major, to_position_major

    temporal = (index == TEMPORAL)[:, :, None, None]
    into = [jnp.where(temporal, to_position_major(x, FRAMES, FRAME_SIZE), x) for x in (q, k, v)]
    return (*into, jnp.where(temporal, to_frame_major(o, FRAMES, FRAME_SIZE), o))


def _permute_gather(q, k, v, o, index):
    """``_permute`` as one gather per tensor: each head's rows in its own order (the
    temporal heads' position-major index, the others' identity), read once, written once."""
    import jax.numpy as jnp

    from splash.svg import TEMPORAL, position_major_index

    t = jnp.arange(SEQ, dtype=jnp.int32)
    pm = position_major_index(t, FRAMES, FRAME_SIZE)
    back = jnp.zeros_like(t).at[pm].set(t)  # position-major slot -> frame-major token
    temporal = (index == TEMPORAL)[:, :, None]

    def take(x, order):
        rows = jnp.where(temporal, order[None, None, :], t[None, None, :])
        return jnp.take_along_axis(x, rows[..., None], axis=2)

    return (*(take(x, back) for x in (q, k, v)), take(o, pm))


def xla_programs(chip: str, out: str) -> None:
    """Worker: compile the permutation (``_permute``, and ``_permute_gather`` beside it) and
    SVG's routing (``splash.svg.route`` at s = 0.3; the band width changes no shape) for one
    device of ``chip`` at the call's shapes, and append ``estimate.program_summary``'s
    figures per call to ``out``."""
    from engine.dry_run import estimate
    from engine.run import runtime

    runtime.use_deviceless_tpu(TOPOLOGY[chip], profile_libtpu=True)
    estimate.dump_block_hlo()  # tpu7x: jaxlib cannot read libtpu 0.0.51's HLO back
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from splash.svg import route, sample_rows

    def named(fn, name):
        """``fn`` under a name the HLO dump keeps (``estimate.block_hlo_text``'s filter)."""
        def wrapped(*a):
            return fn(*a)
        wrapped.__name__ = f"{estimate.BLOCK_NAME}_{name}"
        return jax.jit(wrapped)

    rep = NamedSharding(Mesh(np.array([estimate.topology_device(TOPOLOGY[chip])]), ("x",)), P())
    shape = (CALL["batch"], CALL["heads"], SEQ, CALL["head_dim"])
    x = jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)
    index = jax.ShapeDtypeStruct(shape[:2], jnp.int32, sharding=rep)
    mask, rows = svg_mask(0.3, FRAMES, FRAME_SIZE), sample_rows(SEQ)
    programs = dict(
        permute=(named(_permute, "permute"), (x, x, x, x, index)),
        permute_gather=(named(_permute_gather, "permute_gather"), (x, x, x, x, index)),
        route=(named(lambda q, k, v: route(q, k, v, rows, mask, FRAMES, FRAME_SIZE), "route"),
               (x, x, x)))
    for name, (fn, args) in programs.items():
        t0 = time.perf_counter()
        summary = estimate.program_summary(estimate.block_hlo_text(fn.lower(*args).compile()),
                                           chip)
        _emit(out, dict(chip=chip, kind=name, wall_s=time.perf_counter() - t0,
                        seconds=summary["linear_s"] + summary["other_hbm_floor_s"],
                        linear_s=summary["linear_s"], other_s=summary["other_hbm_floor_s"],
                        flops=summary["flops"], bytes=summary["bytes"],
                        top_ops=summary["top_ops"][:4]))


# ---------------------------------------------------------------------------------------
# Putting the estimate together (parent process)
# ---------------------------------------------------------------------------------------


def read_rows(path: str) -> list:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def chip_blocks(rows: list, chip: str, key: str) -> dict | None:
    """The sparse-call figures of one chip at one fitted block size (``key`` "q/kv/c"), per
    sparsity, from the worker's rows; None if a profile is missing."""
    from engine.dry_run import estimate

    mine = {r["kind"]: r for r in rows if r.get("chip") == chip and r.get("blocks") == key
            and "error" not in r}
    need = ["dense"] + [f"{n} {q}x{k}" for n, _, q, k in PROFILES
                        if n not in ("data", "edge", "partial")]
    bs = BlockSizes(*map(int, key.split("/")))
    reduced = [k for k in mine if " 1x2 q" in k]
    need += ["partial 1x2"] if "partial 1x2" in mine or len(reduced) < 4 else reduced
    if any(k not in mine for k in need):
        return None
    hz = estimate.clock_hz(chip)
    num_sub = bs.block_kv // bs.block_kv_compute
    cost = class_costs({k: mine[k]["cycles"] for k in need[1:]}, num_sub, bs.block_q)
    nq, nkv = -(-SEQ // bs.block_q), -(-SEQ // bs.block_kv)
    grid = [CALL["batch"], CALL["heads"], nq, nkv]
    dense_s = estimate.call_cycles(dict(grid=grid), mine["dense"]["cost"]) / hz
    out = dict(blocks=key, grid=grid, dense_call_s=dense_s, dense_cost=mine["dense"]["cost"],
               class_cost=cost, data_1x2=mine.get("data 1x2", {}).get("cycles"),
               mask_work_extrapolated_from=sorted({int(k.split(" q")[1]) for k in reduced})
               if "partial 1x2" not in mine else None,
               profile_wall_s=sum(r.get("wall_s", 0) for r in mine.values()), sparsity={},
               # PARTIAL with a one-compare predicate (``OneEdgeMask``), if profiled.
               partial_edge=cost["full"] + (mine["edge 1x2"]["cycles"]
                                            - mine["full 1x2"]["cycles"]) / (2 * num_sub)
               if "edge 1x2" in mine and "full 1x2" in mine else None)
    for sp in SPARSITIES:
        counts = tile_counts(svg_mask(sp, FRAMES, FRAME_SIZE), SEQ, bs)
        call_s = sparse_call_cycles(counts, cost, batch=CALL["batch"],
                                    heads=CALL["heads"]) / hz
        out["sparsity"][sp] = dict(
            window=band_tokens(sp, FRAMES, FRAME_SIZE), counts=dataclasses.asdict(counts),
            visited_density=counts.visited_density, grid_density=counts.grid_density,
            sub_tile_density=counts.sub_tile_density,
            score_density=score_density(svg_mask(sp, FRAMES, FRAME_SIZE), SEQ),
            sparse_call_s=call_s, ratio=call_s / dense_s,
            # The masked sub-tiles' extra over unmasked ones: what a free mask would save.
            partial_excess_s=counts.partial_subs * (cost["partial"] - cost["full"])
            * CALL["batch"] * CALL["heads"] / hz,
            edge_call_s=None if out["partial_edge"] is None else call_s - counts.partial_subs
            * (cost["partial"] - out["partial_edge"]) * CALL["batch"] * CALL["heads"] / hz)
    return out


def steps_summary(chip: str, blocks: dict, extra: dict) -> dict:
    """Sparse steps and run averages of one chip at one block size (seconds, ESTIMATE)."""
    d = DENSE[chip]
    extra_layer = extra["permute"] + extra["route"]
    step = {sp: sparse_step(d["step"], d["self_attention"], v["sparse_call_s"], extra_layer)
            for sp, v in blocks["sparsity"].items()}
    wan21 = [d["step"]] * WAN21_DENSE_STEPS + [step[0.3]] * (WAN21_STEPS - WAN21_DENSE_STEPS)
    out = dict(sparse_step=step, extra_layer_s=extra_layer,
               routing_share=LAYERS_SPARSE * extra["route"] / step[0.3],
               wan21_average=average(wan21), wan21_speedup=d["step"] / average(wan21))
    # What if (arithmetic on the same figures): masked sub-tiles at the unmasked cost and
    # the permutation as one gather per tensor.
    v = blocks["sparsity"][0.3]
    step_if = sparse_step(d["step"], d["self_attention"],
                          v["sparse_call_s"] - v["partial_excess_s"],
                          extra["permute_gather"] + extra["route"])
    avg_if = average(wan21[:WAN21_DENSE_STEPS] + [step_if] * (WAN21_STEPS - WAN21_DENSE_STEPS))
    out.update(what_if_step=step_if, what_if_average=avg_if,
               what_if_speedup=d["step"] / avg_if)
    if v["edge_call_s"] is not None:  # PARTIAL at the one-compare cost, gather permutation
        step_edge = sparse_step(d["step"], d["self_attention"], v["edge_call_s"],
                                extra["permute_gather"] + extra["route"])
        avg_edge = average(wan21[:WAN21_DENSE_STEPS]
                           + [step_edge] * (WAN21_STEPS - WAN21_DENSE_STEPS))
        out.update(edge_call_s=v["edge_call_s"], edge_step=step_edge, edge_average=avg_edge,
                   edge_speedup=d["step"] / avg_edge)
    if chip == "v6e":
        plan = a14b_plan(a14b_experts(), A14B_SPARSE, A14B_S)
        times = [d["step"] if s is None else step[s] for s in plan]
        out.update(a14b_plan=plan, a14b_average=average(times),
                   a14b_speedup=d["step"] / average(times))
    return out


LAYERS_SPARSE = LAYERS - DENSE_LAYERS


# A worker past this much resident host memory is stopped: every estimate stays within 8 GB.
RSS_LIMIT_BYTES = 7_500_000_000


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0


def _run(cmd: list) -> float:
    """Run a worker to the end (one compile at a time), stopped past ``RSS_LIMIT_BYTES`` of
    resident memory; its wall seconds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd)
    while proc.poll() is None:
        if _rss(proc.pid) > RSS_LIMIT_BYTES:
            proc.kill()
            print(f"worker {cmd[-1]} stopped: over {RSS_LIMIT_BYTES / 1e9:.1f} GB of host "
                  "memory", file=sys.stderr)
        time.sleep(1.0)
    return time.perf_counter() - t0


def print_report(chip: str, blocks: list, extra: dict) -> None:
    """The estimate as markdown tables (every figure a static estimate)."""
    print(f"\n### {chip} ({TOPOLOGY[chip]}, dp2 x sp4, per device call "
          f"({CALL['batch']}, {CALL['heads']}, {SEQ}, {CALL['head_dim']}) bf16) -- "
          "STATIC ESTIMATE")
    print(f"per call: permutation {extra['permute'] * 1e3:.2f} ms (jnp.where; as one gather "
          f"per tensor {extra['permute_gather'] * 1e3:.2f} ms), routing "
          f"{extra['route'] * 1e3:.2f} ms ({extra['route_flops'] / 1e9:.1f} GFLOP, "
          f"{extra['route_bytes'] / 1e9:.2f} GB)")
    print("| blocks | s | band | grid kv steps | visited | sub-tiles | dense call s | "
          "sparse call s | ratio | sparse step s | 50-step avg s | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for b in blocks:
        summ = steps_summary(chip, b, extra)
        for sp, v in b["sparsity"].items():
            c = v["counts"]
            avg = (f"{summ['wan21_average']:.3f} | {summ['wan21_speedup']:.2f}x"
                   if sp == 0.3 else "- | -")
            print(f"| {b['blocks']} | {sp} | {v['window']} | {c['grid_kv_steps']}/"
                  f"{c['kv_blocks']} = {v['grid_density']:.3f} | {v['visited_density']:.3f} | "
                  f"{v['sub_tile_density']:.3f} | {b['dense_call_s'] * 1e3:.2f} ms | "
                  f"{v['sparse_call_s'] * 1e3:.2f} ms | {v['ratio']:.3f} | "
                  f"{summ['sparse_step'][sp]:.3f} | {avg} |")
        c = b["class_cost"]
        print(f"{b['blocks']}: cycles per q block {c['per_q_block']:,.0f}, per grid step "
              f"{c['step']:,.0f}, per FULL sub-tile {c['full']:,.0f}, per PARTIAL "
              f"{c['partial']:,.0f} (dense path: {b['dense_cost']['per_step']:,.0f} per step "
              f"of {b['grid'][3]} per q block); masked kernel as it runs, 1 x 2 grid: "
              f"{b['data_1x2'] or '-'} cycles (the profile does not see its branches); "
              f"PARTIAL's extra at s = 0.3: {b['sparsity'][0.3]['partial_excess_s'] * 1e3:.2f} "
              f"ms/call. What if PARTIAL cost FULL's and the permutation were one gather: "
              f"step {summ['what_if_step']:.3f} s, 50-step average "
              f"{summ['what_if_average']:.3f} s ({summ['what_if_speedup']:.2f}x)")
        if "edge_step" in summ:
            print(f"{b['blocks']}: PARTIAL with a one-compare predicate: "
                  f"{b['partial_edge']:,.0f} cycles per sub-tile; with it and the gather "
                  f"permutation: call {summ['edge_call_s'] * 1e3:.2f} ms, step "
                  f"{summ['edge_step']:.3f} s, 50-step average {summ['edge_average']:.3f} s "
                  f"({summ['edge_speedup']:.2f}x)")
        print(f"{b['blocks']}: routing {summ['routing_share']:.2%} of the s = 0.3 sparse step"
              + (f"; A14B moderate: 40-step average {summ['a14b_average']:.3f} s "
                 f"({summ['a14b_speedup']:.2f}x)" if "a14b_average" in summ else ""))


def _blocks_arg(text: str) -> BlockSizes:
    """``--blocks`` "block_q,block_kv,block_kv_compute" as ``BlockSizes``."""
    try:
        return BlockSizes(*(int(x) for x in text.split(",")))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(
            f"expected three ints block_q,block_kv,block_kv_compute that BlockSizes accepts, "
            f"got {text!r} ({e})") from None


def _chips_arg(text: str) -> list[str]:
    chips = text.split(",")
    if not chips or any(c not in TOPOLOGY for c in chips):
        raise argparse.ArgumentTypeError(f"expected a comma list of {', '.join(TOPOLOGY)}, "
                                         f"got {text!r}")
    return chips


def estimate_chip(chip: str, blocks: list, jsonl: str) -> dict | None:
    """Profile what ``jsonl`` lacks for ``chip`` at ``blocks`` (workers, one at a time),
    print the report and return its figures; None (said in one line) if a worker failed."""
    keys = [f"{f.block_q}/{f.block_kv}/{f.block_kv_compute}"
            for f in (fit_block_sizes(b, SEQ, SEQ) for b in blocks)]
    me = [sys.executable, os.path.abspath(__file__), "--jsonl", jsonl]
    todo = [b for b, k in zip(blocks, keys, strict=True)
            if chip_blocks(read_rows(jsonl), chip, k) is None]
    if todo:
        _run(me + sum((["--blocks", f"{b.block_q},{b.block_kv},{b.block_kv_compute}"]
                       for b in todo), []) + ["--chips", chip, "--worker", chip])
    if not any(r.get("chip") == chip and r.get("kind") == "route" for r in read_rows(jsonl)):
        _run(me + ["--xla-worker", chip])
    rows = read_rows(jsonl)
    xla = {r["kind"]: r for r in rows if r.get("chip") == chip and "seconds" in r}
    found = [b for b in (chip_blocks(rows, chip, k) for k in keys) if b]
    if not found or any(k not in xla for k in ("permute", "permute_gather", "route")):
        print(f"{chip}: no estimate: a profile or program is missing from {jsonl} (its "
              "worker failed; see above)", file=sys.stderr)
        return None
    extra = dict(permute=xla["permute"]["seconds"], route=xla["route"]["seconds"],
                 permute_gather=xla["permute_gather"]["seconds"],
                 route_flops=xla["route"]["flops"], route_bytes=xla["route"]["bytes"])
    print_report(chip, found, extra)
    return dict(extra=extra, blocks=found, steps=[steps_summary(chip, b, extra) for b in found])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", type=_chips_arg, default="v6e,tpu7x",
                        help="comma list of v6e, tpu7x (default: v6e,tpu7x)")
    parser.add_argument("--blocks", type=_blocks_arg, action="append", default=None,
                        help="block_q,block_kv,block_kv_compute (repeatable; default: the "
                             "chip's default blocks)")
    parser.add_argument("--jsonl", default="/tmp/svg_estimate_profiles.jsonl",
                        help="profile rows are appended here and reused on a rerun (default: "
                             "/tmp/svg_estimate_profiles.jsonl)")
    parser.add_argument("--json", help="also write the results here (default: none)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--xla-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.xla_worker:
        xla_programs(args.xla_worker, args.jsonl)
        return 0
    results = {}
    for chip in args.chips:
        blocks = args.blocks or [default_block_sizes(chip)]
        if args.worker:
            profile_chip(chip, blocks, args.jsonl)
            return 0
        results[chip] = estimate_chip(chip, blocks, args.jsonl)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0 if all(results.values()) else 1

if __name__ == "__main__":
    sys.exit(main())
