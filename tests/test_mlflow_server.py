"""A real `mlflow server` process: a pipeline run against it over HTTP is read back through the MLflow client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from pipeline_fixtures import PLOTTED, run_id_of, write_pipeline

pytestmark = pytest.mark.slow  # starts services or processes (conftest runs these files first)

DISTRIBUTION = [f"test_acc_{s}" for s in ("mean", "weighted", "std", "min", "p10", "p25", "p50", "p75", "p90", "max")]
MEMORY = ["shared_bytes", "personal_bytes_per_client", "personal_bank_bytes", "comm_bytes_per_round",
          "peak_memory_bytes"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"mlflow server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"mlflow server not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


@contextmanager
def running_mlflow_server(store: Path, log: Path, *options: str) -> Iterator[str]:
    """`mlflow server` on a free local port over the SQLite store `store`, its output in `log`; stopped by its PID.
    Without MLflow's GenAI job execution, as docker-compose.yml runs it: else the server starts seven more processes
    that each import MLflow, and they took the cores from the rest of the suite."""
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}",
                                 *options, "--host", "127.0.0.1", "--port", url.rsplit(":", 1)[1], "--workers", "1"],
                                cwd=store.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on a free local port with a SQLite backend and served artifacts."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with running_mlflow_server(root / "mlflow.db", root / "server.log", "--artifacts-destination",
                               str(root / "artifacts")) as url:
        yield url


def test_pipeline_against_a_real_tracking_server(mlflow_server, tmp_path):
    srun = tmp_path / "bin" / "srun"  # on the PATH, Lightning hints at Slurm on every Trainer
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 1\n")
    srun.chmod(0o755)
    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server, "FEDPILOT_CACHE": str(tmp_path / "cache"),
           "PATH": f"{srun.parent}{os.pathsep}{os.environ['PATH']}"}
    path = write_pipeline(tmp_path, PLOTTED)
    proc = subprocess.run([sys.executable, "-m", "fedpilot.cli", "run", str(path), "--no-progress"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (tmp_path / "mlflow.db").exists()  # everything went to the server
    for hint in ("srun", "View run", "View experiment", "Downloading artifacts"):  # no third-party hints
        assert hint not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    client = MlflowClient(mlflow_server)
    parent = client.get_run(run_id_of(proc.stdout))
    page = f"{mlflow_server}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
    assert f"browse: {page}?workflowType=machine_learning" in proc.stdout
    assert f"report: {page}/artifacts/report.html?workflowType=machine_learning" in proc.stdout
    assert parent.data.tags["fedpilot.pipeline"] == "small" and parent.info.status == "FINISHED"
    stages = client.search_runs(parent.info.experiment_id, f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                order_by=["tags.`fedpilot.stage_index` ASC"])
    assert [r.data.tags["fedpilot.stage"] for r in stages] == ["pretrain", "personalize", "finetune"]
    mlflow.set_tracking_uri(mlflow_server)
    mlflow.set_experiment(experiment_id=parent.info.experiment_id)
    for run in stages:
        assert set(DISTRIBUTION + MEMORY) <= set(run.data.metrics)
        assert run.data.tags["fedpilot.cache"] == "miss"
        table = mlflow.load_table("clients.json", run_ids=[run.info.run_id])
        assert len(table) == 20 and table["test_acc"].between(0, 1).all()
        plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
        assert "plots/test_acc_hist.png" in plots
        png = Path(client.download_artifacts(run.info.run_id, "plots/test_acc_hist.png", str(tmp_path)))
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plots/test_acc_before_after.png" in {a.path for a in client.list_artifacts(stages[1].info.run_id, "plots")}
    assert stages[0].data.metrics["peak_memory_bytes"] > 10 * 2**20
    timed = stages[0].data.metrics  # the executor timing: seconds, peak and clients per call of the vmaps
    assert timed["executor_clients_per_call_vmap"] >= 1 and timed["executor_seconds_vmap"] > 0
    assert timed["executor_timing_s"] > 0


def test_fedpilot_ui_serves_the_configured_store(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    log = tmp_path / "ui.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "fedpilot.cli", "ui", "--port", url.rsplit(":", 1)[1]],
                                cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        assert f"MLflow UI for sqlite:///{tmp_path}/mlflow.db on {url}" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_fedpilot_ui_points_at_a_tracking_server(monkeypatch):
    from pipeline_fixtures import cli

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow.lab.example:5000")
    code, output = cli("ui")
    assert code == 0 and "open http://mlflow.lab.example:5000" in output
