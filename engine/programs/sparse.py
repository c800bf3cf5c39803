"""Sparse VideoGen (SVG 1, ``--sparse svg``): its flags, the run's settings, the per-step
plan (which expert, dense or sparse) and the step programs the plan chooses between.

The kernel side (the mask, the two token orders, the routing, the sparse SDPA call) is
``splash.svg``; a family gives its checkpoints' published setting (``SparsePolicy``,
``families.base.Transformer.sparse_policy``). A sparse step is its own compiled program:
the step function traced under ``splash.svg.sparse_scope``, in which every self-attention
call of the layers in the scope's range routes its heads and runs the band mask, and the
block scan splits at that range (``engine.weights.scan_layers``). Dense steps run the plain
program. ``StepPlan`` says per step which program and which expert; ``PlannedStep`` is the
loop's model call that follows it.
"""

from __future__ import annotations

import copy
import dataclasses
import math

from engine.files.checkpoint import read_component_config
from engine.programs import experts
from engine.programs.step import compile_step
from engine.run.errors import fail
from splash import svg

FLAGS = ("sparse", "sparse_density")
KINDS = ("none", "svg")
DENSE = "dense"


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
             " yet: both decide per step what a step computes, and no plan combines them")
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


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What each denoising step runs: ``experts[i]`` (0, or 1 for a two-expert model's
    low-noise expert) and ``programs[i]`` ("dense" or a sparse program's key)."""

    experts: tuple[int, ...]
    programs: tuple[str, ...]

    @classmethod
    def build(cls, expert_of_step: list[int], sparse: SparseSettings | None) -> StepPlan:
        start, stop = sparse.steps if sparse is not None else (0, 0)
        progs = tuple(sparse.key(e) if start <= i < stop else DENSE
                      for i, e in enumerate(expert_of_step))
        return cls(tuple(expert_of_step), progs)

    def report(self) -> dict:
        return dict(experts=list(self.experts), programs=list(self.programs),
                    sparse_steps=sum(p != DENSE for p in self.programs))

    def average_seconds(self, dense_s: float, sparse_s: dict) -> float:
        """Mean seconds per step over the plan: ``dense_s`` for a dense step,
        ``sparse_s[key]`` for a step of sparse program ``key``.

        Raises:
            KeyError: a sparse program of the plan missing from ``sparse_s``.
            ValueError: an empty plan."""
        if not self.programs:
            raise ValueError("average_seconds: the plan has no steps")
        return sum(dense_s if p == DENSE else sparse_s[p]
                   for p in self.programs) / len(self.programs)


class PlannedStep:
    """The loop's model call when steps differ in program: ``at_timestep(t)`` finds the
    step of host timestep ``t`` in ``timesteps`` and returns its program's call (each a
    bound call or an ``experts.ExpertStep``, which then picks the expert).

    Raises (``at_timestep``): KeyError for a timestep not in the run's schedule."""

    def __init__(self, programs: dict, plan: StepPlan, timesteps, sparse: SparseSettings):
        self.programs, self.plan, self.sparse = programs, plan, sparse
        self.index = {float(t): i for i, t in enumerate(timesteps)}
        first = next(iter(programs.values()))
        self.schedule = getattr(first, "schedule", None)  # the experts' (for reports)

    def for_warmup(self, steps: int) -> tuple[PlannedStep, int]:
        """The warmup's plan: the run's first ``steps`` steps, then one more step for each
        program they leave out (a sparse program behind a dense warmup), so the warmup
        runs every compiled program once and the timed runs measure steady state. Each
        step keeps the run's expert. Returns (the planned step, its step count)."""
        progs = list(self.plan.programs[:steps])
        progs += [p for p in dict.fromkeys(self.plan.programs) if p not in progs]
        progs = progs[:len(self.plan.programs)]
        warm = copy.copy(self)
        warm.plan = StepPlan(self.plan.experts,
                             tuple(progs) + self.plan.programs[len(progs):])
        return warm, len(progs)

    def at_timestep(self, t):
        step = self.programs[self.plan.programs[self.index[float(t)]]]
        return step.at_timestep(t) if hasattr(step, "at_timestep") else step

    def __call__(self, latents, timestep, inputs):
        raise TypeError("a planned step needs the host timestep: call at_timestep(t)")

    @property
    def expert_step(self):
        """The dense program's ``experts.ExpertStep`` for a two-expert model, else None."""
        dense = self.programs[DENSE]
        return dense if isinstance(dense, experts.ExpertStep) else None

    def report(self) -> dict:
        """The report's ``step_plan`` entry, and ``experts`` for a two-expert model. FLOPs
        elsewhere in the report are the dense step's (the sparse ones skip tiles)."""
        out = dict(step_plan=dict(self.plan.report(), sparse=dataclasses.asdict(self.sparse),
                                  compiled_programs=len(self.programs)))
        if self.expert_step is not None:
            out["experts"] = dict(self.expert_step.report(), compiled_programs=len(
                self.programs))
        return out


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


def _bound(compiled, placed: dict):
    """``(latents, t, inputs) -> noise prediction`` with ``placed``'s weights bound."""
    params, buffers = placed["params"], placed["buffers"]
    return lambda lat, ts, inp: compiled(params, buffers, lat, ts, inp)


def planned_step(config, pipe, placed: dict, second: dict | None, dense, sparse_programs,
                 inputs, parked) -> PlannedStep:
    """Bind every program to the weights (through ``experts.ExpertStep`` for two experts)
    and build the run's ``StepPlan`` from the scheduler's timesteps."""
    timesteps = pipe.scheduler.timesteps
    compiled = {DENSE: dense, **sparse_programs}
    if second:
        steps = {k: experts.ExpertStep(
            c, [placed, second],
            (config.video.guidance_scale, config.video.guidance_scale_2), inputs,
            boundary_ratio=pipe.config.boundary_ratio,
            num_train_timesteps=pipe.scheduler.config.num_train_timesteps,
            timesteps=timesteps, parking=parked) for k, c in compiled.items()}
        schedule = steps[DENSE].schedule
    else:
        steps = {k: _bound(c, placed) for k, c in compiled.items()}
        schedule = [0] * len(timesteps)
    plan = StepPlan.build(schedule, config.sparse)
    return PlannedStep(steps, plan, timesteps, config.sparse)
