"""The job queue on SQLite and a real PostgreSQL: exactly-once claims with concurrent workers, recovery of a
killed worker's job, cancellation, and the submit/jobs CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient
from sqlalchemy import update

from fedpilot.db import Job, connect, session_factory, utcnow
from fedpilot.jobs.queue import claim, list_jobs, recover, submit
from pipeline_fixtures import cli, write_pipeline

pytestmark = pytest.mark.slow  # starts services or processes (conftest runs these files first)

TINY = {
    "name": "tiny",
    "seed": 0,
    "defaults": [{"dataset": "digits"}, {"model": "mlp"}, "_self_"],
    "dataset": {"partition": {"kind": "iid", "clients": 10}},
    "model": {"hidden": [16]},
    "tracking": {"system_metrics": False, "plots": False},
    "stages": [{"name": "fedavg", "algorithm": "fedavg", "rounds": 2, "clients_per_round": 3}],
}
LONG = 250  # rounds of a job that must still be training when the test acts on it (20-50 ms a round; the test
# sees a round up to a second after it ended: rounds reach the store at most 1 s apart)
FAST = ["--poll-seconds", "0.2", "--heartbeat-seconds", "0.3", "--grace-seconds", "2"]


def tiny(folder: Path, rounds: int = 2) -> Path:
    return write_pipeline(folder, {**TINY, "stages": [{**TINY["stages"][0], "rounds": rounds}]}, "tiny.yaml")


@pytest.fixture
def child_env(tmp_path: Path, new_mlflow_store) -> dict[str, str]:
    """MLflow store and cache under tmp_path; the store and experiment exist before workers race to make them."""
    uri = new_mlflow_store(tmp_path)
    MlflowClient(uri).create_experiment("tiny")
    return {**os.environ, "MLFLOW_TRACKING_URI": uri, "FEDPILOT_CACHE": str(tmp_path / "cache")}


def start_worker(db_url: str, env: dict[str, str], cwd: Path, name: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "fedpilot.cli", "worker", "--db", db_url, "--name", name,
                             *FAST, *extra], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def job(db_url: str, job_id: int) -> dict:
    return next(row for row in list_jobs(connect(db_url)) if row["id"] == job_id)


def submitted(*args: str) -> int:
    code, output = cli("submit", *args)
    assert code == 0, output
    return int(re.search(r"(\d+)\s*$", output).group(1))  # the last thing printed (after any progress bars)


def wait_for(predicate, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_two_workers_run_every_job_exactly_once(db_url, child_env, tmp_path):
    pipeline = tiny(tmp_path)
    ids = [submitted(str(pipeline), f"seed={i}", "--db", db_url) for i in range(3)]
    workers = [start_worker(db_url, child_env, tmp_path, f"w{i}", "--exit-when-idle") for i in range(2)]
    logs = [w.communicate(timeout=240)[0] for w in workers]
    assert [w.returncode for w in workers] == [0, 0], logs
    rows = [job(db_url, i) for i in ids]
    assert [r["status"] for r in rows] == ["succeeded"] * 3, rows
    assert [r["attempts"] for r in rows] == [1] * 3
    assert len({r["run_id"] for r in rows}) == 3 and all(r["run_id"] for r in rows)
    assert {r["worker"] for r in rows} <= {"w0", "w1"}
    client = MlflowClient(child_env["MLFLOW_TRACKING_URI"])
    parents = client.search_runs([client.get_experiment_by_name("tiny").experiment_id],
                                 "tags.`fedpilot.pipeline` = 'tiny'")
    assert sorted(p.info.run_id for p in parents) == sorted(r["run_id"] for r in rows)
    assert all(r["mlflow"] == f"{child_env['MLFLOW_TRACKING_URI']} run {r['run_id']}" for r in rows)


def test_concurrent_claims_take_each_job_once(db_url):
    engine = connect(db_url)
    ids = {submit(engine, {"kind": "run", "pipeline": "p", "spec": "{}"}) for _ in range(40)}
    claimed: list[int] = []
    start = threading.Barrier(8)

    def take(name: str) -> None:
        mine = connect(db_url)
        start.wait()
        while (got := claim(mine, name)) is not None:
            claimed.append(got.id)

    threads = [threading.Thread(target=take, args=(f"t{i}",)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(claimed) == sorted(ids)
    assert {r["attempts"] for r in list_jobs(engine)} == {1}


def test_killed_workers_job_is_resumed_by_another_worker_in_the_same_runs(db_url, child_env, tmp_path):
    """The job's MLflow run is on its row while it trains (not at the worker's next heartbeat); after the worker is
    killed, another one resumes the job in the same runs."""
    job_id = submitted(str(tiny(tmp_path, rounds=LONG)), "--db", db_url)
    first = start_worker(db_url, child_env, tmp_path, "doomed", "--heartbeat-seconds", "120", "--grace-seconds", "300")
    wait_for(lambda: job(db_url, job_id)["run_id"], what="the job's MLflow run to be recorded")
    assert job(db_url, job_id)["status"] == "running"  # long before the doomed worker's first heartbeat (120 s)
    client = MlflowClient(child_env["MLFLOW_TRACKING_URI"])
    run_id = job(db_url, job_id)["run_id"]

    def rounds_logged() -> int:
        stages = client.search_runs([client.get_run(run_id).info.experiment_id],
                                    f"tags.mlflow.parentRunId = '{run_id}'")
        return len(client.get_metric_history(stages[0].info.run_id, "round_time_s")) if stages else 0

    wait_for(lambda: rounds_logged() >= 25, what="the first attempt to train past a checkpoint")
    child = psutil.Process(first.pid).children()[0]
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    child.wait(timeout=30)  # PR_SET_PDEATHSIG: the run dies with its worker
    time.sleep(2.5)  # the grace period passes without heartbeats
    second = start_worker(db_url, child_env, tmp_path, "rescuer", "--exit-when-idle")
    log = second.communicate(timeout=240)[0]
    row = job(db_url, job_id)
    assert (row["status"], row["attempts"], row["worker"]) == ("succeeded", 2, "rescuer"), (row, log)
    assert row["run_id"] == run_id  # the second attempt resumed the first one's runs
    parent = client.get_run(run_id)
    stages = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert parent.info.status == "FINISHED" and [s.info.status for s in stages] == ["FINISHED"]
    steps = [m.step for m in client.get_metric_history(stages[0].info.run_id, "round_time_s")]
    assert steps == list(range(1, LONG + 1))  # every round once, also those redone after the last checkpoint
    code, output = cli("jobs", "show", str(job_id), "--db", db_url, "--json")
    attempts = json.loads(output)["attempts_detail"]
    assert [(a["worker"], a["status"], a["run_id"]) for a in attempts] == [("doomed", "lost", run_id),
                                                                          ("rescuer", "succeeded", run_id)]
    assert "stopped sending heartbeats" in attempts[0]["error"]


def test_a_failed_jobs_error_is_shown(db_url, child_env, tmp_path):
    job_id = submitted(str(tiny(tmp_path)), "--db", db_url)
    with session_factory(connect(db_url)).begin() as session:  # a spec a newer fedpilot would refuse
        session.execute(update(Job).where(Job.id == job_id).values(spec=json.dumps({**TINY, "seed": "zero"})))
    worker = start_worker(db_url, child_env, tmp_path, "w", "--exit-when-idle")
    worker.communicate(timeout=120)
    code, listing = cli("jobs", "--db", db_url)
    assert code == 0 and "failed" in listing and "seed='zero'" in listing
    code, shown = cli("jobs", "show", str(job_id), "--db", db_url)
    assert code == 0, shown
    assert "error:" in shown and "seed='zero': Input should be a valid integer" in shown
    assert "attempts" in shown and "exit_code" in shown
    code, output = cli("jobs", "show", "999", "--db", db_url)
    assert code == 2 and "JOB_ID=999: no such job" in output


def test_submit_makes_local_dataset_paths_absolute(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    rows = {"x": [[float(i % 7), float(i % 3)] for i in range(200)], "y": [i % 2 for i in range(200)]}
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "data" / "points.parquet"))
    spec = {**TINY, "defaults": [{"model": "mlp"}, "_self_"],
            "dataset": {"source": {"kind": "hf", "path": "data/points.parquet", "feature": "x", "label": "y"},
                        "partition": {"kind": "iid", "clients": 10}}}
    db = f"sqlite:///{tmp_path}/platform.db"
    job_id = submitted(str(write_pipeline(tmp_path, spec, "points.yaml")), "--db", db)
    with session_factory(connect(db))() as session:
        stored = json.loads(session.get(Job, job_id).spec)
    assert stored["dataset"]["source"]["path"] == str(tmp_path / "data" / "points.parquet")


def test_recovery_gives_up_after_three_attempts(db_url):
    engine = connect(db_url)
    job_id = submit(engine, {"kind": "run", "pipeline": "p", "spec": "{}"})
    for attempt in (1, 2, 3):
        assert claim(engine, "w").attempts == attempt
        with session_factory(engine).begin() as session:
            session.execute(update(Job).values(heartbeat_at=utcnow() - timedelta(seconds=60)))
        recover(engine, grace_seconds=30)
    row = job(db_url, job_id)
    assert row["status"] == "failed" and row["attempts"] == 3 and claim(engine, "w") is None


def test_cancel_queued_and_running_jobs(db_url, child_env, tmp_path):
    queued = submitted(str(tiny(tmp_path)), "--db", db_url)
    assert cli("cancel", str(queued), "--db", db_url) == (0, f"job {queued}: cancelled\n")
    slow = submitted(str(tiny(tmp_path, rounds=100000)), "--db", db_url)
    worker = start_worker(db_url, child_env, tmp_path, "w", "--exit-when-idle")
    wait_for(lambda: job(db_url, slow)["status"] == "running", what="the worker to claim the slow job")
    wait_for(lambda: psutil.Process(worker.pid).children(), what="the job's child process")
    child = psutil.Process(worker.pid).children()[0]
    assert cli("cancel", str(slow), "--db", db_url) == (0, f"job {slow}: cancel_requested\n")
    log = worker.communicate(timeout=60)[0]
    assert not child.is_running(), log
    assert job(db_url, slow)["status"] == "cancelled"
    never = job(db_url, queued)
    assert never["status"] == "cancelled" and never["started_at"] is None and never["attempts"] == 0
    code, output = cli("cancel", str(slow), "--db", db_url)
    assert code == 2 and "already ended (cancelled)" in output
    code, output = cli("cancel", "999", "--db", db_url)
    assert code == 2 and "JOB_ID=999: no such job" in output


def test_submit_of_a_bad_pipeline_exits_2_and_writes_nothing(tmp_path):
    bad = write_pipeline(tmp_path, {**TINY, "bogus": 1}, "bad.yaml")
    db = tmp_path / "platform.db"
    code, output = cli("submit", str(bad), "--db", f"sqlite:///{db}")
    assert code == 2 and "bogus" in output and "unknown key" in output
    assert not db.exists()
    code, output = cli("submit", str(tiny(tmp_path)), "--search", "--db", f"sqlite:///{db}")
    assert code == 2 and "search=None" in output and not db.exists()


def test_jobs_json_lists_the_documented_fields(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FEDPILOT_DB", raising=False)
    pipeline = tiny(tmp_path)
    first, second = submitted(str(pipeline)), submitted(str(pipeline), "seed=3")
    assert (tmp_path / "fedpilot.db").exists()  # the default platform database
    pipeline.write_text(pipeline.read_text().replace("rounds: 2", "rounds: 7"))  # the queued jobs keep their spec
    code, output = cli("jobs", "--json")
    assert code == 0, output
    rows = json.loads(output)
    assert [r["id"] for r in rows] == [first, second]
    expected = {"id", "kind", "pipeline", "status", "attempts", "worker", "created_at", "started_at",
                "finished_at", "run_id", "mlflow"}
    assert expected <= set(rows[0])
    assert (rows[0]["kind"], rows[0]["pipeline"], rows[0]["status"], rows[0]["attempts"]) == ("run", "tiny",
                                                                                               "queued", 0)
    specs = [json.loads(j.spec) for j in session_factory(connect("sqlite:///fedpilot.db"))().query(Job)]
    assert [s["stages"][0]["rounds"] for s in specs] == [2, 2] and [s["seed"] for s in specs] == [0, 3]
    code, output = cli("jobs")
    assert code == 0 and "queued" in output.splitlines()[1]
