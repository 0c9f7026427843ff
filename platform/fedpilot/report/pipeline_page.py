"""The page of one or several pipeline runs, and the summaries the command line and a run's description share."""

from __future__ import annotations

import pandas as pd

from fedpilot.metric_names import NOVEL, SELECTED, SELECTED_SHARE, TABLE_STATS, higher_is_better, metric_label
from fedpilot.report.figures import (
    before_after_figure,
    cdf_figure,
    change_figure,
    client_table,
    cohort_figure,
    curves_figure,
    footprint_figure,
    human_bytes,
    table_figure,
)
from fedpilot.report.page import page
from fedpilot.report.runs import PipelineRun, primary_metric

REPORT_ARTIFACT = "report.html"


def stage_cells(metrics: dict[str, float], metric: str) -> dict[str, str]:
    """A stage's per-client test distribution and the shares of clients better and worse than the stage before,
    formatted (empty where not recorded: the first stage has no before)."""
    cells = {s: f"{metrics[k]:.3f}" if (k := f"test_{metric}_{s}") in metrics else "" for s in TABLE_STATS}
    cells.update({w: f"{metrics[k]:.0%}" if (k := f"test_{metric}_frac_{w}") in metrics else ""
                  for w in ("better", "worse")})
    return cells


def beyond_cells(metrics: dict[str, float], metric: str) -> dict[str, str]:
    """What a stage recorded beyond its participating clients, formatted, each only where recorded: the novel
    clients' test mean and p10 after their adaptation, the participation gap (participating minus novel mean), and
    with a per-client choice of model the selected test mean and p10 and the share that kept the personal model."""
    keys = {"novel mean": f"{NOVEL}_test_{metric}_mean", "novel p10": f"{NOVEL}_test_{metric}_p10",
            "participation gap": f"participation_gap_{metric}_mean", "selected mean": f"{SELECTED}_test_{metric}_mean",
            "selected p10": f"{SELECTED}_test_{metric}_p10"}
    cells = {label: f"{metrics[key]:+.3f}" if label == "participation gap" else f"{metrics[key]:.3f}"
             for label, key in keys.items() if key in metrics}
    if SELECTED_SHARE in metrics:
        cells["kept personal"] = f"{metrics[SELECTED_SHARE]:.0%}"
    return cells


def summary_table(runs: list[PipelineRun]) -> pd.DataFrame:
    """Per run and stage: the distribution of the per-client test metric, the shares of clients better and worse
    than in the stage before, the novel clients and the selected models where recorded (beyond_cells), and the
    measured peak memory."""
    metric, rows, beyond = runs[0].metric, [], []
    for run in runs:
        for stage in run.stages:
            peak = stage.metrics.get("peak_memory_bytes")
            extra = beyond_cells(stage.metrics, metric)
            beyond += [k for k in extra if k not in beyond]
            rows.append({"run": run.label, "stage": stage.name, "cache": stage.cache,
                         **stage_cells(stage.metrics, metric), **extra,
                         "peak memory": human_bytes(peak) if peak else ""})
    columns = ["run", "stage", "cache", *TABLE_STATS, "better", "worse", *beyond, "peak memory"]
    frame = pd.DataFrame(rows, columns=columns).fillna("")
    return frame.drop(columns="run") if len(runs) == 1 else frame


def pipeline_note(stages: list[tuple[str, str, dict[str, float]]]) -> str:
    """A pipeline run's description (markdown, on its MLflow Overview page) from (stage, cache, metrics) triples."""
    metric = primary_metric(stages[-1][2])
    lines = [f"Per-client test {metric_label(metric)} by stage; the whole report is the artifact `{REPORT_ARTIFACT}`.",
             "", "| stage | cache | mean | p10 | min | better | worse |", "|---|---|---|---|---|---|---|"]
    for name, cache, metrics in stages:
        c = stage_cells(metrics, metric)
        lines.append(f"| {name} | {cache} | {c['mean']} | {c['p10']} | {c['min']} | {c['better']} | {c['worse']} |")
    return "\n".join(lines)


BEYOND_HOW = {"novel mean": " Novel: the clients held out of every round, after the adaptation a newcomer gets; "
               "participation gap: the participating clients' mean minus theirs.",
               "selected mean": " Selected: each client with whichever of the global and its personalized model "
               "scored better on its val split; kept personal: the share that kept its personalized model."}


def render(runs: list[PipelineRun], tracking_uri: str = "") -> str:
    """The HTML page of `runs` (one: its own report; several: side by side)."""
    metric = metric_label(runs[0].metric)
    stages = summary_table(runs)
    named = [c for c in ("run", "stage") if c in stages]
    beyond = [c for c in stages if c not in (*named, "cache", *TABLE_STATS, "better", "worse", "peak memory")]
    sections = [
        ("Per-client test " + metric, "Summary per stage: distribution over clients; better / worse = share of "
         "clients whose test " + metric + " rose / fell against the stage before.", stages.drop(columns=beyond)),
        ("Beyond the participating clients", "".join(how for column, how in BEYOND_HOW.items() if column in stages),
         stages[[*named, *beyond]] if beyond else None),
        ("CDF of per-client test " + metric, "Fraction of clients at or below each value: a curve further right is "
         "better; its lower-left part are the clients doing worst.", cdf_figure(runs)),
        ("Each client before and after a stage", "One point per client; above the diagonal it improved. Hover for "
         "its name.", before_after_figure(runs)),
        ("Change per client by stage", "Each client's test " + metric + " after the stage minus before it: the "
         "violin is their distribution, the box its quartiles and median, the dashed line its mean, each point a "
         "client." + ("" if higher_is_better(runs[0].metric) else " Below 0 is better."), change_figure(runs)),
        ("Curves", "Evaluation of every client on its validation split and the training loss, by round.",
         curves_figure(runs)),
        ("The algorithm's per-client values by round", "Over each round's cohort: the median (line), the 10th to "
         "90th percentile (band), the least and largest (dotted); e.g. Self-FL's local steps (Chen et al., NeurIPS "
         "2022, Eq. 8 and Fig. 11), pFedGate's model and upload densities.", cohort_figure(runs)),
        ("Footprints", "Bytes per stage: shared model, one client's personal part, the bank of all personal parts, "
         "communication per round, the measured peak memory and the estimate where recorded.", footprint_figure(runs)),
        ("Per-client table", "Test " + metric + " of every client after each stage; sort it with the menu.",
         table_figure(client_table(runs))),
    ]
    runs_line = "; ".join(f"{r.name}: run {r.run_id} (experiment {r.experiment_id})" for r in runs)
    return page("fedpilot report: " + " vs ".join(r.name for r in runs), runs_line, tracking_uri, sections)
