"""`fedpilot compare`: a set of pipelines over seeds -> one table (mean and p10 of per-client test accuracy, mean
and sd over seeds, paired differences with the baseline) on stdout and in MLflow, with every seed's run linked."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from fedpilot.compare import format_table, summarize
from pipeline_fixtures import SMALL, cli, run_id_of, write_pipeline

TWO_STAGES = {**SMALL, "tracking": {"system_metrics": False, "plots": False},
              "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 2}]}


def write_set(folder, **changes) -> str:
    write_pipeline(folder, {**TWO_STAGES, "name": "base"}, "base.yaml")
    other = {**TWO_STAGES, "name": "other", "stages": [TWO_STAGES["stages"][0],
                                                       {**TWO_STAGES["stages"][1], "algorithm": "fedsim"}]}
    write_pipeline(folder, other, "other.yaml")
    comparison = {"name": "pair", "baseline": "base", "seeds": 2, "pipelines": ["base.yaml", "other.yaml"], **changes}
    (folder / "pair.yaml").write_text(yaml.safe_dump(comparison))
    return str(folder / "pair.yaml")


def test_compare_runs_every_pipeline_on_every_seed_and_records_the_paired_table(workdir):
    code, output = cli("compare", write_set(workdir))
    assert code == 0, output
    client = MlflowClient()
    run = client.get_run(run_id_of(output))
    assert run.data.tags["fedpilot.compare"] == "pair" and run.info.status == "FINISHED"
    finals = {}
    for name in ("base", "other"):
        for seed in (0, 1):
            child = client.get_run(run.data.tags[f"run.{name}.{seed}"])
            assert child.data.tags["mlflow.parentRunId"] == run.info.run_id  # nested: linked in the UI
            assert child.data.params["seed"] == str(seed)
            finals[name, seed] = {s: child.data.metrics[f"final_{s}"] for s in ("test_acc_mean", "test_acc_p10")}
    metrics = run.data.metrics
    for score in ("test_acc_mean", "test_acc_p10"):
        other = np.array([finals["other", s][score] for s in (0, 1)])
        diffs = other - np.array([finals["base", s][score] for s in (0, 1)])
        assert metrics[f"other.{score}.mean"] == pytest.approx(other.mean())
        assert metrics[f"other.{score}.sd"] == pytest.approx(other.std(ddof=1))
        assert metrics[f"other.{score}.diff_mean"] == pytest.approx(diffs.mean())
        assert metrics[f"other.{score}.better"] == pytest.approx((diffs > 0).mean())
        assert metrics[f"other.{score}.worse"] == pytest.approx((diffs < 0).mean())
        assert metrics[f"base.{score}.diff_mean"] == 0.0
    assert finals["base", 0] != finals["base", 1]  # each seed its own partition and initialisation
    table = output.split("baseline base", 1)[1]
    assert re.search(r"\nother .* \(\d better, \d worse\)", table), table
    artifacts = client.download_artifacts(run.info.run_id, "comparison.json", str(workdir))
    recorded = json.loads(Path(artifacts).read_text())
    assert recorded["runs"]["other"]["1"] == run.data.tags["run.other.1"]


@pytest.mark.parametrize(("changes", "message"), [
    ({"baseline": "fedavg"}, r"baseline='fedavg': not the name of a pipeline of the set \(allowed: base, other\)"),
    ({"pipelines": ["base.yaml", "missing.yaml"]}, r"pipelines.1='missing.yaml': no such file"),
    ({"seeds": 0}, r"seeds=0: .*at least one seed"),
    ({"runs": 3}, r"runs=3: unknown key"),
    ({"overrides": ["stages.1.params.lr_w=0.1"]}, r"lr_w"),
])
def test_bad_sets_exit_2_naming_the_key_and_record_nothing(workdir, changes, message):
    code, output = cli("compare", write_set(workdir, **changes))
    assert code == 2 and "error: " in output
    assert re.search(message, output), output
    assert not (workdir / "mlflow.db").exists() or not MlflowClient().search_experiments(filter_string="name = 'pair'")


def test_the_table_keeps_its_columns_apart_and_counts_ties():
    """Every cell is separated from the next (a wide paired cell does not run into its neighbour), a difference
    that rounds to zero has no minus sign, and ties count as neither better nor worse."""
    scores = {"base": {0: {"test_acc_mean": 28 / 35, "test_acc_p10": 0.8571},
                       1: {"test_acc_mean": 32 / 35, "test_acc_p10": 0.8571}},
              "a-much-longer-pipeline-name": {0: {"test_acc_mean": 30 / 35, "test_acc_p10": 0.7143},
                                              1: {"test_acc_mean": 30 / 35, "test_acc_p10": 0.8571}}}
    assert summarize(scores, "base")["a-much-longer-pipeline-name"]["test_acc_mean.diff_mean"] < 0  # -5.6e-17
    table = format_table(summarize(scores, "base"), "base", 2)
    header, base, other = table.splitlines()[1:]
    assert header.split() == ["pipeline", "test_acc_mean", "vs", "baseline", "test_acc_p10", "vs", "baseline"]
    assert re.split(r"\s{2,}", other) == ["a-much-longer-pipeline-name", "0.8571 ± 0.0000",
                                          "+0.0000 ± 0.0808 (1 better, 1 worse)", "0.7857 ± 0.1010",
                                          "-0.0714 ± 0.1010 (0 better, 1 worse)"]
    assert re.split(r"\s{2,}", base) == ["base", "0.8571 ± 0.0808", "0.8571 ± 0.0000"]
