"""What a report reads: pipeline runs and their stage runs as MLflow recorded them (metrics, curves, per-client
tables), and the labels that tell several runs apart."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pandas as pd
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from fedpilot.client_effects import participating
from fedpilot.errors import NoSuchRun
from fedpilot.metric_names import COHORT, TASK_METRICS
from fedpilot.tracking import (
    CACHE_SOURCE_TAG,
    CACHE_TAG,
    CLIENTS_TABLE,
    DATASET_ARTIFACT,
    PIPELINE_TAG,
    SPEC_ARTIFACT,
    STAGE_TAG,
    read_json,
    stage_runs,
)

# The per-client metrics any task records with their whole distribution, by name
DISTRIBUTED = sorted({m for metrics in TASK_METRICS.values() for m, whole in metrics.items() if whole})


def primary_metric(keys: Iterable[str]) -> str:
    """The per-client metric whose test distribution a stage recorded (`test_<m>_p10`): `acc` when there is one,
    else the first by name (a run records its metrics, not its task)."""
    recorded = set(keys)
    found = [m for m in DISTRIBUTED if f"test_{m}_p10" in recorded]
    return "acc" if "acc" in found or not found else found[0]


FAN = ("p10", "p25", "p50", "p75", "p90")  # the validation quantiles over clients a round's fan draws


def curve_keys(metric: str) -> tuple[str, ...]:
    """The series the report draws: the per-client metric's validation mean and its quantiles over clients (the
    fan), the training loss."""
    return *(f"val_{metric}_{stat}" for stat in ("mean", *FAN)), "train_loss"


@dataclass
class Stage:
    name: str
    run_id: str
    cache: str
    metrics: dict[str, float]  # the stage run's latest values
    clients: pd.DataFrame  # its per-client table, one row per participating client in client order (no novel ones)
    curves: dict[str, pd.Series]  # metric -> values by round within the stage


@dataclass
class PipelineRun:
    run_id: str
    name: str
    experiment_id: str
    stages: list[Stage]
    label: str  # what tells it from the other runs of a report (legends, columns): its name, or see `labelled`
    ran: str = ""  # what ran, as `fedpilot validate` says it (overview.summary); empty for a spec no longer valid

    @property
    def metric(self) -> str:
        return primary_metric(self.stages[-1].metrics)


def get_run(client: MlflowClient, run_id: str):
    """The MLflow run `run_id`, or one line saying there is none."""
    try:
        return client.get_run(run_id)
    except Exception as err:  # MlflowException for an unknown id
        raise NoSuchRun("RUN_ID", run_id, f"no such run ({type(err).__name__})") from None


def load_run(client: MlflowClient, run_id: str) -> PipelineRun:
    """A finished (or partly finished) pipeline run and its stage runs, newest run per stage index."""
    run = get_run(client, run_id)
    if PIPELINE_TAG not in run.data.tags:
        raise NoSuchRun("RUN_ID", run_id, f"not a fedpilot pipeline run (tag {PIPELINE_TAG})")
    newest = {i: r for i, r in stage_runs(client, run.info.experiment_id, run_id).items() if STAGE_TAG in r.data.tags}
    stages = [_stage(client, newest[i]) for i in sorted(newest)]
    stages = [s for s in stages if not s.clients.empty]
    if not stages:
        raise NoSuchRun("RUN_ID", run_id, "no stage of this run has finished yet")
    return PipelineRun(run_id, run.info.run_name, run.info.experiment_id, stages, run.info.run_name,
                       what_ran(client, run_id))


def what_ran(client: MlflowClient, run_id: str) -> str:
    """The summary `fedpilot validate` prints of the run's recorded spec (data, model, per stage its algorithm,
    rounds, cohort, local work and learning rate); empty when the spec is no longer valid (an older fedpilot)."""
    from fedpilot.overview import summary
    from fedpilot.spec import PipelineSpec

    spec, dataset = read_json(client, run_id, SPEC_ARTIFACT), read_json(client, run_id, DATASET_ARTIFACT)
    if spec is None or dataset is None:
        return ""
    try:
        return summary(PipelineSpec.from_dict(spec), dataset.get("clients"), hint=False)
    except ValueError:  # UserError, pydantic's ValidationError: recorded by a fedpilot whose spec differed
        return ""


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its shortest ending that tells it from the others (stages.1.params.lr_v -> lr_v)."""
    short = {}
    for key in keys:
        words, n = key.split("."), 1
        while any(other != key and other.split(".")[-n:] == words[-n:] for other in keys):
            n += 1
        short[key] = ".".join(words[-n:])
    return short


