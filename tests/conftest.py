"""Shared fixtures: a working directory with its own stores, real database servers (tests/postgres.py) and a real
Slurm cluster (tests/slurm.py).

`make test` runs the files on parallel pytest-xdist workers, a whole file to a worker (`--dist loadfile`: module
fixtures start once, one worker owns the Slurm cluster) in the order set here (`--no-loadscope-reorder`: xdist
would otherwise order the files by their number of tests, which put the few long end-to-end tests last)."""

import gc
import os
import shutil
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

# OpenMP threads waiting for work sleep instead of spinning: the suite runs more processes than cores (three
# workers, the services and child processes they start), and spinning threads took the cores from the processes with
# work to do (six of the heaviest files: 212-256 s with spinning, 118-134 s without). Importing fedpilot sets it too,
# but a test module may load torch first: set here, before any process of the suite loads torch's OpenMP runtime;
# the workers and every child process inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

pytest_plugins = ["postgres", "slurm"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Slurm tests first (they share one cluster, so one worker runs them all: the longest chain), then the
    other files holding `slow` tests, then the rest, each in collection order; except that the file after one per
    worker is a light one: xdist hands each worker two files at the start, in turn, and that one waits behind the
    Slurm file."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    files = list(dict.fromkeys(item.path for item in items))
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    heavy = sorted((f for f in files if f in slow), key=lambda f: f.name != "test_slurm.py")
    light = [f for f in files if f not in slow]
    order = heavy[:workers] + light[:1] + heavy[workers:] + light[1:]
    rank = {f: i for i, f in enumerate(order)}
    items.sort(key=lambda item: rank[item.path])


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive once the test modules are imported (torch, Lightning, MLflow, Optuna, fedpilot: some 600k
    objects) lives as long as the process: frozen out of the garbage collector's sight, so that the full collection
    a pipeline run starts with (pipeline.runner.free_what_earlier_runs_left) scans what the tests made, not them."""
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def empty_mlflow_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty MLflow SQLite store, made once per test process: MLflow makes a new store by running its ~50 schema
    migrations (2.3 s), and most tests start from an empty store."""
    path = tmp_path_factory.mktemp("empty-mlflow-store") / "mlflow.db"
    MlflowClient(f"sqlite:///{path}").search_experiments()
    return path


@pytest.fixture(scope="session")
def new_mlflow_store(empty_mlflow_store: Path) -> Callable[[Path], str]:
    """new_mlflow_store(folder): the URI of folder/mlflow.db, a copy of the empty store as MLflow would have made it
    there (its Default experiment's artifacts under folder/mlruns; the rest of a new store does not depend on where
    it is)."""

    def make(folder: Path) -> str:
        path = folder / "mlflow.db"
        shutil.copyfile(empty_mlflow_store, path)
        with closing(sqlite3.connect(path)) as store, store:
            store.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                          (str(folder.absolute() / "mlruns" / "0"),))
        return f"sqlite:///{path}"

    return make


@pytest.fixture
def workdir(tmp_path, monkeypatch, new_mlflow_store):
    """A fresh working directory with its own (empty) MLflow store and fedpilot cache."""
    monkeypatch.chdir(tmp_path)
    uri = new_mlflow_store(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "cache"))
    mlflow.set_tracking_uri(uri)  # earlier tests may have set another store process-wide
    return tmp_path


@pytest.fixture
def untimed(monkeypatch):
    """No executor choice timed earlier in this process (ExecutorChoice.time's memo): a stage under `execution:
    auto` times its candidates, as in a process of its own."""
    from fedpilot.engine.accel import choice

    monkeypatch.setattr(choice, "TIMED", {})
