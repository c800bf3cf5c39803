"""The step cache's resolved settings and its host-side schedules: which steps DeepCache and
MagCache run cached, from the step index alone (no device values), so the whole schedule is
known before the loop and ``engine.programs.step_plan.StepPlan`` records it per step.

DeepCache's rule is HunyuanVideo-1.5's official pipeline's; MagCache's replays diffusers
0.42.1's ``hooks/mag_cache.py`` (``MagCacheHeadHook``) on the calibrated ratios. The flags
that resolve these settings are ``step_cache_flags``; the ratio files ``mag_ratios``; the
compiled programs and the loop's runner ``step_cache``.
"""

from __future__ import annotations

import dataclasses

from engine.programs.experts import EXPERT_NAMES


@dataclasses.dataclass(frozen=True)
class CacheSettings:
    """The resolved step-cache settings (``kind`` "none" turns everything off).

    ``mag_ratios``: one ratio per step, already ``nearest_interp``-ed to the step count, as
    diffusers' ``MagCacheConfig.__post_init__`` does; for a two-expert model a pair of such
    tuples, each interpolated to the steps its expert runs. ``mag_ratios_source`` says where
    they came from (a built-in name, "--mag_ratios", a file, or None).

    ``expert_steps``: a two-expert model's (high-noise, low-noise) step counts, the
    ``transformer`` steps first (``engine.programs.experts.expert_steps``); None for one
    expert. With it each expert is its own cache: MagCache as if diffusers' hook were attached
    to that expert alone (its own step count, ratios, retention, accumulators, residual);
    DeepCache's flags keep their meaning over the global step index, and the first step of
    each expert is full (the recorded input is never the other expert's).
    """
    kind: str = "none"
    start: int = 11
    end: int = 45
    interval: int = 4
    recompute_blocks: int = 1
    threshold: float = 0.06
    max_skip_steps: int = 3
    retention_ratio: float = 0.2
    mag_ratios: tuple | None = None
    mag_ratios_source: str | None = None
    calibrate: bool = False
    expert_steps: tuple[int, int] | None = None

    @property
    def on(self) -> bool:
        return self.kind != "none"

    def cached_share(self, num_layers: int) -> float:
        """A cached step's share of a full step's block work: k / L with DeepCache, none with
        MagCache (embeddings and the output head are outside the blocks)."""
        return self.recompute_blocks / num_layers if self.kind == "deepcache" else 0.0

    def spans(self, num_steps: int) -> list[tuple[int, int]]:
        """(first step, step count) per expert: one span for a one-expert model."""
        if self.expert_steps is None:
            return [(0, num_steps)]
        return [(0, self.expert_steps[0]), (self.expert_steps[0], self.expert_steps[1])]

    def expert_ratios(self) -> list:
        """The per-step ratio tuple of each expert (one entry for one expert)."""
        if self.expert_steps is None:
            return [self.mag_ratios]
        return list(self.mag_ratios or (None, None))

    def schedule(self, num_steps: int) -> tuple[bool, ...]:
        """Per step, True when the step is cached (skips blocks)."""
        if self.kind == "deepcache":
            out = list(deepcache_schedule(num_steps, self.start, self.end, self.interval))
            for first, n in self.spans(num_steps):
                if n and self.expert_steps is not None:
                    out[first] = False  # each expert records its own input first
            return tuple(out)
        if self.kind == "magcache" and not self.calibrate:
            return tuple(skip for (_, n), ratios in zip(self.spans(num_steps),
                                                        self.expert_ratios(), strict=True)
                         for skip in magcache_schedule(n, ratios or (), self.threshold,
                                                       self.max_skip_steps,
                                                       self.retention_ratio))
        return (False,) * num_steps

    def report(self, num_steps: int) -> dict:
        """The JSON report's ``cache`` entry: the resolved settings and the schedule; for a
        two-expert model also ``experts``: per expert its steps, full and cached steps and
        its own settings (MagCache: its step count, retention steps and ratios)."""
        out = dict(kind=self.kind)
        if self.kind == "deepcache":
            out.update(start_step=self.start, end_step=self.end, step_interval=self.interval,
                       recompute_blocks=self.recompute_blocks)
        elif self.kind == "magcache":
            ratios = None if self.mag_ratios is None else (
                [list(r) for r in self.mag_ratios] if self.expert_steps else list(self.mag_ratios))
            out.update(threshold=self.threshold, max_skip_steps=self.max_skip_steps,
                       retention_ratio=self.retention_ratio, calibrate=self.calibrate,
                       mag_ratios=ratios, mag_ratios_source=self.mag_ratios_source)
        schedule = self.schedule(num_steps)
        out["cached_steps"] = [i for i, c in enumerate(schedule) if c]
        out["full_steps"] = len(schedule) - len(out["cached_steps"])
        if self.expert_steps is not None:
            out["experts"] = {name: self._expert_report(schedule, first, n, ratios)
                              for name, (first, n), ratios in zip(
                                  EXPERT_NAMES, self.spans(num_steps), self.expert_ratios(),
                                  strict=True)}
        return out

    def _expert_report(self, schedule, first: int, n: int, ratios) -> dict:
        cached = [i for i in range(first, first + n) if schedule[i]]
        out = dict(steps=list(range(first, first + n)), full_steps=n - len(cached),
                   cached_steps=cached)
        if self.kind == "magcache":
            out.update(num_inference_steps=n,
                       retention_steps=int(self.retention_ratio * n + 0.5),
                       mag_ratios=None if ratios is None else list(ratios))
        elif self.kind == "deepcache" and n:
            out["first_step_full"] = True
        return out



