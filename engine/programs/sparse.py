"""Sparse VideoGen (SVG 1, ``--sparse svg``): its flags, the run's settings and the sparse
step programs; which step runs dense or sparse is the run's ``step_plan.StepPlan``.

The kernel side (the mask, the two token orders, the routing, the sparse SDPA call) is
``splash.svg``; a family gives its checkpoints' published setting (``SparsePolicy``,
``families.base.Transformer.sparse_policy``). A sparse step is its own compiled program:
the step function traced under ``splash.svg.sparse_scope``, in which every self-attention
call of the layers in the scope's range routes its heads and runs the band mask, and the
block scan splits at that range (``engine.weights.scan_layers``). Dense steps run the plain
program. ``step_plan.StepPlan`` says per step which program (and which expert, and cached or
full); ``step_plan.PlannedStep`` is the loop's model call that follows it.
"""

from __future__ import annotations

import dataclasses
import math

from engine.files.checkpoint import read_component_config
from engine.programs.step import compile_step
from engine.run.errors import fail
from splash import svg

FLAGS = ("sparse", "sparse_density")
KINDS = ("none", "svg")


@dataclasses.dataclass(frozen=True)
class SparsePolicy:
    """A checkpoint's published SVG setting, as its family gives it.

    densities: SVG's ``sparsity`` (fraction of scores kept) per expert (one for a
        one-expert model; high-noise first).
    sparse_steps: [start, stop) of the steps run sparse, out of ``reference_steps``.
    layers: [start, stop) of the blocks run sparse (stop clipped to the model's blocks).
    num_frames, frame_size: the run's post-patch latent frames and tokens per frame.
    source: where the setting is published.
    """

    densities: tuple[float, ...]
    sparse_steps: tuple[int, int]
    reference_steps: int
    layers: tuple[int, int]
    num_frames: int
    frame_size: int
    source: str


@dataclasses.dataclass(frozen=True)
class SparseSettings:
    """``--sparse svg`` resolved for a run (JSON-able; the report's ``settings.sparse``).

    densities: per expert; steps: [start, stop) of the run's steps that are sparse;
    layers: [start, stop) of the blocks that are sparse; num_frames, frame_size: the token
    grid; source: the published setting's source (or "flags"); block_sizes: (block_q,
    block_kv, block_kv_compute) of the sparse calls, or None for the dense calls' blocks
    (``engine.run.config.RunConfig.resolve_block_sizes`` fills it: the chip's
    ``splash.blocks.SPARSE_BLOCK_SIZES`` unless --bq/--bkv/--bkv_compute are given).
    """

    densities: tuple[float, ...]
    steps: tuple[int, int]
    layers: tuple[int, int]
    num_frames: int
    frame_size: int
    source: str
    block_sizes: tuple[int, int, int] | None = None

    def scope(self, expert: int) -> svg.SparseScope:
        return svg.SparseScope(self.densities[expert], self.num_frames, self.frame_size,
                               self.layers, self.block_sizes)

    def key(self, expert: int) -> str:
        """The plan's name of expert ``expert``'s sparse program."""
        return f"svg{self.densities[expert]:g}"


def add_sparse_flags(g) -> None:
    """``--sparse`` and ``--sparse_density`` (argparse group ``g``)."""
    g.add_argument("--sparse", choices=KINDS, default="none",
                   help="sparse self-attention: svg = Sparse VideoGen (each head, per layer "
                        "and step, routed by 64 sampled queries to a spatial or a temporal "
                        "band plus the first frame's keys; needs --attention splash; families "
                        "with a published setting, see docs/features.md). Its dense warmup "
                        "steps and dense layers are the checkpoint's published ones, the "
                        "steps scaled to --num_inference_steps as round(k * steps / published "
                        "steps), halves up")
    g.add_argument("--sparse_density", type=float, default=None,
                   help="SVG's sparsity: the fraction of scores kept, in (0, 1]; the band "
                        "half-width is w = N (1 - sqrt(1 - s)) tokens (N = video tokens), "
                        "rounded up to 128 as SVG does (default: the checkpoint's published "
                        "value, per expert for a two-expert model; docs/features.md)")


