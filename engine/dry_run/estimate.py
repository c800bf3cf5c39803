"""``--dry_run --estimate``: seconds per denoising step, and per whole video, from static TPU
cost models and host measurements.

The stages are priced in modules of their own, re-exported here: ``price_ops`` (one
compiled program's ops on a chip: clocks, ``program_summary``), ``price_kernel`` (our
kernel's profiled cost, and the profiling subprocess), ``price_step`` (the denoising step),
``price_decode`` (the VAE decode), ``price_text`` (the text and image encoders, on the mesh
and on the host) and ``price_host`` (measurements on this host: its bf16 matmul rate, the
mp4 write); ``whole_video`` adds them up. This module keeps the printed table.

ESTIMATE ONLY, never a measurement, never checked on hardware. Nothing here runs on a TPU:
libtpu compiles for a described chip on a CPU host (deviceless) and its cost models are read.

How a step is put together (per chip; see the project's shared notes, tpu-static-profile):

* **Attention** (our Splash kernel): libtpu's static profile. With
  ``--xla_jf_dump_static_llo_profile_to=DIR`` in ``LIBTPU_INIT_ARGS`` libtpu simulates the
  final VLIW bundle schedule of every op it compiles and writes its ``estimated_cycles``
  (one ``*_static_llo_profile.textproto`` per op). The flag is read once, when libtpu
  loads, so the kernel is profiled in a subprocess
  (``python -m engine.dry_run.price_kernel``), on a
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

# The public names of the stage modules, re-exported: ``estimate.X`` is the API the dry run,
# the tests and the benchmarks use. (hlo's parsers too: parse_textproto, profile_ops, ...)
from engine.dry_run.hlo import (  # noqa: F401
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
from engine.dry_run.price_decode import decode_estimate, decode_floor  # noqa: F401
from engine.dry_run.price_kernel import (  # noqa: F401
    MASKED_PROFILE_MAX_BLOCK_Q,
    PROFILE_FLAG,
    REDUCED_Q_SPAN,
    _band,
    _band_counts,
    _kernel_key,
    call_cycles,
    clear_profile,
    grid_cost,
    kernel_cost,
    kernel_cycles,
    masked_cost,
    profile_dir,
    profile_worker,
    profiled_cycles,
    reduced_q_cost,
    release_compile_memory,
    setup_profile_environment,
    topology_device,
    worker_failure,
)
from engine.dry_run.price_ops import (  # noqa: F401
    BLOCK_NAME,
    EIGHT_BIT_HLO,
    ICI_EGRESS_GBPS,
    ICI_SOURCE,
    MXU_FLOPS_PER_CYCLE,
    STUB_NAME,
    _sparsecore_wrappers,
    block_hlo_env,
    block_hlo_text,
    clock_hz,
    device_hbm_bytes_per_s,
    device_ici_bytes_per_s,
    device_peak_flops,
    dump_block_hlo,
    label,
    mxu_rate,
    program_summary,
)
from engine.dry_run.price_step import (  # noqa: F401
    METHOD,
    _recorded,
    combine,
    estimate,
    sparse_steps,
    stub_attention_kernel,
)


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

