"""One experiment over several processes (Lightning DDP, 2 CPU processes on gloo) trains like one process.

Every process samples the same cohort, trains its slice, and the aggregate's sums, bank rows and training stats
are all-reduced: parameters, banks and metrics must equal the single-process run within float tolerance (the
sums are added in another order). Upload bytes must be equal exactly: a slice counted twice would show there.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from ddp_cases import CASES, train_cases
from engine_fixtures import ToyData
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.protocol import Upload
from fedpilot.errors import SpecError
from fedpilot.pipeline.checks import check_devices
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.spec import load_pipeline
from pipeline_fixtures import SMALL, run_id_of, write_pipeline

pytestmark = pytest.mark.slow  # starts services or processes (conftest runs these files first)

HERE = Path(__file__).parent


def assert_states_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=f"{what}: {name}")


def assert_within_one_sample(got: dict, want: dict, what: str) -> None:
    """Each split's per-client accuracies differ in at most one sample in all: states equal to float tolerance can
    still flip one prediction on a near-tie (an argmax, a gate's top-k), never more."""
    sizes = ToyData().sizes
    for split in ("val", "test"):
        flipped = float(((got[split]["acc"] - want[split]["acc"]).abs() * sizes[split]).sum())
        assert flipped < 1.5, f"{what}: {flipped:.0f} {split} predictions differ"


def test_two_ddp_processes_train_each_algorithm_like_one(tmp_path):
    out = tmp_path / "ddp.pt"
    proc = subprocess.run([sys.executable, str(HERE / "ddp_cases.py"), "2", str(out)], capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr  # Lightning started the second process
    split, single = torch.load(out, weights_only=False), train_cases(1)
    for name in CASES:
        assert_states_close(split[name]["state"], single[name]["state"], name)
        assert split[name]["comm_bytes"] == single[name]["comm_bytes"], name
        assert split[name]["train"] == pytest.approx(single[name]["train"], rel=1e-5), name
        assert_within_one_sample(split[name]["clients"], single[name]["clients"], name)
        assert len(split[name]["history"]) == len(single[name]["history"]) > 0
        for got, want in zip(split[name]["history"], single[name]["history"], strict=True):
            assert got.pop("split") == want.pop("split")
            losses = {k for k in want if "_acc_" not in k}  # accuracies: within one sample, above
            assert {k: got[k] for k in losses} == pytest.approx({k: want[k] for k in losses}, rel=1e-5, abs=1e-6), name


def test_fedpilot_run_on_two_devices_stopped_and_resumed_records_once_and_equals_one_device(workdir):
    """SIGTERM reaches rank 1 alone in the second stage: both processes stop after the same round with a checkpoint;
    `--resume` on two devices again ends equal to one device's uninterrupted run."""
    path = write_pipeline(workdir, {**SMALL, "device": "cpu"})
    single = PipelineRunner(load_pipeline(path, []), cache_dir=workdir / "one", progress=False).run()
    uri = f"sqlite:///{workdir}/ddp.db"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "FEDPILOT_CACHE": str(workdir / "two"),
           "STOP_STAGE": "1", "STOP_ROUND": "2", "STOP_SIGNAL": "SIGTERM", "STOP_RANK": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    stopped = subprocess.run([sys.executable, str(HERE / "interrupt_run.py"), "run", str(path), "devices=2",
                              "--no-progress"], cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
    assert stopped.returncode == 128 + 15, stopped.stdout[-2000:] + stopped.stderr[-4000:]
    assert "SIGTERM: stopping after this round" in stopped.stderr
    parent_id = re.search(r"run --resume (\w+)", stopped.stderr).group(1)
    client = MlflowClient(uri)
    stage = client.search_runs([client.get_run(parent_id).info.experiment_id], "tags.`fedpilot.stage` = 'personalize'")
    assert [m.step for m in client.get_metric_history(stage[0].info.run_id, "round_time_s")] == [1, 2, 3]
    proc = subprocess.run([sys.executable, "-m", "fedpilot.cli", "run", "--resume", parent_id, "--no-progress"],
                          cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("run_id: ") == 1 and "device cpu x2" in proc.stdout  # rank 1 printed nothing
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 4  # rank 0 alone recorded: one pipeline run, three stage runs
    parent = client.get_run(run_id_of(proc.stdout))
    assert parent.data.params["devices"] == "2" and parent.info.status == "FINISHED"
    stages = {r.data.tags["fedpilot.stage"]: r for r in runs if "fedpilot.stage" in r.data.tags}
    for outcome in single.stages:
        metrics = stages[outcome.name].data.metrics
        for key in ("test_acc_mean", "test_acc_p10", "val_acc_weighted"):
            assert metrics[key] == pytest.approx(outcome.metrics[key], abs=1e-6), (outcome.name, key)
    # devices is not part of the stage cache key: the same stages, with equal states
    one, two = sorted((workdir / "one" / "stages").glob("*.pt")), sorted((workdir / "two" / "stages").glob("*.pt"))
    assert [p.name for p in one] == [p.name for p in two] and len(one) == 3
    for a, b in zip(one, two, strict=True):
        assert_states_close(torch.load(b, weights_only=False)["state"], torch.load(a, weights_only=False)["state"],
                            a.name)


class KeepsUploads:
    """A server that keeps every client's upload (as a robust median or precision weighting does): no sums."""

    class aggregator:  # the engine makes one per round: `algorithm.aggregator()`
        def __init__(self) -> None:
            self.uploads: list[Upload] = []


def test_devices_are_refused_where_a_round_cannot_be_split(workdir):
    spec = load_pipeline(write_pipeline(workdir), ["devices=2"])
    with pytest.raises(SpecError, match=r"stages\.1\.algorithm.*cannot be split across devices"):
        check_devices(spec, torch.device("cpu"), [build_algorithm("fedavg"), KeepsUploads()])
    check_devices(spec, torch.device("cpu"), [build_algorithm(s.algorithm, s.params) for s in spec.stages])
    if torch.cuda.device_count() < 2:
        with pytest.raises(SpecError, match=r"devices.*CUDA devices are visible"):
            check_devices(spec, torch.device("cuda"), [])
    with pytest.raises(SpecError, match="devices"):
        load_pipeline(write_pipeline(workdir), ["devices=0"])
