"""fedpilot on a real Slurm cluster (tests/slurm.py): a submitted pipeline runs there and its MLflow record is read
back; a search over a 2-task job array finishes exactly the requested trials; a job stopped by `scontrol requeue`,
then by its time limit's signal, resumes each time and ends identical to an uninterrupted run; `fedpilot cancel`
ends a Slurm job; a scheduled search fires into Slurm; a bad Slurm option or an unreachable controller is exit 2
with nothing queued."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from fedpilot.db import connect
from fedpilot.jobs.queue import list_jobs
from pipeline_fixtures import (
    SMALL,
    assert_same_as,
    cli,
    final_metrics_of_a_clean_run,
    runs_of,
    write_pipeline,
)
from slurm import squeue
from test_interruptions import assert_each_step_once

pytestmark = pytest.mark.slow

TINY = {**SMALL, "name": "tiny", "tracking": {"system_metrics": False, "plots": False},
        "stages": [{**SMALL["stages"][0], "rounds": 3}]}
SEARCH = {**TINY, "search": {"space": {"stages.0.local.lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
                             "objective": {"metric": "val_acc_mean"}, "pruner": {"kind": "none"}}}
# Long enough a stage to requeue (twice) or cancel it while it trains: a round takes 15 to 100 ms, and the test sees
# a round up to a second after it ended (rounds reach the store at most 1 s apart). Each round is trained twice
# (the reference and the requeued job), so no longer than that.
LONG_ROUNDS = 200
LONG = {**SMALL, "tracking": {"system_metrics": False, "plots": False}, "evaluation": {"every": 10},
        "stages": [{**SMALL["stages"][0], "rounds": 4}, {**SMALL["stages"][1], "rounds": LONG_ROUNDS},
                   SMALL["stages"][2]]}


def jobs(db: str) -> dict[int, dict]:
    code, output = cli("jobs", "--db", db, "--json")
    assert code == 0, output
    return {row["id"]: row for row in json.loads(output)}


def wait_for(predicate, timeout: float = 240, what: str = "condition", every: float = 0.5,
             explain: Callable[[], str] = str):
    """Poll `predicate` until it is true; on timeout, fail with `what` and what `explain` tells of the state."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{explain()}"
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


def test_a_search_over_a_two_task_job_array_finishes_exactly_the_trials(slurm, workdir):
    db = f"sqlite:///{workdir}/platform.db"
    ids = sent("search", str(write_pipeline(workdir, SEARCH, "search.yaml")), "--to", "slurm", "--parallel", "2",
               "--trials", "3", "--storage", db)
    assert len(ids) == 2
    rows = ended(db, ids)
    assert [rows[i]["status"] for i in ids] == ["succeeded"] * 2, [log_of(db, i) for i in ids]
    array = {rows[i]["slurm_job_id"] for i in ids}
    assert len({s.split("_")[0] for s in array}) == 1 and {s.split("_")[1] for s in array} == {"0", "1"}
    study = optuna.load_study(study_name="tiny", storage=db)
    states = [t.state for t in study.get_trials()]
    assert states.count(optuna.trial.TrialState.COMPLETE) == 3 and len(states) == 3, states
    assert rows[ids[0]]["run_id"] == rows[ids[1]]["run_id"]  # one search run for the study, both workers in it