def labelled(runs: list[PipelineRun]) -> list[PipelineRun]:
    """Runs labelled by the words of their names that not all of them share, an override's key by its shortest
    ending that tells it from the others' ("small stages.2.local.lr=0.1" and "small stages.2.local.lr=0.2" become
    "lr=0.1" and "lr=0.2", short enough for a legend and a table's column); the whole name where that leaves nothing
    or two the same."""
    if len(runs) == 1:
        runs[0].label = runs[0].name
        return runs
    common = set.intersection(*(set(r.name.split()) for r in runs))
    differing = [[w for w in r.name.split() if w not in common] for r in runs]
    keys = short_keys(sorted({w.partition("=")[0] for words in differing for w in words if "=" in w}))
    labels = [" ".join(_shortened(w, keys) for w in words) or r.name for r, words in zip(runs, differing, strict=True)]
    unique = len(set(labels)) == len(labels)
    for run, label in zip(runs, labels, strict=True):
        run.label = label if unique else run.name
    return runs


def _shortened(word: str, keys: dict[str, str]) -> str:
    """An override `key=value` with its key shortened (`keys`); any other word as it is."""
    key, equals, value = word.partition("=")
    return f"{keys[key]}={value}" if equals and key in keys else word


def _stage(client: MlflowClient, run) -> Stage:
    """A stage run as the report reads it. A stage reused from the cache logged the evaluations the cache keeps, not
    the training loss of its rounds: that curve comes from the run that trained it (tag fedpilot.cache_source)."""
    run_id, metrics = run.info.run_id, run.data.metrics
    source = run.data.tags.get(CACHE_SOURCE_TAG)
    curves = {}
    trained = metrics if source is None else _metrics(client, source)  # the run whose rounds were logged
    for key in [*curve_keys(primary_metric(metrics)), *sorted(k for k in trained if k.startswith(f"{COHORT}_"))]:
        series = _history(client, run_id, key) if key in metrics else _history(client, source, key)
        if len(series):
            curves[key] = series
    return Stage(run.data.tags[STAGE_TAG], run_id, run.data.tags.get(CACHE_TAG, ""), dict(metrics),
                 participating(clients_frame(client, run_id)), curves)


def _metrics(client: MlflowClient, run_id: str) -> dict[str, float]:
    """A run's latest metrics (none when it is gone)."""
    try:
        return dict(client.get_run(run_id).data.metrics)
    except MlflowException:  # a cache source run deleted since
        return {}


def _history(client: MlflowClient, run_id: str | None, key: str) -> pd.Series:
    """The series `key` of run `run_id` by step (empty when the run is None or gone)."""
    try:
        points = client.get_metric_history(run_id, key) if run_id else []
    except MlflowException:  # a cache source run deleted since
        points = []
    return pd.Series({p.step: p.value for p in points}, dtype=float).sort_index()


def clients_frame(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """A stage's per-client table, every row (empty when the stage did not finish)."""
    table = read_table(client, run_id, CLIENTS_TABLE)
    return table.sort_values("client", ignore_index=True) if not table.empty else table


def read_table(client: MlflowClient, run_id: str, path: str) -> pd.DataFrame:
    """A table a run logged with MLflow's log_table (empty when it has none)."""
    table = read_json(client, run_id, path)
    return pd.DataFrame() if table is None else pd.DataFrame(table["data"], columns=table["columns"])
