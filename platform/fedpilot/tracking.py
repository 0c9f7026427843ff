"""MLflow records of a pipeline: one parent run, one nested run per stage, all through one explicit URI.

Names other tools rely on: tag `fedpilot.pipeline` on the parent; `fedpilot.stage` and `fedpilot.cache`
(hit|miss) on each stage run; the distribution metrics `{val,test}_acc_{mean,weighted,std,min,p10,p25,p50,
p75,p90,max}` and the memory metrics `shared_bytes personal_bytes_per_client personal_bank_bytes
comm_bytes_per_round peak_memory_bytes` on each stage run.
"""

from __future__ import annotations

import fcntl
import json
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import sqlalchemy
from lightning.pytorch.callbacks import Callback
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from fedpilot import plots
from fedpilot.errors import SpecError

PIPELINE_TAG, STAGE_TAG, CACHE_TAG = "fedpilot.pipeline", "fedpilot.stage", "fedpilot.cache"
SPEC_ARTIFACT = "pipeline.json"
STOPPED = (KeyboardInterrupt, SystemExit, optuna.TrialPruned)  # ended on purpose: status KILLED, not FAILED


@contextmanager
def schema_init_lock(url: str) -> Iterator[None]:
    """Serialize the first use of a database by several processes: MLflow's and Optuna's schema creation race
    otherwise ("duplicate column name", "type already exists"). SQLite: a lock file beside the database;
    PostgreSQL: an advisory lock; anything else (an MLflow server over HTTP) needs none."""
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///")).with_suffix(".init.lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield
    elif url.startswith("postgresql"):
        engine = sqlalchemy.create_engine(url.replace("postgresql://", "postgresql+psycopg://", 1))
        with engine.connect() as db:
            db.execute(sqlalchemy.text("SELECT pg_advisory_lock(7403)"))
            try:
                yield
            finally:
                db.execute(sqlalchemy.text("SELECT pg_advisory_unlock(7403)"))
        engine.dispose()
    else:
        yield


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested mappings as dotted keys (lists by index), values as strings, for MLflow params."""
    flat: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, item in enumerate(value):
                flat.update(flatten(item, f"{name}.{i}."))
        else:
            flat[name] = json.dumps(value) if not isinstance(value, str) else value
    return flat


def close_orphans(uri: str, run_id: str, reason: str) -> None:
    """A run whose process died, and its nested runs (stages; a search's trials and theirs): those still RUNNING
    become KILLED with `reason` as their `fedpilot.error` tag, so no run is left RUNNING for ever."""
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    for child in client.search_runs([run.info.experiment_id], f"tags.{MLFLOW_PARENT_RUN_ID} = '{run_id}'"):
        close_orphans(uri, child.info.run_id, reason)
    if run.info.status == "RUNNING":
        client.set_tag(run_id, "fedpilot.error", reason)
        client.set_terminated(run_id, "KILLED")


class RoundMetrics(Callback):
    """Logs each round's metrics (training stats, and evaluations when due) to a stage run; step = rounds done."""

    def __init__(self, tracker: Tracker, run_id: str):
        self.tracker, self.run_id = tracker, run_id

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.tracker.log_metrics(self.run_id, pl_module.round_log, step=trainer.global_step)


class Tracker:
    """Creates and fills the runs of one pipeline in the experiment named by the pipeline."""

    system_sampling_seconds = 2.0  # MLflow system metrics: one sample (CPU, memory, GPU) every this many seconds

    def __init__(self, uri: str, experiment: str):
        self.uri = uri
        self._logged: dict[str, dict[str, int]] = {}  # resumed run -> metric key -> last step its store holds
        with schema_init_lock(uri):
            self.client = MlflowClient(uri)
            found = self.client.get_experiment_by_name(experiment)
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)

    # ---- runs ------------------------------------------------------------------------------------------------
    def start_pipeline(self, spec: dict[str, Any], dataset: dict[str, Any], checkpoints: str,
                       tags: dict[str, str] | None = None) -> str:
        """The parent run: the resolved spec as params and artifact, the dataset summary and fingerprint."""
        run = self.client.create_run(self.experiment_id, run_name=spec["name"], tags={
            PIPELINE_TAG: spec["name"], "fedpilot.checkpoints": checkpoints,
            "fedpilot.dataset_fingerprint": dataset["fingerprint"], **(tags or {})})
        run_id = run.info.run_id
        params = flatten({k: v for k, v in spec.items() if k != "stages"})
        params.update({f"stages.{i}.{k}": v for i, stage in enumerate(spec["stages"])
                       for k, v in flatten(stage).items()})
        self.log_params(run_id, params)
        self.client.log_dict(run_id, spec, SPEC_ARTIFACT)
        self.client.log_dict(run_id, dataset, "dataset.json")
        return run_id

    def start_stage(self, parent: str, index: int, name: str, algorithm: str, tags: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=f"{index}-{name}", tags={
            MLFLOW_PARENT_RUN_ID: parent, STAGE_TAG: name, "fedpilot.stage_index": str(index),
            "fedpilot.algorithm": algorithm, **tags})
        return run.info.run_id

    def stage_runs(self, parent: str) -> dict[int, Any]:
        """The stage runs of a pipeline run by stage index (the newest per index)."""
        runs = self.client.search_runs([self.experiment_id], f"tags.{MLFLOW_PARENT_RUN_ID} = '{parent}'",
                                       order_by=["attributes.start_time ASC"])
        return {int(r.data.tags["fedpilot.stage_index"]): r for r in runs if "fedpilot.stage_index" in r.data.tags}

    def resume(self, run_id: str) -> None:
        """Continue a run that a process stopped or lost: status RUNNING again, and every (metric, step) it already
        holds is not logged a second time (rounds redone after its last checkpoint log each step exactly once)."""
        run = self.client.get_run(run_id)
        self._logged[run_id] = {key: max(m.step for m in self.client.get_metric_history(run_id, key))
                                for key in run.data.metrics if not key.startswith("system/")}
        self.client.update_run(run_id, status="RUNNING")

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_tag(run_id, key, value)

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Finite `metrics` at `step`, each (key, step) once: steps a resumed run already holds are skipped."""
        held = self._logged.get(run_id, {})
        items = [Metric(k, float(v), 0, step) for k, v in metrics.items()
                 if np.isfinite(v) and step > held.get(k, -1)]
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def finish(self, run_id: str) -> None:
        self.client.set_terminated(run_id, "FINISHED")

    def fail(self, run_ids: list[str], error: BaseException) -> None:
        """Mark runs FAILED with the traceback as `error.txt`; what they logged before stays."""
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        for run_id in run_ids:
            self.client.log_text(run_id, text, "error.txt")
            self.client.set_tag(run_id, "fedpilot.error", f"{type(error).__name__}: {error}"[:5000])
            self.client.set_terminated(run_id, "KILLED" if isinstance(error, STOPPED) else "FAILED")

    @contextmanager
    def system_metrics(self, run_id: str, enabled: bool) -> Iterator[None]:
        """MLflow's system metrics (CPU, memory, GPU when present) sampled into `run_id` while the block runs; a
        resumed run continues its steps."""
        if not enabled:
            yield
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=self.system_sampling_seconds, samples_before_logging=1, tracking_uri=self.uri,
                                       resume_logging=run_id in self._logged)
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()

    # ---- what a stage records -------------------------------------------------------------------------------
    def log_history(self, run_id: str, history: list[dict[str, Any]]) -> None:
        """Evaluation curves of a stage whose rounds were not logged live (a stage reused from the cache)."""
        for entry in history:
            metrics = {k: v for k, v in entry.items() if k not in {"round", "split"}}
            self.log_metrics(run_id, metrics, step=int(entry["round"]))

    def log_stage_results(self, run_id: str, name: str, clients: dict[str, Any], metrics: dict[str, float],
                          previous: tuple[str, dict[str, np.ndarray]] | None, plot: bool, metric: str = "acc") -> None:
        """Final metrics, the per-client table, and the histogram and before/after plots of one stage's per-client
        `metric` (the task's primary one) on the test split."""
        self.log_metrics(run_id, metrics, step=int(metrics.get("rounds", 0)))
        self.client.log_table(run_id, clients, "clients.json")
        if not plot:
            return
        values = np.asarray(clients[f"test_{metric}"], dtype=float)
        before = (previous[0], previous[1]["test"]) if previous else None
        self.client.log_figure(run_id, plots.accuracy_histogram(name, values, before, metric=metric),
                               f"plots/test_{metric}_hist.png")
        if before is not None:
            self.client.log_figure(run_id, plots.before_after(before, (name, values), metric=metric),
                                   f"plots/test_{metric}_before_after.png")

    def log_pipeline_results(self, run_id: str, accuracy: dict[str, np.ndarray], summary: list[dict[str, Any]],
                             plot: bool, metric: str = "acc") -> None:
        """On the parent: the per-stage summary table and the CDF plot of the per-client `metric` by stage."""
        self.client.log_table(run_id, {k: [row[k] for row in summary] for k in summary[0]}, "stages.json")
        last = summary[-1]
        self.log_metrics(run_id, {f"final_{k}": v for k, v in last.items() if isinstance(v, float)})
        if plot:
            self.client.log_figure(run_id, plots.accuracy_cdf(accuracy, metric=metric), f"plots/test_{metric}_cdf.png")


def load_resumed_spec(run_id: str, uri: str) -> dict[str, Any]:
    """The resolved spec a pipeline run recorded (for `fedpilot run --resume RUN_ID`)."""
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except Exception as err:  # mlflow raises MlflowException for an unknown id
        raise SpecError("--resume", run_id, f"no such run in {uri} ({type(err).__name__})") from None
    if "fedpilot.pipeline" not in run.data.tags:
        raise SpecError("--resume", run_id, "not a fedpilot pipeline run (its parent run has tag fedpilot.pipeline)")
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, SPEC_ARTIFACT, tmp)).read_text())
