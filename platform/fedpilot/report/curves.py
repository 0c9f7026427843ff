"""The report's figures by round (stages one after another on the x axis): the validation metric's spread over
clients as a fan, the training loss, and an algorithm's per-client values over each round's cohort."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
from plotly.colors import hex_to_rgb
from plotly.subplots import make_subplots

from fedpilot.metric_names import COHORT, COHORT_STATS, metric_label
from fedpilot.report.figures import COLORS, sized
from fedpilot.report.runs import FAN, PipelineRun

ROUNDS = "round (stages one after another)"


def _rgba(color: str, alpha: float) -> str:
    red, green, blue = hex_to_rgb(color)
    return f"rgba({red},{green},{blue},{alpha})"


def _band(fig: go.Figure, low: pd.Series, high: pd.Series, offset: int, color: str, alpha: float, col: int,
          hover: str) -> None:
    """The area between two series by round (`high` drawn first, `low` filled up to it)."""
    fig.add_trace(go.Scatter(x=high.index + offset, y=high.to_numpy(), mode="lines", line={"width": 0},
                             showlegend=False, hoverinfo="skip"), 1, col)
    fig.add_trace(go.Scatter(x=low.index + offset, y=low.to_numpy(), mode="lines", line={"width": 0}, fill="tonexty",
                             fillcolor=_rgba(color, alpha), showlegend=False, customdata=high.to_numpy(),
                             hovertemplate=hover + " %{y:.3f} to %{customdata:.3f}<extra></extra>"), 1, col)


def _fan(fig: go.Figure, curves: dict[str, pd.Series], metric: str, offset: int, color: str, name: str,
         legend: bool) -> None:
    """One stage's validation fan: the 10th-90th and 25th-75th percentile over clients (bands), the median (line)
    and the mean (dashed)."""
    quantile = {stat: curves.get(f"val_{metric}_{stat}") for stat in FAN}
    for low, high, alpha in (("p10", "p90", 0.15), ("p25", "p75", 0.3)):
        if quantile[low] is not None and quantile[high] is not None:
            _band(fig, quantile[low], quantile[high], offset, color, alpha, 1, f"{name} round %{{x}}: {low}-{high}")
    for stat, dash in (("p50", "solid"), ("mean", "dash")):
        series = curves.get(f"val_{metric}_{stat}")
        if series is not None and len(series):
            fig.add_trace(go.Scatter(x=series.index + offset, y=series.to_numpy(), mode="lines",
                                     line={"color": color, "dash": dash, "width": 2}, name=name, legendgroup=name,
                                     showlegend=legend and stat == "p50",
                                     hovertemplate=f"{name} round %{{x}}: {'median' if stat == 'p50' else stat} "
                                                   "%{y:.3f}<extra></extra>"), 1, 1)


def curves_figure(runs: list[PipelineRun]) -> go.Figure | None:
    """By round: the validation metric over clients as a fan per stage (a colour per stage; per run when several)
    and the training loss."""
    metric = runs[0].metric
    if not any(s.curves for r in runs for s in r.stages):
        return None
    label = metric_label(metric)
    fig = make_subplots(1, 2, subplot_titles=(f"validation {label} over clients", "training loss"))
    for j, run in enumerate(runs):
        offset = 0
        for i, stage in enumerate(run.stages):
            color = COLORS[(i if len(runs) == 1 else j) % len(COLORS)]
            name = stage.name if len(runs) == 1 else run.label
            _fan(fig, stage.curves, metric, offset, color, name, legend=len(runs) == 1 or i == 0)
            loss = stage.curves.get("train_loss")
            if loss is not None and len(loss):
                fig.add_trace(go.Scatter(x=loss.index + offset, y=loss.to_numpy(), mode="lines", name=name,
                                         legendgroup=name, showlegend=False, line={"color": color},
                                         hovertemplate=f"{name} round %{{x}}: loss %{{y:.4f}}<extra></extra>"), 1, 2)
            offset += int(stage.metrics.get("rounds", 0))
    fig.update_xaxes(title_text=ROUNDS)
    fig.update_yaxes(title_text=f"validation {label} of a client", row=1, col=1)
    fig.update_yaxes(title_text="training loss (mean over the round's local steps)", row=1, col=2)
    return sized(fig, 420)


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
                _band(fig, lines["p10"], lines["p90"], offset, color, 0.3, i + 1, f"{stage.name} round %{{x}}: p10-p90")
                for stat, dash in (("p50", "solid"), ("min", "dot"), ("max", "dot")):
                    series = lines[stat]
                    fig.add_trace(go.Scatter(
                        x=series.index + offset, y=series.to_numpy(), mode="lines", name=run.label,
                        line={"color": color, "dash": dash, "width": 2 if stat == "p50" else 1},
                        legendgroup=run.run_id, showlegend=stat == "p50" and i == 0 and stage is run.stages[0],
                        hovertemplate=f"{stage.name} round %{{x}}: {stat} %{{y:.4g}}<extra>{run.label}</extra>"),
                        1, i + 1)
            offset += int(stage.metrics.get("rounds", 0))
    fig.update_xaxes(title_text=ROUNDS)
    fig.update_yaxes(title_text="value over the round's cohort", row=1, col=1)
    return sized(fig, 380)
