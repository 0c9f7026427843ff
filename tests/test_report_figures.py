"""The pipeline report's figures, checked from the data they are drawn from (issue 53): axis titles and units (a
bytes axis ticked in IEC units, y labels on the curves), discrete values drawn as dots, not densities, the fan of
the validation metric per stage, what ran and the test samples per client stated."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedpilot.report.curves import curves_figure
from fedpilot.report.figures import bytes_ticks, change_figure, dot_heights, footprint_figure
from fedpilot.report.pipeline_page import render, samples_note
from fedpilot.report.runs import PipelineRun, Stage

ROUNDS = pd.RangeIndex(2, 8, 2)


def curves(shift: float) -> dict[str, pd.Series]:
    """A stage's validation quantiles over clients and its training loss by round."""
    stats = {"p10": 0.1, "p25": 0.3, "p50": 0.5, "p75": 0.7, "p90": 0.9, "mean": 0.45}
    series = {f"val_acc_{stat}": pd.Series([v + shift] * len(ROUNDS), index=ROUNDS, dtype=float)
              for stat, v in stats.items()}
    return {**series, "train_loss": pd.Series([2.0, 1.5, 1.0], index=ROUNDS, dtype=float)}


def quickstart_like() -> PipelineRun:
    """Two stages of 4 clients with 4 test samples each (3 for one): accuracy in steps of 0.25."""
    clients = pd.DataFrame({"client": range(4), "name": list("abcd"), "test_acc": [0.5, 0.75, 1.0, 1.0],
                            "test_samples": [4, 4, 3, 4]})
    after = clients.assign(previous_test_acc=[0.25, 0.75, 1.0, 0.75], test_acc=[0.5, 0.75, 1.0, 1.0])
    footprints = {"shared_bytes": 60_040.0, "personal_bytes_per_client": 8040.0, "comm_bytes_per_round": 1_200_800.0,
                  "peak_memory_bytes": 668_893_184.0, "estimated_training_bytes": 183_912.0}
    stages = [Stage("pretrain", "s0", "miss", {"rounds": 6, "test_acc_mean": 0.81, **footprints}, clients,
                    curves(0.0)),
              Stage("personalize", "s1", "hit", {"rounds": 6, "test_acc_mean": 0.81, **footprints}, after,
                    curves(0.05))]
    return PipelineRun("r1", "quickstart", "1", stages, "quickstart", ran="quickstart: digits data, 4 clients")


def test_the_bytes_axis_is_ticked_in_iec_units_and_titled():
    figure = footprint_figure([quickstart_like()])
    axis = figure.layout.yaxis
    assert axis.type == "log" and axis.title.text == "bytes (log scale; 1 KiB = 1024 B)"
    assert list(axis.ticktext) == ["1 KiB", "32 KiB", "1 MiB", "32 MiB", "1 GiB"]  # never plotly's "1B" (a billion)
    assert list(axis.tickvals) == [2.0 ** p for p in (10, 15, 20, 25, 30)]
    bars = figure.data[0]
    assert list(bars.x)[-2:] == ["measured peak", "estimate"] and bars.text[-2] == "637.9 MiB"
    assert bytes_ticks([]) == {} and bytes_ticks([512.0])["ticktext"] == ["32 B", "1 KiB"]


def test_discrete_changes_are_stacked_dots_not_a_density():
    x, height = dot_heights(np.array([0.25, 0.0, 0.25, 0.0, 0.0, -0.25]))
    assert list(x) == [0.25, 0.0, 0.25, 0.0, 0.0, -0.25] and list(height) == [1, 1, 2, 2, 3, 1]
    many = np.linspace(0, 1, 100)  # more distinct values than bins: binned first, each bin its stack
    x, height = dot_heights(many)
    assert len(np.unique(x)) <= 40 and height.max() <= 4
    figure = change_figure([quickstart_like()])
    dots = figure.data[0]
    assert dots.type == "scatter" and dots.mode == "markers" and not any(t.type == "violin" for t in figure.data)
    assert list(dots.x) == [0.25, 0.0, 0.0, 0.25] and list(dots.y) == [1, 1, 2, 2]
    assert figure.layout.annotations[0].text == "personalize: 2 better, 0 worse, 2 unchanged"
    assert figure.layout.xaxis.title.text == "change in test accuracy per client"
    assert list(figure.layout.xaxis.tickvals) == [0.0, 0.25]  # the values there are, each a tick
    assert figure.layout.yaxis.title.text == "clients"


