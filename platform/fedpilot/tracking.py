"""MLflow records of a pipeline: one parent run, one nested run per stage, all through one explicit URI.

Names other tools rely on: tag `fedpilot.pipeline` on the parent; `fedpilot.stage` and `fedpilot.cache`
(hit|miss) on each stage run; the distribution metrics `{val,test}_{metric}_{stat}` (e.g. `test_acc_p10`) and the
footprints (`shared_bytes`, `peak_memory_bytes`, ...) on each stage run, named by fedpilot.metric_names, and each
stage's as `<stage>/<metric>` on the parent.
Experiments are tagged as model training (`mlflow.experimentKind`), so MLflow 3 does not treat them as GenAI.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import tempfile
import time
import traceback
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import sqlalchemy
from mlflow import MlflowClient
from mlflow.entities import Metric, Param, Run, RunTag
from mlflow.exceptions import MlflowException
from mlflow.utils.file_utils import local_file_uri_to_path
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from fedpilot import plots
from fedpilot.errors import NoSuchRun, StoreUnavailable
from fedpilot.metric_names import NOVEL
from fedpilot.settings import UI_PORT, hidden, sqlite_file, store_exists, tracking_key

# Every tag fedpilot sets on a run, by name: the other modules write and read them through these.
PIPELINE_TAG, STAGE_TAG, CACHE_TAG = "fedpilot.pipeline", "fedpilot.stage", "fedpilot.cache"
STAGE_INDEX_TAG, ALGORITHM_TAG = "fedpilot.stage_index", "fedpilot.algorithm"  # a stage run's place and method
CACHE_KEY_TAG = "fedpilot.cache_key"  # a stage run: its stage cache key
EXECUTOR_TAG = "fedpilot.executor"  # a stage run: the executor it ran (chosen on its first round under `auto`)
EXECUTION_TAG = "fedpilot.execution"  # a stage run: its executor, clients per call and per chunk (JSON): a rerun's pin
CHECKPOINTS_TAG = "fedpilot.checkpoints"  # a pipeline run: the folder of its checkpoints while it trains
FINGERPRINT_TAG = "fedpilot.dataset_fingerprint"  # a pipeline run: its federated data's fingerprint
SEED_TAG = "fedpilot.seed"  # a trial's or a comparison's pipeline run: the seed it trained on
NOISE_SEED_TAG = "fedpilot.noise_seed"  # a trial's pipeline run on trial 0's noise seed (the pruner's margin only)
TRIAL_TAG, STUDY_TAG = "fedpilot.trial", "fedpilot.study"  # a trial's pipeline run: its number and study
SEARCH_TAG = "fedpilot.search"  # a search's run: its study
COMPARE_TAG = "fedpilot.compare"  # a comparison's run (without fedpilot.pipeline) and each of its pipeline runs
COMPARE_RUN_TAG = "fedpilot.compare_run"  # a comparison's pipeline run: the comparison's run id
VARIANT_TAG = "fedpilot.compare_variant"  # a comparison's pipeline run: tuned | written
KEY_TAG = "fedpilot.compare_key"  # a comparison's run: the hash of its plan (a rerun continues the run)
BASELINE_TAG = "fedpilot.baseline"  # a comparison's run: its baseline pipeline
CACHE_SOURCE_TAG = "fedpilot.cache_source"  # a stage reused from the cache: the run that trained it
ERROR_TAG = "fedpilot.error"  # a FAILED or KILLED run: the error's type and message
RESUMABLE_TAG = "fedpilot.resumable"  # "false" on a run that failed for good (a stage diverged): --resume refuses it
ERROR_ARTIFACT = "error.txt"  # a FAILED or KILLED run: the error's whole traceback
# A comparison's run: its plan (what --resume continues), and once finished its record and its table
PLAN_ARTIFACT, RECORD_ARTIFACT, TABLE_ARTIFACT = "comparison_plan.json", "comparison.json", "comparison.txt"
SPEC_ARTIFACT, CLIENTS_TABLE, DATASET_ARTIFACT = "pipeline.json", "clients.json", "dataset.json"
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")  # MLflow 3's model-training experiments
NOTE_TAG = "mlflow.note.content"  # a run's Description (markdown) on its Overview page
MAX_RUN_NAME = 250
UI_URL = f"http://127.0.0.1:{UI_PORT}"  # where `fedpilot ui` serves a local store
STOPPED = (KeyboardInterrupt, SystemExit, optuna.TrialPruned)  # ended on purpose: status KILLED, not FAILED


@contextmanager
def schema_init_lock(url: str) -> Iterator[None]:
    """Serialize the first use of a database by several processes: MLflow's and Optuna's schema creation race
    otherwise ("duplicate column name", "type already exists"). SQLite: a lock file beside the database;
    PostgreSQL: an advisory lock; anything else (an MLflow server over HTTP) needs none."""
    database = sqlite_file(url)
    if database is not None:
        path = database.with_suffix(".init.lock")
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


def quiet_mlflow() -> None:
    """MLflow's notes in fedpilot's output are noise: creating its tables, system-metrics start and stop, download
    progress bars, the "View run at" links of a tracking server (fedpilot prints its own)."""
    for name in ("mlflow.system_metrics", "mlflow.store.db.utils", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")


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


def set_params(spec: dict[str, Any]) -> dict[str, str]:
    """A (resolved) spec as MLflow params: dotted keys, stages by index, without the keys left unset (null)."""
    return {key: value for key, value in flatten(spec).items() if value != "null"}


def close_orphans(uri: str, run_id: str, reason: str) -> None:
    """A run whose process died, and its nested runs (stages; a search's trials and theirs): those still RUNNING
    become KILLED with `reason` as their `fedpilot.error` tag, so no run is left RUNNING for ever."""
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    for child in client.search_runs([run.info.experiment_id], f"tags.{MLFLOW_PARENT_RUN_ID} = '{run_id}'"):
        close_orphans(uri, child.info.run_id, reason)
    if run.info.status == "RUNNING":
        client.set_tag(run_id, ERROR_TAG, reason)
        client.set_terminated(run_id, "KILLED")


class Tracker:
    """Creates and fills the runs of one pipeline in the experiment named by the pipeline."""

    system_sampling_seconds = 2.0  # MLflow system metrics: one sample (CPU, memory, GPU) every this many seconds

    def __init__(self, uri: str, experiment: str):
        self.uri = uri
        self._logged: dict[str, dict[str, int]] = {}  # resumed run -> metric key -> last step its store holds
        with schema_init_lock(uri):
            self.client = MlflowClient(uri)
            try:
                found = self.client.get_experiment_by_name(experiment)
            except MlflowException as err:  # the first request: a server that refuses these credentials, say
                problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise StoreUnavailable(tracking_key(uri), hidden(uri),
                                       f"cannot open the tracking store: {problem}") from None
            kind, value = EXPERIMENT_KIND
            if found is None:
                self.experiment_id = self.client.create_experiment(experiment, tags={kind: value})
            else:
                self.experiment_id = found.experiment_id
                if kind not in found.tags:  # created by an older fedpilot, or by hand
                    self.client.set_experiment_tag(self.experiment_id, kind, value)

    # ---- runs ------------------------------------------------------------------------------------------------
    def start_pipeline(self, spec: dict[str, Any], dataset: dict[str, Any], checkpoints: str,
                       tags: dict[str, str] | None = None, name: str | None = None,
                       applies: dict[str, Any] | None = None) -> str:
        """The parent run, named `name` (default: the pipeline's): the resolved spec as artifact, what of it applies
        (`applies`, default all of it) as params, the dataset summary and fingerprint."""
        run = self.client.create_run(self.experiment_id, run_name=(name or spec["name"])[:MAX_RUN_NAME], tags={
            PIPELINE_TAG: spec["name"], CHECKPOINTS_TAG: checkpoints, FINGERPRINT_TAG: dataset["fingerprint"],
            **(tags or {})})
        run_id = run.info.run_id
        self.log_params(run_id, set_params(applies or spec))
        self.client.log_dict(run_id, spec, SPEC_ARTIFACT)
        self.client.log_dict(run_id, dataset, DATASET_ARTIFACT)
        return run_id

    def start_stage(self, parent: str, index: int, name: str, algorithm: str, tags: dict[str, str]) -> str:
        """A stage's run nested under `parent`, named `<stage> · <parent's name>` (legends and tables tell which)."""
        label = self.client.get_run(parent).info.run_name
        run = self.client.create_run(self.experiment_id, run_name=f"{name} · {label}"[:MAX_RUN_NAME], tags={
            MLFLOW_PARENT_RUN_ID: parent, STAGE_TAG: name, STAGE_INDEX_TAG: str(index), ALGORITHM_TAG: algorithm,
            **tags})
        return run.info.run_id

    def stage_runs(self, parent: str) -> dict[int, Run]:
        """The stage runs of a pipeline run by stage index (the newest per index)."""
        return stage_runs(self.client, self.experiment_id, parent)

    def resume(self, run_id: str) -> None:
        """Continue a run that a process stopped or lost: status RUNNING again, and every (metric, step) it already
        holds is not logged a second time (rounds redone after its last checkpoint log each step exactly once)."""
        run = self.client.get_run(run_id)
        self._logged[run_id] = {key: max(m.step for m in self.client.get_metric_history(run_id, key))
                                for key in run.data.metrics if not key.startswith("system/")}
        self.client.update_run(run_id, status="RUNNING")

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        """`tags` in batches (MLflow takes at most 100 tags a request), not one request a tag."""
        items = [RunTag(k, str(v)) for k, v in tags.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, tags=items[i : i + 100])

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        items = [Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        """Finite `metrics` at `step`, stamped with the time they are logged (the UI's wall-time axis), each (key,
        step) once: steps a resumed run already holds are skipped."""
        self.write_metrics(run_id, self.new_metrics(run_id, metrics, step))

    def new_metrics(self, run_id: str, metrics: dict[str, float], step: int) -> list[Metric]:
        """`log_metrics`'s entries, stamped now, to write later (`write_metrics`)."""
        held, now = self._logged.get(run_id, {}), int(time.time() * 1000)
        return [Metric(k, float(v), now, step) for k, v in metrics.items() if np.isfinite(v) and step > held.get(k, -1)]

    def write_metrics(self, run_id: str, items: list[Metric]) -> None:
        for i in range(0, len(items), 1000):
            self.client.log_batch(run_id, metrics=items[i : i + 1000])

    def finish(self, run_id: str) -> None:
        self.client.set_terminated(run_id, "FINISHED")

    def fail(self, run_ids: list[str], error: BaseException) -> None:
        """Mark runs FAILED with the traceback as `error.txt`; what they logged before stays."""
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        for run_id in run_ids:
            self.client.log_text(run_id, text, ERROR_ARTIFACT)
            self.client.set_tag(run_id, ERROR_TAG, f"{type(error).__name__}: {error}"[:5000])
            self.client.set_terminated(run_id, "KILLED" if isinstance(error, STOPPED) else "FAILED")

    def artifact_location(self, run_id: str, path: str) -> str:
        """Where to read a run's artifact: its file when the run's artifacts are a local folder, else its page in
        the MLflow UI."""
        local = local_artifact(self.uri, run_id, path)
        return str(local) if local is not None else ui_url(self.uri, self.experiment_id, run_id, path)

    @contextmanager
    def system_metrics(self, run_id: str, enabled: bool) -> Iterator[None]:
        """MLflow's system metrics (CPU, memory, GPU when present) sampled into `run_id` while the block runs; a
        resumed run continues its steps."""
        if not enabled:
            yield
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=self.system_sampling_seconds, samples_before_logging=1,
                                       tracking_uri=self.uri, resume_logging=run_id in self._logged)
        monitor.start()
        try:
            yield
        finally:
            monitor.finish()

    # ---- what a stage records -------------------------------------------------------------------------------
    def log_history(self, run_id: str, history: list[dict[str, Any]]) -> None:
        """Validation curves of a stage whose rounds were not logged live (a stage reused from the cache); its test
        evaluation is one of the values log_stage_results logs once."""
        for entry in history:
            if entry["split"] != "test":
                metrics = {k: v for k, v in entry.items() if k not in {"round", "split"}}
                self.log_metrics(run_id, metrics, step=int(entry["round"]))

    def log_stage_results(self, run_id: str, name: str, clients: dict[str, Any], metrics: dict[str, float],
                          previous: tuple[str, dict[str, np.ndarray]] | None, plot: bool, metric: str = "acc") -> None:
        """The values a stage has once (its test distribution, footprints, shares of clients better and worse), at
        step 0 so that MLflow shows them as values; the per-client table; the histogram and before/after plots of
        the per-client `metric` (the task's primary one) on the test split."""
        self.log_metrics(run_id, metrics, step=0)
        self.client.log_table(run_id, {k: [_shown(v) for v in clients[k]] for k in table_order(clients)},
                              CLIENTS_TABLE)
        if not plot:
            return
        novel = clients.get(NOVEL, [False] * len(clients[f"test_{metric}"]))  # held-out clients' rows: not in plots
        values = np.asarray([v for v, held_out in zip(clients[f"test_{metric}"], novel, strict=True) if not held_out],
                            dtype=float)
        before = (previous[0], previous[1]["test"]) if previous else None
        self.client.log_figure(run_id, plots.accuracy_histogram(name, values, before, metric=metric),
                               f"plots/test_{metric}_hist.png")
        if before is not None:
            self.client.log_figure(run_id, plots.before_after(before, (name, values), metric=metric),
                                   f"plots/test_{metric}_before_after.png")

    def log_pipeline_results(self, run_id: str, accuracy: dict[str, np.ndarray], summary: list[dict[str, Any]],
                             plot: bool, metric: str = "acc") -> None:
        """On the parent: each stage's numbers as `<stage>/<metric>` (the runs table and the compare view show
        whole pipelines side by side), the last stage's as `final_<metric>`, the per-stage summary table, the
        CDF plot of the per-client `metric` comparing stages."""
        self.client.log_table(run_id, {k: [row[k] for row in summary] for k in summary[0]}, "stages.json")
        numbers = [{k: v for k, v in row.items() if _is_number(v)} for row in summary]
        self.log_metrics(run_id, {**{f"{row['stage']}/{k}": v for row, nums in zip(summary, numbers, strict=True)
                                     for k, v in nums.items()}, **{f"final_{k}": v for k, v in numbers[-1].items()}})
        if plot:
            self.client.log_figure(run_id, plots.accuracy_cdf(accuracy, metric=metric), f"plots/test_{metric}_cdf.png")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float | np.number) and not isinstance(value, bool)


def _shown(value: Any) -> Any:
    """A float with the 6 significant digits it has (float32 metrics: 0.3333333433 -> 0.333333), else the value."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def table_order(columns: list[str]) -> list[str]:
    """Per-client table columns in reading order: the client's name, its test, previous and validation metrics, its
    sample counts, the rest, and its index last (the table is wide; what matters first is on screen)."""
    def rank(column: str) -> int:
        if column.endswith("_samples"):
            return 4
        prefixes = ("name", "test_", "previous_", "val_")
        first = next((i for i, p in enumerate(prefixes) if column.startswith(p)), None)
        return first if first is not None else 6 if column == "client" else 5

    return sorted(columns, key=rank)


def stage_runs(client: MlflowClient, experiment_id: str, parent: str) -> dict[int, Run]:
    """The stage runs of the pipeline run `parent` by stage index: the newest per index (a stage trained again after
    a stop has an older, KILLED run)."""
    runs = client.search_runs([experiment_id], f"tags.{MLFLOW_PARENT_RUN_ID} = '{parent}'",
                              order_by=["attributes.start_time ASC"])
    return {int(r.data.tags[STAGE_INDEX_TAG]): r for r in runs if STAGE_INDEX_TAG in r.data.tags}


def recorded_executions(client: MlflowClient, experiment_id: str, parent: str) -> dict[int, dict[str, Any]]:
    """How each stage of the pipeline run `parent` ran, by stage index, as far as it got (a stage records it after
    its first round): its executor, and the clients it took per call and per chunk (EXECUTION_TAG)."""
    return {i: json.loads(run.data.tags[EXECUTION_TAG]) for i, run in stage_runs(client, experiment_id, parent).items()
            if EXECUTION_TAG in run.data.tags}


def read_artifact(client: MlflowClient, run_id: str, path: str) -> str | None:
    """The text of a run's artifact `path` (a comparison's plan, its table, a stage's per-client table), None when
    the run has none."""
    folder = path.rpartition("/")[0] or None
    if path not in {a.path for a in client.list_artifacts(run_id, folder)}:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        return Path(client.download_artifacts(run_id, path, tmp)).read_text()


def read_json(client: MlflowClient, run_id: str, path: str) -> Any:
    """A run's JSON artifact `path`, None when the run has none."""
    text = read_artifact(client, run_id, path)
    return None if text is None else json.loads(text)


def comparison_outcome(client: MlflowClient, run_id: str) -> tuple[dict[str, Any], str] | None:
    """A finished comparison's record (its comparison.json) and table (comparison.txt); None before it finished."""
    record = read_json(client, run_id, RECORD_ARTIFACT)
    return None if record is None else (record, read_artifact(client, run_id, TABLE_ARTIFACT) or "")


def ui_url(uri: str, experiment_id: str, run_id: str, artifact: str | None = None) -> str:
    """The MLflow UI page of a run (or of one of its artifacts) in the model-training view: MLflow 3.17's UI takes
    the view from the page's `workflowType`, not from the experiment's kind."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else UI_URL
    page = f"{base}/#/experiments/{experiment_id}/runs/{run_id}" + (f"/artifacts/{artifact}" if artifact else "")
    return f"{page}?workflowType=machine_learning"


def local_artifact(uri: str, run_id: str, path: str) -> Path | None:
    """The file of a run's artifact when the run's artifacts are a local folder, else None."""
    location = MlflowClient(uri).get_run(run_id).info.artifact_uri
    if urllib.parse.urlparse(location).scheme not in ("", "file"):
        return None
    return Path(local_file_uri_to_path(location)) / path


def load_resumed_spec(run_id: str, uri: str) -> dict[str, Any]:
    """The resolved spec a pipeline run recorded (for `fedpilot run --resume RUN_ID`)."""
    if not store_exists(uri):
        raise NoSuchRun("--resume", run_id, f"no such run: the tracking store {hidden(uri)} does not exist")
    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except Exception as err:  # mlflow raises MlflowException for an unknown id
        raise NoSuchRun("--resume", run_id, f"no such run in {uri} ({type(err).__name__})") from None
    if PIPELINE_TAG not in run.data.tags:
        raise NoSuchRun("--resume", run_id, f"not a fedpilot pipeline run (its parent run has tag {PIPELINE_TAG})")
    if run.data.tags.get(RESUMABLE_TAG) == "false":
        raise NoSuchRun("--resume", run_id, "this run cannot be resumed, it would fail the same way again: "
                        f"{run.data.tags.get(ERROR_TAG, f'see its {ERROR_ARTIFACT}')}")
    return read_json(client, run_id, SPEC_ARTIFACT)
