"""The page of one or several pipeline runs, and the summaries the command line and a run's description share."""

from __future__ import annotations

import pandas as pd

from fedpilot.metric_names import NOVEL, SELECTED, SELECTED_SHARE, TABLE_STATS, higher_is_better, metric_label
from fedpilot.report.curves import cohort_figure, curves_figure
from fedpilot.report.figures import (
    before_after_figure,
    cdf_figure,
    change_figure,
    client_table,
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


def pipeline_note(stages: list[tuple[str, str, dict[str, float]]], ran: str = "") -> str:
    """A pipeline run's description (markdown, on its MLflow Overview page) from (stage, cache, metrics) triples:
    what ran (`ran`, as `fedpilot validate` says it), then the per-client test metric by stage."""
    metric = primary_metric(stages[-1][2])
    lines = [*(["What ran:", "", "```", ran, "```", ""] if ran else []),
             f"Per-client test {metric_label(metric)} by stage (cache hit: reused from the stage cache); the whole "
             f"report is the artifact `{REPORT_ARTIFACT}`.",
             "", "| stage | cache | mean | p10 | min | better | worse |", "|---|---|---|---|---|---|---|"]
    for name, cache, metrics in stages:
        c = stage_cells(metrics, metric)
        lines.append(f"| {name} | {cache} | {c['mean']} | {c['p10']} | {c['min']} | {c['better']} | {c['worse']} |")
    return "\n".join(lines)


BEYOND_HOW = {"novel mean": " Novel: the clients held out of every round, after the adaptation a newcomer gets; "
               "participation gap: the participating clients' mean minus theirs.",
               "selected mean": " Selected: each client with whichever of the global and its personalized model "
               "scored better on its val split; kept personal: the share that kept its personalized model."}


def samples_note(runs: list[PipelineRun]) -> str:
    """How many test samples a client has (least and median over the clients of every run) and, for a metric counted
    in samples (accuracy), the step one sample makes: why a CDF is a staircase and p50 or p90 often read 1.000."""
    sizes = pd.concat([s.clients["test_samples"] for r in runs for s in r.stages[-1:] if "test_samples" in s.clients])
    if sizes.empty:
        return ""
    least, median = int(sizes.min()), float(sizes.median())
    text = f"Clients have {least} to {int(sizes.max())} test samples (median {median:g})."
    if runs[0].metric == "acc" and median > 0:
        steps = ", ".join(f"{k / median:.2g}" for k in range(int(median) + 1)) if median <= 10 else ""
        text += (f" A client's test accuracy moves in steps of 1/{median:g} = {1 / median:.3g}"
                 + (f": it is one of {steps} for the median client, so the CDF is a staircase and its quantiles "
                    "sit on those values." if steps else "."))
    return text


HOW_TO_READ_STAGES = ("Summary per stage: the distribution over clients (weighted: the mean weighted by each client's "
                      "test samples, for accuracy the share of all test samples right); better / worse = share of "
                      "clients whose test {metric} rose / fell against the stage before; cache: hit = the stage "
                      "was reused from the stage cache (same data, spec, seed and code), miss = trained in this run.")
HOW_TO_READ_FOOTPRINTS = (
    "Bytes per stage, on a log scale ticked in IEC units. Shared model: the parameters every client shares; personal, "
    "per client: one client's own part; personal bank: every client's personal part, which the platform keeps. "
    "Communication per round: the shared model sent down to each client of a round's cohort plus what they upload, "
    "averaged over the stage's rounds (a stage that visits each client once, such as fine-tuning, is one round over "
    "its cohort that uploads nothing). Measured peak: this process's peak memory while the stage ran (resident set "
    "size on a CPU, the allocator's peak on a GPU): the runtime, the whole federation's data, the bank and a chunk "
    "of clients trained at once. Estimate: Pillutla et al.'s (ICML 2022, App. B.4) memory one client needs to train "
    "(3x the shared model, 2x its personal part, the activations of one batch): what a device must hold, hence orders "
    "of magnitude below the measured peak of a process that simulates them all.")


def render(runs: list[PipelineRun], tracking_uri: str = "") -> str:
    """The HTML page of `runs` (one: its own report; several: side by side)."""
    metric = metric_label(runs[0].metric)
    stages = summary_table(runs)
    named = [c for c in ("run", "stage") if c in stages]
    beyond = [c for c in stages if c not in (*named, "cache", *TABLE_STATS, "better", "worse", "peak memory")]
    ran = "\n\n".join((f"{r.label}:\n" if len(runs) > 1 else "") + r.ran for r in runs if r.ran)
    samples = samples_note(runs)
    sections = [
        ("What ran", "The pipeline as fedpilot validate shows it: data, model, and per stage its algorithm, rounds, "
         "clients per round, local work and learning rate.", ran or None),
        ("Per-client test " + metric, HOW_TO_READ_STAGES.format(metric=metric) + " " + samples,
         stages.drop(columns=beyond)),
        ("Beyond the participating clients", "".join(how for column, how in BEYOND_HOW.items() if column in stages),
         stages[[*named, *beyond]] if beyond else None),
        ("CDF of per-client test " + metric, "Fraction of clients at or below each value: a curve further right is "
         "better; its lower-left part are the clients doing worst. " + samples.split(". ", 1)[-1], cdf_figure(runs)),
        ("Each client before and after a stage", "One point per client; above the diagonal it improved. Hover for "
         "its name.", before_after_figure(runs)),
        ("Change per client by stage", "Each client's test " + metric + " after the stage minus before it, one dot "
         "per client stacked at its value (a dot plot: few test samples give few values, drawn as they are)."
         + ("" if higher_is_better(runs[0].metric) else " Below 0 is better."), change_figure(runs)),
        ("Curves by round", f"Left: every client's validation {metric} at each evaluation, as a fan per stage: the "
         "band from the 10th to the 90th percentile over clients, the darker one from the 25th to the 75th, the "
         "median (line) and the mean (dashed). Right: the training loss, the mean over the round's local steps.",
         curves_figure(runs)),
        ("The algorithm's per-client values by round", "Over each round's cohort: the median (line), the 10th to "
         "90th percentile (band), the least and largest (dotted); e.g. Self-FL's local steps (Chen et al., NeurIPS "
         "2022, Eq. 8 and Fig. 11), pFedGate's model and upload densities.", cohort_figure(runs)),
        ("Footprints", HOW_TO_READ_FOOTPRINTS, footprint_figure(runs)),
        ("Per-client table", "Test " + metric + " of every client after each stage; sort it with the menu.",
         table_figure(client_table(runs))),
    ]
    runs_line = "; ".join(f"{r.name}: run {r.run_id} (experiment {r.experiment_id})" for r in runs)
    return page("fedpilot report: " + " vs ".join(r.name for r in runs), runs_line, tracking_uri, sections)
