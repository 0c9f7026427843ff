"""The names of what a stage records and how to read them: each task's per-client metrics, the statistics of their
distribution over clients, the footprints, which way is better, and what to call them.

Torch-free, so that validating a search's objective imports no engine. The engine's tasks name their metrics from
here; the spec, tuning, tracking, the report, the command line and comparisons read the records back by it.
A stage records `{split}_{metric}_{stat}` per evaluation (split: train, val or test), the shares of clients better
and worse than after the stage before as `{split}_{primary}_frac_better` / `_frac_worse`, and its footprints.
With `evaluation.novel_clients`, each stage also records the held-out clients' `novel_{split}_{metric}_{stat}` (after
their adaptation), `novel_global_{split}_{metric}_{stat}` (the global model as it stands) and the participation gap;
with `evaluation.select: val`, the last stage records `selected_{split}_{metric}_{stat}` and the share of clients that
kept their personal model.
"""

from __future__ import annotations

# A per-client metric's distribution over clients: its quantiles, in percent (numpy's percentile takes them so,
# torch's quantile takes a hundredth of them), between the ends of its range.
QUANTILES = {"p10": 10, "p25": 25, "p50": 50, "p75": 75, "p90": 90}
STATS = ("mean", "weighted", "std", "min", *QUANTILES, "max")  # `weighted`: the mean weighted by sample count
TABLE_STATS = ("mean", "weighted", "min", "p10", "p50", "p90")  # the columns of a stage table (report, `fedpilot run`)
HEADLINE_STATS = ("mean", "p10")  # a run at a glance: the average client and the worst-off tenth (curves, comparisons)

# What each task records per client: metric -> recorded with its whole distribution (else its weighted mean only).
# The first is the task's primary metric (stage tables, plots, better or worse than the stage before).
TASK_METRICS = {"classification": {"acc": True, "loss": False}, "next_token": {"acc": True, "loss": True},
                "regression": {"mse": True, "mae": True}}
LOWER_IS_BETTER = ("loss", "mse", "mae", "rmse")
LABELS = {"acc": "accuracy", "mse": "mean squared error", "mae": "mean absolute error"}  # the others by their name

# Footprint metric -> what it is. Other recorded `*bytes*` metrics (optimizer and algorithm state) go by their names.
FOOTPRINT_LABELS = {
    "shared_bytes": "shared model", "personal_bytes_per_client": "personal, per client",
    "personal_bank_bytes": "personal bank", "comm_bytes_per_round": "communication per round",
    "peak_memory_bytes": "measured peak", "estimated_training_bytes": "estimate",
}
FOOTPRINTS = tuple(k for k in FOOTPRINT_LABELS if k != "estimated_training_bytes")  # a search may optimize these

# Evaluations beyond the participating clients' personalized models: the prefix of their `{split}_{metric}_{stat}`.
# A comparison's clients against the baseline over the seeds, recorded as `<pipeline>/clients_<count>` (unchanged: the
# same value as with the baseline on every seed)
CLIENT_COUNTS = ("helped_every_seed", "hurt_every_seed", "unchanged_every_seed", "mixed")
NOVEL = "novel"  # clients held out of every round, after the adaptation a newcomer gets
NOVEL_GLOBAL = "novel_global"  # the same clients with the global model as it stands
GLOBAL = "global"  # participating clients with the global model (the per-client table's columns, for `select`)
SELECTED = "selected"  # each participating client with the model its val split chose (`evaluation.select: val`)
SELECTED_SHARE = "selected_personal_share"  # the share of clients that kept their personal model

# An algorithm's per-client scalars (Self-FL's steps, pFedGate's densities) over each round's cohort, logged per
# round as `cohort_{name}_{stat}`: how they spread, round by round (Chen et al., NeurIPS 2022, Fig. 11's steps).
COHORT = "cohort"
COHORT_STATS = {"min": 0, "p10": 10, "p50": 50, "p90": 90, "max": 100}  # statistic -> percentile


def task_metrics(task: str) -> tuple[str, ...]:
    """The per-client metrics of `task`, its primary one first."""
    return tuple(TASK_METRICS[task])


def distributions(task: str) -> tuple[str, ...]:
    """The metrics of `task` recorded with their whole distribution over clients."""
    return tuple(m for m, whole in TASK_METRICS[task].items() if whole)


def primary(task: str) -> str:
    """The metric by which `task`'s stages are shown and compared."""
    return next(iter(TASK_METRICS[task]))


def scores_of(metric: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """A comparison's scores of a run by its task's primary `metric`: the headline ones (test mean and p10, compared
    with the baseline) and those shown where recorded (the novel clients' mean, the selected models' mean)."""
    return (tuple(f"test_{metric}_{stat}" for stat in HEADLINE_STATS),
            (f"{NOVEL}_test_{metric}_mean", f"{SELECTED}_test_{metric}_mean"))


def higher_is_better(metric: str) -> bool:
    """Whether a larger value of the per-client `metric` (acc, loss, mse, ...) is better."""
    return metric not in LOWER_IS_BETTER


def split_metrics(task: str, split: str) -> list[str]:
    """What an evaluation of `split` records for `task`: each distribution metric's STATS, the others' weighted mean."""
    return [f"{split}_{m}_{stat}" for m, whole in TASK_METRICS[task].items()
            for stat in (STATS if whole else ("weighted",))]


def participation_gap(task: str) -> str:
    """The participating clients' mean test metric minus the novel clients' (after their adaptation)."""
    return f"participation_gap_{primary(task)}_mean"


def recorded_metrics(task: str, novel: bool = False) -> list[str]:
    """The validation metrics of a stage of `task` a search can optimize (with `novel`: the held-out clients' too),
    and the footprints."""
    names = [*split_metrics(task, "val"), *(split_metrics(task, f"{NOVEL}_val") if novel else [])]
    return [*names, f"val_{primary(task)}_frac_better", f"val_{primary(task)}_frac_worse", *FOOTPRINTS]


OBJECTIVE_METRICS = sorted({m for task in TASK_METRICS for m in recorded_metrics(task, novel=True)})
_METRICS = {m for metrics in TASK_METRICS.values() for m in metrics}


def default_direction(name: str) -> str:
    """How a search optimizes the recorded `name` by default: maximize accuracy and the share of clients better off;
    minimize losses, errors, the share worse off and footprints."""
    if name.endswith("_frac_better") or name == SELECTED_SHARE:
        return "maximize"
    for prefix in (f"{NOVEL_GLOBAL}_", f"{NOVEL}_", f"{SELECTED}_"):
        name = name.removeprefix(prefix)
    parts = name.split("_")
    metric = parts[1] if len(parts) > 2 and not name.endswith("_frac_worse") else ""
    return "maximize" if metric in _METRICS and higher_is_better(metric) else "minimize"


def metric_label(metric: str) -> str:
    """What a per-client metric is called in titles and axes (acc -> accuracy)."""
    return LABELS.get(metric, metric)


def footprint_label(name: str) -> str:
    """What a footprint metric is called on a chart (shared_bytes -> shared model)."""
    return FOOTPRINT_LABELS.get(name, name)
