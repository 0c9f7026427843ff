"""The report a researcher opens first: one HTML page per pipeline run (its `report.html` artifact), or several runs
side by side (`fedpilot report RUN_ID ...`): per-client CDFs, each client before and after a stage, the change per
client of each stage, the curves, the memory and communication footprints, and a sortable per-client table; the
stage table adds the novel clients and the per-client model choice where recorded. A comparison's run
(`fedpilot compare`) has its own page: its table and, per pipeline, each client's change against the baseline over
the seeds (fedpilot.client_effects).

Built only from what the runs recorded in MLflow, with plotly. The page carries plotly.js itself, so it opens offline
as a file and inside MLflow's artifact view (which shows an HTML artifact without its neighbouring files).
"""

from __future__ import annotations

import html
import itertools
import json
import re
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from fedpilot.client_effects import CHANGES_TABLE, COUNTS, every_seed, participating
from fedpilot.errors import SpecError
from fedpilot.metric_names import (
    COHORT,
    COHORT_STATS,
    FOOTPRINT_LABELS,
    HEADLINE_STATS,
    NOVEL,
    SELECTED,
    SELECTED_SHARE,
    TABLE_STATS,
    TASK_METRICS,
    footprint_label,
    higher_is_better,
    metric_label,
)
from fedpilot.tracking import CACHE_SOURCE_TAG, CACHE_TAG, CLIENTS_TABLE, PIPELINE_TAG, STAGE_TAG

REPORT_ARTIFACT = "report.html"
COMPARE_TAG = "fedpilot.compare"  # a comparison's run (without fedpilot.pipeline) and each of its pipeline runs
# The per-client metrics any task records with their whole distribution, by name
DISTRIBUTED = sorted({m for metrics in TASK_METRICS.values() for m, whole in metrics.items() if whole})
COLORS = qualitative.Plotly
PATTERNS = ("", "/", "x", ".", "+", "-")  # a stage's bars when a colour stands for a run


def primary_metric(keys: Iterable[str]) -> str:
    """The per-client metric whose test distribution a stage recorded (`test_<m>_p10`): `acc` when there is one,
    else the first by name (a run records its metrics, not its task)."""
    recorded = set(keys)
    found = [m for m in DISTRIBUTED if f"test_{m}_p10" in recorded]
    return "acc" if "acc" in found or not found else found[0]


