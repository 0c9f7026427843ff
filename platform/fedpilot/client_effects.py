"""Whether a pipeline helps a client or only luck does: each client's change in test metric against the baseline on
every seed of a comparison, and the clients helped on every seed, hurt on every seed, or neither (Pillutla et al.,
ICML 2022, Sec. C.3 and Fig. 11: whether personalization helps a device depends on the random seed).

A client is known by its `name` across seeds. Torch-free: the comparison records these, the report reads them back.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from fedpilot.metric_names import CLIENT_COUNTS

CHANGES_TABLE = "clients_across_seeds.json"  # the comparison run's table: client, pipeline, seed, change
COUNTS = CLIENT_COUNTS
FIXED_NAMES = "on every seed: the same federation throughout"  # federation_note's words when a name is the same data


def participating(clients: pd.DataFrame) -> pd.DataFrame:
    """The rows of a per-client table that took part in training (without the novel clients held out of it)."""
    if "novel" not in clients.columns:
        return clients
    novel = clients["novel"].map(lambda v: v is True or str(v).lower() == "true")
    return clients[~novel].reset_index(drop=True)


def client_changes(values: dict[str, dict[int, dict[str, float]]], baseline: str) -> pd.DataFrame:
    """Columns client, pipeline, seed, change: each non-baseline pipeline's per-client test value minus the
    baseline's on the same seed (`values`: pipeline -> seed -> client name -> value), for the clients both have."""
    rows = []
    for pipeline, by_seed in values.items():
        if pipeline == baseline:
            continue
        for seed, clients in by_seed.items():
            base = values[baseline][seed]
            rows += [(name, pipeline, seed, float(v - base[name])) for name, v in clients.items()
                     if name in base and np.isfinite(v - base[name])]
    return pd.DataFrame(rows, columns=["client", "pipeline", "seed", "change"])


def every_seed(changes: pd.DataFrame, seeds: int) -> pd.DataFrame:
    """Per pipeline and client seen on all `seeds`: mean, min and max of its change, sorted by pipeline and mean."""
    grouped = changes.groupby(["pipeline", "client"], sort=False)["change"]
    bands = grouped.agg(["mean", "min", "max", "count"]).reset_index()
    bands = bands[bands["count"] == seeds].drop(columns="count")
    return bands.sort_values(["pipeline", "mean"], kind="stable", ignore_index=True)


def seed_counts(changes: pd.DataFrame, pipelines: list[str], seeds: int, higher: bool) -> dict[str, dict[str, int]]:
    """Per pipeline, of the clients seen on all `seeds`: those better than the baseline on every seed (higher or
    lower values, as `higher` says), worse on every seed, tied with it on every seed (unchanged: with few test
    samples, most clients of a saturated task), and the rest (mixed)."""
    bands = every_seed(changes, seeds)
    sign = 1.0 if higher else -1.0
    counts = {}
    for pipeline in pipelines:
        rows = bands[bands["pipeline"] == pipeline]
        worst, best = (rows["min"], rows["max"]) if higher else (rows["max"], rows["min"])
        helped, hurt = int((sign * worst > 0).sum()), int((sign * best < 0).sum())
        unchanged = int(((rows["min"] == 0) & (rows["max"] == 0)).sum())
        counts[pipeline] = dict(zip(COUNTS, (helped, hurt, unchanged, len(rows) - helped - hurt - unchanged),
                                    strict=True))
    return counts


def federation_note(dataset_seeds: dict[str, dict[int, int | None]]) -> str:
    """Whether a client's name denotes the same data on every seed (`dataset_seeds`: pipeline -> seed -> the
    resolved spec's `dataset.seed`), said for the reader of the per-client changes."""
    fixed = {s for by_seed in dataset_seeds.values() for s in by_seed.values()}
    if fixed == {None}:
        return ("dataset.seed is unset: the partition follows the pipeline's seed, so on a partition drawn at random "
                "a client's name denotes different data on each seed (the spread mixes the draw of the federation "
                "with training's randomness). Hold the federation fixed with the override dataset.seed=0.")
    if len(fixed) == 1:
        return (f"dataset.seed={fixed.pop()} {FIXED_NAMES}, a client's name the same data; only training's "
                "randomness varies (as in Pillutla et al., ICML 2022, Sec. C.3).")
    return ("dataset.seed differs between runs of the comparison (" + ", ".join(
        f"{p}: {sorted({str(s) for s in by_seed.values()})}" for p, by_seed in dataset_seeds.items()) +
            "): a client's name may denote different data on different seeds.")
