"""The page of a comparison's run (`fedpilot compare`): its table and, per pipeline, each client's change against the
baseline over the seeds (fedpilot.client_effects)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from mlflow import MlflowClient
from plotly.subplots import make_subplots

from fedpilot.client_effects import CHANGES_TABLE, COUNTS, every_seed
from fedpilot.compare.stats import StudySummary, paired
from fedpilot.compare.table import frame, pipelines_rows, tuning_rows
from fedpilot.errors import NoSuchRun
from fedpilot.metric_names import higher_is_better, metric_label
from fedpilot.report.figures import COLORS, sized
from fedpilot.report.page import Section, page
from fedpilot.report.runs import read_table
from fedpilot.tracking import COMPARE_TAG, PIPELINE_TAG, RECORD_ARTIFACT, comparison_outcome


@dataclass
class ComparisonRun:
    run_id: str
    name: str
    experiment_id: str
    record: dict  # its comparison.json: baseline, metric, seeds, federation, scores, runs, summary
    table: str  # its comparison.txt
    changes: pd.DataFrame  # its clients_across_seeds.json: client, pipeline, seed, change
    counts: dict[str, dict[str, int]]  # pipeline -> helped_every_seed / hurt_every_seed / mixed (its metrics)


def is_comparison(run) -> bool:
    """Whether `run` is a comparison's own run (not one of its pipeline runs)."""
    return COMPARE_TAG in run.data.tags and PIPELINE_TAG not in run.data.tags


def load_comparison_run(client: MlflowClient, run) -> ComparisonRun:
    """A finished comparison's run as its report reads it."""
    run_id = run.info.run_id
    outcome = comparison_outcome(client, run_id)
    if outcome is None:
        raise NoSuchRun("RUN_ID", run_id, f"this comparison has not finished (no {RECORD_ARTIFACT})")
    record, table = outcome
    metrics = run.data.metrics
    counts = {p: {k: int(metrics[f"{p}/clients_{k}"]) for k in COUNTS} for p in record["runs"]
              if f"{p}/clients_{COUNTS[0]}" in metrics}
    return ComparisonRun(run_id, run.info.run_name, run.info.experiment_id, record, table,
                         read_table(client, run_id, CHANGES_TABLE), counts)


def band_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline, its clients (seen on every seed) sorted by their mean change against the baseline, the line
    their mean and the band the least and the most over the seeds (Pillutla et al., ICML 2022, Fig. 11)."""
    pipelines = list(comparison.counts)
    if not pipelines or comparison.changes.empty:
        return None
    bands = every_seed(comparison.changes, len(comparison.record["seeds"]))
    cols = min(2, len(pipelines))
    rows = -(-len(pipelines) // cols)
    titles = [f"{p}: {c['helped_every_seed']} helped on every seed, {c['hurt_every_seed']} hurt on every seed, "
              f"{c['mixed']} mixed" for p, c in comparison.counts.items()]
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


def counts_table(comparison: ComparisonRun) -> pd.DataFrame | None:
    """Per pipeline, its clients helped on every seed, hurt on every seed, and mixed."""
    if not comparison.counts:
        return None
    return pd.DataFrame([{"pipeline": p, "helped on every seed": c["helped_every_seed"],
                          "hurt on every seed": c["hurt_every_seed"], "mixed": c["mixed"]}
                         for p, c in comparison.counts.items()])


def pipelines_frame(comparison: ComparisonRun) -> pd.DataFrame:
    """The comparison's table of pipelines against the baseline, as the command printed it (compare.table)."""
    record = comparison.record
    rows = pipelines_rows(record["summary"], record["baseline"], len(record["seeds"]), record.get("metric", "acc"),
                          record.get("untuned"))
    return frame(rows)