def curve_keys(metric: str) -> tuple[str, ...]:
    """The series the report draws: the validation mean and p10 of the per-client metric, the training loss."""
    return *(f"val_{metric}_{stat}" for stat in HEADLINE_STATS), "train_loss"


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    power = min(3, int(np.log2(abs(n)) // 10))
    return f"{n / 1024 ** power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"


# ---- what the runs recorded --------------------------------------------------------------------------------------
@dataclass
class Stage:
    name: str
    run_id: str
    cache: str
    metrics: dict[str, float]  # the stage run's latest values
    clients: pd.DataFrame  # its per-client table, one row per participating client in client order (no novel ones)
    curves: dict[str, pd.Series]  # metric -> values by round within the stage


@dataclass
class PipelineRun:
    run_id: str
    name: str
    experiment_id: str
    stages: list[Stage]
    label: str  # what tells it from the other runs of a report (legends, columns): its name, or see `labelled`

    @property
    def metric(self) -> str:
        return primary_metric(self.stages[-1].metrics)


def _get_run(client: MlflowClient, run_id: str):
    """The MLflow run `run_id`, or one line saying there is none."""
    try:
        return client.get_run(run_id)
    except Exception as err:  # MlflowException for an unknown id
        raise SpecError("RUN_ID", run_id, f"no such run ({type(err).__name__})") from None


def load_run(client: MlflowClient, run_id: str) -> PipelineRun:
    """A finished (or partly finished) pipeline run and its stage runs, newest run per stage index."""
    run = _get_run(client, run_id)
    if PIPELINE_TAG not in run.data.tags:
        raise SpecError("RUN_ID", run_id, "not a fedpilot pipeline run (tag fedpilot.pipeline)")
    children = client.search_runs([run.info.experiment_id], f"tags.{MLFLOW_PARENT_RUN_ID} = '{run_id}'",
                                  order_by=["attributes.start_time ASC"])
    newest = {int(r.data.tags["fedpilot.stage_index"]): r for r in children if STAGE_TAG in r.data.tags}
    stages = [_stage(client, newest[i]) for i in sorted(newest)]
    stages = [s for s in stages if not s.clients.empty]
    if not stages:
        raise SpecError("RUN_ID", run_id, "no stage of this run has finished yet")
    return PipelineRun(run_id, run.info.run_name, run.info.experiment_id, stages, run.info.run_name)


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its shortest ending that tells it from the others (stages.1.params.lr_v -> lr_v)."""
    short = {}
    for key in keys:
        words, n = key.split("."), 1
        while any(other != key and other.split(".")[-n:] == words[-n:] for other in keys):
            n += 1
        short[key] = ".".join(words[-n:])
    return short


def labelled(runs: list[PipelineRun]) -> list[PipelineRun]:
    """Runs labelled by the words of their names that not all of them share, an override's key by its shortest
    ending that tells it from the others' ("small stages.2.local.lr=0.1" and "small stages.2.local.lr=0.2" become
    "lr=0.1" and "lr=0.2", short enough for a legend and a table's column); the whole name where that leaves nothing
    or two the same."""
    if len(runs) == 1:
        runs[0].label = runs[0].name
        return runs
    common = set.intersection(*(set(r.name.split()) for r in runs))
    differing = [[w for w in r.name.split() if w not in common] for r in runs]
    keys = short_keys(sorted({w.partition("=")[0] for words in differing for w in words if "=" in w}))
    labels = [" ".join(_shortened(w, keys) for w in words) or r.name for r, words in zip(runs, differing, strict=True)]
    unique = len(set(labels)) == len(labels)
    for run, label in zip(runs, labels, strict=True):
        run.label = label if unique else run.name
    return runs


def _shortened(word: str, keys: dict[str, str]) -> str:
    """An override `key=value` with its key shortened (`keys`); any other word as it is."""
    key, equals, value = word.partition("=")
    return f"{keys[key]}={value}" if equals and key in keys else word


def _stage(client: MlflowClient, run) -> Stage:
    """A stage run as the report reads it. A stage reused from the cache logged the evaluations the cache keeps, not
    the training loss of its rounds: that curve comes from the run that trained it (tag fedpilot.cache_source)."""
    run_id, metrics = run.info.run_id, run.data.metrics
    source = run.data.tags.get(CACHE_SOURCE_TAG)
    curves = {}
    trained = metrics if source is None else _metrics(client, source)  # the run whose rounds were logged
    for key in [*curve_keys(primary_metric(metrics)), *sorted(k for k in trained if k.startswith(f"{COHORT}_"))]:
        series = _history(client, run_id, key) if key in metrics else _history(client, source, key)
        if len(series):
            curves[key] = series
    return Stage(run.data.tags[STAGE_TAG], run_id, run.data.tags.get(CACHE_TAG, ""), dict(metrics),
                 participating(clients_frame(client, run_id)), curves)


def _metrics(client: MlflowClient, run_id: str) -> dict[str, float]:
    """A run's latest metrics (none when it is gone)."""
    try:
        return dict(client.get_run(run_id).data.metrics)
    except MlflowException:  # a cache source run deleted since
        return {}


def _history(client: MlflowClient, run_id: str | None, key: str) -> pd.Series:
    """The series `key` of run `run_id` by step (empty when the run is None or gone)."""
    try:
        points = client.get_metric_history(run_id, key) if run_id else []
    except MlflowException:  # a cache source run deleted since
        points = []
    return pd.Series({p.step: p.value for p in points}, dtype=float).sort_index()


def clients_frame(client: MlflowClient, run_id: str) -> pd.DataFrame:
    """A stage's per-client table, every row (empty when the stage did not finish)."""
    table = _table(client, run_id, CLIENTS_TABLE)
    return table.sort_values("client", ignore_index=True) if not table.empty else table


def _table(client: MlflowClient, run_id: str, path: str) -> pd.DataFrame:
    """A table a run logged with MLflow's log_table (empty when it has none)."""
    if path not in {a.path for a in client.list_artifacts(run_id)}:
        return pd.DataFrame()
    with tempfile.TemporaryDirectory() as tmp:
        table = json.loads(Path(client.download_artifacts(run_id, path, tmp)).read_text())
    return pd.DataFrame(table["data"], columns=table["columns"])


# ---- figures -----------------------------------------------------------------------------------------------------
def _cdf(values: pd.Series, name: str, **style) -> go.Scatter:
    """The empirical CDF of `values` as a step line."""
    x = np.sort(values.dropna().to_numpy(dtype=float))
    return go.Scatter(x=x, y=np.arange(1, len(x) + 1) / max(len(x), 1), name=name, mode="lines", line_shape="hv",
                      hovertemplate="%{y:.0%} of clients at or below %{x:.3f}<extra>" + name + "</extra>", **style)


def _stage_names(runs: list[PipelineRun]) -> list[str]:
    names: list[str] = []
    for run in runs:
        names += [s.name for s in run.stages if s.name not in names]
    return names


def _find(run: PipelineRun, name: str) -> Stage | None:
    return next((s for s in run.stages if s.name == name), None)


def cdf_figure(runs: list[PipelineRun]) -> go.Figure:
    """Empirical CDF of the per-client test metric: one line per stage (one run), or a panel per stage with a line
    per run (several runs). Lower left = clients doing badly."""
    metric = runs[0].metric
    column, label = f"test_{metric}", f"per-client test {metric_label(metric)}"
    if len(runs) == 1:
        fig = go.Figure([_cdf(s.clients[column], s.name) for s in runs[0].stages])
        fig.update_layout(xaxis_title=label, yaxis_title="fraction of clients")
        return _sized(fig, 420)
    names = _stage_names(runs)
    fig = make_subplots(1, len(names), subplot_titles=names, shared_yaxes=True)
    for i, name in enumerate(names):
        for j, run in enumerate(runs):
            stage = _find(run, name)
            if stage is not None:
                fig.add_trace(_cdf(stage.clients[column], run.label, legendgroup=run.run_id, showlegend=i == 0,
                                   line_color=COLORS[j % len(COLORS)]), 1, i + 1)
        fig.update_xaxes(title_text=label, row=1, col=i + 1)
    fig.update_yaxes(title_text="fraction of clients", row=1, col=1)
    return _sized(fig, 420)


def _transitions(runs: list[PipelineRun]) -> list[tuple[str, str]]:
    """(previous stage, stage) pairs in pipeline order, over every run."""
    pairs: list[tuple[str, str]] = []
    for run in runs:
        pairs += [(a.name, b.name) for a, b in itertools.pairwise(run.stages) if (a.name, b.name) not in pairs]
    return pairs


def before_after_figure(runs: list[PipelineRun]) -> go.Figure | None:
    """Each client's test metric before (x) and after (y) each stage; above the diagonal = better for accuracy. One
    run: better / worse / unchanged in three colours; several: a colour per run. Clients at the same point are one
    marker sized by their number."""
    pairs, metric = _transitions(runs), runs[0].metric
    if not pairs:
        return None
    column, single = f"test_{metric}", len(runs) == 1
    panels = [[(j, _pairs(run, a, b, column)) for j, run in enumerate(runs) if _find(run, a) and _find(run, b)]
              for a, b in pairs]
    titles = [f"{a} → {b}" + (f": {_counts(panel[0][1], metric)}" if single else "")
              for (a, b), panel in zip(pairs, panels, strict=True)]
    fig = make_subplots(1, len(pairs), subplot_titles=titles)
    for i, ((a, b), panel) in enumerate(zip(pairs, panels, strict=True)):
        for j, frame in panel:
            groups = _outcomes(frame, metric) if single else {runs[j].label: (frame, COLORS[j % len(COLORS)])}
            for name, (members, color) in groups.items():
                fig.add_trace(_points(members, name, color, legend=i == 0), 1, i + 1)
        fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", line={"color": "grey", "width": 1},
                                 showlegend=False, hoverinfo="skip"), 1, i + 1)
        fig.update_xaxes(title_text=f"{a}: test {metric_label(metric)}", row=1, col=i + 1)
        fig.update_yaxes(title_text=f"{b}: test {metric_label(metric)}", row=1, col=i + 1)
    return _sized(fig, 460)


