"""Pruning that respects the noise and waits for slow starters.

A trial is pruned at an evaluation when it is worse than the finished trials' median at the same round by more than
a margin, and only past the round at which the finished trials' curves stop crossing. The margin is twice the
root-mean-square difference between two seeds' evaluations of one configuration (trial 0 trains a second seed to
measure it, `Search`): the objective's noise between seeds, measured on the study's own searched stages, so the
order of a set's pipelines changes nothing (a shared stage reports no evaluation). Early judgement prefers small
step sizes (the short-horizon bias of Wu et al., ICLR 2018): the crossing rule keeps a configuration that starts
slowly while a finished one has been seen to overtake the others late."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

CURVES = "curves"  # a trial's user attribute: per seed, its [[step, value], ...] of the objective's evaluations


class MarginPruner(optuna.pruners.BasePruner):
    """Optuna's median rule with a margin for the noise: at an evaluation past `warmup` rounds and past the round
    at which the finished trials' curves settle (`settled_step`), once `startup` trials have finished, a trial is
    pruned when its value is worse than the median of the finished trials' values at the same round by more than
    `margin`. `margin=None`: twice the noise between seeds (`seed_margin`), and no pruning before it is measured."""

    def __init__(self, startup: int, warmup: int, margin: float | None):
        self.startup, self.warmup, self.margin = startup, warmup, margin

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        step = trial.last_step
        finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if step is None or step < self.warmup or len(finished) < self.startup:
            return False
        margin = self.margin if self.margin is not None else seed_margin(study.get_trials(deepcopy=False))
        others = [t.intermediate_values[step] for t in finished if step in t.intermediate_values]
        if not others or margin is None or step <= settled_step(finished, margin):
            return False
        gap = float(np.median(others)) - trial.intermediate_values[step]
        return (gap if study.direction == optuna.study.StudyDirection.MAXIMIZE else -gap) > margin


def seed_margin(trials: list[FrozenTrial], least: int = 3) -> float | None:
    """Twice the root-mean-square difference between two seeds' evaluations of the same configuration at the same
    round, pooled over the trials that trained several seeds (their `curves`); None with fewer than `least`
    differences."""
    differences = [a[step] - b[step] for t in trials for a, b in itertools.combinations(_curves(t), 2)
                   for step in sorted(a.keys() & b.keys())]
    finite = np.array([d for d in differences if math.isfinite(d)])
    return None if len(finite) < least else 2 * float(np.sqrt(np.mean(finite**2)))


def _curves(trial: FrozenTrial) -> list[dict[int, float]]:
    return [{int(step): float(value) for step, value in curve} for curve in trial.user_attrs.get(CURVES, {}).values()]


def settled_step(finished: list[FrozenTrial], margin: float) -> int:
    """The last round at which two finished trials whose final evaluations differ by more than `margin` were in the
    other order (their curves crossed after it no more); -1 where none did."""
    last = -1
    for a, b in itertools.combinations(finished, 2):
        steps = sorted(a.intermediate_values.keys() & b.intermediate_values.keys())
        if not steps:
            continue
        gaps = [a.intermediate_values[s] - b.intermediate_values[s] for s in steps]
        if abs(gaps[-1]) <= margin:
            continue
        crossed = [s for s, gap in zip(steps, gaps, strict=True) if gap * gaps[-1] < 0]
        last = max([last, *crossed])
    return last


def curve_attr(curves: dict[int, list[tuple[int, float]]]) -> dict[str, Any]:
    """Per seed evaluations as a trial's user attribute (JSON: string keys, [step, value] pairs)."""
    return {str(seed): [[int(step), float(value)] for step, value in curve] for seed, curve in curves.items()}
