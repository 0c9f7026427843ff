"""Shared fixtures: a working directory with its own stores, real database servers (tests/postgres.py) and a real
Slurm cluster (tests/slurm.py)."""

import mlflow
import pytest

pytest_plugins = ["postgres", "slurm"]


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory with its own MLflow store and fedpilot cache."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "cache"))
    mlflow.set_tracking_uri(uri)  # earlier tests may have set another store process-wide
    return tmp_path