def _pairs(run: PipelineRun, before: str, after: str, column: str) -> pd.DataFrame:
    """Each client's value before (x) and after (y), with its name; clients without a value left out."""
    a, b = _find(run, before).clients, _find(run, after).clients
    frame = pd.DataFrame({"x": a[column], "y": b[column], "name": b["name"].astype(str)})
    return frame.dropna(subset=["x", "y"])


def _gain(frame: pd.DataFrame, metric: str) -> pd.Series:
    return (frame["y"] - frame["x"]) if higher_is_better(metric) else (frame["x"] - frame["y"])


def _outcomes(frame: pd.DataFrame, metric: str) -> dict[str, tuple[pd.DataFrame, str]]:
    gain = _gain(frame, metric)
    return {"better": (frame[gain > 0], "#2ca02c"), "worse": (frame[gain < 0], "#d62728"),
            "unchanged": (frame[gain == 0], "grey")}


def _counts(frame: pd.DataFrame, metric: str) -> str:
    return ", ".join(f"{len(members)} {name}" for name, (members, _) in _outcomes(frame, metric).items())


def _points(frame: pd.DataFrame, name: str, color: str, legend: bool) -> go.Scatter:
    """Clients as markers, those with the same before and after values as one marker sized by their number."""
    groups = frame.groupby(["x", "y"])["name"].agg(list).reset_index()
    counts = groups["name"].str.len().to_numpy()
    text = [f"{len(n)} client{'s' if len(n) != 1 else ''}: {', '.join(n[:8])}{' …' if len(n) > 8 else ''}"
            for n in groups["name"]]
    return go.Scatter(x=groups["x"], y=groups["y"], mode="markers", name=name, legendgroup=name, showlegend=legend,
                      marker={"color": color, "size": 6 + 3 * np.sqrt(counts), "opacity": 0.6}, text=text,
                      hovertemplate="%{text}<br>before %{x:.3f}, after %{y:.3f}<extra></extra>")


