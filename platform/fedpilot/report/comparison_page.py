"""The page of a comparison's run (`fedpilot compare`): its table, each pipeline's verdict against the baseline with
its adjusted intervals (fedpilot.stats, read back from comparison.json), what each study chose and, per pipeline,
each client's change against the baseline over the seeds (fedpilot.client_effects)."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from mlflow import MlflowClient
from plotly.subplots import make_subplots

from fedpilot.client_effects import CHANGES_TABLE, COUNTS, FIXED_NAMES, every_seed
from fedpilot.errors import NoSuchRun
from fedpilot.metric_names import higher_is_better, metric_label
from fedpilot.report.figures import COLORS, sized
from fedpilot.report.page import Section, page
from fedpilot.report.runs import read_table
from fedpilot.stats.scores import in_points
from fedpilot.stats.study import StudySummary
from fedpilot.stats.table import frame, pipelines_rows, tuning_rows, verdict_rows
from fedpilot.tracking import COMPARE_TAG, PIPELINE_TAG


@dataclass
class ComparisonRun:
    run_id: str
    name: str
    experiment_id: str
    record: dict  # its comparison.json: baseline, metric, seeds, federation, scores, runs, summary, verdicts
    table: str  # its comparison.txt
    changes: pd.DataFrame  # its clients_across_seeds.json: client, pipeline, seed, change
    counts: dict[str, dict[str, int]]  # pipeline -> helped / hurt / unchanged on every seed, mixed (its metrics)


def is_comparison(run) -> bool:
    """Whether `run` is a comparison's own run (not one of its pipeline runs)."""
    return COMPARE_TAG in run.data.tags and PIPELINE_TAG not in run.data.tags


def load_comparison_run(client: MlflowClient, run) -> ComparisonRun:
    """A finished comparison's run as its report reads it."""
    run_id = run.info.run_id
    paths = {a.path for a in client.list_artifacts(run_id)}
    if "comparison.json" not in paths:
        raise NoSuchRun("RUN_ID", run_id, "this comparison has not finished (no comparison.json)")
    with tempfile.TemporaryDirectory() as tmp:
        record = json.loads(Path(client.download_artifacts(run_id, "comparison.json", tmp)).read_text())
        table = Path(client.download_artifacts(run_id, "comparison.txt", tmp)).read_text()
    metrics = run.data.metrics
    counts = {p: {k: int(metrics[f"{p}/clients_{k}"]) for k in COUNTS if f"{p}/clients_{k}" in metrics}
              for p in record["runs"] if f"{p}/clients_{COUNTS[0]}" in metrics}  # an older run: no unchanged
    return ComparisonRun(run_id, run.info.run_name, run.info.experiment_id, record, table,
                         read_table(client, run_id, CHANGES_TABLE), counts)


def band_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline, its clients (seen on every seed) sorted by their mean change against the baseline, the line
    their mean and the band the least and the most over the seeds (Pillutla et al., ICML 2022, Fig. 11)."""
    pipelines = list(comparison.counts)
    if not pipelines or comparison.changes.empty or not same_clients(comparison):
        return None
    bands = every_seed(comparison.changes, len(comparison.record["seeds"]))
    cols = min(2, len(pipelines))
    rows = -(-len(pipelines) // cols)
    titles = [f"{p}: {counted(c)}" for p, c in comparison.counts.items()]
    fig = make_subplots(rows, cols, subplot_titles=titles, shared_yaxes="all", vertical_spacing=0.3 / rows)
    for i, pipeline in enumerate(pipelines):
        frame, row, col = bands[bands["pipeline"] == pipeline], i // cols + 1, i % cols + 1
        rank, color = np.arange(1, len(frame) + 1), COLORS[i % len(COLORS)]
        text = [f"{c}: mean {m:+.3f}, min {lo:+.3f}, max {hi:+.3f}"
                for c, m, lo, hi in zip(frame["client"], frame["mean"], frame["min"], frame["max"], strict=True)]
        fig.add_trace(go.Scatter(x=rank, y=frame["max"], mode="lines", line={"width": 0}, showlegend=False,
                                 hoverinfo="skip"), row, col)
        fig.add_trace(go.Scatter(x=rank, y=frame["min"], mode="lines", line={"width": 0}, fill="tonexty",
                                 fillcolor="rgba(99,110,250,0.25)", name="min-max over seeds", showlegend=i == 0,
                                 hoverinfo="skip"), row, col)
        fig.add_trace(go.Scatter(x=rank, y=frame["mean"], mode="lines+markers", line_color=color, text=text,
                                 marker={"size": 4}, name=pipeline, showlegend=False,
                                 hovertemplate="%{text}<extra>" + pipeline + "</extra>"), row, col)
        fig.add_hline(y=0, line={"color": "grey", "width": 1}, row=row, col=col)
        fig.update_xaxes(title_text="clients sorted by mean change", row=row, col=col)
    metric = metric_label(comparison.record.get("metric", "acc"))
    fig.update_yaxes(title_text=f"change in test {metric}", col=1)
    return sized(fig, 80 + 320 * rows, top=60)


def same_clients(comparison: ComparisonRun) -> bool:
    """Whether a client's name is the same data on every seed (the federation held fixed): else its change over
    the seeds mixes the draw of the federation with training's randomness, and is not drawn."""
    return FIXED_NAMES in comparison.record.get("federation", "")


