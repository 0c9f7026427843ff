"""Summaries of per-client metrics: the distribution, not only the mean."""

from __future__ import annotations

import torch

from fedpilot.metric_names import QUANTILES


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