def change_figure(runs: list[PipelineRun]) -> go.Figure | None:
    """Per stage from the second on, the distribution of its clients' change in test metric against the stage
    before (Pillutla et al., ICML 2022, Fig. 7): a violin with its box and every client as a point; one colour per
    run when several."""
    metric = runs[0].metric
    column, before = f"test_{metric}", f"previous_test_{metric}"
    fig = go.Figure()
    for j, run in enumerate(runs):
        for stage in run.stages:
            if before not in stage.clients or column not in stage.clients:
                continue
            frame = stage.clients.dropna(subset=[column, before])
            fig.add_trace(go.Violin(
                x=[stage.name] * len(frame), y=frame[column] - frame[before], text=frame["name"].astype(str),
                name=run.label if len(runs) > 1 else stage.name, legendgroup=run.run_id,
                showlegend=len(runs) > 1 and stage is next(s for s in run.stages if before in s.clients),
                line_color=COLORS[j % len(COLORS)], box_visible=True, meanline_visible=True, points="all",
                pointpos=0, jitter=0.3, marker={"size": 4, "opacity": 0.6}, spanmode="hard",
                hovertemplate="%{text}: %{y:+.3f}<extra>" + stage.name + "</extra>"))
    if not fig.data:
        return None
    fig.add_hline(y=0, line={"color": "grey", "width": 1})
    fig.update_layout(violinmode="group" if len(runs) > 1 else "overlay", showlegend=len(runs) > 1,
                      xaxis_title="stage", yaxis_title=f"change in test {metric_label(metric)} per client")
    return _sized(fig, 420)


def curves_figure(runs: list[PipelineRun]) -> go.Figure | None:
    """Validation mean and p10 and the training loss over the pipeline's rounds (stages one after another)."""
    keys = [k for k in curve_keys(runs[0].metric) if any(k in s.curves for r in runs for s in r.stages)]
    if not keys:
        return None
    fig = make_subplots(1, len(keys), subplot_titles=keys)
    for j, run in enumerate(runs):
        offset = 0
        for stage in run.stages:
            for i, key in enumerate(keys):
                series = stage.curves.get(key)
                if series is not None and len(series):
                    fig.add_trace(go.Scatter(x=series.index + offset, y=series.to_numpy(), mode="lines+markers",
                                             name=run.label, legendgroup=run.run_id, line_color=COLORS[j % len(COLORS)],
                                             showlegend=i == 0 and stage is run.stages[0],
                                             hovertemplate=f"{stage.name} round %{{x}}: %{{y:.4f}}<extra>{run.label}"
                                                           "</extra>"), 1, i + 1)
            offset += int(stage.metrics.get("rounds", 0))
            if j == 0 and stage is not run.stages[-1]:
                fig.add_vline(x=offset, line={"dash": "dot", "color": "grey"}, annotation_text=stage.name,
                              annotation_position="top left", annotation_font_color="grey")
    fig.update_xaxes(title_text="round (stages one after another)")
    return _sized(fig, 380)


def cohort_figure(runs: list[PipelineRun]) -> go.Figure | None:
    """Per algorithm scalar (Self-FL's steps, pFedGate's densities), its spread over each round's cohort: the median,
    the band from the 10th to the 90th percentile, and the least and largest (dotted), over the pipeline's rounds."""
    names = sorted({k.removeprefix(f"{COHORT}_").rsplit("_", 1)[0] for r in runs for s in r.stages for k in s.curves
                    if k.startswith(f"{COHORT}_")})
    if not names:
        return None
    fig = make_subplots(1, len(names), subplot_titles=names)
    for j, run in enumerate(runs):
        offset, color = 0, COLORS[j % len(COLORS)]
        for stage in run.stages:
            for i, name in enumerate(names):
                lines = {stat: stage.curves.get(f"{COHORT}_{name}_{stat}") for stat in COHORT_STATS}
                if lines["p50"] is None:
                    continue
                for stat, dash, fill in (("p10", None, None), ("p90", None, "tonexty"), ("p50", "solid", None),
                                         ("min", "dot", None), ("max", "dot", None)):
                    series = lines[stat]
                    fig.add_trace(go.Scatter(
                        x=series.index + offset, y=series.to_numpy(), mode="lines", fill=fill, name=run.label,
                        line={"color": color, "dash": dash, "width": 2 if stat == "p50" else 1 if dash else 0},
                        opacity=1 if dash else 0.3, legendgroup=run.run_id,
                        showlegend=stat == "p50" and i == 0 and stage is run.stages[0],
                        hovertemplate=f"{stage.name} round %{{x}}: {stat} %{{y:.4g}}<extra>{run.label}</extra>"),
                        1, i + 1)
            offset += int(stage.metrics.get("rounds", 0))
    fig.update_xaxes(title_text="round (stages one after another)")
    return _sized(fig, 380)


def footprint_figure(runs: list[PipelineRun]) -> go.Figure:
    """Bytes of each footprint (shared model, personal per client, bank, communication per round, measured peak,
    estimate) per stage, on a log scale."""
    keys = [k for k in FOOTPRINT_LABELS if any(k in s.metrics for r in runs for s in r.stages)]
    keys += sorted({k for r in runs for s in r.stages for k in s.metrics if "bytes" in k and "/" not in k} - set(keys))
    fig = go.Figure()
    for j, run in enumerate(runs):
        for i, stage in enumerate(run.stages):
            values = [stage.metrics.get(k) for k in keys]
            fig.add_trace(go.Bar(x=[footprint_label(k) for k in keys], y=values,
                                 text=[human_bytes(v) if v else "" for v in values],
                                 textposition="outside" if len(runs) == 1 else "none",
                                 name=stage.name if len(runs) == 1 else f"{run.label} / {stage.name}",
                                 marker_color=None if len(runs) == 1 else COLORS[j % len(COLORS)],
                                 marker_pattern_shape=None if len(runs) == 1 else PATTERNS[i % len(PATTERNS)],
                                 hovertemplate="%{x}: %{text}<extra>%{fullData.name}</extra>"))
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="bytes (log scale)")
    return _sized(fig, 420)


def client_table(runs: list[PipelineRun]) -> pd.DataFrame:
    """One row per client: its name and sizes, the test metric after every stage of every run, the last stage's
    change, its validation metric."""
    metric, first = runs[0].metric, runs[0].stages[-1].clients.set_index("client")
    table = first[["name", *[c for c in first.columns if c.endswith("_samples")]]].copy()
    for run in runs:
        prefix = "" if len(runs) == 1 else f"{run.label} / "
        scores = {s.name: s.clients.set_index("client")[f"test_{metric}"] for s in run.stages}
        for name, values in scores.items():
            table[f"{prefix}{name}"] = values  # aligned by client index
        if len(run.stages) > 1:
            last, previous = run.stages[-1].name, run.stages[-2].name
            table[f"{prefix}change in {last}"] = scores[last] - scores[previous]
        if len(runs) == 1 and f"val_{metric}" in run.stages[-1].clients:
            table[f"val {run.stages[-1].name}"] = run.stages[-1].clients.set_index("client")[f"val_{metric}"]
    return table.reset_index(drop=True)


