"""Each pipeline's verdict against the baseline, per headline score, and the tuned choice's optimism.

A verdict is the paired mean difference over seeds with two 95% intervals: the t interval over seeds (the seeds are
the replicates: what another run of the same comparison would find on these clients; exact for normal differences
however few the seeds) and a hierarchical bootstrap over seeds and clients (what it would find on other clients
like these; crossed when every seed has one federation, nested when each seed draws its own). Each misses what the
other holds: with few seeds a bootstrap cannot reach past the seeds it saw, and the t over seeds knows nothing of
the clients (tests/test_stats.py measures both). The m pipelines other than the baseline are one family per score,
adjusted by Holm's step-down at ALPHA on the larger of the two p-values, each interval made at its Holm level
(intervals.holm_levels). `resolved`: Holm rejects "no difference", so that both adjusted intervals exclude 0, on the
same side. Where the per-client values are unrecorded, or the score is no per-client statistic, the bootstrap is
missing and the t decides alone; with one seed nothing is resolved."""

from __future__ import annotations

import math

import numpy as np

from fedpilot.metric_names import QUANTILES, scores_of
from fedpilot.stats.intervals import (
    ALPHA,
    BOOTSTRAP_DRAWS,
    BOOTSTRAP_SEED,
    POWER,
    Interval,
    Statistic,
    bootstrap_interval,
    bootstrap_pvalue,
    crossed_draws,
    holm,
    holm_levels,
    nested_draws,
    seeds_needed,
    t_interval,
    t_pvalue,
)
from fedpilot.stats.scores import Scores, Values, client_matrix, in_points, paired, paired_clients, sd

DIFFERENCE = 0.005  # 0.5 percentage points: the difference whose seeds a comparison of accuracy says it needs
NAN = float("nan")


def method(metric: str, pipelines: int, crossed: bool) -> dict[str, object]:
    """How the verdicts were made, as comparison.json records it."""
    clients = ("crossed: the clients resampled once per draw, the same on every resampled seed" if crossed else
               "nested: the clients resampled within each resampled seed")
    return {"alpha": ALPHA, "family": pipelines, "adjustment": "Holm step-down over the pipelines other than the "
            "baseline, per headline score, on the larger of the t and the bootstrap p-value",
            "t": "paired t over seeds", "bootstrap": f"hierarchical over seeds and clients, {clients}; percentile, "
            f"{BOOTSTRAP_DRAWS} draws, seed {BOOTSTRAP_SEED}", "resolved": "Holm rejects: both adjusted intervals "
            "exclude 0, on the same side",
            "seeds_needed": f"paired t at level alpha / {max(pipelines, 1)} with power {POWER} against a difference of "
            f"{DIFFERENCE if in_points(metric) else NAN} at the measured sd of the paired differences"}


def statistic(score: str) -> Statistic | None:
    """The per-client statistic a headline score is (`test_acc_mean`: the mean; `_p10`: the 10th percentile, as the
    engine computes it), over the last axis; None for another."""
    stat = score.rsplit("_", 1)[-1]
    if stat == "mean":
        return lambda values: values.mean(axis=-1)
    if stat in QUANTILES:
        return lambda values: np.percentile(values, QUANTILES[stat], axis=-1)
    return None


def verdicts(scores: Scores, values: Values, baseline: str, metric: str,
             crossed: bool) -> dict[str, dict[str, dict[str, float]]]:
    """Per headline score, per pipeline other than the baseline with a seed both have: its verdict (the module's
    docstring), a row of plain numbers. `crossed`: every seed has the same federation (clients known by name)."""
    pipelines = [p for p in scores if p != baseline]
    found = {}
    for score in scores_of(metric)[0]:
        tests = {p: _tested(scores, values, p, baseline, score, crossed) for p in pipelines}
        found[score] = _adjusted({p: t for p, t in tests.items() if len(t[0])}, len(pipelines), metric)
    return found


