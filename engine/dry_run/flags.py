"""The dry run's flags (``--dry_run``, ``--topology``, ...), and ``--aot_export``'s checks,
made before anything compiles."""

from __future__ import annotations

from engine.run import runtime
from engine.run.config import check_writable_dir
from engine.run.errors import fail


def add_dry_run_flags(g) -> None:
    """The dry-run flags, on an argparse group."""
    g.add_argument("--dry_run", action="store_true",
                   help="compile the denoising step and the VAE decode for --topology with the "
                        "real TPU compiler, no TPU and no weights; print per-chip HBM; exit 0 "
                        "if the run fits, 3 if not")
    g.add_argument("--topology", default=None,
                   help="TPU topology for --dry_run, e.g. v5e:2x4, v6e:2x4, v6e:4x4, v5p:2x2x1 "
                        "(default: none; --dry_run needs one)")
    g.add_argument("--dry_run_layers", type=int, default=None,
                   help="compile only this many transformer blocks in --dry_run (quick checks; "
                        "default: all)")
    g.add_argument("--dry_run_skip_vae", action="store_true",
                   help="compile only the transformer step in --dry_run (the VAE decode's TPU "
                        "compile alone can take ~10 min on a 2-core host)")
    g.add_argument("--dry_run_exact_convs", action="store_true",
                   help="compile convolutions in --dry_run with the TPU compiler's default "
                        "effort (5-10x slower VAE compile; same HBM figures measured here)")
    g.add_argument("--estimate", action="store_true",
                   help="with --dry_run: estimated s/step from libtpu's static profile (the "
                        "kernel) and the roofline (a compiled block); v5e, v6e; assumed clock; "
                        "not a measurement (engine/dry_run/estimate.py)")
    g.add_argument("--aot_export", default=None, metavar="DIR",
                   help="with --dry_run: write the compiled programs to DIR as executable-cache "
                        "entries that a run on that topology loads (copy DIR to the TPU VM's "
                        "--executable_cache_dir); implies exact convolutions; single-host "
                        "topologies, not tpu7x; not yet verified on a TPU (default: none, "
                        "nothing exported; docs/features.md)")


def check_dry_run_flags(args) -> None:
    """The dry run's flags against the others (``check_aot_export``, ``check_estimate``)."""
    check_aot_export(args)
    check_estimate(args)


def check_estimate(args) -> None:
    """``--estimate`` with ``--window_size`` is refused: the window runs the kernel's masked
    path, which picks each sub-tile's work by a branch on its scalar-prefetched class, and
    libtpu's static profile does not count work under such branches (a 1 x 2 grid at
    4736/2048/1024 profiles at 3,972 cycles as it runs, 34,278 with the work made visible;
    Wan 14B 720p with a 12,416-token window came out at 0.022 s of self-attention per step:
    benchmarks/svg_results.md). An estimate that low would be wrong, not optimistic.

    Raises:
        UsageError: both flags given.
    """
    if getattr(args, "estimate", False) and getattr(args, "window_size", None) is not None:
        fail("--estimate", "on", f"cannot cost --window_size {args.window_size}: libtpu's "
             "static profile does not count the masked kernel path's work (its sub-tile "
             "branches on table data); run the dry run without --estimate")


def check_aot_export(args) -> None:
    """``--aot_export`` against the other flags.

    Raises:
        UsageError: without --dry_run; with --dry_run_layers (a run compiles every block);
            for a topology the dry run compiles with another libtpu than a TPU VM loads; a
            folder that cannot be written.
    """
    if args.aot_export is None:
        return
    if not args.dry_run:
        fail("--aot_export", args.aot_export, "needs --dry_run --topology")
    if args.dry_run_layers is not None:
        fail("--aot_export", args.aot_export, f"cannot be combined with --dry_run_layers "
             f"{args.dry_run_layers} (a run compiles every block)")
    chip = (args.topology or ":").split(":")[0]
    if chip in runtime.PROFILE_LIBTPU_CHIPS:
        fail("--aot_export", args.aot_export, f"{chip} compiles here with libtpu "
             f"{runtime.PROFILE_LIBTPU_VERSION} (installed apart), not the one a TPU VM loads")
    check_writable_dir(args.aot_export, flag="--aot_export")