def test_a_tuned_comparison_over_a_two_task_job_array_records_its_table(slurm, workdir):
    """`fedpilot compare --tune 2 --to slurm --parallel 2`: the array's two tasks share the studies and the runs;
    the comparison's run ends FINISHED with each study at exactly 2 trials."""
    db = f"sqlite:///{workdir}/platform.db"
    for name, algorithm in (("base", "fedavg"), ("other", "fedalt")):
        write_pipeline(workdir, {**TINY, "name": name, "stages": [
            TINY["stages"][0], {**TINY["stages"][0], "name": "more", "algorithm": algorithm, "rounds": 2}]},
            f"{name}.yaml")
    (workdir / "pair.yaml").write_text(json.dumps({"name": "pair", "seeds": 1, "pipelines": ["base.yaml", "other.yaml"],
                                                   "tune": {"trials": 2, "pruner": {"kind": "none"}}}))
    ids = sent("compare", str(workdir / "pair.yaml"), "--to", "slurm", "--parallel", "2", "--storage", db)
    rows = ended(db, ids, timeout=400)
    assert [rows[i]["status"] for i in ids] == ["succeeded"] * 2, [log_of(db, i) for i in ids]
    run = MlflowClient().get_run(rows[ids[0]]["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["other/tune_trials"] == 2
    assert {rows[i]["slurm_job_id"].split("_")[1] for i in ids} == {"0", "1"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    return final_metrics_of_a_clean_run(tmp_path_factory.mktemp("uninterrupted"), LONG)


def test_a_requeued_job_resumes_identical_to_an_uninterrupted_run(slurm, workdir, uninterrupted):
    """Stopped twice in its second stage, then finished. First `scontrol requeue` (what preemption does too):
    SIGTERM, the run stops after its round with a checkpoint and Slurm requeues the job. Then, once it has resumed,
    the time limit: Slurm's SIGUSR2 shortly before it (sent here by scancel --signal), the run stops the same way
    and the job requeues itself. Each attempt resumes in the same MLflow runs."""
    db = f"sqlite:///{workdir}/platform.db"
    [job_id] = sent("submit", str(write_pipeline(workdir, LONG, "long.yaml")), "--to", "slurm", "--time", "30",
                    "--db", db)
    slurm_id = jobs(db)[job_id]["slurm_job_id"]  # requeued jobs keep their id
    client = MlflowClient()

    def stage_rounds() -> int:
        """Rounds of the second stage in the store."""
        row = jobs(db)[job_id]
        runs = runs_of(client, row["run_id"]) if row["run_id"] else []
        return len(client.get_metric_history(runs[2].info.run_id, "round_time_s")) if len(runs) > 2 else 0

    def where_it_is() -> str:
        """Slurm's view of the job, its log and the controller's, for a timeout's message."""
        shown = subprocess.run(["scontrol", "show", "job", slurm_id], capture_output=True, text=True).stdout
        controller = (Path(slurm["root"]) / "log" / "slurmctld.log").read_text()[-3000:]
        return f"{shown}\n--- job log\n{log_of(db, job_id)[-3000:]}\n--- slurmctld.log\n{controller}"

    def training_past(rounds: int) -> None:
        wait_for(lambda: stage_rounds() >= rounds + 3, what=f"the job to train its second stage past round {rounds}",
                 every=0.2, explain=where_it_is)

    signalled_at, stopped_at = [], 0
    for interrupt in (["scontrol", "requeue"], ["scancel", "--signal=USR2"]):
        training_past(stopped_at)
        signalled_at.append(time.time())
        subprocess.run([*interrupt, slurm_id], check=True)
        # The requeued job waits CRED_EXPIRE_S + 1 seconds after its old processes end, then starts again
        wait_for(lambda: squeue(slurm_id) == "PENDING", 60, "the requeued job to wait", explain=where_it_is)
        stopped_at = stage_rounds()
    row = ended(db, [job_id])[job_id]
    assert row["status"] == "succeeded", log_of(db, job_id)
    code, output = cli("jobs", "show", str(job_id), "--db", db, "--json")
    attempts = json.loads(output)["attempts_detail"]
    # if this fails, did a signal come after the stage had trained? (metrics carry the time they were logged)
    stage = runs_of(client, row["run_id"])[2].info.run_id
    history = client.get_metric_history(stage, "round_time_s")
    late = [max((m.step for m in history if m.timestamp <= 1000 * at), default=0) for at in signalled_at]
    assert [a["status"] for a in attempts] == ["stopped", "stopped", "succeeded"], (
        f"signalled after rounds {late} of the stage", attempts, log_of(db, job_id))
    assert {a["run_id"] for a in attempts} == {row["run_id"]}
    assert "SIGTERM" in attempts[0]["error"] and "SIGUSR2" in attempts[1]["error"], attempts
    runs = runs_of(client, row["run_id"])
    assert [r.info.status for r in runs] == ["FINISHED"] * 4
    assert_each_step_once(client, runs)
    steps = [m.step for m in client.get_metric_history(runs[2].info.run_id, "round_time_s")]
    assert steps == list(range(1, LONG_ROUNDS + 1))
    assert_same_as(uninterrupted, runs)


def test_fedpilot_cancel_ends_a_slurm_job(slurm, workdir):
    db = f"sqlite:///{workdir}/platform.db"
    [job_id] = sent("submit", str(write_pipeline(workdir, LONG, "long.yaml")), "--to", "slurm", "--db", db)
    wait_for(lambda: jobs(db)[job_id]["status"] == "running" and jobs(db)[job_id]["run_id"], what="the job to run")
    code, output = cli("cancel", str(job_id), "--db", db)
    assert code == 0 and "scancel" in output, output
    row = ended(db, [job_id], timeout=120)[job_id]
    assert row["status"] == "cancelled"
    wait_for(lambda: squeue(row["slurm_job_id"]) == "CANCELLED", 60, "Slurm to cancel it")
    client = MlflowClient()
    assert "RUNNING" not in [r.info.status for r in runs_of(client, row["run_id"])]
    assert cli("cancel", str(job_id), "--db", db)[0] == 2  # it already ended


def test_a_scheduled_search_fires_into_slurm(slurm, workdir):
    from fedpilot.db import utcnow
    from fedpilot.jobs.schedule import tick

    db = f"sqlite:///{workdir}/platform.db"
    code, output = cli("schedule", "add", str(write_pipeline(workdir, SEARCH, "search.yaml")), "--cron",
                       "* * * * *", "--trials", "1", "--to", "slurm", "--db", db)
    assert code == 0 and "on Slurm" in output, output
    [job_id] = tick(connect(db), utcnow() + timedelta(minutes=2))
    row = jobs(db)[job_id]
    assert row["backend"] == "slurm" and row["slurm_job_id"], row
    row = ended(db, [job_id])[job_id]
    assert row["status"] == "succeeded", log_of(db, job_id)
    assert len(optuna.load_study(study_name="tiny", storage=db).get_trials()) == 1


@pytest.mark.parametrize(("option", "message"), [
    (["--partition", "nosuch"], "invalid partition"),
    (["--mem", "999G"], "Memory specification can not be satisfied"),
    (["--time", "soon"], "--time='soon': not a Slurm time limit"),
    (["--gpus", "1"], "Invalid generic resource"),  # a GPU on a cluster without any
    (["--gpus", "0", "+device=cuda"], "asks for `device: cuda`"),
])
def test_a_bad_slurm_option_is_exit_2_and_queues_nothing(slurm, workdir, option, message):
    db = f"sqlite:///{workdir}/platform.db"
    code, output = cli("submit", str(write_pipeline(workdir, TINY, "tiny.yaml")), "--to", "slurm", "--db", db,
                       *[o for o in option if not o.startswith("+")], *[o[1:] for o in option if o.startswith("+")])
    assert code == 2 and message in output, output
    assert list_jobs(connect(db)) == []


def test_an_unreachable_controller_is_exit_2_and_queues_nothing(slurm, workdir, monkeypatch):
    conf = Path(slurm["SLURM_CONF"])
    other = workdir / "slurm.conf"
    other.write_text(re.sub(r"SlurmctldPort=\d+", "SlurmctldPort=9", conf.read_text()))
    monkeypatch.setenv("SLURM_CONF", str(other))
    db = f"sqlite:///{workdir}/platform.db"
    code, output = cli("submit", str(write_pipeline(workdir, TINY, "tiny.yaml")), "--to", "slurm", "--db", db)
    assert code == 2 and "Unable to contact slurm controller" in output, output
    assert list_jobs(connect(db)) == []


def test_one_experiment_over_two_slurm_tasks_records_once_and_equals_one_process(slurm, workdir):
    """`devices: 2` on a CPU-only cluster: srun starts two tasks, each a rank of Lightning's SLURM environment."""
    from fedpilot.pipeline.runner import PipelineRunner
    from fedpilot.spec import load_pipeline

    path = write_pipeline(workdir, {**TINY, "device": "cpu", "devices": 2}, "ddp.yaml")
    db = f"sqlite:///{workdir}/platform.db"
    [job_id] = sent("submit", str(path), "--to", "slurm", "--db", db)
    row = ended(db, [job_id])[job_id]
    assert row["status"] == "succeeded", log_of(db, job_id)
    client = MlflowClient()
    runs = runs_of(client, row["run_id"])
    assert len(runs) == 2 and runs[0].data.params["devices"] == "2"  # rank 0 alone recorded
    single = PipelineRunner(load_pipeline(path, ["devices=1"]), cache_dir=workdir / "one", progress=False).run()
    for key in ("test_acc_mean", "test_acc_p10", "val_acc_weighted"):
        assert runs[1].data.metrics[key] == pytest.approx(single.stages[0].metrics[key], abs=1e-6), key


def test_queue_workers_leave_slurm_jobs_alone(tmp_path):
    from fedpilot.jobs.queue import claim, idle, submit

    engine = connect(f"sqlite:///{tmp_path}/platform.db")
    submit(engine, {"kind": "run", "pipeline": "tiny", "spec": "{}", "backend": "slurm"})
    assert claim(engine, "worker") is None and idle(engine, 60)


def test_slurm_options_come_from_the_environment_then_the_pipeline_then_the_flags(monkeypatch):
    from fedpilot.errors import UserError
    from fedpilot.jobs.slurm import options, parameters

    monkeypatch.setenv("FEDPILOT_SLURM", "partition=cpu account=lab time=1:00:00 qos=low")
    chosen = options({"partition": "gpu", "time": "2-00:00:00", "setup": ["module load cuda"]},
                     {"time": "90", "mem": "16G", "gpus": None})
    assert (chosen.partition, chosen.account, chosen.qos, chosen.time, chosen.mem) == ("gpu", "lab", "low", "90",
                                                                                       "16G")
    params = parameters({"devices": 2, "nodes": 3, "device": "auto"}, chosen, "fedpilot-x")
    assert params["time"] == 90 and params["gpus_per_node"] == 2 and params["ntasks_per_node"] == 2
    assert params["nodes"] == 3 and params["setup"] == ["module load cuda"] and params["mem"] == "16G"
    assert parameters({"device": "cpu"}, options(None, {}), "x")["gpus_per_node"] is None  # no GPUs asked
    for env, flags, key in [("partition=a b=1", {}, "FEDPILOT_SLURM"), ("mem=lots", {}, "FEDPILOT_SLURM.mem"),
                            ("", {"time": "1:2:3:4"}, "--time"), ("", {"gpus": -1}, "--gpus")]:
        monkeypatch.setenv("FEDPILOT_SLURM", env)
        with pytest.raises(UserError) as err:
            options(None, flags)
        assert err.value.key == key, err.value
    with pytest.raises(UserError, match="one per GPU"):
        parameters({"devices": 4}, options(None, {"gpus": 2}), "x")


def test_a_pipelines_slurm_block_is_validated_and_nodes_need_slurm(workdir):
    path = write_pipeline(workdir, {**TINY, "slurm": {"time": "1-00:00:00", "gpus": 0}}, "tiny.yaml")
    assert cli("validate", str(path))[0] == 0
    code, output = cli("validate", str(path), "slurm.mem=much")
    assert code == 2 and "slurm.mem" in output, output
    code, output = cli("run", str(path), "nodes=2")
    assert code == 2 and "nodes" in output and "--to slurm" in output, output
