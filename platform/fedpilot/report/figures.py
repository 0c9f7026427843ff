"""The report's figures (plotly), each drawn from the runs as report.runs reads them."""

from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from fedpilot.metric_names import FOOTPRINT_LABELS, footprint_label, higher_is_better, metric_label
from fedpilot.report.runs import PipelineRun, Stage

COLORS = qualitative.Plotly
PATTERNS = ("", "/", "x", ".", "+", "-")  # a stage's bars when a colour stands for a run


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    if abs(n) < 1024:
        return f"{n:.0f} B"
    power = min(3, int(np.log2(abs(n)) // 10))
    return f"{n / 1024 ** power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"


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
        return sized(fig, 420)
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
    return sized(fig, 420)


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
    return sized(fig, 460)


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


DOT_BINS = 40  # a dot plot stacks each value's clients; more distinct values than this are binned first


def dot_heights(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A dot plot of `values`: each value's x (itself, or its bin's centre when there are more than DOT_BINS
    distinct values) and its height, the clients at that x before it (1, 2, 3, ...)."""
    x = np.asarray(values, dtype=float)
    if len(np.unique(x)) > DOT_BINS:
        edges = np.linspace(x.min(), x.max(), DOT_BINS + 1)
        index = np.clip(np.digitize(x, edges) - 1, 0, DOT_BINS - 1)
        x = (edges[index] + edges[index + 1]) / 2
    return x, pd.Series(x).groupby(x).cumcount().to_numpy() + 1


def change_figure(runs: list[PipelineRun]) -> go.Figure | None:
    """Per stage from the second on, each client's change in test metric against the stage before as a dot plot
    (one dot per client, stacked at its value: a test split of a few samples gives a few values, drawn as they
    are, not smoothed into a density); a row per run when several (Pillutla et al., ICML 2022, Fig. 7)."""
    metric = runs[0].metric
    column, before = f"test_{metric}", f"previous_test_{metric}"
    names = [n for n in _stage_names(runs) if any((s := _find(r, n)) and before in s.clients for r in runs)]
    if not names:
        return None
    titles = [f"{(r.label + ': ') if len(runs) > 1 else ''}{n}: {_change_counts(_find(r, n), column, before, metric)}"
              for r in runs for n in names]
    fig = make_subplots(len(runs), len(names), subplot_titles=titles, shared_xaxes=True, vertical_spacing=0.12)
    for j, run in enumerate(runs):
        for i, name in enumerate(names):
            stage = _find(run, name)
            if stage is None or before not in stage.clients:
                continue
            frame = stage.clients.dropna(subset=[column, before])
            change = (frame[column] - frame[before]).to_numpy(dtype=float)
            x, height = dot_heights(change)
            fig.add_trace(go.Scatter(x=x, y=height, mode="markers", name=run.label, showlegend=False,
                                     marker={"color": COLORS[j % len(COLORS)], "size": 7, "opacity": 0.8},
                                     text=frame["name"].astype(str), customdata=change,
                                     hovertemplate="%{text}: %{customdata:+.3f}<extra>" + name + "</extra>"),
                          j + 1, i + 1)
            fig.add_vline(x=0, line={"color": "grey", "width": 1}, row=j + 1, col=i + 1)
            values = np.unique(x)  # few values: each one a tick (steps of 1/4 with 4 test samples)
            fig.update_xaxes(title_text=f"change in test {metric_label(metric)} per client", row=j + 1, col=i + 1,
                             tickvals=values if len(values) <= 12 else None)
        fig.update_yaxes(title_text="clients", row=j + 1, col=1)
    return sized(fig, 120 + 300 * len(runs))


def _change_counts(stage: Stage | None, column: str, before: str, metric: str) -> str:
    """How many clients a stage left better, worse and unchanged."""
    if stage is None or before not in stage.clients:
        return ""
    frame = stage.clients.dropna(subset=[column, before]).rename(columns={before: "x", column: "y"})
    return _counts(frame, metric)


def footprint_figure(runs: list[PipelineRun]) -> go.Figure:
    """Bytes of each footprint (shared model, personal per client, bank, communication per round, measured peak,
    estimate) per stage, on a log scale ticked in IEC units (KiB, MiB, GiB)."""
    keys = [k for k in FOOTPRINT_LABELS if any(k in s.metrics for r in runs for s in r.stages)]
    keys += sorted({k for r in runs for s in r.stages for k in s.metrics if "bytes" in k and "/" not in k
                    and not k.startswith("executor_")} - set(keys))  # the engine's own timing is not a footprint
    fig, shown = go.Figure(), []
    for j, run in enumerate(runs):
        for i, stage in enumerate(run.stages):
            values = [stage.metrics.get(k) for k in keys]
            shown += [v for v in values if v]
            fig.add_trace(go.Bar(x=[footprint_label(k) for k in keys], y=values,
                                 text=[human_bytes(v) if v else "" for v in values],
                                 textposition="outside" if len(runs) == 1 else "none",
                                 name=stage.name if len(runs) == 1 else f"{run.label} / {stage.name}",
                                 marker_color=None if len(runs) == 1 else COLORS[j % len(COLORS)],
                                 marker_pattern_shape=None if len(runs) == 1 else PATTERNS[i % len(PATTERNS)],
                                 hovertemplate="%{x}: %{text}<extra>%{fullData.name}</extra>"))
    fig.update_layout(barmode="group", yaxis_title="bytes (log scale; 1 KiB = 1024 B)")
    fig.update_yaxes(type="log", **bytes_ticks(shown))
    return sized(fig, 440)


def bytes_ticks(values: list[float]) -> dict:
    """A log axis's ticks at powers of 32 bytes (1 B, 32 B, 1 KiB, 32 KiB, 1 MiB, ...) around `values`, each
    labelled in IEC units (plotly's own would read 1B for a billion, and mix decimal with binary units)."""
    if not values:
        return {}
    low, high = np.log2(min(values)), np.log2(max(values))
    powers = range(int(np.floor(low / 5)) * 5, int(np.ceil(high / 5)) * 5 + 1, 5)
    ticks = [2.0 ** p for p in powers]
    return {"tickvals": ticks, "ticktext": [human_bytes(t).replace(".0 ", " ") for t in ticks],
            "range": [np.log10(ticks[0]), np.log10(ticks[-1] * 8)]}  # room above the bars for their labels


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
    return sized(fig, 620, top=60)


def sized(fig: go.Figure, height: int, top: int = 50) -> go.Figure:
    fig.update_layout(height=height, margin={"l": 60, "r": 20, "t": top, "b": 50}, template="plotly_white",
                      legend={"orientation": "h", "y": -0.2})
    return fig
