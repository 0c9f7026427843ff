"""`fedpilot compare`: a set of pipelines over seeds -> one table (mean and p10 of per-client test accuracy, mean
and sd over seeds, paired differences with the baseline and their Holm-adjusted intervals) on stdout and in MLflow,
with every seed's run linked; each client's change against the baseline on every seed, the clients helped / hurt on
every seed, and the report (tests/test_stats.py checks the statistics themselves)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from fedpilot.client_effects import CHANGES_TABLE, client_changes, every_seed, federation_note, seed_counts
from fedpilot.report import REPORT_ARTIFACT, build
from fedpilot.report.comparison_page import forest_figure
from fedpilot.report.runs import clients_frame
from fedpilot.stats.intervals import t_interval
from fedpilot.stats.scores import summarize
from fedpilot.stats.table import format_counts, format_table
from fedpilot.stats.verdicts import verdicts
from pipeline_fixtures import SMALL, cli, run_id_of, runs_of, write_pipeline
from test_stats import scores_and_values

TWO_STAGES = {**SMALL, "tracking": {"system_metrics": False, "plots": False},
              "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 2}]}
K2 = {key: value for key, value in TWO_STAGES.items() if key != "dataset"} | {
    "defaults": [{"dataset": "digits-k2"}, {"model": "mlp"}, "_self_"]}  # digits-k2's 50 clients, 2 rounds a stage


def write_set(folder, spec: dict = TWO_STAGES, **changes) -> str:
    write_pipeline(folder, {**spec, "name": "base"}, "base.yaml")
    other = {**spec, "name": "other", "stages": [spec["stages"][0], {**spec["stages"][1], "algorithm": "fedsim"}]}
    write_pipeline(folder, other, "other.yaml")
    comparison = {"name": "pair", "baseline": "base", "seeds": 2, "pipelines": ["base.yaml", "other.yaml"], **changes}
    (folder / "pair.yaml").write_text(yaml.safe_dump(comparison))
    return str(folder / "pair.yaml")


def test_compare_runs_every_pipeline_on_every_seed_and_records_the_paired_table(workdir):
    code, output = cli("compare", write_set(workdir, K2), "--seeds", "3")
    assert code == 0, output
    client = MlflowClient()
    run = client.get_run(run_id_of(output))
    assert run.data.tags["fedpilot.compare"] == "pair" and run.info.status == "FINISHED"
    finals, last = {}, {}
    for name in ("base", "other"):
        for seed in (0, 1, 2):
            child = client.get_run(run.data.tags[f"run.{name}.{seed}"])
            assert child.data.tags["mlflow.parentRunId"] == run.info.run_id  # nested: linked in the UI
            assert child.data.params["seed"] == str(seed)
            finals[name, seed] = {s: child.data.metrics[f"final_{s}"] for s in ("test_acc_mean", "test_acc_p10")}
            last[name, seed] = clients_frame(client, runs_of(client, child.info.run_id)[-1].info.run_id)
    metrics = run.data.metrics
    for score in ("test_acc_mean", "test_acc_p10"):
        other = np.array([finals["other", s][score] for s in (0, 1, 2)])
        diffs = other - np.array([finals["base", s][score] for s in (0, 1, 2)])
        assert metrics[f"other.{score}.mean"] == pytest.approx(other.mean())
        assert metrics[f"other.{score}.sd"] == pytest.approx(other.std(ddof=1))
        assert metrics[f"other.{score}.diff_mean"] == pytest.approx(diffs.mean())
        assert metrics[f"other.{score}.better"] == pytest.approx((diffs > 0).mean())
        assert metrics[f"other.{score}.worse"] == pytest.approx((diffs < 0).mean())
        assert f"base.{score}.diff_mean" not in metrics and f"base.{score}.resolved" not in metrics  # no self-diff
        # one comparison: nothing to adjust, the t interval at 95% (tests/test_stats.py checks the statistics)
        assert metrics[f"other.{score}.level"] == pytest.approx(0.05)
        assert (metrics[f"other.{score}.t_holm_low"], metrics[f"other.{score}.t_holm_high"]) == pytest.approx(
            tuple(t_interval(diffs).__dict__.values()))
        assert metrics[f"other.{score}.resolved"] == float(metrics[f"other.{score}.p_holm"] <= 0.05)
    assert finals["base", 0] != finals["base", 1]  # each seed its own partition and initialisation
    table = output.split("baseline base", 1)[1]
    assert re.search(r"\nother .* [+-]\d+\.\d\d \[[+-]\d+\.\d\d, [+-]\d+\.\d\d\] pp", table), table
    artifacts = client.download_artifacts(run.info.run_id, "comparison.json", str(workdir))
    recorded = json.loads(Path(artifacts).read_text())
    assert recorded["runs"]["other"]["1"] == run.data.tags["run.other.1"]
    verdict = recorded["verdicts"]["test_acc_mean"]["other"]
    assert verdict["clients"] == 50 and verdict["seeds"] == 3 and "nested" in recorded["method"]["bootstrap"]
    assert verdict["p"] == max(verdict["p_t"], verdict["p_boot"])
    assert "base" not in recorded["verdicts"]["test_acc_mean"]
    # per client: the last stage's test accuracy minus the baseline's, by name, on each seed
    table = json.loads(Path(client.download_artifacts(run.info.run_id, CHANGES_TABLE, str(workdir))).read_text())
    changes = pd.DataFrame(table["data"], columns=table["columns"])
    assert table["columns"] == ["client", "pipeline", "seed", "change"] and set(changes["pipeline"]) == {"other"}
    for seed in (0, 1, 2):
        base, other = (last[name, seed].set_index("name")["test_acc"] for name in ("base", "other"))
        assert len(base) == 50
        recorded = changes[changes["seed"] == seed].set_index("client")["change"]
        assert recorded.sort_index().to_numpy() == pytest.approx((other - base).sort_index().to_numpy(), abs=1e-5)
    counts = {k: metrics[f"other/clients_{k}"] for k in ("helped_every_seed", "hurt_every_seed",
                                                           "unchanged_every_seed", "mixed")}
    assert counts == seed_counts(changes, ["other"], 3, higher=True)["other"]
    assert sum(counts.values()) == len(every_seed(changes, 3)) > 0
    assert "dataset.seed is unset" in output  # each seed draws its own shards: say that a name is other data
    # the intervals' statement, and the step of one test sample of the median client, in the mean
    sizes = last["base", 0]["test_samples"]
    assert metrics["sample_step.mean"] == pytest.approx(1 / sizes.median() / len(sizes))
    assert "resolution" not in output and "adjusted by Holm's step-down for the 1 comparison(s)" in output.replace(
        "\n", " ")
    # the comparison's report: the table, the clients sorted by mean change with their band, the counts
    page = Path(client.download_artifacts(run.info.run_id, REPORT_ARTIFACT, str(workdir))).read_text()
    # a client's name is other data on each seed (dataset.seed unset): its band is not drawn, the reason said first
    assert "Not drawn: a client&#x27;s name is not the same data on every seed" in page
    assert '"name":"min-max over seeds"' not in page
    assert "<th>unchanged on every seed</th>" in page and f"<td>{counts['unchanged_every_seed']:.0f}</td>" in page
    assert "bootstrap over seeds and clients" in page and "percentage points" in page  # the forest plot
    assert cli("report", run.info.run_id, "-o", str(workdir / "pair.html"))[0] == 0
    assert "Not drawn: a client&#x27;s name" in (workdir / "pair.html").read_text()
    # a pipeline's report: the change of each client in its second stage, as a dot plot
    pipeline_page = build(client, [run.data.tags["run.other.2"]])
    assert "Change per client by stage" in pipeline_page and '"type":"violin"' not in pipeline_page


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


def test_clients_helped_on_every_seed_hurt_on_every_seed_unchanged_or_mixed():
    """By name across seeds: a tie on one seed makes a client mixed, a tie on every seed unchanged, one missing on a
    seed is not counted, and for an error (lower is better) helped and hurt trade places; the baseline gets no
    rows."""
    values = {"base": {s: {"a": 0.5, "b": 0.5, "c": 0.5, "d": 0.5, "e": 0.5, "f": 0.5} for s in (0, 1, 2)},
              "p": {0: {"a": 0.75, "b": 0.25, "c": 0.75, "d": 0.75, "e": 1.0, "f": 1.0},
                    1: {"a": 1.0, "b": 0.25, "c": 0.25, "d": 0.5, "e": 1.0, "f": 1.0},
                    2: {"a": 0.625, "b": 0.375, "c": 0.75, "d": 0.75, "e": 0.875}}}
    changes = client_changes(values, "base")
    assert list(changes.columns) == ["client", "pipeline", "seed", "change"] and set(changes["pipeline"]) == {"p"}
    assert changes.set_index(["client", "seed"])["change"][("a", 1)] == 0.5 and len(changes) == 17
    assert seed_counts(changes, ["p"], 3, higher=True)["p"] == {"helped_every_seed": 2, "hurt_every_seed": 1,
                                                                "unchanged_every_seed": 0, "mixed": 2}
    assert seed_counts(changes, ["p"], 3, higher=False)["p"] == {"helped_every_seed": 1, "hurt_every_seed": 2,
                                                                 "unchanged_every_seed": 0, "mixed": 2}
    bands = every_seed(changes, 3)
    assert list(bands["client"]) == ["b", "c", "d", "a", "e"]  # sorted by mean change; f is not on every seed
    assert bands.set_index("client").loc["c", ["min", "max"]].tolist() == [-0.25, 0.25]
    values["p"][2]["b"] = 0.5  # b ties on seed 2: no longer hurt on every seed
    assert seed_counts(client_changes(values, "base"), ["p"], 3, higher=True)["p"]["hurt_every_seed"] == 0
    values["p"] = {s: {**values["p"][s], "d": 0.5} for s in (0, 1, 2)}  # d ties on every seed: unchanged
    assert seed_counts(client_changes(values, "base"), ["p"], 3, higher=True)["p"] == {
        "helped_every_seed": 2, "hurt_every_seed": 0, "unchanged_every_seed": 1, "mixed": 2}
    assert "unset" in federation_note({"p": {0: None, 1: None}})
    assert "dataset.seed=0 on every seed" in federation_note({"p": {0: 0, 1: 0}, "q": {0: 0, 1: 0}})


def test_the_table_keeps_its_columns_apart_and_counts_ties():
    """Every cell is separated from the next (a wide cell does not run into its neighbour), the baseline has no
    difference with itself, and ties count as neither better nor worse."""
    scores = {"base": {0: {"test_acc_mean": 28 / 35, "test_acc_p10": 0.8571},
                       1: {"test_acc_mean": 32 / 35, "test_acc_p10": 0.8571}},
              "a-much-longer-pipeline-name": {0: {"test_acc_mean": 30 / 35, "test_acc_p10": 0.7143},
                                              1: {"test_acc_mean": 30 / 35, "test_acc_p10": 0.8571}}}
    summary = summarize(scores, "base")
    assert summary["a-much-longer-pipeline-name"]["test_acc_mean.diff_mean"] < 0  # -5.6e-17
    assert summary["a-much-longer-pipeline-name"]["test_acc_mean.better"] == 0.5  # 1 of 2 seeds, the other worse
    assert summary["a-much-longer-pipeline-name"]["test_acc_p10.better"] == 0.0  # a tie and a loss
    shown = {"test_acc_mean": {"a-much-longer-pipeline-name": {
        "diff_mean": -5.6e-17, "resolved": False, "t_holm_low": -0.7262, "t_holm_high": 0.7262, "boot_holm_low": -0.05,
        "boot_holm_high": 0.05}}}
    table = format_table(summary, "base", 2, verdicts=shown)
    header, base, other = table.splitlines()[1:]
    assert header.split() == ["pipeline", "test_acc_mean", "vs", "baseline", "test_acc_p10", "vs", "baseline"]
    assert re.split(r"\s{2,}", other) == ["a-much-longer-pipeline-name", "0.8571 ± 0.0000",
                                          "+0.00 [-72.62, +72.62] pp", "0.7857 ± 0.1010"]  # no verdict for p10
    assert re.split(r"\s{2,}", base) == ["base", "0.8571 ± 0.0808", "0.8571 ± 0.0000"]
    for seed, value in ((0, 0.5), (1, 0.75)):  # a score only one pipeline recorded: a column of its own
        scores["base"][seed]["novel_test_acc_mean"] = value
    header, base, other = format_table(summarize(scores, "base"), "base", 2, verdicts=shown).splitlines()[1:]
    assert header.split()[-1] == "novel_test_acc_mean" and base.endswith("0.6250 ± 0.1768")


def test_the_forest_plot_draws_the_adjusted_intervals_in_percentage_points():
    """Per pipeline its difference in test_acc_mean with the baseline (x 100: percentage points), the bars its
    Holm-adjusted t and bootstrap intervals, a filled marker where resolved; the first pipeline at the top."""
    scores, values = scores_and_values({"base": 0.0, "big": 0.05, "none": 0.0})
    found = verdicts(scores, values, "base", "acc", crossed=True)
    record = {"metric": "acc", "baseline": "base", "verdicts": found}
    figure = forest_figure(record)
    t, boot, baseline = figure.data
    assert t.name == "t over seeds" and boot.name == "bootstrap over seeds and clients"
    rows = found["test_acc_mean"]
    assert list(t.x) == pytest.approx([100 * rows[n]["diff_mean"] for n in ("none", "big")])
    assert list(t.error_x.array) == pytest.approx([100 * (rows[n]["t_holm_high"] - rows[n]["diff_mean"])
                                                   for n in ("none", "big")])
    assert list(boot.error_x.arrayminus) == pytest.approx([100 * (rows[n]["diff_mean"] - rows[n]["boot_holm_low"])
                                                           for n in ("none", "big")])
    assert list(t.marker.symbol) == ["circle-open", "circle"] and "percentage points" in figure.layout.xaxis.title.text
    assert list(figure.layout.yaxis.ticktext) == ["base (baseline)", "none", "big"]
    assert baseline.name == "the baseline" and list(baseline.x) == [0]


def test_the_printed_counts_show_the_clients_unchanged_on_every_seed_apart():
    counts = {"fedalt": {"helped_every_seed": 3, "hurt_every_seed": 1, "unchanged_every_seed": 2, "mixed": 4},
              "older": {"helped_every_seed": 1, "hurt_every_seed": 0, "mixed": 5}}  # recorded before it was counted
    head, columns, fedalt, older = format_counts(counts, "fedavg", 3).splitlines()
    assert "better / worse than with fedavg on each of 3 seed(s)" in head
    assert columns.split() == ["pipeline", "helped", "every", "seed", "hurt", "every", "seed", "unchanged", "every",
                               "seed", "mixed"]
    assert fedalt.split() == ["fedalt", "3", "1", "2", "4"] and older.split() == ["older", "1", "0", "5"]