def counted(counts: dict[str, int]) -> str:
    """'3 helped, 1 hurt, 44 unchanged on every seed, 2 mixed' (unchanged where recorded)."""
    shown = [f"{counts[k]} {k.removesuffix('_every_seed')}" for k in COUNTS[:3] if k in counts]
    return ", ".join(shown) + f" on every seed, {counts['mixed']} mixed"


def counts_table(comparison: ComparisonRun) -> pd.DataFrame | None:
    """Per pipeline, its clients helped on every seed, hurt on every seed, unchanged on every seed, and mixed."""
    if not comparison.counts:
        return None
    return pd.DataFrame([{"pipeline": p, **{k.replace("_every_seed", " on every seed"): n for k, n in c.items()}}
                         for p, c in comparison.counts.items()])


def pipelines_frame(comparison: ComparisonRun) -> pd.DataFrame:
    """The comparison's table of pipelines against the baseline, as the command printed it (stats.table)."""
    record = comparison.record
    rows = pipelines_rows(record["summary"], record["baseline"], record.get("metric", "acc"), record.get("untuned"),
                          record.get("verdicts"))
    return frame(rows)


def verdicts_frame(comparison: ComparisonRun, score: str) -> pd.DataFrame | None:
    """One headline score's verdicts: the difference, the Holm-adjusted intervals, the p-values, resolved and the
    seeds a 0.5 pp difference needs (stats.table)."""
    rows = (comparison.record.get("verdicts") or {}).get(score)
    return frame(verdict_rows(rows, comparison.record.get("metric", "acc"))) if rows else None


FOREST_BARS = (("t", "t over seeds", 0.15), ("boot", "bootstrap over seeds and clients", -0.15))


