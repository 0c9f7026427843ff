"""Figures of per-client accuracy: a histogram per stage, CDFs comparing stages, a before/after scatter."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only, never a window

import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from fedpilot.metric_names import metric_label  # noqa: E402


def _finite(values: np.ndarray) -> np.ndarray:
    return values[np.isfinite(values)]


def _bins(*values: np.ndarray, metric: str) -> np.ndarray:
    """20 bins over [0, 1] for accuracy, else over the values' range."""
    if metric == "acc":
        return np.linspace(0, 1, 21)
    finite = _finite(np.concatenate([np.ravel(v) for v in values]))
    high = float(finite.max()) if len(finite) else 1.0
    return np.linspace(0, high if high > 0 else 1.0, 21)


def accuracy_histogram(stage: str, acc: np.ndarray, previous: tuple[str, np.ndarray] | None = None,
                       split: str = "test", metric: str = "acc") -> Figure:
    """Histogram of the per-client `metric` (accuracy by default) of one stage, with the previous stage's outlined
    behind it."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    bins = _bins(acc, *([previous[1]] if previous else []), metric=metric)
    if previous is not None:
        ax.hist(_finite(previous[1]), bins=bins, histtype="step", lw=2, color="grey", label=previous[0])
    ax.hist(_finite(acc), bins=bins, alpha=0.7, color="tab:blue", label=stage)
    ax.axvline(float(np.nanmean(acc)), color="tab:blue", ls="--", label=f"mean {np.nanmean(acc):.3f}")
    name = metric_label(metric)
    ax.set(xlabel=f"per-client {split} {name}", ylabel="clients", title=f"{stage}: {split} {name} per client")
    ax.legend()
    fig.tight_layout()
    return fig


def accuracy_cdf(stages: dict[str, np.ndarray], split: str = "test", metric: str = "acc") -> Figure:
    """Empirical CDF of the per-client `metric` (accuracy by default), one line per stage (for accuracy,
    lower-left = more clients doing badly)."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for name, acc in stages.items():
        values = np.sort(_finite(acc))
        ax.step(values, np.arange(1, len(values) + 1) / max(len(values), 1), where="post",
                label=f"{name} (p10 {np.percentile(values, 10):.3f})" if len(values) else name)
    name = metric_label(metric)
    ax.set(xlabel=f"per-client {split} {name}", ylabel="fraction of clients", ylim=(0, 1),
           title=f"CDF of per-client {split} {name} by stage")
    if metric == "acc":
        ax.set_xlim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


def before_after(before: tuple[str, np.ndarray], after: tuple[str, np.ndarray], split: str = "test",
                 metric: str = "acc") -> Figure:
    """Each client's `metric` before (x) and after (y) a stage; for accuracy, points above the diagonal improved."""
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    x, y = before[1], after[1]
    better = y > x if metric == "acc" else y < x
    ax.scatter(x[better], y[better], s=14, color="tab:green", label=f"better ({better.sum()})")
    ax.scatter(x[~better], y[~better], s=14, color="tab:red", label=f"not better ({(~better).sum()})")
    top = 1.02 if metric == "acc" else float(_bins(x, y, metric=metric)[-1]) * 1.02
    ax.plot([0, top], [0, top], color="grey", lw=1)
    name = metric_label(metric)
    ax.set(xlabel=f"{before[0]} {split} {name}", ylabel=f"{after[0]} {split} {name}", xlim=(0, top), ylim=(0, top),
           title=f"per-client {split} {name}: {before[0]} -> {after[0]}")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig
