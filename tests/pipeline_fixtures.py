"""A small pipeline on digits (20 clients, three short stages) and a way to run the CLI in-process."""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from typer.testing import CliRunner

from fedpilot.cli import app

SMALL = {
    "name": "small",
    "seed": 0,
    "defaults": [{"dataset": "digits"}, {"model": "mlp"}, "_self_"],
    "dataset": {"partition": {"kind": "dirichlet", "alpha": 0.5, "clients": 20}},
    "model": {"hidden": [32]},
    "personalization": "output_layer",
    "evaluation": {"every": 2},
    "tracking": {"system_metrics": False, "plots": False},  # PLOTTED for the tests that read plots or reports
    "stages": [
        {"name": "pretrain", "algorithm": "fedavg", "rounds": 4, "clients_per_round": 5,
         "local": {"epochs": 1, "batch_size": 10, "lr": 0.05}},
        {"name": "personalize", "algorithm": "fedalt", "rounds": 4, "clients_per_round": 5,
         "params": {"lr_v": 0.01}},
        {"name": "finetune", "algorithm": "finetune", "local": {"epochs": 2, "lr": 0.005}},
    ],
}
PLOTTED = {**SMALL, "tracking": {"system_metrics": False, "plots": True}}


def write_pipeline(folder: Path, spec: dict | None = None, name: str = "small.yaml") -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump(spec or SMALL, sort_keys=False))
    return path


def cli(*args: str) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `fedpilot ARGS` run in this process."""
    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    crash = result.exception and not isinstance(result.exception, SystemExit)
    trace = "".join(traceback.format_exception(result.exception)) if crash else ""  # shown when an assert fails
    return result.exit_code, result.output + trace


def run_id_of(output: str) -> str:
    """The parent run id from the `run_id: <id>` line `fedpilot run` ends with."""
    lines = [line for line in output.splitlines() if line.startswith("run_id: ")]
    assert lines, output
    return lines[-1].split(": ", 1)[1].strip()


def runs_of(client: MlflowClient, parent: str) -> list:
    """The parent run and its stage runs, in stage order."""
    experiment = client.get_run(parent).info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    return [client.get_run(parent), *sorted(children, key=lambda r: int(r.data.tags["fedpilot.stage_index"]))]


FINAL_METRICS = ("test_acc_mean", "test_acc_p10", "val_acc_weighted")


def final_metrics_of_a_clean_run(folder: Path, spec: dict) -> list[dict[str, float]]:
    """Each stage's FINAL_METRICS after `fedpilot run` of `spec`, uninterrupted, in this process with a store and
    cache of its own under `folder`: the reference an interrupted and resumed run must equal bit for bit."""
    uri = f"sqlite:///{folder}/mlflow.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("FEDPILOT_CACHE", str(folder / "cache"))
        code, output = cli("run", str(write_pipeline(folder, spec, "clean.yaml")), "--no-progress")
    assert code == 0, output
    return [{key: run.data.metrics[key] for key in FINAL_METRICS} for run in runs_of(MlflowClient(uri),
                                                                                    run_id_of(output))[1:]]


def assert_same_as(clean: list[dict[str, float]], runs: list) -> None:
    """`runs` (a parent and its stages, `runs_of`) end with the metrics of `final_metrics_of_a_clean_run`."""
    for run, metrics in zip(runs[1:], clean, strict=True):
        assert {key: run.data.metrics[key] for key in metrics} == metrics, run.info.run_name  # bit-identical
