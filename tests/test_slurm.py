"""fedpilot on a real Slurm cluster (tests/slurm.py): a submitted pipeline runs there and its MLflow record is read
back; a search over a 2-task job array finishes exactly the requested trials; `scontrol requeue` of a running job
resumes it and ends identical to an uninterrupted run; `fedpilot cancel` ends a Slurm job; a scheduled search fires
into Slurm; a bad Slurm option or an unreachable controller is exit 2 with nothing queued."""

from __future__ import annotations

import json
import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from fedpilot.db import connect
from fedpilot.jobs.queue import list_jobs
from pipeline_fixtures import SMALL, cli, write_pipeline
from slurm import squeue
from test_interruptions import assert_each_step_once, runs_of

pytestmark = pytest.mark.slow

TINY = {**SMALL, "name": "tiny", "tracking": {"system_metrics": False, "plots": False},
        "stages": [{**SMALL["stages"][0], "rounds": 3}]}
SEARCH = {**TINY, "search": {"space": {"stages.0.local.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
                             "objective": {"metric": "val_acc_mean"}, "pruner": {"kind": "none"}}}
# Long enough a stage to requeue or cancel it while it trains (a round takes some tens of milliseconds).
LONG = {**SMALL, "tracking": {"system_metrics": False, "plots": False}, "evaluation": {"every": 10},
        "stages": [{**SMALL["stages"][0], "rounds": 4}, {**SMALL["stages"][1], "rounds": 150}, SMALL["stages"][2]]}


def jobs(db: str) -> dict[int, dict]:
    code, output = cli("jobs", "--db", db, "--json")
    assert code == 0, output
    return {row["id"]: row for row in json.loads(output)}


def wait_for(predicate, timeout: float = 240, what: str = "condition", every: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def ended(db: str, ids: list[int], timeout: float = 240) -> dict[int, dict]:
    done = ("succeeded", "failed", "cancelled")
    wait_for(lambda: all(jobs(db)[i]["status"] in done for i in ids), timeout, f"jobs {ids} to end", every=1)
    return jobs(db)


def sent(*args: str) -> list[int]:
    code, output = cli(*args)
    assert code == 0, output
    return [int(x) for x in output.strip().splitlines()[-1].split()]


def log_of(db: str, job_id: int) -> str:
    code, output = cli("jobs", "show", str(job_id), "--db", db, "--json")
    assert code == 0, output
    row = json.loads(output)
    return (row.get("log") or "") + (row.get("log_err") or "")


def test_a_submitted_pipeline_runs_on_slurm_and_its_mlflow_record_is_read_back(slurm, workdir):
    db = f"sqlite:///{workdir}/platform.db"
    [job_id] = sent("submit", str(write_pipeline(workdir, TINY, "tiny.yaml")), "--to", "slurm", "--time", "10",
                    "--db", db)
    row = ended(db, [job_id])[job_id]
    assert row["status"] == "succeeded", log_of(db, job_id)
    assert row["backend"] == "slurm" and re.fullmatch(r"\d+", row["slurm_job_id"])
    wait_for(lambda: squeue(row["slurm_job_id"]) == "COMPLETED", 60, "Slurm to see the job end")
    assert row["node"] and row["slurm_state"] is None  # ended jobs are not asked again
    client = MlflowClient()
    run = client.get_run(row["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["fedpilot.pipeline"] == "tiny"
    assert [r.info.status for r in runs_of(client, row["run_id"])] == ["FINISHED"] * 2
    assert "test_acc_mean" in runs_of(client, row["run_id"])[1].data.metrics
    assert "run_id: " + row["run_id"] in log_of(db, job_id)  # the job's Slurm log holds the run's output
    code, output = cli("jobs", "--db", db)
    assert code == 0 and row["slurm_job_id"] in output and "slurm_state" in output.splitlines()[0], output
