"""The statistics of a comparison: per pipeline the mean and sd over seeds of each score and the paired difference
with the baseline on the same seed, the resolution of the set, and the summary of a tuning study (how its best value
grew with the trials, how its objective spread over them). Plain numbers in, plain numbers out: the comparison, its
report and its table read them alike."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

Scores = dict[str, dict[int, dict[str, float]]]  # pipeline -> seed -> score -> value


def summarize(scores: Scores, baseline: str, higher: bool = True) -> dict[str, dict[str, float]]:
    """Per pipeline and score it has on every one of its seeds: mean and sd over seeds, and where the baseline has
    it on those seeds too, the paired difference (mean, sd, the fractions of seeds on which the pipeline is better and
    worse, `higher` saying which way is better; the rest are ties)."""
    summary = {}
    for name, by_seed in scores.items():
        seeds = sorted(by_seed)
        row: dict[str, float] = {}
        for score in [s for s in by_seed[seeds[0]] if all(s in by_seed[seed] for seed in seeds)] if seeds else []:
            values = np.array([by_seed[s][score] for s in seeds])
            row.update({f"{score}.mean": float(values.mean()), f"{score}.sd": sd(values)})
            if all(score in scores[baseline].get(s, {}) for s in seeds):
                diffs = paired(scores, name, baseline, score)
                gains = diffs if higher else -diffs
                row.update({f"{score}.diff_mean": float(diffs.mean()), f"{score}.diff_sd": sd(diffs),
                            f"{score}.better": float((gains > 0).mean()), f"{score}.worse": float((gains < 0).mean())})
        summary[name] = row
    return summary


def paired(scores: Scores, name: str, baseline: str, score: str) -> np.ndarray:
    """`name`'s `score` minus the baseline's on each seed both have, in seed order."""
    seeds = sorted(s for s in scores[name] if score in scores[name][s] and score in scores[baseline].get(s, {}))
    return np.array([scores[name][s][score] - scores[baseline][s][score] for s in seeds])


def sd(values: np.ndarray) -> float:
    """Sample standard deviation over seeds (NaN with one seed)."""
    return float(values.std(ddof=1)) if len(values) > 1 else float("nan")


def resolution(summary: dict[str, dict[str, float]], baseline: str, test_sizes: list[int],
               metric: str) -> dict[str, float]:
    """The smallest difference of the mean test `metric` the set can tell from noise: twice the sd over seeds of
    the paired differences with the baseline (median and largest over the pipelines; NaN with one seed), and for a
    metric counted in samples (accuracy) the step one test sample makes: a client's (median client) and the mean
    over clients' (the median client's sample in a mean over every client). `smallest` is the larger of the median
    paired 2 sd and the mean's step."""
    score = f"test_{metric}_mean.diff_sd"
    spreads = [2 * row[score] for name, row in summary.items()
               if name != baseline and np.isfinite(row.get(score, np.nan))]
    paired_2sd = float(np.median(spreads)) if spreads else float("nan")
    counted = metric == "acc" and len(test_sizes) > 0 and min(test_sizes) > 0
    client_step = 1 / float(np.median(test_sizes)) if counted else float("nan")
    mean_step = client_step / len(test_sizes) if counted else float("nan")
    smallest = float(np.nanmax([paired_2sd, mean_step])) if spreads or counted else float("nan")
    return {"paired_2sd": paired_2sd, "paired_2sd_max": float(max(spreads)) if spreads else float("nan"),
            "client_step": client_step, "mean_step": mean_step, "smallest": smallest}


@dataclass
class StudySummary:
    """A tuning study over its first `trials` finished trials (by number): the objective of each completed one, the
    best value so far after each finished trial (NaN before the first completed), how many were pruned, the chosen
    values and their objective, whether the best still improved in the last quarter of the trials (the budget may
    have been short), and the objective's spread over completed trials (p10 / p50 / p90: how much the method's
    result depends on its settings)."""

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

    def to_json(self) -> dict:
        return asdict(self)


def study_summary(study: str, finished: list[tuple[float | None, dict]], maximize: bool) -> StudySummary:
    """The summary of a study from its finished trials in number order: (objective, params) each, the objective
    None for a pruned (or diverged) trial."""
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
                        sign * best if math.isfinite(best) else float("nan"), improving, p10, p50, p90)
