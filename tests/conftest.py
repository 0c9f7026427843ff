"""Shared fixtures: a working directory with its own stores, real database servers (tests/postgres.py) and a real
Slurm cluster (tests/slurm.py).

`make test` runs the files on parallel pytest-xdist workers, a whole file to a worker (`--dist loadfile`: module
fixtures start once, one worker owns the Slurm cluster); the Slurm file and then the other files with `slow` tests
go first so that none of them is left to run alone at the end."""

import mlflow
import pytest

pytest_plugins = ["postgres", "slurm"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Slurm tests first (they share one cluster, so one worker runs them all: the longest chain), then the
    other files holding `slow` tests, then the rest, each in collection order."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path.name != "test_slurm.py", item.path not in slow_files))


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory with its own MLflow store and fedpilot cache."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "cache"))
    mlflow.set_tracking_uri(uri)  # earlier tests may have set another store process-wide
    return tmp_path
