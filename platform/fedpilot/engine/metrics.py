"""Summaries of per-client metrics: the distribution, not only the mean."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedpilot.metric_names import COHORT, COHORT_STATS, QUANTILES

if TYPE_CHECKING:
    from fedpilot.engine.bank import ClientBank


def distribution(values: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """The statistics of fedpilot.metric_names.STATS (mean, sample-weighted mean, std, min, quantiles, max) over the
    clients with data (not NaN)."""
    keep = ~torch.isnan(values)
    v, w = values[keep].double(), weights[keep].double()
    if len(v) == 0:
        return {}
    stats = {
        "mean": v.mean(),
        "weighted": (v * w).sum() / w.sum(),
        "std": v.std(unbiased=False),
        "min": v.min(),
        **{name: torch.quantile(v, percent / 100) for name, percent in QUANTILES.items()},
        "max": v.max(),
    }
    return {k: float(x) for k, x in stats.items()}


def summarize(name: str, scores: dict[str, torch.Tensor], weights: torch.Tensor,
              distributions: tuple[str, ...]) -> dict[str, float]:
    """`{name}_{metric}_{stat}` of per-client `scores` (name: a split, or a prefixed one such as novel_test): every
    statistic for the metrics in `distributions`, the sample-weighted mean for the others."""
    summary = {}
    for metric, values in scores.items():
        stats = distribution(values, weights)
        shown = stats if metric in distributions else {"weighted": stats.get("weighted")}
        summary.update({f"{name}_{metric}_{k}": v for k, v in shown.items() if v is not None})
    return summary


def cohort_spread(state: ClientBank, clients: torch.Tensor) -> dict[str, float]:
    """The spread over a round's cohort `clients` of each per-client scalar of the algorithm's `state` (Self-FL's
    steps, pFedGate's densities), as `cohort_{name}_{stat}` (under DDP every process has the whole cohort's rows)."""
    if not any(v.dim() == 0 for v in state.init.values()):  # no per-client scalar: no gather
        return {}
    rows = state.get(clients.cpu())
    percents = torch.tensor(list(COHORT_STATS.values()), dtype=torch.float64) / 100
    return {f"{COHORT}_{name}_{stat}": float(q) for name, values in rows.items() if values.dim() == 1
            for stat, q in zip(COHORT_STATS, torch.quantile(values.double(), percents), strict=True)}
