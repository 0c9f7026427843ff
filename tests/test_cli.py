"""The fedpilot command: help, data describe (text and JSON), clear errors with exit code 2, what validate shows,
the stage table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from fedpilot.cli import app, format_outcomes
from fedpilot.spec import PipelineSpec, load_pipeline
from pipeline_fixtures import SMALL, cli, write_pipeline

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_help_lists_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0 and "data" in result.output


def test_data_describe_json_and_cache(tmp_path):
    args = ["data", "describe", str(ROOT / "pipelines" / "quickstart.yaml"), "--json", "--cache-dir", str(tmp_path)]
    first = json.loads(runner.invoke(app, args).stdout)
    second = json.loads(runner.invoke(app, args).stdout)
    assert first["clients"] == 100 and first["num_classes"] == 10 and not first["cache_hit"]
    assert second["cache_hit"] and second["fingerprint"] == first["fingerprint"]
    assert second["build_seconds"] < 1.0


def test_data_describe_text_with_override(tmp_path):
    result = runner.invoke(app, ["data", "describe", str(ROOT / "pipelines" / "quickstart.yaml"),
                                 "dataset.partition.clients=20", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "clients 20" in result.stdout and "label skew" in result.stdout


def test_bad_value_exits_2_and_names_the_key(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedpilot.cli", "data", "describe",
                           str(ROOT / "pipelines" / "quickstart.yaml"), "dataset.partition.alpha=-1",
                           "--cache-dir", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "dataset.partition.alpha=-1" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_missing_file_and_yaml_syntax_error(tmp_path):
    missing = runner.invoke(app, ["data", "describe", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "no such file" in missing.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: x\nstages: [\n")
    result = runner.invoke(app, ["data", "describe", str(broken)])
    assert result.exit_code == 2 and "not valid YAML" in result.stderr


def test_validate_prints_a_summary_and_full_prints_only_keys_that_apply(tmp_path):
    path = str(ROOT / "pipelines" / "quickstart.yaml")
    result = runner.invoke(app, ["validate", path, "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert len(result.stdout.splitlines()) < 15 and "100 clients (dirichlet alpha=0.3" in result.stdout
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[3:6]}
    assert rows["pretrain"].split()[1:4] == ["fedavg", "100", "10"] and "none" in rows["pretrain"]
    assert "output_layer" in rows["personalize"] and rows["personalize"].endswith("lr_v=0.01")  # set, not defaults
    assert "each client once" in rows["finetune"]

    result = runner.invoke(app, ["validate", path, "--full", "--cache-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    full, spec = yaml.safe_load(result.stdout), load_pipeline(path)
    assert "classes_per_client" not in full["dataset"]["partition"] and "column" not in full["dataset"]["partition"]
    assert "adapter_dim" not in full["personalization"] and "gamma" not in full["stages"][0]["local"]["schedule"]
    assert "server" not in full["stages"][2] and "betas" not in full["stages"][0]["server"]
    expected = spec.resolved()
    for stage in expected["stages"]:
        stage["eval_every"] = 10  # shown as the value in force
    assert PipelineSpec.from_dict(full).resolved() == expected  # nothing that applies was left out


def test_stage_table_shows_clients_better_and_worse():
    stages = [SimpleNamespace(name="pretrain", cache="miss", metrics={"test_acc_mean": 0.8, "test_acc_p10": 0.5}),
              SimpleNamespace(name="finetune", cache="hit", metrics={"test_acc_mean": 0.79, "test_acc_p10": 0.5,
                                                                     "test_acc_frac_better": 0.04,
                                                                     "test_acc_frac_worse": 0.08})]
    lines = format_outcomes(stages, "acc").splitlines()
    assert lines[0] == "per-client test accuracy" and lines[1].split()[-2:] == ["better", "worse"]
    assert lines[3].split() == ["finetune", "hit", "0.790", "0.500", "4%", "8%"]


def test_fedpilot_processes_let_waiting_openmp_threads_sleep_unless_the_environment_says_otherwise():
    """OMP_WAIT_POLICY=PASSIVE is in the environment before torch loads its OpenMP runtime (importing fedpilot sets
    it, and the `fedpilot` command imports fedpilot first); a value the user set is kept."""
    show = "import os, sys, fedpilot.cli; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    for given, expected in ((None, "PASSIVE"), ("ACTIVE", "ACTIVE")):
        child_env = env if given is None else {**env, "OMP_WAIT_POLICY": given}
        proc = subprocess.run([sys.executable, "-c", show], env=child_env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == [expected, "False"]  # set before anything could load torch


SEARCHABLE = {**SMALL, "search": {"space": {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": 0.1}},
                                  "objective": {"metric": "val_acc_weighted"}, "trials": 2}}
DAILY = ("--cron", "0 2 * * *")


@pytest.mark.parametrize(("args", "expect"), [
    (("search", "@PIPE@", "--trials", str(2**31)), f"--trials={2**31}: must be from 1 to 2,147,483,647"),
    (("submit", "@PIPE@", "--search", "--trials", str(2**31)), f"--trials={2**31}: must be from 1"),
    (("schedule", "add", "@PIPE@", *DAILY, "--trials", str(2**31)), f"--trials={2**31}: must be from 1"),
    (("search", "@PIPE@", "--heartbeat-seconds", "0"), "--heartbeat-seconds=0: must be from 1 to 86,400"),
    (("search", "@PIPE@", "--parallel", "0"), "--parallel=0: must be from 1 to 1,000"),
    (("search", "@PIPE@", "--to", "queue", "--parallel", "1001"), "--parallel=1001: must be from 1 to 1,000"),
    (("submit", "@PIPE@", "--search", "--parallel", "1001"), "--parallel=1001: must be from 1 to 1,000"),
    (("schedule", "add", "@PIPE@", *DAILY, "--trials", "1", "--to", "slurm", "--parallel", "5000"),
     "--parallel=5000: must be from 1 to 1,000"),
    (("jobs", "show", str(2**70)), f"JOB_ID={2**70}: must be from 1 to 2,147,483,647"),
    (("cancel", "0"), "JOB_ID=0: must be from 1 to 2,147,483,647"),
    (("worker", "--exit-when-idle", "--grace-seconds", "1e30"), "--grace-seconds=1e+30: must be from 0.01 to 86,400"),
    (("scheduler", "--once", "--poll-seconds", "0"), "--poll-seconds=0.0: must be from 0.01 to 86,400"),
    (("ui", "--port", "70000"), "--port=70000: must be from 1 to 65,535"),
    (("data", "describe", "@PIPE@", "seed=-1"), "seed=-1: Input should be greater than or equal to 0"),
    (("data", "describe", "@PIPE@", "seed=true"), "seed=True: a number, not true or false"),
    (("compare", "@SET@"), "seed=-1: Input should be greater than or equal to 0"),
    (("compare", "@SET@", "--seeds", "1001"), "--seeds=1001: must be from 1 to 1,000"),
])
def test_numeric_options_out_of_range_exit_2_naming_them_and_create_nothing(workdir, monkeypatch, args, expect):
    monkeypatch.setattr(os, "execvp", lambda *args: pytest.fail("`fedpilot ui` started MLflow"))
    pipe = write_pipeline(workdir, SEARCHABLE)
    (workdir / "set.yaml").write_text(yaml.safe_dump({"name": "s", "baseline": "small", "seeds": [-1],
                                                      "pipelines": [pipe.name]}))
    before = sorted(workdir.rglob("*"))
    code, output = cli(*(a.replace("@PIPE@", str(pipe)).replace("@SET@", str(workdir / "set.yaml")) for a in args))
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and expect in errors[0], output
    assert sorted(workdir.rglob("*")) == before
