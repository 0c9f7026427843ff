"""Crashes and stops: after `kill -9` or SIGTERM and `--resume`, every run holds each (metric, step) once, no run is
left RUNNING, and the result equals an uninterrupted run; the stage cache key follows the code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlflow import MlflowClient

from fedpilot.algorithms import build_algorithm
from fedpilot.pipeline.cache import code_fingerprint
from fedpilot.pipeline.round_metrics import RoundMetrics
from fedpilot.testing import device_under_test
from fedpilot.tracking import Tracker
from pipeline_fixtures import (
    SMALL,
    assert_same_as,
    cli,
    final_metrics_of_a_clean_run,
    run_id_of,
    runs_of,
    write_pipeline,
)

pytestmark = pytest.mark.slow  # starts services or processes (conftest runs these files first)

HERE = Path(__file__).parent
CPU = "system/cpu_utilization_percentage"
DEVICE = {"device": os.environ["FEDPILOT_TEST_DEVICE"]} if "FEDPILOT_TEST_DEVICE" in os.environ else {}
LONGER = {**SMALL, **DEVICE, "tracking": {"system_metrics": True},
          "stages": [{**SMALL["stages"][0], "rounds": 12}, {**SMALL["stages"][1], "rounds": 10},
                     SMALL["stages"][2]], "evaluation": {"every": 4}}


def interrupted(workdir: Path, signal_name: str, stage: int, round_idx: int,
                when: str = "round_start") -> subprocess.CompletedProcess:
    """`fedpilot run` of LONGER in a child that gets `signal_name` at the start of that round (`round_end`: at the
    end of the round before, once the stop callback has looked at it)."""
    env = {**os.environ, "STOP_STAGE": str(stage), "STOP_ROUND": str(round_idx), "STOP_SIGNAL": signal_name,
           "STOP_WHEN": when,
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(HERE / "interrupt_run.py"), "run", str(write_pipeline(workdir, LONGER)),
                           "--no-progress"], env=env, cwd=workdir, capture_output=True, text=True, timeout=300)


def assert_each_step_once(client: MlflowClient, runs: list) -> None:
    for run in runs:
        for key in run.data.metrics:
            steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, key))
            assert max(steps.values()) == 1, (run.info.run_name, key, steps)


def the_parent(client: MlflowClient) -> str:
    found = client.search_runs([client.get_experiment_by_name("small").experiment_id],
                               "tags.`fedpilot.pipeline` = 'small'")
    assert len(found) == 1
    return found[0].info.run_id


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, float]]:
    """LONGER's final metrics when nothing stops it: both interrupted runs must end equal to it."""
    device_under_test()
    return final_metrics_of_a_clean_run(tmp_path_factory.mktemp("uninterrupted"),
                                        {**LONGER, "tracking": {"system_metrics": False}})


def test_kill_9_then_resume_logs_every_metric_step_once_and_ends_identical(workdir, monkeypatch, uninterrupted):
    proc = interrupted(workdir, "SIGKILL", stage=1, round_idx=6)  # checkpoint at round 4: rounds 4, 5 run twice
    assert proc.returncode == -9, proc.stderr
    client = MlflowClient()
    parent = the_parent(client)
    before = runs_of(client, parent)
    assert [r.info.status for r in before] == ["RUNNING", "FINISHED", "RUNNING"]  # what kill -9 leaves behind
    assert max(m.step for m in client.get_metric_history(before[2].info.run_id, "round_time_s")) == 6

    sampled = len(client.get_metric_history(parent, CPU))
    assert sampled > 0
    monkeypatch.setattr(Tracker, "system_sampling_seconds", 0.1)
    code, output = cli("run", "--resume", parent, "--no-progress")
    assert code == 0, output
    runs = runs_of(client, parent)
    assert [r.info.status for r in runs] == ["FINISHED"] * 4
    assert [r.info.run_id for r in runs[:3]] == [r.info.run_id for r in before]  # resumed in the same runs
    assert_each_step_once(client, runs)
    assert [m.step for m in client.get_metric_history(runs[2].info.run_id, "round_time_s")] == list(range(1, 11))
    assert len(client.get_metric_history(parent, CPU)) > sampled  # system metrics went on, at new steps
    assert_same_as(uninterrupted, runs)


def test_rounds_reach_the_store_together_and_all_before_a_checkpoint(workdir):
    tracker = Tracker(os.environ["MLFLOW_TRACKING_URI"], "rounds")
    run_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    rounds = RoundMetrics(tracker, run_id)
    rounds.flush_seconds = 3600.0

    def train(first: int, last: int) -> None:
        for step in range(first, last + 1):
            module = SimpleNamespace(round_log={"train_loss": 1 / step, "test_acc_mean": 0.5})
            rounds.on_train_batch_end(SimpleNamespace(global_step=step), module, None, None, step - 1)

    def steps() -> list[int]:
        return [m.step for m in tracker.client.get_metric_history(run_id, "train_loss")]

    train(1, 3)
    assert steps() == []  # not yet written
    rounds.on_save_checkpoint(None, None, {})
    assert steps() == [1, 2, 3] and not tracker.client.get_metric_history(run_id, "test_acc_mean")
    train(4, 5)
    rounds.on_exception(None, None, RuntimeError("stopped"))
    assert steps() == [1, 2, 3, 4, 5]
    rounds.flush_seconds = 0.0  # due at every round
    train(6, 6)
    assert steps() == [1, 2, 3, 4, 5, 6]
    history = tracker.client.get_metric_history(run_id, "train_loss")
    assert [m.value for m in history] == pytest.approx([1 / s for s in range(1, 7)])
    assert [m.timestamp for m in history] == sorted(m.timestamp for m in history)  # each round's own time


@pytest.mark.parametrize("when", ["round_start", "round_end"])
def test_sigterm_stops_after_the_round_killed_and_resumable(workdir, uninterrupted, when):
    """On the device under test (FEDPILOT_TEST_DEVICE) too: the resumed run ends bit-identical to the clean one."""
    device_under_test()
    proc = interrupted(workdir, "SIGTERM", stage=1, round_idx=6, when=when)
    assert proc.returncode == 128 + 15, proc.stderr
    assert "SIGTERM: stopping after this round" in proc.stderr and "run --resume" in proc.stderr
    client = MlflowClient()
    parent = the_parent(client)
    stopped = runs_of(client, parent)
    assert [r.info.status for r in stopped] == ["KILLED", "FINISHED", "KILLED"]
    assert max(m.step for m in client.get_metric_history(stopped[2].info.run_id, "round_time_s")) == 7
    checkpoint = workdir / "cache" / "runs" / parent / "1-personalize" / "last.ckpt"
    assert checkpoint.is_file()  # saved after round 7, not only at the last evaluation (round 4)

    code, output = cli("run", "--resume", parent, "--no-progress")
    assert code == 0, output
    runs = runs_of(client, parent)
    assert [r.info.status for r in runs] == ["FINISHED"] * 4
    assert_each_step_once(client, runs)
    assert_same_as(uninterrupted, runs)


def test_code_fingerprint_follows_the_code_of_a_model_and_an_algorithm(tmp_path, monkeypatch):
    import importlib

    import torch

    from fedpilot.models.zoo import Net

    module = tmp_path / "my_layers.py"
    module.write_text(textwrap.dedent("""
        import torch
        class Body(torch.nn.Module):
            def forward(self, x):
                return x.flatten(1)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    layers = importlib.import_module("my_layers")
    model = Net(layers.Body(), torch.nn.Linear(4, 2))
    algorithm = build_algorithm("fedavg")
    first = code_fingerprint(algorithm, model)
    assert code_fingerprint(algorithm, model) == first
    assert code_fingerprint(build_algorithm("fedalt"), model) != first  # another algorithm's module
    module.write_text(module.read_text().replace("flatten(1)", "flatten(1) * 2"))
    assert code_fingerprint(algorithm, model) != first  # the edited model: a new stage key


def test_no_cache_recomputes_every_stage(workdir):
    path = write_pipeline(workdir)
    assert cli("run", str(path), "--no-progress")[0] == 0
    code, output = cli("run", str(path), "--no-progress", "--no-cache")
    assert code == 0, output
    client = MlflowClient()
    runs = runs_of(client, run_id_of(output))[1:]
    assert [r.data.tags["fedpilot.cache"] for r in runs] == ["miss"] * 3
    code, output = cli("run", str(path), "--no-progress")
    assert [r.data.tags["fedpilot.cache"] for r in runs_of(client, run_id_of(output))[1:]] == ["hit"] * 3


def test_safe_path_keeps_paths_under_their_root(tmp_path):
    from fedpilot.errors import SpecError
    from fedpilot.names import safe_path

    root = tmp_path / "cache" / "runs"
    assert safe_path(root, "parent", "1-a.b") == (root / "parent" / "1-a.b").resolve()
    for escape in ("1-x/../../../../../evil", "/tmp/evil", "../../sibling"):
        with pytest.raises(SpecError, match="leaves its root"):
            safe_path(root, "parent", escape)
    (tmp_path / "outside").mkdir()
    (root / "parent").mkdir(parents=True)
    (root / "parent" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(SpecError, match="leaves its root"):
        safe_path(root, "parent", "link", "last.ckpt")
