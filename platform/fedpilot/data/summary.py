"""A federated dataset at a glance: clients, split sizes, and what the task makes of them (classes per client and
label skew; tokens; targets), computed once when the dataset is built and kept with it."""

from __future__ import annotations

import json

import numpy as np

from fedpilot.data.federated import SPLITS, FederatedData
from fedpilot.metric_names import QUANTILES

# Per-client sizes are described by the quantiles of a per-client metric's distribution and the ends of their range;
# the middle one keeps its name here, `median` (summary.json's key and the table's column).
PERCENTILES = {"min": 0, **{"median" if k == "p50" else k: q for k, q in QUANTILES.items()}, "max": 100}


def quantiles(values: np.ndarray) -> dict[str, float]:
    """min, p10, p25, median, p75, p90, max and mean of per-client values."""
    values = np.asarray(values, dtype=np.float64)
    return {**{k: float(np.percentile(values, q)) for k, q in PERCENTILES.items()}, "mean": float(values.mean())}


def label_histograms(data: FederatedData, split: str = "train") -> np.ndarray:
    """[n_clients, num_classes] label counts of one split (classification)."""
    hist = np.zeros((data.n_clients, data.num_classes))
    for c in range(data.n_clients):
        start, size = int(data.offsets[split][c]), int(data.sizes[split][c])
        hist[c] = np.bincount(data.y[start : start + size], minlength=data.num_classes)
    return hist


def label_skew(hist: np.ndarray) -> float:
    """Mean over clients of the total-variation distance between the client's label distribution and the
    global one: 0 when every client looks like the whole, towards 1 when clients hold disjoint classes."""
    global_dist = hist.sum(0) / hist.sum()
    own = hist / hist.sum(1, keepdims=True).clip(min=1)
    return float(0.5 * np.abs(own - global_dist).sum(1).mean())


def summarize(data: FederatedData) -> dict:
    """A JSON-serialisable summary: task, clients, outputs, per-split totals and per-client size quantiles, and by
    task: distinct train labels per client and label_skew (classification), real tokens per client and the
    vocabulary (next_token), the targets' per-client mean (regression)."""
    summary = {
        "task": data.task,
        "clients": data.n_clients,
        "num_classes": data.num_classes,
        "feature_shape": list(data.feature_shape),
        "fingerprint": data.fingerprint,
        "samples": {s: int(data.sizes[s].sum()) for s in SPLITS},
        "sizes": {s: quantiles(data.sizes[s]) for s in SPLITS},
    }
    if data.task == "classification":
        hist = label_histograms(data)
        summary.update(classes_per_client=quantiles((hist > 0).sum(1)), label_skew=label_skew(hist))
    elif data.task == "next_token":
        real = data.targets() != data.specials["pad"]
        summary["tokens_per_client"] = quantiles([real[data.rows("train", c)].sum() for c in range(data.n_clients)])
    else:
        summary["target_mean_per_client"] = quantiles([_mean(data.y[data.rows("train", c)])
                                                       for c in range(data.n_clients)])
    return summary


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if len(values) else float("nan")


def describe(data: FederatedData) -> dict:
    """The summary kept with a built dataset."""
    return json.loads((data.folder / "summary.json").read_text())


def format_summary(d: dict) -> str:
    """`describe`'s summary as a text table for the terminal."""
    extra = {"classification": f"classes {d['num_classes']}   label skew (mean TV distance to global) "
                               f"{d.get('label_skew', float('nan')):.3f}",
             "next_token": f"vocabulary {d['num_classes']}",
             "regression": f"targets {d['num_classes']}"}[d["task"]]
    lines = [f"task {d['task']}   clients {d['clients']}   features {tuple(d['feature_shape'])}   {extra}",
             "", f"{'per client':<20}" + "".join(f"{k:>9}" for k in [*PERCENTILES, "mean"]) + f"{'total':>10}"]
    for split in SPLITS:
        row = d["sizes"][split]
        lines.append(f"{split + ' samples':<20}" + "".join(f"{row[k]:9.6g}" for k in [*PERCENTILES, "mean"])
                     + f"{d['samples'][split]:10d}")
    for key, label in (("classes_per_client", "classes (train)"), ("tokens_per_client", "tokens (train)"),
                       ("target_mean_per_client", "target mean")):
        if key in d:
            lines.append(f"{label:<20}" + "".join(f"{d[key][k]:9.4g}" for k in [*PERCENTILES, "mean"]))
    return "\n".join(lines)
