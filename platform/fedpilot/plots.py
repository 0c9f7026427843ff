"""Figures of per-client accuracy: a histogram per stage, CDFs comparing stages, a before/after scatter."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def accuracy_histogram(stage: str, acc: np.ndarray, previous: tuple[str, np.ndarray] | None = None,
                       split: str = "test") -> Figure:
    """Histogram of per-client accuracy of one stage, with the previous stage's outlined behind it."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    bins = np.linspace(0, 1, 21)
    if previous is not None:
        ax.hist(_finite(previous[1]), bins=bins, histtype="step", lw=2, color="grey", label=previous[0])
    ax.hist(_finite(acc), bins=bins, alpha=0.7, color="tab:blue", label=stage)
    ax.axvline(float(np.nanmean(acc)), color="tab:blue", ls="--", label=f"mean {np.nanmean(acc):.3f}")
    ax.set(xlabel=f"per-client {split} accuracy", ylabel="clients", title=f"{stage}: {split} accuracy per client")
    ax.legend()
    fig.tight_layout()
    return fig


def accuracy_cdf(stages: dict[str, np.ndarray], split: str = "test") -> Figure:
    """Empirical CDF of per-client accuracy, one line per stage (lower-left = more clients doing badly)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for name, acc in stages.items():
        values = np.sort(_finite(acc))
        ax.step(values, np.arange(1, len(values) + 1) / max(len(values), 1), where="post",
                label=f"{name} (p10 {np.percentile(values, 10):.3f})" if len(values) else name)
    ax.set(xlabel=f"per-client {split} accuracy", ylabel="fraction of clients", xlim=(0, 1), ylim=(0, 1),
           title=f"CDF of per-client {split} accuracy by stage")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def before_after(before: tuple[str, np.ndarray], after: tuple[str, np.ndarray], split: str = "test") -> Figure:
    """Each client's accuracy before (x) and after (y) a stage; points above the diagonal improved."""
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    x, y = before[1], after[1]
    better = y > x
    ax.scatter(x[better], y[better], s=14, color="tab:green", label=f"better ({better.sum()})")
    ax.scatter(x[~better], y[~better], s=14, color="tab:red", label=f"not better ({(~better).sum()})")
    ax.plot([0, 1], [0, 1], color="grey", lw=1)
    ax.set(xlabel=f"{before[0]} {split} accuracy", ylabel=f"{after[0]} {split} accuracy", xlim=(0, 1.02),
           ylim=(0, 1.02), title=f"per-client {split} accuracy: {before[0]} -> {after[0]}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig
