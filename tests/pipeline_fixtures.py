"""A small pipeline on digits (20 clients, three short stages) and a way to run the CLI in-process."""

from __future__ import annotations

import traceback
from pathlib import Path

import yaml
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
    "tracking": {"system_metrics": False},
    "stages": [
        {"name": "pretrain", "algorithm": "fedavg", "rounds": 4, "clients_per_round": 5,
         "local": {"epochs": 1, "batch_size": 10, "lr": 0.05}},
        {"name": "personalize", "algorithm": "fedalt", "rounds": 4, "clients_per_round": 5,
         "params": {"lr_v": 0.01}},
        {"name": "finetune", "algorithm": "finetune", "local": {"epochs": 2, "lr": 0.005}},
    ],
}


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
