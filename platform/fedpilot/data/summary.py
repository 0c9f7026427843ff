"""A federated dataset at a glance: clients, split sizes, classes per client, label heterogeneity."""

from __future__ import annotations

import numpy as np

from fedpilot.data.federated import SPLITS, FederatedData

STATS = {"min": 0, "p10": 10, "p25": 25, "median": 50, "p75": 75, "p90": 90, "max": 100}


def quantiles(values: np.ndarray) -> dict[str, float]:
    """min, p10, p25, median, p75, p90, max and mean of per-client values."""
    return {**{k: float(np.percentile(values, q)) for k, q in STATS.items()}, "mean": float(values.mean())}


def label_histograms(data: FederatedData, split: str = "train") -> np.ndarray:
    """[n_clients, num_classes] label counts of one split."""
    y = data.y.cpu().numpy()
    hist = np.zeros((data.n_clients, data.num_classes))
    for c in range(data.n_clients):
        start, size = int(data.offsets[split][c]), int(data.sizes[split][c])
        hist[c] = np.bincount(y[start : start + size], minlength=data.num_classes)
    return hist


def label_skew(hist: np.ndarray) -> float:
    """Mean over clients of the total-variation distance between the client's label distribution and the
    global one: 0 when every client looks like the whole, towards 1 when clients hold disjoint classes."""
    global_dist = hist.sum(0) / hist.sum()
    own = hist / hist.sum(1, keepdims=True).clip(min=1)
    return float(0.5 * np.abs(own - global_dist).sum(1).mean())


def describe(data: FederatedData) -> dict:
    """A JSON-serialisable summary: clients, classes, per-split totals and per-client size quantiles, the number
    of distinct train labels per client (quantiles) and label_skew (see `label_skew`)."""
    hist = label_histograms(data)
    return {
        "clients": data.n_clients,
        "num_classes": data.num_classes,
        "feature_shape": list(data.feature_shape),
        "fingerprint": data.fingerprint,
        "samples": {s: int(data.sizes[s].sum()) for s in SPLITS},
        "sizes": {s: quantiles(data.sizes[s].cpu().numpy()) for s in SPLITS},
        "classes_per_client": quantiles((hist > 0).sum(1)),
        "label_skew": label_skew(hist),
    }


def format_summary(d: dict) -> str:
    """`describe`'s summary as a text table for the terminal."""
    lines = [f"clients {d['clients']}   classes {d['num_classes']}   features {tuple(d['feature_shape'])}   "
             f"label skew (mean TV distance to global) {d['label_skew']:.3f}",
             "", f"{'per client':<20}" + "".join(f"{k:>8}" for k in [*STATS, "mean"]) + f"{'total':>9}"]
    for split in SPLITS:
        row = d["sizes"][split]
        lines.append(f"{split + ' samples':<20}" + "".join(f"{row[k]:8.1f}" for k in [*STATS, "mean"])
                     + f"{d['samples'][split]:9d}")
    row = d["classes_per_client"]
    lines.append(f"{'classes (train)':<20}" + "".join(f"{row[k]:8.1f}" for k in [*STATS, "mean"]))
    return "\n".join(lines)