def deepcache_schedule(num_steps: int, start: int, end: int, interval: int) -> tuple:
    """True for the cached steps: every step except ``[0, start)``, ``start + n * interval``
    and ``[end, num_steps)``. Defaults 11/45/4 over 50 steps: 25 full, 25 cached."""
    return tuple(not (i < start or i >= end or (i - start) % interval == 0)
                 for i in range(num_steps))


def nearest_interp(values, target_length: int) -> tuple:
    """diffusers' ``hooks.mag_cache.nearest_interp``: nearest-neighbour resampling of a ratio
    list to ``target_length`` entries (torch.round, i.e. round half to even, as there)."""
    n = len(values)
    if target_length == 1:
        return (float(values[-1]),)
    scale = (n - 1) / (target_length - 1)
    # numpy's round, like torch's, rounds half to even; Python's round does too.
    return tuple(float(values[round(i * scale)]) for i in range(target_length))


def magcache_schedule(num_steps: int, ratios, threshold: float, max_skip_steps: int,
                      retention_ratio: float) -> tuple:
    """True for the steps diffusers' ``MagCacheHeadHook`` skips, replayed on the host.

    From step ``int(retention_ratio * num_steps + 0.5)`` on, each step multiplies its ratio
    into an accumulated ratio and adds ``|1 - accumulated ratio|`` to an accumulated error;
    the step is skipped while that error is <= ``threshold``, the consecutive count is <=
    ``max_skip_steps`` and a residual exists (a full step ran before); otherwise it runs in
    full and the accumulators reset. Steps past the ratio list use ratio 1.0, as there.
    """
    retention_step = int(retention_ratio * num_steps + 0.5)
    acc_ratio, acc_err, acc_steps, has_residual = 1.0, 0.0, 0, False
    out = []
    for step in range(num_steps):
        skip = False
        if step >= retention_step:
            acc_ratio *= ratios[step] if step < len(ratios) else 1.0
            acc_steps += 1
            acc_err += abs(1.0 - acc_ratio)
            if has_residual and acc_err <= threshold and acc_steps <= max_skip_steps:
                skip = True
            else:
                acc_ratio, acc_err, acc_steps = 1.0, 0.0, 0
        has_residual = has_residual or not skip
        out.append(skip)
    return tuple(out)
