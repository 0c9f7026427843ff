"""The commands that answer at once (`validate`, `submit`, `jobs`, `schedule`, `data describe`) import neither torch
nor Lightning nor MLflow (nor scikit-learn or Hugging Face `datasets` once the data is cached), and neither do `run`
and `search` refusing a bad input: each runs here in a fresh interpreter (`python -X importtime`, whose report names
every module imported) with its cache, platform database and MLflow store in a temporary folder. Nothing here measures
time (docs/cli.md and the issue's note give wall times); what keeps them short is what is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = str(ROOT / "pipelines" / "quickstart.yaml")
TRAINING = {"torch", "lightning", "mlflow"}  # only where training starts or a run is recorded
DATA_BUILDING = {"sklearn", "datasets", "tokenizers"}  # only where a dataset is built, not loaded from the cache


@pytest.fixture
def place(tmp_path: Path) -> dict[str, str]:
    """The environment of a command run in `tmp_path` with its own stores."""
    return {**os.environ, "FEDPILOT_CACHE": str(tmp_path / "cache"), "FEDPILOT_DB": f"sqlite:///{tmp_path}/fp.db",
            "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db", "PYTHONPATH": os.pathsep.join(sys.path)}


def imported(env: dict[str, str], cwd: Path, *args: str, code: int = 0, says: str = "") -> set[str]:
    """The top-level packages `fedpilot ARGS` imports in a fresh interpreter; it must exit with `code` and print
    `says`."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "fedpilot.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)
    report = [line for line in proc.stderr.splitlines() if line.startswith("import time:")]
    output = proc.stdout + "\n".join(line for line in proc.stderr.splitlines() if line not in report)
    assert proc.returncode == code and says in output, output
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in report}


def test_validate_imports_no_torch_and_no_data_library_once_the_data_is_cached(place, tmp_path):
    first = imported(place, tmp_path, "validate", QUICKSTART)
    assert first & TRAINING == set()
    assert "sklearn" in first  # digits comes from scikit-learn: the first validate builds it into the cache
    assert imported(place, tmp_path, "validate", QUICKSTART, "--full") & (TRAINING | DATA_BUILDING) == set()
    assert imported(place, tmp_path, "data", "describe", QUICKSTART) & (TRAINING | DATA_BUILDING) == set()
    # a personalization of name regexes is checked against the built model's parameters: torch then
    assert "torch" in imported(place, tmp_path, "validate", QUICKSTART, "personalization=[head.weight,head.bias]")


def test_submit_jobs_and_schedules_import_no_torch_nor_lightning(place, tmp_path):
    for command in [
        ("submit", QUICKSTART),  # every check (the data built into the cache), then job 1 queued in SQLite
        ("jobs",), ("jobs", "show", "1"),
        ("schedule", "add", QUICKSTART, "--cron", "0 2 * * *", "--trials", "2"),  # checks, counts the study's trials
        ("schedule", "list"),
    ]:
        assert imported(place, tmp_path, *command) & TRAINING == set(), command



def test_run_and_search_refuse_a_bad_input_before_importing_torch(place, tmp_path):
    """A typo fails in a second or two, not after the ten seconds of importing what trains."""
    bad = "stages.1.local.lr=fast"
    for command in [("run", QUICKSTART, bad), ("search", QUICKSTART, bad), ("run", QUICKSTART, "--resume", "abc")]:
        assert imported(place, tmp_path, *command, code=2, says="error: ") & TRAINING == set(), command