def forest_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline, its paired difference in mean test metric with the baseline: the mean over seeds (a marker)
    and the least and the most (the bar), beside the band of differences the set does not resolve."""
    record = comparison.record
    metric, baseline = record.get("metric", "acc"), record["baseline"]
    scores = {p: {int(s): v for s, v in by_seed.items()} for p, by_seed in record["scores"].items()}
    score = f"test_{metric}_mean"
    rows = [(p, paired(scores, p, baseline, score)) for p in scores if p != baseline and scores[p]]
    rows = [(p, d) for p, d in rows if len(d)]
    if not rows:
        return None
    names = [p for p, _ in rows][::-1]  # the first pipeline at the top
    means = [float(d.mean()) for _, d in rows][::-1]
    lows, highs = [float(d.min()) for _, d in rows][::-1], [float(d.max()) for _, d in rows][::-1]
    fig = go.Figure(go.Scatter(
        x=means, y=names, mode="markers", marker={"size": 9, "color": COLORS[0]}, name="mean over seeds",
        error_x={"type": "data", "symmetric": False, "array": np.subtract(highs, means),
                 "arrayminus": np.subtract(means, lows)},
        hovertemplate="%{y}: %{x:+.4f}<extra></extra>"))
    band = record.get("resolution", {}).get("smallest")
    if band is not None and np.isfinite(band):
        fig.add_vrect(x0=-band, x1=band, fillcolor="grey", opacity=0.15, line_width=0,
                      annotation_text=f"not resolved (±{band:.4f})", annotation_position="top left")
    fig.add_vline(x=0, line={"color": "grey", "width": 1})
    fig.update_layout(xaxis_title=f"{score} minus {baseline}'s, same seed", showlegend=False)
    return sized(fig, 170 + 30 * len(names))


def best_so_far_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline's study, the best objective after each finished trial (dashed where it still improved in the
    last quarter of the trials: the budget may have been short)."""
    tuning = comparison.record.get("tuning") or {}
    if not tuning:
        return None
    fig = go.Figure()
    for i, (name, study) in enumerate(tuning.items()):
        late = " (still improving)" if study["improving_late"] else ""
        fig.add_trace(go.Scatter(x=list(range(1, len(study["best_so_far"]) + 1)), y=study["best_so_far"],
                                 mode="lines+markers", name=name + late, line_color=COLORS[i % len(COLORS)],
                                 line_dash="dash" if late else "solid",
                                 hovertemplate=f"{name} after trial %{{x}}: %{{y:.4f}}<extra></extra>"))
    fig.update_layout(xaxis_title="finished trials", yaxis_title=f"best {comparison.record.get('objective')}")
    fig.update_xaxes(dtick=1 if max(len(s["best_so_far"]) for s in tuning.values()) <= 20 else None)
    return sized(fig, 420)


def tuning_frame(comparison: ComparisonRun) -> pd.DataFrame | None:
    """Per pipeline's study: trials and pruned, best objective, its spread over trials, the chosen values."""
    record = comparison.record
    tuning = record.get("tuning") or {}
    if not tuning:
        return None
    studies = {name: StudySummary(**study) for name, study in tuning.items()}
    return frame(tuning_rows(studies, record.get("objective") or "objective"))


def render_comparison(comparison: ComparisonRun, tracking_uri: str = "") -> str:
    """The HTML page of a comparison: its table and forest plot, what each study chose, and per pipeline each
    client's change against the baseline."""
    record = comparison.record
    metric, seeds, baseline = metric_label(record.get("metric", "acc")), len(record["seeds"]), record["baseline"]
    better = "above" if higher_is_better(record.get("metric", "acc")) else "below"
    tuned = bool(record.get("tuning"))
    notes = [part for part in comparison.table.split("\n\n") if part.startswith(("resolution:", "diverged"))]
    sections: list[Section] = [
        ("Pipelines against " + baseline, f"Each {'tuned ' if tuned else ''}pipeline's last stage over {seeds} "
         f"seed(s): mean ± sd over seeds; the paired differences are with the baseline on the same seed. "
         + " ".join(notes).replace("\n", " "), pipelines_frame(comparison)),
        ("Paired difference with " + baseline, "Each pipeline's mean test " + metric + " minus the baseline's on the "
         "same seed: the marker is the mean over seeds, the bar spans the least and the most; the grey band is what "
         "the set does not resolve.", forest_figure(comparison)),
        ("Tuning: the best value against the trials", f"Each pipeline's study on the validation split of seed(s) "
         f"{record.get('tuning_seeds')}: its best {record.get('objective')} after each finished trial, trial 0 the "
         "pipeline as written. A dashed line still rose in the last quarter of its trials: more trials may help.",
         best_so_far_figure(comparison)),
        ("Tuning: what each study chose", "Trials (of which pruned), the chosen configuration's objective, the "
         "objective's 10th / 50th / 90th percentile over the completed trials (how much the method's result depends "
         "on its settings), and the chosen values.", tuning_frame(comparison)),
        ("Per-client change against " + baseline + " over the seeds", f"Each client (by name) is a point at its "
         f"mean change in test {metric} over the seeds, sorted; the band spans its least and its most. Helped on "
         f"every seed: {better} 0 on each; hurt on every seed: the other side on each; mixed: the rest (a tie counts "
         "as neither). " + record.get("federation", ""), band_figure(comparison)),
        ("Clients helped and hurt on every seed", "Of the clients seen on every seed.", counts_table(comparison)),
    ]
    line = f"{comparison.name}: run {comparison.run_id} (experiment {comparison.experiment_id})"
    return page(f"fedpilot comparison: {comparison.name}", line, tracking_uri, sections)
