"""A comparison's forest plot as a paper draws one: a row per pipeline sorted by its difference with the baseline
(the largest at the top), the baseline's own row at 0, each difference's Holm-adjusted t and bootstrap intervals as
bars, a filled marker where resolved, and beside the plot the text column `difference [interval]`, unresolved rows
flagged; names without the prefix the set's pipelines share."""

from __future__ import annotations

import os

import numpy as np
import plotly.graph_objects as go

from fedpilot.report.figures import COLORS, sized
from fedpilot.stats.scores import in_points
from fedpilot.stats.table import difference, hull, unit

FOREST_BARS = (("t", "t over seeds", 0.15), ("boot", "bootstrap over seeds and clients", -0.15))


def short_names(names: list[str]) -> dict[str, str]:
    """Each name without the prefix every name shares, cut at a separator (digits-k2-fedalt -> fedalt); the names
    as they are when that would leave one empty or two the same, or when there is one."""
    prefix = os.path.commonprefix(names) if len(names) > 1 else ""
    cut = max(prefix.rfind(sep) for sep in "-_.") + 1 if prefix else 0
    short = {name: name[cut:] for name in names}
    return short if all(short.values()) and len(set(short.values())) == len(names) else {n: n for n in names}


def sorted_by_difference(rows: dict[str, dict]) -> list[str]:
    """The pipelines by their difference with the baseline, the largest first."""
    return sorted(rows, key=lambda name: -rows[name]["diff_mean"])


def verdict_text(verdict: dict, metric: str) -> str:
    """`+1.23 [-0.40, +2.86] not resolved`: the difference, the adjusted interval the table shows (the outer ends of
    the t and bootstrap intervals), and whether it is resolved."""
    low, high = hull(verdict)
    interval = f" [{difference(low, metric)}, {difference(high, metric)}]" if not np.isnan(low) else ""
    resolved = "resolved" if verdict["resolved"] else "not resolved"
    return f"{difference(verdict['diff_mean'], metric)}{interval} {resolved}"


def forest_figure(record: dict) -> go.Figure | None:
    """The forest plot of a comparison's `test_<metric>_mean` verdicts (comparison.json's `record`)."""
    metric, baseline = record.get("metric", "acc"), record["baseline"]
    score = f"test_{metric}_mean"
    rows = (record.get("verdicts") or {}).get(score) or {}
    if not rows:
        return None
    names = short_names([baseline, *rows])
    order = sorted_by_difference(rows)[::-1]  # plotly counts rows from the bottom: the largest on top
    position = {baseline: 0} | {name: i + 1 for i, name in enumerate(order)}
    scale, fig = 100.0 if in_points(metric) else 1.0, go.Figure()
    for i, (kind, label, offset) in enumerate(FOREST_BARS):
        shown = [n for n in order if np.isfinite(rows[n][f"{kind}_holm_low"] + rows[n][f"{kind}_holm_high"])]
        diff, low, high = (np.array([rows[n][k] for n in shown]) * scale
                           for k in ("diff_mean", f"{kind}_holm_low", f"{kind}_holm_high"))
        fig.add_trace(go.Scatter(
            x=diff, y=[position[n] + offset for n in shown], mode="markers", name=label,
            marker={"size": 9, "color": COLORS[i], "symbol": ["circle" if rows[n]["resolved"] else "circle-open"
                                                              for n in shown]},
            error_x={"type": "data", "symmetric": False, "array": high - diff, "arrayminus": diff - low},
            text=[names[n] for n in shown], hovertemplate="%{text}: %{x:+.2f}<extra>" + label + "</extra>"))
    fig.add_trace(go.Scatter(x=[0], y=[0], mode="markers", name="the baseline", hoverinfo="skip",
                             marker={"size": 11, "color": "black", "symbol": "diamond"}))
    fig.add_vline(x=0, line={"color": "grey", "width": 1})
    labels = {n: names[n] for n in order} | {baseline: f"{names[baseline]} (baseline)"}
    fig.update_yaxes(tickvals=list(position.values()), ticktext=[labels[n] for n in position], range=[-0.6,
                                                                                                     len(order) + 0.8])
    for name in order:
        fig.add_annotation(x=1.01, y=position[name], xref="paper", text=verdict_text(rows[name], metric),
                           showarrow=False, xanchor="left", font={"family": "monospace", "size": 12})
    fig.add_annotation(x=1.01, y=len(order) + 0.7, xref="paper", showarrow=False, xanchor="left",
                       text=f"<b>difference [adjusted 95% interval]{unit(metric)}</b>")
    points = " (percentage points)" if in_points(metric) else ""
    fig.update_layout(xaxis_title=f"{score} minus {names[baseline]}'s, same seed{points}")
    return sized(fig, 220 + 40 * len(order)).update_layout(  # the legend above: the axis title has the foot
        margin={"r": 330, "t": 60}, legend={"orientation": "h", "y": 1.02, "yanchor": "bottom", "x": 0})
