"""The summary of a tuning study: how its best value grew with the trials, how its objective spread over them, and
what it chose. A plain dataclass, recorded in comparison.json and read back by the report."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np


@dataclass
class StudySummary:
    """A tuning study over its first `trials` finished trials (by number): the objective of each completed one, the
    best value so far after each finished trial (NaN before the first completed), how many were pruned, the chosen
    values and their objective, whether the best still improved in the last quarter of the trials (the budget may
    have been short), and the objective's spread over completed trials (p10 / p50 / p90: how much the method's
    result depends on its settings). `stages`: the tuned pipeline's stage names, which label the chosen keys
    (stats.keys)."""

    study: str
    trials: int
    pruned: int
    values: list[float]
    best_so_far: list[float]
    chosen: dict[str, float | int | str]
    best: float
    improving_late: bool
    p10: float
    p50: float
    p90: float
    stages: list[str] = field(default_factory=list)
    trial_values: list[float | None] = field(default_factory=list)  # each finished trial's objective, None: pruned

    def to_json(self) -> dict:
        return asdict(self)


def study_summary(study: str, finished: list[tuple[float | None, dict]], maximize: bool,
                  stages: list[str] | None = None) -> StudySummary:
    """The summary of a study from its finished trials in number order: (objective, params) each, the objective
    None for a pruned (or diverged) trial; `stages` the tuned pipeline's stage names."""
    sign = 1.0 if maximize else -1.0
    best_so_far, best, chosen = [], -math.inf, {}
    for value, params in finished:
        if value is not None and math.isfinite(value) and sign * value > best:
            best, chosen = sign * value, params
        best_so_far.append(sign * best if math.isfinite(best) else float("nan"))
    values = [v for v, _ in finished if v is not None and math.isfinite(v)]
    last_quarter = max(1, math.ceil(len(finished) / 4))
    before = best_so_far[-last_quarter - 1] if len(finished) > last_quarter else float("nan")
    improving = bool(values) and (not math.isfinite(before) or sign * best_so_far[-1] > sign * before)
    p10, p50, p90 = (float(q) for q in np.percentile(values, [10, 50, 90])) if values else (float("nan"),) * 3
    return StudySummary(study, len(finished), len(finished) - len(values), values, best_so_far, chosen,
                        sign * best if math.isfinite(best) else float("nan"), improving, p10, p50, p90,
                        list(stages or []), [v if v is not None and math.isfinite(v) else None for v, _ in finished])
