"""One per-step plan: every decision a run makes per denoising step, in one place the loop
reads (``StepPlan``), and the loop's model call that follows it (``PlannedStep``).

Per step a run decides three things:

- **which expert** (a two-expert model: ``transformer`` while ``t >= boundary_ratio *
  num_train_timesteps``, else ``transformer_2``, diffusers' rule,
  ``engine.programs.experts.expert_schedule``);
- **which program**: the dense step or a sparse one (``--sparse svg``: the steps in
  ``SparseSettings.steps``, each expert at its own density, ``engine.programs.sparse``);
- **cached or full** (``--cache``: DeepCache's fixed pattern, or MagCache's decisions
  replayed on the host from the precomputed ratios, ``step_cache_settings.CacheSettings``).

All three are known on the host before the loop starts, from the run's timesteps and
settings: none depends on a value the device computes, so the plan is built once and needs no
device-to-host sync. (With ``--cache_calibrate`` every step is full: the run measures the
ratios a later plan will use.) A run whose steps all run one program with one expert and no
cache needs no plan; a two-expert run with neither ``--sparse`` nor ``--cache`` keeps
``experts.ExpertStep``, which applies the same rule per timestep, because the server may run
its requests at other step counts.

``--sparse`` with ``--cache`` is refused before any model loads (``sparse``): no program
runs a sparse step on a cache's kept arrays yet. A plan can still say it (a step both sparse
and cached); ``StepPlan.build`` refuses that combination until such programs exist, so
combining them later changes the plan's builder and the programs, not the loop.
"""

from __future__ import annotations

import copy
import dataclasses

from engine.programs import experts

