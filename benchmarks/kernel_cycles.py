"""Estimated cycles per grid step of the splash kernel, from libtpu's static profile.

ESTIMATE ONLY: no TPU is used. libtpu compiles the kernel for a described chip
(deviceless, ``jax.experimental.topologies``) and, with
``--xla_jf_dump_static_llo_profile_to=DIR`` in ``LIBTPU_INIT_ARGS``, writes the
``estimated_cycles`` it simulates from the final VLIW bundle schedule. DMA time is not
charged and work under data-dependent branches is only partly counted; see
the project's shared notes (tpu-static-profile).

The kernel is profiled on a tiny grid (batch 1, ``heads`` heads, ``q_blocks`` x
``kv_blocks`` blocks of the given sizes, head_dim 128, bf16) and the kernel's cycles are
divided by the number of grid steps; per-step cost is independent of grid size (checked
with ``--check-linearity``), so it scales to any sequence.

MXU use = (4 * block_q * block_kv * head_dim FLOPs per step / MXU FLOPs per cycle) /
cycles per step.

Usage::

    python benchmarks/kernel_cycles.py           # v5e, v6e, tpu7x at the default blocks
    python benchmarks/kernel_cycles.py --blocks 3328,2816,256 --chips v6e

Importable: ``cycles_per_grid_step(chip, block_sizes, head_dim=128, ...)`` returns a float.
The profile flag must be in ``LIBTPU_INIT_ARGS`` before libtpu initialises, so import
this module (or call ``setup_environment``) before anything else touches the TPU backend.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine import estimate  # noqa: E402

# MXU bf16 FLOPs per cycle per TensorCore: MXUs x width^2 x 2 (tpu7x: assumed as v6e).
MXU_FLOPS_PER_CYCLE = {**estimate.MXU_FLOPS_PER_CYCLE, "tpu7x": 4 * 256 * 256 * 2}
TOPOLOGY = {"v5e": "v5e:2x4", "v6e": "v6e:2x4", "tpu7x": "tpu7x:2x2x1"}


def setup_environment(profile_dir: str | None = None) -> str:
    """Set the deviceless libtpu environment and the profile flag; returns the dump dir."""
    return estimate.setup_profile_environment(profile_dir)


setup_environment()

import custom_splash_attention as csa  # noqa: E402


def kernel_cycles(chip: str, block_sizes, **kwargs) -> tuple[int, int]:
    """(estimated kernel cycles, grid steps) of one deviceless compile on ``chip``."""
    return estimate.kernel_cycles(TOPOLOGY[chip], block_sizes, **kwargs)


def cycles_per_grid_step(chip: str, block_sizes, head_dim: int = 128, **kwargs) -> float:
    """Estimated cycles per grid step (static profile, tiny grid; an estimate)."""
    cycles, steps = kernel_cycles(chip, block_sizes, head_dim=head_dim, **kwargs)
    return cycles / steps


def per_step_and_per_q_block(chip: str, block_sizes, head_dim: int = 128) -> tuple[float, float]:
    """(cycles per grid step, cycles per q block) of the kernel (static-profile estimate).

    The kernel's first and last kv step of a q block also run ``_init`` and ``_finish``;
    on a tiny grid with 2 kv steps per q block they weigh ~12x more than on the 720p grid
    (25 kv steps). Profiles 1 x 2 and 1 x 4 (q blocks x kv blocks) grids and solves
    cycles = step * q_blocks * kv_blocks + fixed * q_blocks.
    """
    c2, _ = kernel_cycles(chip, block_sizes, head_dim=head_dim, q_blocks=1, kv_blocks=2)
    c4, _ = kernel_cycles(chip, block_sizes, head_dim=head_dim, q_blocks=1, kv_blocks=4)
    step = (c4 - c2) / 2
    return step, c2 - 2 * step


def mxu_use(chip: str, block_sizes, cycles_per_step: float, head_dim: int = 128) -> float:
    """Fraction of the MXU peak: step FLOPs / MXU FLOPs per cycle / cycles per step."""
    bs = block_sizes if isinstance(block_sizes, csa.BlockSizes) else csa.BlockSizes(*block_sizes)
    flops = 4 * bs.block_q * bs.block_kv * head_dim
    return flops / MXU_FLOPS_PER_CYCLE[chip] / cycles_per_step


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chips", default="v5e,v6e,tpu7x")
    parser.add_argument("--blocks", default="3328,2816,256", help="block_q,block_kv,bkv_compute")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--check-linearity", action="store_true", help="also a 2-head grid")
    parser.add_argument(
        "--fit-kv-steps", type=int, default=0,
        help="profile 1x2 and 1x4 grids (q blocks x kv blocks), split the cycles into a "
        "per-step part and a per-q-block part (init + finish) and report cycles/step at "
        "this many kv steps per q block (720p 14B at 3072-key blocks: 25)",
    )
    parser.add_argument("--q-blocks", type=int, default=2, help="q blocks in the profiled grid")
    parser.add_argument("--kv-blocks", type=int, default=2, help="kv blocks in the profiled grid")
    args = parser.parse_args(argv)
    bs = csa.BlockSizes(*(int(x) for x in args.blocks.split(",")))
    if len(args.chips.split(",")) > 1:
        print(f"ESTIMATE (libtpu static profile, deviceless; no TPU measured). blocks {bs}")
    chips = args.chips.split(",")
    if len(chips) > 1:
        # One process per chip: libtpu aborts the process on some targets (tpu7x here).
        import subprocess

        for chip in chips:
            cmd = [sys.executable, __file__, "--chips", chip, "--blocks", args.blocks]
            cmd += ["--head-dim", str(args.head_dim)]
            cmd += ["--q-blocks", str(args.q_blocks), "--kv-blocks", str(args.kv_blocks)]
            cmd += ["--fit-kv-steps", str(args.fit_kv_steps)]
            cmd += ["--check-linearity"] if args.check_linearity else []
            run = subprocess.run(cmd, capture_output=True, text=True)
            lines = [x for x in run.stdout.splitlines() if x.startswith(chip)]
            print(lines[0] if lines else f"{chip}: failed (exit {run.returncode})", flush=True)
        return
    for chip in chips:
        if args.fit_kv_steps:
            try:
                step, fixed = per_step_and_per_q_block(chip, bs, head_dim=args.head_dim)
            except Exception as e:  # noqa: BLE001 - report and go on with the next chip
                print(f"{chip}: failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            per_step = step + fixed / args.fit_kv_steps
            print(
                f"{chip}: {per_step:,.0f} cycles/grid step at {args.fit_kv_steps} kv steps per "
                f"q block (estimate: {step:,.0f}/step + {fixed:,.0f}/q block), MXU use "
                f"{mxu_use(chip, bs, per_step, args.head_dim):.1%}; per step alone "
                f"{mxu_use(chip, bs, step, args.head_dim):.1%}",
                flush=True,
            )
            continue
        try:
            per_step = cycles_per_grid_step(
                chip, bs, head_dim=args.head_dim, q_blocks=args.q_blocks, kv_blocks=args.kv_blocks
            )
        except Exception as e:  # noqa: BLE001 - report and go on with the next chip
            print(f"{chip}: failed: {type(e).__name__}: {str(e)[:200]}")
            continue
        line = (
            f"{chip}: {per_step:,.0f} cycles/grid step (estimate), MXU use "
            f"{mxu_use(chip, bs, per_step, args.head_dim):.1%}"
        )
        if args.check_linearity:
            per_step2 = cycles_per_grid_step(
                chip, bs, head_dim=args.head_dim, heads=2,
                q_blocks=args.q_blocks, kv_blocks=args.kv_blocks,
            )
            line += f"; 2-head grid: {per_step2:,.0f} cycles/step"
        print(line, flush=True)


if __name__ == "__main__":
    main()