def test_the_round_curves_are_one_fan_per_stage_with_titled_axes():
    figure = curves_figure([quickstart_like()])
    titles = [a.text for a in figure.layout.annotations]
    assert titles == ["validation accuracy over clients", "training loss"]
    assert figure.layout.yaxis.title.text == "validation accuracy of a client"
    assert figure.layout.yaxis2.title.text == "training loss (mean over the round's local steps)"
    assert figure.layout.xaxis.title.text == "round (stages one after another)"
    fan = [t for t in figure.data if t.xaxis == "x"]
    bands = [t for t in fan if t.fill == "tonexty"]
    assert len(bands) == 4  # p10-p90 and p25-p75, per stage
    assert list(bands[0].y) == [0.1] * 3 and list(bands[0].customdata) == [0.9] * 3  # the first stage's p10 to p90
    medians = [t for t in fan if t.line.dash == "solid" and t.fill is None and t.mode == "lines" and t.showlegend]
    assert [t.name for t in medians] == ["pretrain", "personalize"]
    assert list(medians[1].x) == [8, 10, 12]  # the second stage after the first's 6 rounds
    means = [t for t in fan if t.line.dash == "dash"]
    assert list(means[0].y) == [pytest.approx(0.45)] * 3


def test_the_page_states_what_ran_and_the_test_samples_per_client():
    run = quickstart_like()
    said = samples_note([run])
    assert said.startswith("Clients have 3 to 4 test samples (median 4).")
    assert "steps of 1/4 = 0.25: it is one of 0, 0.25, 0.5, 0.75, 1" in said
    page = render([run])
    assert "<h2>What ran</h2>" in page and "quickstart: digits data, 4 clients" in page
    assert page.index("What ran") < page.index("Per-client test accuracy")
    assert "weighted: the mean weighted by each client&#x27;s test samples" in page
    assert "cache: hit = the stage was reused from the stage cache" in page
    assert "Measured peak: this process&#x27;s peak memory" in page and "Estimate: Pillutla et al." in page


def test_the_comparison_draws_each_study_on_its_own_scale_from_trial_0_and_counts_unchanged_clients():
    from fedpilot.report.comparison_page import ComparisonRun, band_figure, best_so_far_figure, counted

    study = {"trials": 3, "pruned": 1, "improving_late": False}
    record = {"objective": "val_acc_mean", "seeds": [0, 1], "baseline": "base", "federation": "dataset.seed is unset",
              "tuning": {"base": {**study, "best_so_far": [0.9, 0.95, 0.95]},
                         "other": {**study, "best_so_far": [0.1, 0.1, 0.2], "improving_late": True}}}
    changes = pd.DataFrame({"client": ["a", "a"], "pipeline": ["other", "other"], "seed": [0, 1], "change": [0., 0.]})
    counts = {"other": {"helped_every_seed": 0, "hurt_every_seed": 0, "unchanged_every_seed": 1, "mixed": 0}}
    comparison = ComparisonRun("c", "pair", "1", record, "", changes, counts)
    figure = best_so_far_figure(comparison)
    assert [a.text for a in figure.layout.annotations] == ["base: 3 trials, 1 pruned", "other: 3 trials, 1 pruned"]
    assert [t.yaxis for t in figure.data] == ["y", "y2"]  # one panel each: 0.9 does not squash 0.1 flat
    assert list(figure.data[0].x) == [0, 1, 2] and figure.data[1].line.dash == "dash"
    assert figure.layout.xaxis.title.text == "trial (0: as written)"
    assert band_figure(comparison) is None  # a name is other data on each seed: not drawn
    comparison.record["federation"] = "dataset.seed=0 on every seed: the same federation throughout"
    assert band_figure(comparison).layout.annotations[0].text == \
        "other: 0 helped, 0 hurt, 1 unchanged on every seed, 0 mixed"
    assert counted({"helped_every_seed": 2, "hurt_every_seed": 1, "mixed": 3}) == \
        "2 helped, 1 hurt on every seed, 3 mixed"  # a run recorded before unchanged was counted


