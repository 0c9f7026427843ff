"""`fedpilot run` end to end on a local SQLite store: what the runs record, stage caching, failure and resume."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow import MlflowClient

from fedpilot.engine.stage import FederatedStage
from pipeline_fixtures import PLOTTED, SMALL, cli, run_id_of, write_pipeline

DISTRIBUTION = [f"{split}_acc_{stat}" for split in ("test", "val")
                for stat in ("mean", "weighted", "std", "min", "p10", "p25", "p50", "p75", "p90", "max")]
MEMORY = ["shared_bytes", "personal_bytes_per_client", "personal_bank_bytes", "comm_bytes_per_round",
          "peak_memory_bytes"]


def stage_runs(client: MlflowClient, parent: str) -> list:
    runs = client.search_runs(client.get_run(parent).info.experiment_id,
                              f"tags.mlflow.parentRunId = '{parent}'")
    return sorted(runs, key=lambda r: int(r.data.tags["fedpilot.stage_index"]))


def test_run_records_stages_distributions_tables_plots_and_memory(workdir):
    code, output = cli("run", str(write_pipeline(workdir, PLOTTED)), "--no-progress")
    assert code == 0, output
    assert output.rstrip().splitlines()[-1].startswith("run_id: ")
    client = MlflowClient()
    parent = client.get_run(run_id_of(output))
    assert parent.info.status == "FINISHED" and parent.data.tags["fedpilot.pipeline"] == "small"
    assert parent.data.params["stages.1.algorithm"] == "fedalt"
    names = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"pipeline.json", "dataset.json", "stages.json"} <= names
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "plots")] == ["plots/test_acc_cdf.png"]

    runs = stage_runs(client, parent.info.run_id)
    assert [r.data.tags["fedpilot.stage"] for r in runs] == ["pretrain", "personalize", "finetune"]
    mlflow.set_experiment(experiment_id=parent.info.experiment_id)  # load_table looks in the active experiment
    for run in runs:
        assert run.info.status == "FINISHED" and run.data.tags["fedpilot.cache"] == "miss"
        assert set(DISTRIBUTION + MEMORY) <= set(run.data.metrics), run.data.tags["fedpilot.stage"]
        m = run.data.metrics
        assert m["test_acc_min"] <= m["test_acc_p10"] <= m["test_acc_p50"] <= m["test_acc_p90"] <= m["test_acc_max"]
        # the bank holds the rows of the clients that trained, and the shared starting value
        rows = m["personal_bank_bytes"] / max(m["personal_bytes_per_client"], 1)
        assert rows == int(rows) and rows <= 21 and (rows > 0) == (m["personal_bytes_per_client"] > 0)
        table = mlflow.load_table("clients.json", run_ids=[run.info.run_id])
        assert len(table) == 20 and {"test_acc", "val_acc", "train_samples"} <= set(table.columns)
        assert np.isclose(table["test_acc"].mean(), m["test_acc_mean"])
        assert "plots/test_acc_hist.png" in {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    pretrain, personalize, finetune = (r.data.metrics for r in runs)
    assert finetune["personal_bank_bytes"] == 21 * finetune["personal_bytes_per_client"]  # fine-tuning visits all 20
    assert pretrain["personal_bytes_per_client"] == 0 and personalize["personal_bytes_per_client"] == (32 + 1) * 10 * 4
    assert pretrain["shared_bytes"] == personalize["shared_bytes"] + personalize["personal_bytes_per_client"]
    assert pretrain["comm_bytes_per_round"] == 2 * 5 * pretrain["shared_bytes"]  # 5 clients, down and up
    assert finetune["comm_bytes_per_round"] == 20 * finetune["shared_bytes"]  # one download each, no upload
    assert 0 <= personalize["test_acc_frac_better"] <= 1
    curve = client.get_metric_history(runs[0].info.run_id, "val_acc_mean")
    assert [p.step for p in curve] == [2, 4]
    # stamped when logged, within the stage run's time (the UI's wall-time axis), not at 1970
    assert all(runs[0].info.start_time <= p.timestamp <= runs[0].info.end_time for p in curve)
    assert "personalize" in output and "p10" in output  # the summary table


def test_changing_only_the_finetune_lr_reruns_only_that_stage(workdir):
    path = write_pipeline(workdir)
    code, first = cli("run", str(path), "--no-progress")
    assert code == 0, first
    code, second = cli("run", str(path), "stages.2.local.lr=0.02", "--no-progress")
    assert code == 0, second
    client = MlflowClient()
    before, after = (stage_runs(client, run_id_of(out)) for out in (first, second))
    assert [r.data.tags["fedpilot.cache"] for r in after] == ["hit", "hit", "miss"]
    for old, new in zip(before[:2], after[:2], strict=True):
        assert new.data.tags["fedpilot.cache_source"] == old.info.run_id
        assert new.data.metrics["test_acc_mean"] == old.data.metrics["test_acc_mean"]
        assert [p.step for p in client.get_metric_history(new.info.run_id, "val_acc_mean")] == \
               [p.step for p in client.get_metric_history(old.info.run_id, "val_acc_mean")]
    assert after[2].data.params["local.lr"] == "0.02"


def test_a_failure_marks_runs_failed_and_resume_finishes_with_the_same_result(workdir, monkeypatch):
    path = write_pipeline(workdir)
    original = FederatedStage.run_round

    def crash_once(self, round_idx, chunk=None):
        if self.stage_index == 1 and round_idx == 3:
            monkeypatch.setattr(FederatedStage, "run_round", original)
            raise RuntimeError("simulated node failure")
        return original(self, round_idx, chunk)

    monkeypatch.setattr(FederatedStage, "run_round", crash_once)
    code, output = cli("run", str(path), "--no-progress")
    assert code != 0
    client = MlflowClient()
    parent = client.search_runs(client.get_experiment_by_name("small").experiment_id,
                                "tags.`fedpilot.pipeline` = 'small'")[0]
    assert parent.info.status == "FAILED"
    runs = stage_runs(client, parent.info.run_id)
    assert [r.info.status for r in runs] == ["FINISHED", "FAILED"]
    error = client.download_artifacts(runs[1].info.run_id, "error.txt", str(workdir))
    assert "simulated node failure" in Path(error).read_text()
    assert [p.step for p in client.get_metric_history(runs[1].info.run_id, "val_acc_mean")] == [2]  # kept

    code, output = cli("run", "--resume", parent.info.run_id, "--no-progress")
    assert code == 0, output
    assert run_id_of(output) == parent.info.run_id
    resumed = stage_runs(client, parent.info.run_id)
    assert [r.info.status for r in resumed] == ["FINISHED"] * 3
    assert resumed[1].info.run_id == runs[1].info.run_id  # the interrupted stage continued in its own run

    monkeypatch.setenv("FEDPILOT_CACHE", str(workdir / "fresh-cache"))
    code, clean = cli("run", str(path), "--no-progress")
    assert code == 0, clean
    uninterrupted = stage_runs(client, run_id_of(clean))
    for a, b in zip(resumed, uninterrupted, strict=True):
        assert a.data.metrics["test_acc_mean"] == pytest.approx(b.data.metrics["test_acc_mean"], abs=1e-6)


def test_resume_rejects_unknown_runs(workdir):
    code, output = cli("run", "--resume", "0123456789abcdef0123456789abcdef")
    assert code == 2 and "--resume=" in output


def test_peak_memory_sees_a_stage_allocation_and_not_earlier_ones():
    """Also when the engine has told the allocator to keep freed memory (as every CPU round does)."""
    import time

    import psutil
    import torch

    from fedpilot.engine.memory import PeakMemory, keep_freed_memory, release_freed_memory

    keep_freed_memory(torch.device("cpu"))
    release_freed_memory()  # as PeakMemory starts: what earlier tests freed is not part of the baseline
    before = psutil.Process().memory_info().rss
    with PeakMemory(torch.device("cpu")) as memory:
        block = torch.ones(50 * 2**20)  # 200 MiB, touched
        time.sleep(0.2)
        del block
    assert memory.bytes >= before + 150 * 2**20
    with PeakMemory(torch.device("cpu")) as later:
        time.sleep(0.1)
    assert later.bytes < memory.bytes - 100 * 2**20


def test_the_progress_bar_says_when_the_first_round_times_the_executors(workdir, monkeypatch):
    monkeypatch.setattr("fedpilot.cli.pipeline.on_terminal", lambda stream: True)  # the bars are a terminal's only
    spec = {**SMALL, "stages": [SMALL["stages"][0], {**SMALL["stages"][1], "execution": "loop"}]}
    code, output = cli("run", str(write_pipeline(workdir, spec)))
    assert code == 0, output
    bars = {stage: [line for line in output.replace("\r", "\n").splitlines() if stage in line]
            for stage in ("pretrain", "personalize")}
    assert any("timing the executor candidates" in line for line in bars["pretrain"]), output  # execution: auto
    assert not any("timing" in line for line in bars["personalize"]), output  # pinned: nothing to time