def table_figure(table: pd.DataFrame) -> go.Figure:
    """The per-client table with a menu that sorts it by any column (descending or ascending)."""
    def cells(frame: pd.DataFrame) -> list[list]:
        return [[f"{v:.4g}" if isinstance(v, float) else v for v in frame[c]] for c in frame.columns]

    options = [(f"{c} ↓", table.sort_values(c, ascending=False, na_position="last")) for c in table.columns[1:]]
    options += [(f"{c} ↑", table.sort_values(c, na_position="last")) for c in table.columns[1:]]
    options.insert(0, ("client order", table))
    header = [c.replace(" / ", "<br>") for c in table.columns]  # a run's label above the stage
    fig = go.Figure(go.Table(header={"values": header, "align": "left", "fill_color": "#e8eef7"},
                             cells={"values": cells(table), "align": "left"}))
    fig.update_layout(updatemenus=[{"buttons": [{"label": label, "method": "restyle",
                                                 "args": [{"cells.values": [cells(frame)]}]}
                                                for label, frame in options],
                                    "x": 0.06, "xanchor": "left", "y": 1.01, "yanchor": "bottom"}],
                      annotations=[{"text": "sort by", "x": 0, "y": 1.02, "xref": "paper", "yref": "paper",
                                    "showarrow": False, "xanchor": "left", "yanchor": "bottom"}])
    return _sized(fig, 620, top=60)


def _sized(fig: go.Figure, height: int, top: int = 50) -> go.Figure:
    fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": top, "b": 50}, template="plotly_white",
                      legend={"orientation": "h", "y": -0.2})
    return fig


# ---- summaries: the report's, the parent run's description, the command line's -----------------------------------
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
                         **stage_cells(stage.metrics, metric), **extra, "peak memory": human_bytes(peak) if peak else ""})
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