def verdict(diff: float, low: float, high: float, resolved: bool) -> dict:
    return {"diff_mean": diff, "t_holm_low": low, "t_holm_high": high, "boot_holm_low": low + 0.001,
            "boot_holm_high": high - 0.001, "resolved": resolved}


def tuned_comparison() -> dict:
    """A comparison.json of three pipelines of the set `k4`: fedalt resolved above the baseline, fedsim not."""
    summary = {name: {"test_acc_mean.mean": m, "test_acc_mean.sd": 0.01, "test_acc_p10.mean": m - 0.2,
                      "test_acc_p10.sd": 0.02} for name, m in (("k4-fedavg", 0.80), ("k4-fedsim", 0.81),
                                                               ("k4-fedalt", 0.85))}
    verdicts = {"test_acc_mean": {"k4-fedsim": verdict(0.01, -0.02, 0.04, False),
                                  "k4-fedalt": verdict(0.05, 0.02, 0.08, True)},
                "test_acc_p10": {"k4-fedsim": verdict(0.0, -0.1, 0.1, False),
                                 "k4-fedalt": verdict(0.0, -0.1, 0.1, False)}}
    study = {"study": "s", "trials": 3, "pruned": 1, "values": [0.5, 0.7], "best_so_far": [0.5, 0.5, 0.7],
             "chosen": {"stages.1.local.lr": 0.1, "stages.1.server.lr": 1.0}, "best": 0.7, "improving_late": True,
             "p10": 0.52, "p50": 0.6, "p90": 0.68, "stages": ["pretrain", "personalize"],
             "trial_values": [0.5, None, 0.7]}
    return {"baseline": "k4-fedavg", "metric": "acc", "seeds": [0, 1, 2], "summary": summary, "verdicts": verdicts,
            "objective": "val_acc_mean", "tuning": {"k4-fedalt": study}, "federation": "dataset.seed is unset"}


def test_the_comparison_table_and_forest_plot_read_like_a_papers():
    from fedpilot.report.comparison_page import ComparisonRun, best_so_far_figure, pipelines_frame, tuning_frame
    from fedpilot.report.forest import forest_figure

    record = tuned_comparison()
    comparison = ComparisonRun("c", "k4", "1", record, "", pd.DataFrame(), {})
    table = pipelines_frame(comparison)
    assert list(table["pipeline"]) == ["fedavg (baseline)", "fedalt", "fedsim"]  # marked, sorted, prefix dropped
    assert list(table.columns) == ["pipeline", "test_acc_mean", "test_acc_mean vs baseline", "test_acc_p10",
                                   "test_acc_p10 vs baseline"]  # no two columns named alike
    assert table.loc[1, "test_acc_mean vs baseline"] == "+5.00 [+2.00, +8.00] pp resolved"
    assert table.loc[2, "test_acc_mean vs baseline"] == "+1.00 [-2.00, +4.00] pp not resolved"  # holds 0: flagged
    figure = forest_figure(record)
    assert list(figure.layout.yaxis.ticktext) == ["fedavg (baseline)", "fedsim", "fedalt"]  # the largest on top
    assert figure.layout.xaxis.title.text == "test_acc_mean minus fedavg's, same seed (percentage points)"
    column = [a.text for a in figure.layout.annotations]
    assert column == ["+1.00 [-2.00, +4.00] not resolved", "+5.00 [+2.00, +8.00] resolved",
                      "<b>difference [adjusted 95% interval] pp</b>"]  # the text column, as in a paper
    assert [t.marker.symbol for t in figure.data[:1]] == [("circle-open", "circle")]  # filled where resolved
    assert figure.data[-1].name == "the baseline" and list(figure.data[-1].x) == [0]
    tuning = tuning_frame(comparison)
    assert tuning.loc[0, "chosen"] == "personalize.local.lr=0.1, personalize.server.lr=1"  # unique, readable keys
    assert tuning.loc[0, "p10 over trials"] == ""  # 2 completed trials: their percentiles would be noise
    trials = best_so_far_figure(comparison).data
    assert list(trials[1].x) == [0, 2] and list(trials[2].x) == [1] and trials[2].marker.symbol == "x"  # pruned