def scaled_step(k: int, steps: int, reference: int) -> int:
    """``k`` of ``reference`` steps at ``steps`` steps: round(k * steps / reference), halves
    up (exact at the reference count)."""
    return int(math.floor(k * steps / reference + 0.5))


def _refuse_combinations(args, family) -> None:
    """The one-line refusals of ``--sparse svg`` with what it cannot run with."""
    given = "svg"
    # A dry run resolves --attention auto to splash (engine.dry_run.fit); a run may not.
    if args.attention != "splash" and not (args.dry_run and args.attention == "auto"):
        fail("--sparse", given, f"needs --attention splash (our kernel runs SVG's masks), got "
             f"--attention {args.attention}")
    if args.cache not in (None, "none") or args.enable_cache:
        fail("--sparse", given, "cannot be combined with a step cache (--cache/--enable_cache)"
             " yet: no program runs a sparse step on the cache's kept arrays")
    for flag, on in (("--window_size", args.window_size is not None),
                     ("--no_scan_layers", args.scan_layers is False),
                     ("--serve", bool(args.serve)),
                     ("--sr", getattr(args, "sr", "none") != "none"),
                     ("--aot_export", bool(getattr(args, "aot_export", None)))):
        if on:
            fail("--sparse", given, f"cannot be combined with {flag} yet")
    if family.transformer.sparse_policy is None:
        fail("--sparse", given, f"not supported for {family.name} (no published SVG setting "
             "wired for it)")


def validate_sparse_flags(args, family, values: dict):
    """``--sparse`` and ``--sparse_density`` before any model loads.

    Args:
        args: the parsed flags; family: the ``families.ModelFamily``; values: the resolved
            family flags (height, width, frames, num_inference_steps). The transformer's
            block count (its config's ``num_layers``) clips the policy's layers.

    Returns:
        ``SparseSettings``, or None for ``--sparse none``.

    Raises:
        UsageError: one line (density outside (0, 1], a flag or backend it cannot run
            with, a family or checkpoint with no setting).
    """
    s = args.sparse_density
    if s is not None and not 0.0 < s <= 1.0:
        fail("--sparse_density", s, "must be a fraction of scores kept in (0, 1]")
    if args.sparse == "none":
        if s is not None:
            fail("--sparse_density", s, "needs --sparse svg")
        return None
    _refuse_combinations(args, family)
    policy = family.transformer.sparse_policy(args.model_id, values)
    if isinstance(policy, str):
        fail("--sparse", "svg", policy)
    n = values["num_inference_steps"]
    num_layers = (read_component_config(args.model_id, "transformer") or {}).get("num_layers")
    start, stop = (scaled_step(k, n, policy.reference_steps) for k in policy.sparse_steps)
    hi = policy.layers[1] if num_layers is None else min(policy.layers[1], num_layers)
    densities = policy.densities if s is None else tuple(s for _ in policy.densities)
    return SparseSettings(densities=tuple(densities), steps=(start, stop),
                          layers=(policy.layers[0], hi), num_frames=policy.num_frames,
                          frame_size=policy.frame_size,
                          source=policy.source if s is None else "--sparse_density")


def compile_sparse_programs(config, placed: dict, mesh, fn, latents, timestep, inputs,
                            timings: dict, seconds_by_key: dict | None = None) -> dict:
    """{key: compiled} of the run's sparse step programs (one per distinct expert density),
    each traced under its ``splash.svg.sparse_scope``; adds ``compile_transformer_sparse_s``
    to ``timings`` and each program's compile seconds to ``seconds_by_key`` if given."""
    out, seconds = {}, 0.0
    sparse = config.sparse
    for e in range(len(sparse.densities)):
        key = sparse.key(e)
        if key in out:
            continue
        scope = sparse.scope(e)
        with svg.sparse_scope(scope):
            out[key], s = compile_step(placed, mesh, fn, latents, timestep, inputs,
                                       extra=dict(sparse=dataclasses.asdict(scope)))
        seconds += s
        if seconds_by_key is not None:
            seconds_by_key[key] = s
    timings["compile_transformer_sparse_s"] = seconds
    return out
