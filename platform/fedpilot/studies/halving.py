"""Successive halving inside a wave of trials: numbers in, decisions out (the search applies them, tuning.py).

A wave's trials train the same rounds side by side, so they can be judged together as they go (a synchronous rule,
Jamieson and Talwalkar, AISTATS 2016; Li et al., JMLR 2018): at rungs a ninth and a third of the way through the
searched stages' rounds (eta = 3: the rungs at 1/eta^2 and 1/eta), the best third of the trials still training go
on, judged on their latest validation evaluation. A trial within the noise-aware margin of the best one
(studies/pruner.py `seed_margin`: twice the noise between two seeds of one configuration) goes on too: the
evaluation cannot tell it from the best, and an early judgement already prefers small step sizes (Wu et al., ICLR
2018). Without a margin there is no halving."""

from __future__ import annotations

import math
from collections.abc import Mapping

ETA = 3  # a rung keeps the best 1/ETA of the trials, at 1/ETA^2 and 1/ETA of the searched rounds


def rung_steps(before: int, searched: int, eta: int = ETA) -> list[int]:
    """The rungs, as steps counted in rounds across the pipeline (`before`: the rounds of the stages before the
    searched ones; `searched`: theirs): at 1/eta^2 and 1/eta of the searched rounds (at least one round in), those
    before the searched stages' last round (a judgement at the end prunes nothing the study would not see)."""
    steps = sorted({before + max(1, math.ceil(searched / eta**power)) for power in (2, 1)})
    return [step for step in steps if step < before + searched]


def losers(values: Mapping[int, float], margin: float, maximize: bool, eta: int = ETA) -> list[int]:
    """The trials a rung drops, given each live trial's latest validation value (by trial): all but the best
    ceil(n / eta), save those within `margin` of the best one; a value that is not finite (a trial that has not
    evaluated, or diverged) is the worst. In trial order."""
    sign = 1.0 if maximize else -1.0
    score = {k: sign * v if math.isfinite(v) else -math.inf for k, v in values.items()}
    ranked = sorted(score, key=lambda k: (-score[k], k))
    kept = set(ranked[:math.ceil(len(ranked) / eta)])
    best = score[ranked[0]] if ranked else -math.inf
    near = {k for k in ranked if math.isfinite(score[k]) and best - score[k] <= margin}
    return sorted(k for k in ranked if k not in kept and k not in near)


def due(rungs: list[int], passed: int, step: int) -> int:
    """How many of `rungs` an evaluation at `step` has reached; a rung is judged at the first evaluation at or
    after it, and rungs one evaluation reaches together are judged once (the same values, judged again, would only
    cut deeper). `passed`: the rungs judged before. Returns the new count of rungs passed (> `passed`: judge now)."""
    return max(passed, sum(rung <= step for rung in rungs))
