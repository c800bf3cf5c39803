"""Where the Splash kernel's cycles go: its final VLIW bundles, slot by slot, per phase.

ESTIMATE ONLY: no TPU is used. libtpu compiles the kernel for a described chip (deviceless)
with ``--xla_jf_dump_to=DIR`` in ``LIBTPU_INIT_ARGS``, which writes the kernel's final bundle
schedule (``*exp2_splash_attention*-final_bundles.txt``, about 500 MB of dump per compile,
deleted afterwards unless ``--keep``). This script counts, per window of bundles, how many
of each unit's instructions issue per bundle:

* ``mxu_pop``: results popped from the MXUs (``vpop.f32.mrf`` on v5e/v6e, ``vpop.f32.mrb``
  on tpu7x): one vreg of 8 x 128 float32 each;
* ``eup``: exp2 issued (``vpow2`` / ``vexp2``); its result is popped like the MXU's;
* ``mxu_push``: weight pushes, weight preps and streamed operands (``vmatpush*``,
  ``vmatprep*``, ``vmatmul*``);
* ``vld`` / ``vst``: vector loads and stores (spills included); ``valu``: the rest of the
  vector arithmetic.

A phase where one column sits at its ceiling is bound by that unit. The whole file is
counted, so branches that rarely run (the lazy shift's redo) appear as windows of their own.
The cycles per grid step are libtpu's static profile of the same compile.

Usage::

    python benchmarks/kernel_bundles.py --chip v6e --blocks 4736,2048,1024
    python benchmarks/kernel_bundles.py --chip tpu7x --blocks 3328,2048,1024 --window 500

Findings and the variants tried: benchmarks/kernel_cycles_results.md ("Issue 45: where the
kernel's cycles go").
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine.run import runtime  # noqa: E402

TOPOLOGY = {"v5e": "v5e:2x4", "v6e": "v6e:2x4", "tpu7x": "tpu7x:2x2x1"}
COLUMNS = ("mxu_pop", "eup", "mxu_push", "vld", "vst", "valu")
# One bundle per line: "<address> [markers] : [>] { op ;; op ... }".
_BUNDLE = re.compile(r"^\s*(?:0x[0-9a-f]+|\d+)\s+[A-Z: >]*\{")
_OP = re.compile(r"= (v[a-z0-9]+(?:\.[a-z0-9]+)*)")


def unit(op: str) -> str | None:
    """The column of one vector instruction's opcode, or None (scalar, DMA, misc)."""
    base = op.split(".")[0]
    if op.startswith(("vpop.f32.mrf", "vpop.f32.mrb")):
        return "mxu_pop"
    if base in ("vpow2", "vexp2"):
        return "eup"
    if base.startswith(("vmatpush", "vmatprep", "vmatmul")):
        return "mxu_push"
    if base in ("vld", "vst"):
        return base
    if base.startswith("vpop") or base in ("vsyncpa", "vsyncadd", "vpush", "vxpose"):
        return None
    return "valu"


def count_bundles(path: str) -> list[collections.Counter]:
    """One Counter of columns per bundle of a final-bundles dump."""
    rows = []
    with open(path) as f:
        for line in f:
            if _BUNDLE.match(line):
                rows.append(collections.Counter(
                    u for u in map(unit, _OP.findall(line)) if u is not None))
    return rows


def print_phases(rows: list[collections.Counter], window: int) -> None:
    """Per-bundle rates per window of ``window`` bundles, then the whole file."""
    print(f"{'bundles':>13} " + " ".join(f"{c:>8}" for c in COLUMNS))
    for start in range(0, len(rows), window):
        part = rows[start:start + window]
        total = sum(part, collections.Counter())
        print(f"{start:6d}-{start + len(part):<6d} "
              + " ".join(f"{total[c] / len(part):8.2f}" for c in COLUMNS))
    total = sum(rows, collections.Counter())
    print(f"{'all ' + str(len(rows)):>13} " + " ".join(f"{total[c]:8d}" for c in COLUMNS))


def compile_and_dump(chip: str, blocks, q_blocks: int, kv_blocks: int, dump: str):
    """(cycles, grid steps) of one profiled deviceless compile, with the full dump in
    ``dump``; libtpu must not be loaded yet in this process."""
    runtime.use_deviceless_tpu(TOPOLOGY[chip], profile_libtpu=True)
    os.environ["LIBTPU_INIT_ARGS"] = (f"{os.environ.get('LIBTPU_INIT_ARGS', '')} "
                                      f"--xla_jf_dump_to={dump}").strip()
    from engine.dry_run import estimate

    estimate.setup_profile_environment()
    return estimate.kernel_cycles(TOPOLOGY[chip], blocks, q_blocks=q_blocks,
                                  kv_blocks=kv_blocks)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chip", default="v6e", choices=sorted(TOPOLOGY))
    parser.add_argument("--blocks", default="4736,2048,1024",
                        help="block_q,block_kv,block_kv_compute (default: v6e's defaults)")
    parser.add_argument("--q-blocks", type=int, default=1)
    parser.add_argument("--kv-blocks", type=int, default=2)
    parser.add_argument("--window", type=int, default=250, help="bundles per printed row")
    parser.add_argument("--keep", help="keep the dump in this folder (about 500 MB)")
    args = parser.parse_args(argv)
    blocks = tuple(int(x) for x in args.blocks.split(","))
    dump = args.keep or tempfile.mkdtemp(prefix="kernel_bundles_")
    try:
        cycles, steps = compile_and_dump(args.chip, blocks, args.q_blocks, args.kv_blocks,
                                         dump)
        files = [f for f in glob.glob(os.path.join(dump, "*final_bundles.txt"))
                 if "exp2_splash_attention" in f and "schedule-analysis" not in f]
        if not files:
            raise SystemExit(f"no final bundles of the kernel in {dump}")
        print(f"ESTIMATE (libtpu static profile, deviceless, no TPU): {args.chip} blocks "
              f"{args.blocks}, grid {args.q_blocks} x {args.kv_blocks}: {cycles:,} cycles, "
              f"{cycles / steps:,.0f} per grid step")
        print_phases(count_bundles(files[0]), args.window)
    finally:
        if not args.keep:
            shutil.rmtree(dump, ignore_errors=True)


if __name__ == "__main__":
    main()