DENSE = "dense"


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What each denoising step runs; step ``i`` of the loop runs with

    - ``experts[i]``: 0 (``transformer``), or 1 (a two-expert model's ``transformer_2``);
    - ``programs[i]``: "dense" or a sparse program's key (``SparseSettings.key``);
    - ``cached[i]``: True when the step cache's cached program runs (skips blocks on what
      the last full step of the same expert kept), False for a full step; all False without
      a cache (the default). ``cache``: the cache kind that decided it ("none" without one).

    Raises (construction): ValueError when the three tuples differ in length.
    """

    experts: tuple[int, ...]
    programs: tuple[str, ...]
    cached: tuple[bool, ...] = ()
    cache: str = "none"

    def __post_init__(self):
        if not self.cached:
            object.__setattr__(self, "cached", (False,) * len(self.experts))
        if not len(self.experts) == len(self.programs) == len(self.cached):
            raise ValueError(f"StepPlan: {len(self.experts)} experts, {len(self.programs)} "
                             f"programs and {len(self.cached)} cache decisions")

    def __len__(self) -> int:
        return len(self.experts)

    @classmethod
    def build(cls, expert_of_step, sparse=None, cache=None) -> StepPlan:
        """The plan of a run from its per-step experts (``expert_of_step``: one int per
        step, from the run's timesteps), its ``sparse.SparseSettings`` (or None) and its
        ``step_cache_settings.CacheSettings`` (or None / kind "none").

        Raises:
            ValueError: a step both sparse and cached (no program runs that yet).
        """
        n = len(expert_of_step)
        start, stop = sparse.steps if sparse is not None else (0, 0)
        progs = tuple(sparse.key(e) if start <= i < stop else DENSE
                      for i, e in enumerate(expert_of_step))
        on = cache is not None and cache.on
        cached = tuple(cache.schedule(n)) if on else (False,) * n
        both = [i for i, (p, c) in enumerate(zip(progs, cached, strict=True)) if c and p != DENSE]
        if both:
            raise ValueError(f"StepPlan: steps {both} are both sparse and cached; no program "
                             "runs a sparse step on a cache's kept arrays")
        return cls(tuple(int(e) for e in expert_of_step), progs, cached,
                   cache.kind if on else "none")

    @property
    def kinds(self) -> tuple[str, ...]:
        """Per step, "cached" or "full"."""
        return tuple("cached" if c else "full" for c in self.cached)

    def warmup(self, steps: int) -> tuple[StepPlan, int]:
        """The warmup's plan and step count: the run's first steps changed so that every
        program the run uses runs once, and the timed runs measure steady state. Each step
        keeps the run's expert; the steps past the count are the run's (never run).

        - With cached steps: full, then cached, alternating, for ``steps`` steps and until
          a cached step ran; a cached step only right after a full step of the same expert
          (what it reads was recorded by that expert).
        - Else: the first ``steps`` steps, then one more step for each program they leave
          out (a sparse program behind a dense warmup).
        """
        if any(self.cached):
            out: list[bool] = []
            for i in range(len(self)):
                if len(out) >= steps and any(out):
                    break
                out.append(bool(out) and not out[-1] and self.experts[i] == self.experts[i - 1])
            return dataclasses.replace(self, cached=tuple(out) + self.cached[len(out):]), len(out)
        progs = list(self.programs[:steps])
        progs += [p for p in dict.fromkeys(self.programs) if p not in progs]
        progs = progs[:len(self.programs)]
        plan = dataclasses.replace(self, programs=tuple(progs) + self.programs[len(progs):])
        return plan, len(progs)

    def report(self) -> dict:
        """The report's ``step_plan`` entry: per step the expert, the program and "full" /
        "cached" (``caching``), the cache kind, and the counts of sparse and cached steps."""
        return dict(experts=list(self.experts), programs=list(self.programs),
                    caching=list(self.kinds), cache=self.cache,
                    sparse_steps=sum(p != DENSE for p in self.programs),
                    cached_steps=sum(self.cached))

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
    """The loop's model call of a run with a plan: ``at_step(i)`` returns step ``i``'s call
    ``(latents, t, inputs) -> noise prediction``: the plan's program, with the plan's expert
    (each program a bound call, or an ``experts.ExpertStep`` serving both experts).

    Args:
        programs: {program key: call or ``ExpertStep``}, "dense" among them.
        plan: the run's ``StepPlan``; timesteps: the run's host timesteps, in order
            (``at_timestep`` finds a step by its timestep: the profiler's call).
        sparse: the run's ``SparseSettings`` or None (for the report).
        cache: the run's ``step_cache.StepCache`` or None: with one, ``for_loop`` gives
            the cache's runner, which follows the plan's "cached" and holds the kept
            arrays between steps; "dense" is then the full program's noise prediction.

    Raises (``at_timestep``): KeyError for a timestep not in the run's schedule.
    """

    def __init__(self, programs: dict, plan: StepPlan, timesteps, sparse=None, cache=None):
        self.programs, self.plan, self.sparse, self.cache = programs, plan, sparse, cache
        self.index = {float(t): i for i, t in enumerate(timesteps)}

    def for_warmup(self, steps: int) -> tuple[PlannedStep, int]:
        """(this step over the warmup's plan, its step count): ``StepPlan.warmup``."""
        warm = copy.copy(self)
        warm.plan, n = self.plan.warmup(steps)
        return warm, n

    def for_loop(self):
        """The call one sampling loop runs (its ``at_step(i)`` gives step ``i``'s call):
        this step, or with a cache a fresh runner over the plan (kept arrays are per loop)."""
        if self.cache is None:
            return self
        return self.cache.runner(self.plan, calibrate=self.cache.settings.calibrate)

    def at_step(self, i: int):
        """Step ``i``'s program with step ``i``'s expert (no cache: ``for_loop``'s runner
        runs a cached plan's steps)."""
        step = self.programs[self.plan.programs[i]]
        if isinstance(step, experts.ExpertStep):
            return step.for_expert(self.plan.experts[i])
        return step

    def at_timestep(self, t):
        return self.at_step(self.index[float(t)])

    def __call__(self, latents, timestep, inputs):
        raise TypeError("a planned step needs the step index: call at_step(i)")

    @property
    def expert_step(self):
        """The dense program's ``experts.ExpertStep`` for a two-expert model, else None."""
        dense = self.programs[DENSE]
        return dense if isinstance(dense, experts.ExpertStep) else None

    @property
    def experts(self) -> list:
        """A two-expert model's placed experts (the server reuses them for its buckets).

        Raises:
            AttributeError: a one-expert model (``hasattr`` then says False)."""
        if self.expert_step is None:
            raise AttributeError("a one-expert planned step has no experts")
        return self.expert_step.experts

    def report(self) -> dict:
        """The report's ``step_plan`` entry (every per-step decision, the sparse settings,
        the compiled programs), and ``experts`` for a two-expert model. FLOPs elsewhere in
        the report are the dense step's (the sparse ones skip tiles)."""
        n = len(self.programs) + (self.cache is not None)  # a cache adds its cached program
        sparse = None if self.sparse is None else dataclasses.asdict(self.sparse)
        out = dict(step_plan=dict(self.plan.report(), sparse=sparse, compiled_programs=n))
        if self.expert_step is not None:
            out["experts"] = dict(self.expert_step.report(), compiled_programs=n)
        return out
