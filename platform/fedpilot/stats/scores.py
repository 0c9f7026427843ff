"""A comparison's scores over seeds: per pipeline the mean and sd of each score, the paired differences with the
baseline on the same seed, and how far one test sample moves a score."""

from __future__ import annotations

import numpy as np

Scores = dict[str, dict[int, dict[str, float]]]  # pipeline -> seed -> score -> value
Values = dict[str, dict[int, dict[str, float]]]  # pipeline -> seed -> client name -> per-client test value


def summarize(scores: Scores, baseline: str, higher: bool = True) -> dict[str, dict[str, float]]:
    """Per pipeline and score it has on every one of its seeds: mean and sd over seeds, and for a pipeline other than
    the baseline, where the baseline has the score on those seeds too, the paired difference (mean, sd, the fractions
    of seeds on which the pipeline is better and worse, `higher` saying which way is better; the rest are ties)."""
    summary = {}
    for name, by_seed in scores.items():
        seeds = sorted(by_seed)
        row: dict[str, float] = {}
        for score in [s for s in by_seed[seeds[0]] if all(s in by_seed[seed] for seed in seeds)] if seeds else []:
            values = np.array([by_seed[s][score] for s in seeds])
            row.update({f"{score}.mean": float(values.mean()), f"{score}.sd": sd(values)})
            if name != baseline and all(score in scores[baseline].get(s, {}) for s in seeds):
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


def paired_clients(values: Values, name: str, baseline: str, seeds: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per seed of `seeds`, the per-client values of `name` and of the baseline for the clients both have a value
    for on that seed, matched by the client's name (in name order)."""
    pairs = []
    for seed in seeds:
        ours, theirs = values[name].get(seed, {}), values[baseline].get(seed, {})
        both = sorted(c for c in ours if c in theirs and np.isfinite(ours[c]) and np.isfinite(theirs[c]))
        pairs.append((np.array([ours[c] for c in both]), np.array([theirs[c] for c in both])))
    return pairs


def client_matrix(values: Values, name: str, baseline: str, seeds: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The per-client values of `name` and of the baseline as [seeds, clients], for the clients (by name) both have a
    value for on every one of `seeds` (in name order): one federation seen on every seed."""
    common = None
    for seed in seeds:
        ours, theirs = values[name].get(seed, {}), values[baseline].get(seed, {})
        both = {c for c in ours if c in theirs and np.isfinite(ours[c]) and np.isfinite(theirs[c])}
        common = both if common is None else common & both
    clients = sorted(common or ())
    return (np.array([[values[name][s][c] for c in clients] for s in seeds]).reshape(len(seeds), len(clients)),
            np.array([[values[baseline][s][c] for c in clients] for s in seeds]).reshape(len(seeds), len(clients)))


def sd(values: np.ndarray) -> float:
    """Sample standard deviation over seeds (NaN with one seed)."""
    return float(values.std(ddof=1)) if len(values) > 1 else float("nan")


def in_points(metric: str) -> bool:
    """Whether the per-client `metric` is a fraction of test samples (accuracy), shown in percentage points."""
    return metric == "acc"


def sample_steps(test_sizes: list[int], metric: str) -> dict[str, float]:
    """For a metric counted in test samples (accuracy), how far one test sample moves a client's value (the median
    client's) and the mean over clients (that client's sample in a mean over every client); NaN otherwise."""
    if not (in_points(metric) and len(test_sizes) > 0 and min(test_sizes) > 0):
        return {"client": float("nan"), "mean": float("nan")}
    client = 1 / float(np.median(test_sizes))
    return {"client": client, "mean": client / len(test_sizes)}