def _tested(scores: Scores, values: Values, pipeline: str, baseline: str, score: str,
            crossed: bool) -> tuple[np.ndarray, np.ndarray | None, int]:
    """A pipeline's paired differences on `score`, its bootstrap draws (None without two seeds or per-client values)
    and the clients they resampled (per seed: the median)."""
    diffs = paired(scores, pipeline, baseline, score)
    seeds = sorted(s for s in scores[pipeline] if score in scores[pipeline][s] and score in scores[baseline].get(s, {}))
    stat = statistic(score)
    if stat is None or len(seeds) < 2 or pipeline not in values or baseline not in values:
        return diffs, None, 0
    if crossed:
        ours, theirs = client_matrix(values, pipeline, baseline, seeds)
        return (diffs, crossed_draws(ours, theirs, stat), ours.shape[1]) if ours.shape[1] else (diffs, None, 0)
    pairs = paired_clients(values, pipeline, baseline, seeds)
    if not all(len(ours) for ours, _ in pairs):
        return diffs, None, 0
    return diffs, nested_draws(pairs, stat), int(np.median([len(ours) for ours, _ in pairs]))


def _adjusted(tests: dict, family: int, metric: str) -> dict[str, dict[str, float]]:
    """The rows of one score's family: Holm over the `family` pipelines (one without a common seed still counts)."""
    p_t = {p: t_pvalue(diffs) for p, (diffs, _, _) in tests.items()}
    p_boot = {p: bootstrap_pvalue(draws) if draws is not None else NAN for p, (_, draws, _) in tests.items()}
    p_both = [_larger(p_t[p], p_boot[p]) for p in tests]
    padded = p_both + [NAN] * (family - len(p_both))
    adjusted, levels = holm(padded), holm_levels(padded)
    rows = {}
    for i, (p, (diffs, draws, clients)) in enumerate(tests.items()):
        rows[p] = {"seeds": len(diffs), "clients": clients,
                   "diff_mean": float(diffs.mean()), "diff_sd": sd(diffs), "p_t": p_t[p], "p_boot": p_boot[p],
                   "p": p_both[i], "p_holm": adjusted[i], "level": levels[i], **_intervals(diffs, draws, levels[i])}
        ends = [rows[p][k] for k in ("t_holm_low", "t_holm_high", "boot_holm_low", "boot_holm_high")
                if draws is not None or k.startswith("t_")]
        rows[p]["resolved"] = bool(adjusted[i] <= ALPHA and (all(e > 0 for e in ends) or all(e < 0 for e in ends)))
        rows[p]["seeds_needed"] = seeds_needed(sd(diffs), DIFFERENCE, ALPHA / family) if in_points(metric) else None
    return rows


def _larger(p_t: float, p_boot: float) -> float:
    """The p-value a verdict is adjusted on: the larger of the two (none without the t's two seeds)."""
    if not math.isfinite(p_t):
        return NAN
    return max(p_t, p_boot) if math.isfinite(p_boot) else p_t


def _intervals(diffs: np.ndarray, draws: np.ndarray | None, level: float) -> dict[str, float]:
    """The t and bootstrap intervals at 95% and at the comparison's Holm `level` (NaN without draws)."""
    t95, t_holm = t_interval(diffs), t_interval(diffs, level)
    ends = {"t_low": t95.low, "t_high": t95.high, "t_holm_low": t_holm.low, "t_holm_high": t_holm.high}
    boot95, boot_holm = ((bootstrap_interval(draws), bootstrap_interval(draws, level)) if draws is not None
                         else (Interval(NAN, NAN), Interval(NAN, NAN)))
    return ends | {"boot_low": boot95.low, "boot_high": boot95.high, "boot_holm_low": boot_holm.low,
                   "boot_holm_high": boot_holm.high}


def optimism(best: float, reruns: list[float], maximize: bool) -> dict[str, float]:
    """The winner's curse of a tuned choice: its objective on the tuning seeds (`best`, the study's) against the
    same objective of its reruns on the comparison seeds (`reruns`). `optimism` is best minus each rerun, counted
    the way that is better (positive: the tuning seeds flattered the choice), its mean and 95% t interval over the
    comparison seeds (the tuning seeds' own noise is not in it: `best` is one number)."""
    sign = 1.0 if maximize else -1.0
    gaps = sign * (best - np.asarray(reruns, dtype=float))
    ci = t_interval(gaps)
    return {"tuning": best, "comparison": float(np.mean(reruns)) if len(reruns) else NAN,
            "optimism": float(gaps.mean()) if len(gaps) else NAN, "low": ci.low, "high": ci.high,
            "seeds": len(gaps)}