def forest_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline, its paired difference in mean test metric with the baseline (in percentage points for
    accuracy): the marker the mean over seeds, the bars its Holm-adjusted t and bootstrap intervals, a filled marker
    where the difference is resolved."""
    record = comparison.record
    metric, baseline = record.get("metric", "acc"), record["baseline"]
    score = f"test_{metric}_mean"
    rows = (record.get("verdicts") or {}).get(score) or {}
    if not rows:
        return None
    names, scale = list(rows)[::-1], 100.0 if in_points(metric) else 1.0  # the first pipeline at the top
    fig = go.Figure()
    for i, (kind, label, offset) in enumerate(FOREST_BARS):
        shown = [n for n in names if np.isfinite(rows[n][f"{kind}_holm_low"] + rows[n][f"{kind}_holm_high"])]
        diff, low, high = (np.array([rows[n][k] for n in shown]) * scale
                           for k in ("diff_mean", f"{kind}_holm_low", f"{kind}_holm_high"))
        text = [f"{n}: {d:+.2f} [{lo:+.2f}, {hi:+.2f}] at level {rows[n]['level']:.4g}"
                + (", resolved" if rows[n]["resolved"] else "") for n, d, lo, hi in zip(shown, diff, low, high,
                                                                                        strict=True)]
        fig.add_trace(go.Scatter(
            x=diff, y=[names.index(n) + offset for n in shown], mode="markers", name=label, text=text,
            marker={"size": 9, "color": COLORS[i], "symbol": ["circle" if rows[n]["resolved"] else "circle-open"
                                                              for n in shown]},
            error_x={"type": "data", "symmetric": False, "array": high - diff, "arrayminus": diff - low},
            hovertemplate="%{text}<extra>" + label + "</extra>"))
    fig.add_vline(x=0, line={"color": "grey", "width": 1})
    fig.update_yaxes(tickvals=list(range(len(names))), ticktext=names)
    unit = " (percentage points)" if in_points(metric) else ""
    fig.update_layout(xaxis_title=f"{score} minus {baseline}'s, same seed{unit}", legend={"orientation": "h"})
    return sized(fig, 200 + 40 * len(names))


def best_so_far_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline's study, a panel of its own (its own scale: one study's values do not squash another's) with
    the best objective after each finished trial, trial 0 the pipeline as written (dashed where it still improved
    in the last quarter of the trials: the budget may have been short)."""
    tuning = comparison.record.get("tuning") or {}
    if not tuning:
        return None
    cols = min(3, len(tuning))
    rows = -(-len(tuning) // cols)
    titles = [f"{name}: {study['trials']} trials, {study['pruned']} pruned" for name, study in tuning.items()]
    fig = make_subplots(rows, cols, subplot_titles=titles, vertical_spacing=0.4 / rows)
    for i, (name, study) in enumerate(tuning.items()):
        late = study["improving_late"]
        row, col = i // cols + 1, i % cols + 1
        fig.add_trace(go.Scatter(x=list(range(len(study["best_so_far"]))), y=study["best_so_far"],
                                 mode="lines+markers", name=name, line_color=COLORS[i % len(COLORS)],
                                 line_shape="hv", line_dash="dash" if late else "solid", showlegend=False,
                                 hovertemplate=f"{name}: best %{{y:.4f}} after trial %{{x}}<extra></extra>"), row, col)
        fig.update_xaxes(title_text="trial (0: as written)", dtick=1 if len(study["best_so_far"]) <= 20 else None,
                         row=row, col=col)
    fig.update_yaxes(title_text=f"best {comparison.record.get('objective')}", col=1)
    return sized(fig, 60 + 300 * rows, top=60)


def tuning_frame(comparison: ComparisonRun) -> pd.DataFrame | None:
    """Per pipeline's study: trials and pruned, best objective, its spread over trials, the chosen values."""
    record = comparison.record
    tuning = record.get("tuning") or {}
    if not tuning:
        return None
    studies = {name: StudySummary(**study) for name, study in tuning.items()}
    return frame(tuning_rows(studies, record.get("objective") or "objective", record.get("optimism"),
                             record.get("study_facts")))


def render_comparison(comparison: ComparisonRun, tracking_uri: str = "") -> str:
    """The HTML page of a comparison: its table and forest plot, what each study chose, and per pipeline each
    client's change against the baseline."""
    record = comparison.record
    metric, seeds, baseline = metric_label(record.get("metric", "acc")), len(record["seeds"]), record["baseline"]
    better = "above" if higher_is_better(record.get("metric", "acc")) else "below"
    tuned = bool(record.get("tuning"))
    notes = [part for part in comparison.table.split("\n\n") if part.startswith("diverged")]
    intervals = next((part for part in comparison.table.split("\n\n") if part.startswith("intervals:")), "")
    sections: list[Section] = [
        ("Pipelines against " + baseline, f"Each {'tuned ' if tuned else ''}pipeline's last stage over {seeds} "
         f"seed(s): mean ± sd over seeds; vs baseline: the paired difference with the baseline on the same seed and "
         f"its adjusted interval (below). " + " ".join(notes).replace("\n", " "), pipelines_frame(comparison)),
        ("Paired difference with " + baseline, "Each pipeline's mean test " + metric + " minus the baseline's on the "
         "same seed: the marker is the mean over seeds, the bars its t interval over seeds and its bootstrap "
         "interval over seeds and clients, both adjusted by Holm for the set's comparisons; a filled marker is a "
         "resolved difference. " + intervals.replace("\n", " ").removeprefix("intervals: "),
         forest_figure(comparison)),
        *[(f"Verdicts: {score} against {baseline}", "The Holm-adjusted intervals, the p-value each comparison was "
           "adjusted on (the larger of the t's and the bootstrap's) and its adjusted p-value.",
           verdicts_frame(comparison, score)) for score in (record.get("verdicts") or {})],
        ("Tuning: the best value against the trials", f"Each pipeline's study on the validation split of seed(s) "
         f"{record.get('tuning_seeds')}, in a panel of its own scale: its best {record.get('objective')} after each "
         "finished trial, numbered from trial 0, the pipeline as written; a pruned trial leaves the best as it was. "
         "A dashed line still rose in the last quarter of its trials: more trials may help.",
         best_so_far_figure(comparison)),
        ("Tuning: what each study chose", "Trials (of which pruned), the chosen configuration's objective, the "
         "objective's 10th / 50th / 90th percentile over the completed trials (how much the method's result depends "
         "on its settings), the same objective of the chosen configuration rerun on the comparison seeds and its "
         "optimism (the winner's curse: the best minus the rerun, positive where the tuning seeds flattered it, with "
         "its 95% t interval over the comparison seeds), and the chosen values (stage.key).",
         tuning_frame(comparison)),
        ("Per-client change against " + baseline + " over the seeds", (
            f"Each client (by name) is a point at its mean change in test {metric} over the seeds, sorted; the band "
            f"spans its least and its most. Helped on every seed: {better} 0 on each; hurt on every seed: the other "
            "side on each; unchanged: the baseline's value on every seed; mixed: the rest. "
            if same_clients(comparison) else "") + record.get("federation", ""),
         band_figure(comparison) if same_clients(comparison) else "Not drawn: a client's name is not the same data "
         "on every seed."),
        ("Clients helped, hurt and unchanged on every seed", "Of the clients seen on every seed."
         + ("" if same_clients(comparison) else " A client's name is not the same data on every seed (above)."),
         counts_table(comparison)),
    ]
    line = f"{comparison.name}: run {comparison.run_id} (experiment {comparison.experiment_id})"
    return page(f"fedpilot comparison: {comparison.name}", line, tracking_uri, sections)
