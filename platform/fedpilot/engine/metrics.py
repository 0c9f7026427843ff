"""Summaries of per-client metrics: the distribution, not only the mean."""

from __future__ import annotations

import torch

QUANTILES = {"p10": 0.10, "p25": 0.25, "p50": 0.50, "p75": 0.75, "p90": 0.90}


def distribution(values: torch.Tensor, weights: torch.Tensor) -> dict[str, float]:
    """mean, sample-weighted mean, std, min, p10, p25, p50, p75, p90, max over clients with data (not NaN)."""
    keep = ~torch.isnan(values)
    v, w = values[keep].double(), weights[keep].double()
    if len(v) == 0:
        return {}
    stats = {
        "mean": v.mean(),
        "weighted": (v * w).sum() / w.sum(),
        "std": v.std(unbiased=False),
        "min": v.min(),
        **{name: torch.quantile(v, q) for name, q in QUANTILES.items()},
        "max": v.max(),
    }
    return {k: float(x) for k, x in stats.items()}