# ---- the page ----------------------------------------------------------------------------------------------------
STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h2{margin-top:32px;border-bottom:1px solid #ddd}p.how{color:#555;margin:4px 0 8px}
table.summary{border-collapse:collapse}table.summary td,table.summary th{padding:4px 10px;text-align:right}
table.summary td:nth-child(-n+2),table.summary th:nth-child(-n+2){text-align:left}
table.summary tr:nth-child(even){background:#f4f6fa}"""


BEYOND_HOW = {"novel mean": " Novel: the clients held out of every round, after the adaptation a newcomer gets; "
               "participation gap: the participating clients' mean minus theirs.",
               "selected mean": " Selected: each client with whichever of the global and its personalized model "
               "scored better on its val split; kept personal: the share that kept its personalized model."}


def render(runs: list[PipelineRun], tracking_uri: str = "") -> str:
    """The HTML page of `runs` (one: its own report; several: side by side)."""
    metric = metric_label(runs[0].metric)
    stages = summary_table(runs)
    sections = [
        ("Per-client test " + metric, "Summary per stage: distribution over clients; better / worse = share of "
         "clients whose test " + metric + " rose / fell against the stage before." +
         "".join(how for column, how in BEYOND_HOW.items() if column in stages), stages),
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
    return _page("fedpilot report: " + " vs ".join(r.name for r in runs), runs_line, tracking_uri, sections)


Section = tuple[str, str, "go.Figure | pd.DataFrame | str | None"]  # title, how to read it, content (str: text)


def _page(title: str, runs_line: str, tracking_uri: str, sections: list[Section]) -> str:
    """An HTML page of `sections` (a missing content leaves its section out), with plotly.js once."""
    body, plotly_js = [], True
    for heading, how, content in sections:
        if content is None:
            continue
        if isinstance(content, str):
            shown = f"<pre>{html.escape(content)}</pre>"
        elif isinstance(content, pd.DataFrame):
            shown = content.to_html(index=False, classes="summary", border=0)
        else:
            shown = content.to_html(full_html=False, include_plotlyjs=plotly_js, config={"displaylogo": False})
            plotly_js = False
        body.append(f"<h2>{html.escape(heading)}</h2><p class='how'>{html.escape(how)}</p>{shown}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body><h1>{html.escape(title)}</h1>"
            f"<p class='how'>{html.escape(runs_line)}; tracking {html.escape(_without_secrets(tracking_uri))}</p>"
            f"{''.join(body)}</body></html>")


# ---- a comparison's page -----------------------------------------------------------------------------------------
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
    paths = {a.path for a in client.list_artifacts(run_id)}
    if "comparison.json" not in paths:
        raise SpecError("RUN_ID", run_id, "this comparison has not finished (no comparison.json)")
    with tempfile.TemporaryDirectory() as tmp:
        record = json.loads(Path(client.download_artifacts(run_id, "comparison.json", tmp)).read_text())
        table = Path(client.download_artifacts(run_id, "comparison.txt", tmp)).read_text()
    metrics = run.data.metrics
    counts = {p: {k: int(metrics[f"{p}/clients_{k}"]) for k in COUNTS} for p in record["runs"]
              if f"{p}/clients_{COUNTS[0]}" in metrics}
    return ComparisonRun(run_id, run.info.run_name, run.info.experiment_id, record, table,
                         _table(client, run_id, CHANGES_TABLE), counts)


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
    return _sized(fig, 80 + 320 * rows, top=60)


def counts_table(comparison: ComparisonRun) -> pd.DataFrame | None:
    """Per pipeline, its clients helped on every seed, hurt on every seed, and mixed."""
    if not comparison.counts:
        return None
    return pd.DataFrame([{"pipeline": p, "helped on every seed": c["helped_every_seed"],
                          "hurt on every seed": c["hurt_every_seed"], "mixed": c["mixed"]}
                         for p, c in comparison.counts.items()])


def render_comparison(comparison: ComparisonRun, tracking_uri: str = "") -> str:
    """The HTML page of a comparison: its table, and per pipeline each client's change against the baseline."""
    record = comparison.record
    metric, seeds, baseline = metric_label(record.get("metric", "acc")), len(record["seeds"]), record["baseline"]
    better = "above" if higher_is_better(record.get("metric", "acc")) else "below"
    sections: list[Section] = [
        ("Pipelines against " + baseline, f"Each pipeline's last stage over {seeds} seed(s); the paired differences "
         "are with the baseline on the same seed.", comparison.table),
        ("Per-client change against " + baseline + " over the seeds", f"Each client (by name) is a point at its "
         f"mean change in test {metric} over the seeds, sorted; the band spans its least and its most. Helped on "
         f"every seed: {better} 0 on each; hurt on every seed: the other side on each; mixed: the rest (a tie counts "
         "as neither). " + record.get("federation", ""), band_figure(comparison)),
        ("Clients helped and hurt on every seed", "Of the clients seen on every seed.", counts_table(comparison)),
    ]
    line = f"{comparison.name}: run {comparison.run_id} (experiment {comparison.experiment_id})"
    return _page(f"fedpilot comparison: {comparison.name}", line, tracking_uri, sections)


def _without_secrets(uri: str) -> str:
    """A store URI without the user and password it may carry (postgresql://user:pass@host/db)."""
    return re.sub(r"//[^/@]*@", "//", uri)


def build(client: MlflowClient, run_ids: list[str]) -> str:
    """The report page of pipeline runs, or of one comparison's run, read from the tracking store."""
    comparisons = [run for run in (_get_run(client, i) for i in run_ids) if is_comparison(run)]
    if comparisons and len(run_ids) > 1:
        raise SpecError("RUN_ID", comparisons[0].info.run_id, "a comparison's run is reported alone")
    if comparisons:
        return render_comparison(load_comparison_run(client, comparisons[0]), client.tracking_uri)
    return render(labelled([load_run(client, run_id) for run_id in run_ids]), client.tracking_uri)


def log_report(client: MlflowClient, run_id: str, run_ids: list[str] | None = None) -> None:
    """Log the report of `run_ids` (default: the run itself) as the run's `report.html`."""
    client.log_text(run_id, build(client, run_ids or [run_id]), REPORT_ARTIFACT)
