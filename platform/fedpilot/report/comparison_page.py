"""The page of a comparison's run (`fedpilot compare`): its table, each pipeline's verdict against the baseline with
its adjusted intervals (fedpilot.stats, read back from comparison.json), what each study chose and, per pipeline,
each client's change against the baseline over the seeds (fedpilot.client_effects)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from mlflow import MlflowClient
from plotly.subplots import make_subplots

from fedpilot.client_effects import CHANGES_TABLE, COUNTS, FIXED_NAMES, every_seed
from fedpilot.errors import NoSuchRun
from fedpilot.metric_names import higher_is_better, metric_label
from fedpilot.report.figures import COLORS, sized
from fedpilot.report.forest import forest_figure, short_names, sorted_by_difference
from fedpilot.report.page import Section, page
from fedpilot.report.runs import read_table
from fedpilot.stats.study import StudySummary
from fedpilot.stats.table import frame, pipelines_rows, tuning_rows, verdict_rows
from fedpilot.tracking import COMPARE_TAG, PIPELINE_TAG, RECORD_ARTIFACT, comparison_outcome


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
    outcome = comparison_outcome(client, run_id)
    if outcome is None:
        raise NoSuchRun("RUN_ID", run_id, f"this comparison has not finished (no {RECORD_ARTIFACT})")
    record, table = outcome
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
    names = short_names(list(comparison.record.get("summary", comparison.counts)))
    titles = [f"{names.get(p, p)}: {counted(c)}" for p, c in comparison.counts.items()]
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
    names = short_names(list(comparison.record.get("summary", comparison.counts)))
    return pd.DataFrame([{"pipeline": names.get(p, p), **{k.replace("_every_seed", " on every seed"): n
                                                         for k, n in c.items()}} for p, c in comparison.counts.items()])


def pipelines_frame(comparison: ComparisonRun) -> pd.DataFrame:
    """The comparison's table of pipelines against the baseline (stats.table), as a paper shows it: the baseline
    first and marked, the others by their difference in test mean (the largest first), names without the set's
    prefix, each difference column named by its score and an unresolved difference flagged."""
    record = comparison.record
    baseline, verdicts = record["baseline"], record.get("verdicts") or {}
    table = frame(pipelines_rows(record["summary"], baseline, record.get("metric", "acc"), record.get("untuned"),
                                 verdicts))
    columns = list(table.columns)
    table.columns = [f"{columns[i - 1]} vs baseline" if c == "vs baseline" else c for i, c in enumerate(columns)]
    for column in [c for c in table.columns if c.endswith(" vs baseline")]:
        table[column] = [c if not c or c.endswith(" resolved") else f"{c} not resolved" for c in table[column]]
    mean = verdicts.get(f"test_{record.get('metric', 'acc')}_mean") or {}
    order = [baseline, *sorted_by_difference(mean), *[n for n in table["pipeline"] if n != baseline and n not in mean]]
    table = table.set_index("pipeline").loc[order].reset_index()
    names = short_names(list(table["pipeline"]))
    table["pipeline"] = [names[n] + (" (baseline)" if n == baseline else "") for n in table["pipeline"]]
    return table


def verdicts_frame(comparison: ComparisonRun, score: str) -> pd.DataFrame | None:
    """One headline score's verdicts: the difference, the Holm-adjusted intervals, the p-values, resolved and the
    seeds a 0.5 pp difference needs (stats.table)."""
    rows = (comparison.record.get("verdicts") or {}).get(score)
    if not rows:
        return None
    names = short_names(list(comparison.record.get("summary", rows)))
    ordered = {names.get(n, n): rows[n] for n in sorted_by_difference(rows)}  # as the table and the forest plot
    return frame(verdict_rows(ordered, comparison.record.get("metric", "acc")))


def best_so_far_figure(comparison: ComparisonRun) -> go.Figure | None:
    """Per pipeline's study, a panel of its own (its own scale: one study's values do not squash another's) with
    the best objective after each finished trial, trial 0 the pipeline as written (dashed where it still improved
    in the last quarter of the trials: the budget may have been short)."""
    tuning = comparison.record.get("tuning") or {}
    if not tuning:
        return None
    cols = min(3, len(tuning))
    rows = -(-len(tuning) // cols)
    names = short_names(list(comparison.record.get("summary", tuning)))
    titles = [f"{names.get(n, n)}: {study['trials']} trials, {study['pruned']} pruned" for n, study in tuning.items()]
    fig = make_subplots(rows, cols, subplot_titles=titles, vertical_spacing=0.4 / rows)
    for i, (name, study) in enumerate(tuning.items()):
        late = study["improving_late"]
        row, col = i // cols + 1, i % cols + 1
        fig.add_trace(go.Scatter(x=list(range(len(study["best_so_far"]))), y=study["best_so_far"],
                                 mode="lines+markers", name=name, line_color=COLORS[i % len(COLORS)],
                                 line_shape="hv", line_dash="dash" if late else "solid", showlegend=False,
                                 hovertemplate=f"{name}: best %{{y:.4f}} after trial %{{x}}<extra></extra>"), row, col)
        _trials(fig, study.get("trial_values") or [], row, col)
        fig.update_xaxes(title_text="trial (0: as written)", dtick=1 if len(study["best_so_far"]) <= 20 else None,
                         row=row, col=col)
    fig.update_yaxes(title_text=f"best {comparison.record.get('objective')}", col=1)
    return sized(fig, 60 + 300 * rows, top=60)


FEW_TRIALS = 5  # under this many completed trials a study's percentiles over them are left blank


def _trials(fig: go.Figure, values: list[float | None], row: int, col: int) -> None:
    """Each finished trial (Optuna's history): a completed one at its objective, a pruned one as a cross at the
    panel's foot (none for a comparison recorded before they were)."""
    if not values:
        return
    done = [(i, v) for i, v in enumerate(values) if v is not None]
    pruned = [i for i, v in enumerate(values) if v is None]
    foot = min((v for _, v in done), default=0.0)
    fig.add_trace(go.Scatter(x=[i for i, _ in done], y=[v for _, v in done], mode="markers", showlegend=False,
                             marker={"color": "grey", "size": 7, "opacity": 0.7},
                             hovertemplate="trial %{x}: %{y:.4f}<extra></extra>"), row, col)
    if pruned:
        fig.add_trace(go.Scatter(x=pruned, y=[foot] * len(pruned), mode="markers", showlegend=False,
                                 marker={"color": "grey", "symbol": "x", "size": 8},
                                 hovertemplate="trial %{x}: pruned<extra></extra>"), row, col)


def tuning_frame(comparison: ComparisonRun) -> pd.DataFrame | None:
    """Per pipeline's study: trials and pruned, best objective, its spread over trials, the chosen values."""
    record = comparison.record
    tuning = record.get("tuning") or {}
    if not tuning:
        return None
    studies = {name: StudySummary(**study) for name, study in tuning.items()}
    table = frame(tuning_rows(studies, record.get("objective") or "objective", record.get("optimism"),
                              record.get("study_facts")))
    few = [study.trials - study.pruned < FEW_TRIALS for study in studies.values()]
    for stat in ("p10", "p50", "p90"):  # over the trials, not the clients; of 2 or 3 trials, noise
        table[stat] = ["" if noise else value for value, noise in zip(table[stat], few, strict=True)]
    names = short_names(list(table["pipeline"]))
    table["pipeline"] = [names[n] for n in table["pipeline"]]
    return table.rename(columns={stat: f"{stat} over trials" for stat in ("p10", "p50", "p90")})


def method_frame(record: dict) -> pd.DataFrame | None:
    """How the comparison's intervals and verdicts are made (comparison.json's `method`), one row each."""
    method = record.get("method")
    return pd.DataFrame({"what": list(method), "how": [str(v) for v in method.values()]}) if method else None


def _prefix(record: dict) -> str:
    """What the page says of the names it shortened: ` (names without the set's prefix digits-k2-)`."""
    names = list(record["summary"])
    short = short_names(names)
    cut = names[0][:len(names[0]) - len(short[names[0]])] if names else ""
    return f" (names without the set's prefix {cut})" if cut else ""


def render_comparison(comparison: ComparisonRun, tracking_uri: str = "") -> str:
    """The HTML page of a comparison: its table and forest plot, what each study chose, and per pipeline each
    client's change against the baseline."""
    record = comparison.record
    metric, seeds, baseline = metric_label(record.get("metric", "acc")), len(record["seeds"]), record["baseline"]
    better = "above" if higher_is_better(record.get("metric", "acc")) else "below"
    tuned = bool(record.get("tuning"))
    notes = [part for part in comparison.table.split("\n\n") if part.startswith("diverged")]
    intervals = next((part for part in comparison.table.split("\n\n") if part.startswith("intervals:")), "")
    prefix = _prefix(record)
    sections: list[Section] = [
        ("Pipelines against " + baseline, f"Each {'tuned ' if tuned else ''}pipeline's last stage over {seeds} "
         f"seed(s), the baseline first, the others by their difference in test mean{prefix}: mean ± sd over seeds of "
         "the clients' mean and 10th percentile (p10: over the clients); vs baseline: the paired difference with "
         "the baseline on the same seed and its adjusted interval, 'not resolved' where the interval holds 0. "
         + " ".join(notes).replace("\n", " "), pipelines_frame(comparison)),
        ("How a difference is judged", intervals.replace("\n", " ").removeprefix("intervals: "),
         method_frame(record)),
        ("Paired difference with " + baseline, "Each pipeline's mean test " + metric + " minus the baseline's on the "
         "same seed, the largest on top: the marker is the mean over seeds, the bars its t interval over seeds and "
         "its bootstrap interval over seeds and clients, both adjusted by Holm for the set's comparisons; a filled "
         "marker is a resolved difference; the diamond is the baseline. On the right, as in a paper: the "
         "difference and its adjusted interval (the outer ends of the two).", forest_figure(comparison.record)),
        *[(f"Verdicts: {score} against {baseline}", "The Holm-adjusted intervals, the p-value each comparison was "
           "adjusted on (the larger of the t's and the bootstrap's) and its adjusted p-value.",
           verdicts_frame(comparison, score)) for score in (record.get("verdicts") or {})],
        ("Tuning: the best value against the trials", f"Each pipeline's study on the validation split of seed(s) "
         f"{record.get('tuning_seeds')}, in a panel of its own scale: each finished trial's "
         f"{record.get('objective')} (grey; a cross at the foot: pruned) and the best after it (the line), numbered "
         "from trial 0, the pipeline as written. A dashed line still rose in the last quarter of its trials: more "
         "trials may help.",
         best_so_far_figure(comparison)),
        ("Tuning: what each study chose", "Trials (of which pruned), the chosen configuration's objective, the "
         "objective's 10th / 50th / 90th percentile over the completed trials, not over clients (how much the "
         f"method's result depends on its settings; blank under {FEW_TRIALS} completed trials, where they are noise), "
         "the same objective of the chosen configuration rerun on the comparison seeds and its "
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
