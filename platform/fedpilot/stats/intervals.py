"""Confidence intervals of a paired difference, Holm's step-down adjustment for several of them, and the seeds a
difference needs. Each interval comes with the two-sided p-value of "no difference" that it is the dual of: the
interval at level `alpha` excludes 0 exactly when p <= alpha, so that an adjusted interval and an adjusted test say
the same thing."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from scipy import stats

ALPHA = 0.05  # 95% intervals; the familywise error rate of a set's verdicts
BOOTSTRAP_DRAWS = 9999  # B + 1 = 10,000: the order statistics of the intervals fall on whole ranks
BOOTSTRAP_SEED = 0  # the same records give the same table
POWER = 0.8
MOST_SEEDS = 10**6  # seeds_needed answers None beyond this


@dataclass(frozen=True)
class Interval:
    low: float
    high: float


def t_pvalue(diffs: np.ndarray) -> float:
    """Two-sided p-value of a zero mean of the paired differences `diffs` (one-sample t over seeds; NaN with fewer
    than two; with no spread at all, 1 for differences all 0 and 0 otherwise)."""
    if len(diffs) < 2:
        return float("nan")
    if np.ptp(diffs) == 0:
        return 1.0 if diffs[0] == 0 else 0.0
    return float(stats.ttest_1samp(diffs, 0.0).pvalue)


def t_interval(diffs: np.ndarray, alpha: float = ALPHA) -> Interval:
    """The (1 - alpha) t interval of the mean of `diffs`: mean ± t(1 - alpha/2, n - 1) sd / sqrt(n)."""
    if len(diffs) < 2 or not math.isfinite(alpha):
        return Interval(float("nan"), float("nan"))
    if np.ptp(diffs) == 0:
        return Interval(float(diffs[0]), float(diffs[0]))
    low, high = stats.ttest_1samp(diffs, 0.0).confidence_interval(1 - alpha)
    return Interval(float(low), float(high))


Statistic = Callable[[np.ndarray], np.ndarray]  # the score of each row of [draws, clients] values


def nested_draws(pairs: list[tuple[np.ndarray, np.ndarray]], statistic: Statistic, draws: int = BOOTSTRAP_DRAWS,
                 seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """A hierarchical bootstrap of the mean over seeds of a paired difference when each seed has clients of its own
    (a federation redrawn per seed: clients nested in seeds): `pairs` holds per seed the values of the pipeline and
    of the baseline on the same clients (matched). Each draw resamples the seeds with replacement, then within each
    resampled seed its clients with replacement (the same clients for both, so the pairing holds), and scores the
    difference of `statistic` over the resampled clients, averaged over the resampled seeds."""
    rng = np.random.default_rng(seed)
    picks = rng.integers(len(pairs), size=(draws, len(pairs)))
    total = np.zeros(draws)
    for index, (ours, theirs) in enumerate(pairs):
        rows = np.nonzero(picks == index)[0]  # one row per (draw, slot) that drew this seed
        clients = rng.integers(len(ours), size=(len(rows), len(ours)))
        np.add.at(total, rows, statistic(ours[clients]) - statistic(theirs[clients]))
    return total / len(pairs)


def crossed_draws(ours: np.ndarray, theirs: np.ndarray, statistic: Statistic, draws: int = BOOTSTRAP_DRAWS,
                  seed: int = BOOTSTRAP_SEED) -> np.ndarray:
    """A hierarchical bootstrap of the mean over seeds of a paired difference when every seed has the same clients
    (one federation for every seed: clients crossed with seeds): `ours` and `theirs` are [seeds, clients], matched.
    Each draw resamples the clients once and the seeds, and scores every resampled seed on the same resampled
    clients: a client's own effect counts once, however many seeds see it (resampling the clients afresh within
    each seed would count it as seeds-many independent ones and make the interval too narrow)."""
    rng = np.random.default_rng(seed)
    n, k = ours.shape
    picks = rng.integers(n, size=(draws, n))
    clients = rng.integers(k, size=(draws, k))
    total = np.zeros(draws)
    for index in range(n):
        total += (picks == index).sum(axis=1) * (statistic(ours[index][clients]) - statistic(theirs[index][clients]))
    return total / n


def _rank(draws: np.ndarray, alpha: float) -> int:
    """How many draws each tail of a (1 - alpha) interval leaves out and past: k = floor(alpha (B + 1) / 2)."""
    return math.floor(alpha * (len(draws) + 1) / 2)


def bootstrap_interval(draws: np.ndarray, alpha: float = ALPHA) -> Interval:
    """The (1 - alpha) percentile interval of bootstrap `draws`: the k-th smallest and k-th largest draws (infinite
    where alpha is too small for the draws)."""
    k = _rank(draws, alpha) if math.isfinite(alpha) else 0
    if k < 1:
        return Interval(-math.inf, math.inf)
    ordered = np.sort(draws)
    return Interval(float(ordered[k - 1]), float(ordered[-k]))


def bootstrap_pvalue(draws: np.ndarray) -> float:
    """Two-sided p-value of "no difference" from bootstrap `draws`: 2 min(#{d <= 0} + 1, #{d >= 0} + 1) / (B + 1),
    capped at 1, the dual of bootstrap_interval (its interval at level p' excludes 0 exactly when p <= p')."""
    tail = min(int((draws <= 0).sum()), int((draws >= 0).sum())) + 1
    return min(1.0, 2 * tail / (len(draws) + 1))


def holm(pvalues: list[float]) -> list[float]:
    """Holm's (1979) step-down adjusted p-values, in the order given: ranked i = 1..m by p (ascending),
    p~(i) = max over j <= i of min(1, (m - j + 1) p(j)); a NaN p (no test) counts as 1."""
    p = np.nan_to_num(np.asarray(pvalues, dtype=float), nan=1.0)
    m, order = len(p), np.argsort(p, kind="stable")
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    result = np.empty(m)
    result[order] = adjusted
    return result.tolist()


def holm_levels(pvalues: list[float], alpha: float = ALPHA) -> list[float]:
    """The level at which each comparison's interval is made, compatible with Holm's step-down at `alpha`: ranked i
    by p, a rejected comparison's level is alpha / (m - i + 1), the one its step tested it at; once the step-down
    stops after k rejections, every other's is alpha / (m - k), the level at which it stopped (so an adjusted
    interval excludes 0 exactly when Holm rejects)."""
    adjusted = holm(pvalues)
    p = np.nan_to_num(np.asarray(pvalues, dtype=float), nan=1.0)
    m, order = len(p), np.argsort(p, kind="stable")
    rejected = sum(adjusted[i] <= alpha for i in order)
    levels = np.empty(m)
    for rank, i in enumerate(order):
        levels[i] = alpha / (m - min(rank, rejected))
    return levels.tolist()


def t_power(seeds: int, effect: float, alpha: float) -> float:
    """The power of the two-sided paired t test at level `alpha` over `seeds` seeds against a true mean difference of
    `effect` sd's (Cohen's d): P(|T| > t(1 - alpha/2, n - 1)) for T noncentral t with n - 1 degrees of freedom and
    noncentrality effect sqrt(n)."""
    df, shift = seeds - 1, effect * math.sqrt(seeds)
    critical = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(critical, df, shift) + stats.nct.cdf(-critical, df, shift))


def seeds_needed(sd: float, difference: float, alpha: float, power: float = POWER) -> int | None:
    """The fewest seeds (at least 2) whose paired t test at level `alpha` finds a true mean difference `difference`
    with probability `power`, if the paired differences are normal with standard deviation `sd` (the measured one
    taken as the truth); None where sd is unknown or it takes more than MOST_SEEDS."""
    if not math.isfinite(sd) or not math.isfinite(alpha):
        return None
    if sd == 0:
        return 2
    effect, low, high = abs(difference) / sd, 2, MOST_SEEDS
    if t_power(high, effect, alpha) < power:
        return None
    while low < high:  # the power grows with the seeds: the first that reaches it, by bisection
        middle = (low + high) // 2
        low, high = (middle + 1, high) if t_power(middle, effect, alpha) < power else (low, middle)
    return low

