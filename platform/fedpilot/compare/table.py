"""A comparison's tables as rows of cells, printed as text (`fedpilot compare`, comparison.txt) and shown as HTML
tables (the comparison's report): the pipelines against the baseline, the resolution, the clients helped and hurt on
every seed, and with tuning what each study chose."""

from __future__ import annotations

import textwrap
from typing import Any

import numpy as np
import pandas as pd

from fedpilot.compare.stats import StudySummary
from fedpilot.metric_names import metric_label, scores_of
from fedpilot.overview import aligned

Rows = list[list[str]]  # the first row is the header


def text(rows: Rows) -> list[str]:
    """Rows as aligned text lines: the first column left-aligned, the others right-aligned."""
    return aligned(rows, right=tuple(range(1, len(rows[0]))))


def frame(rows: Rows) -> pd.DataFrame:
    """Rows as a table for the report's HTML."""
    return pd.DataFrame(rows[1:], columns=rows[0])


def pipelines_rows(summary: dict[str, dict[str, Any]], baseline: str, seeds: int, metric: str,
                   untuned: dict[str, dict[str, float]] | None = None) -> Rows:
    """Per pipeline, mean ± sd over seeds of each headline score and of its difference with the baseline, with the
    numbers of seeds on which it is better and worse (the others are ties); the untuned test mean where it ran; then
    mean ± sd of the other scores any pipeline recorded (novel clients, selected models)."""
    headline, extra = scores_of(metric)
    extra = tuple(s for s in extra if any(f"{s}.mean" in row for row in summary.values()))
    mean = f"test_{metric}_mean"
    shown_untuned = untuned is not None and any(f"{mean}.mean" in row for row in untuned.values())
    rows = [["pipeline", *[cell for s in headline for cell in (s, "vs baseline")],
             *(["untuned " + mean] if shown_untuned else []), *extra]]
    for name, row in summary.items():
        cells = [name]
        for s in headline:
            cells.append(pm(row[f"{s}.mean"], row[f"{s}.sd"]) if f"{s}.mean" in row else "")
            cells.append("" if name == baseline or f"{s}.diff_mean" not in row else
                         f"{pm(row[f'{s}.diff_mean'], row[f'{s}.diff_sd'], sign=True)} "
                         f"({round(row[f'{s}.better'] * seeds)} better, {round(row[f'{s}.worse'] * seeds)} worse)")
        if shown_untuned:
            other = untuned.get(name, {})
            cells.append(pm(other[f"{mean}.mean"], other[f"{mean}.sd"]) if f"{mean}.mean" in other else "")
        cells += [pm(row[f"{s}.mean"], row[f"{s}.sd"]) if f"{s}.mean" in row else "" for s in extra]
        rows.append(cells)
    return rows


def format_table(summary: dict[str, dict[str, Any]], baseline: str, seeds: int, metric: str = "acc",
                 untuned: dict[str, dict[str, float]] | None = None, tuned: bool = False) -> str:
    """The comparison as text: its head line, then pipelines_rows."""
    what = "tuned pipeline's" if tuned else "pipeline's"
    head = (f"per-client test {metric_label(metric)} of each {what} last stage, {seeds} seed(s); baseline {baseline}")
    return "\n".join([head, *text(pipelines_rows(summary, baseline, seeds, metric, untuned))])


def format_resolution(resolved: dict[str, float], seeds: int, metric: str) -> str:
    """The resolution as one paragraph: what it is and what it is made of."""
    name = f"test_{metric}_mean"
    parts = [f"2 x sd of the paired differences over {seeds} seeds: {resolved['paired_2sd']:.4f} (median over the "
             f"pipelines; largest {resolved['paired_2sd_max']:.4f})" if np.isfinite(resolved["paired_2sd"]) else
             "the paired differences' sd needs 2 or more seeds"]
    if np.isfinite(resolved["client_step"]):
        parts.append(f"one test sample moves a client's {metric_label(metric)} by {resolved['client_step']:.4f} "
                     f"(median client) and {name} by {resolved['mean_step']:.4f}")
    head = f"resolution: differences of {name} below {resolved['smallest']:.4f} are not resolved" \
        if np.isfinite(resolved["smallest"]) else "resolution: unknown"
    return textwrap.fill(f"{head}: " + "; ".join(parts) + ".", 118)


def counts_rows(counts: dict[str, dict[str, int]]) -> Rows:
    """Per pipeline, its clients helped on every seed, hurt on every seed, and mixed."""
    return [["pipeline", "helped every seed", "hurt every seed", "mixed"],
            *[[name, *(str(row[k]) for k in ("helped_every_seed", "hurt_every_seed", "mixed"))]
              for name, row in counts.items()]]


def format_counts(counts: dict[str, dict[str, int]], baseline: str, seeds: int, metric: str = "acc") -> str:
    """Per pipeline, its clients (by name, seen on every seed) better than the baseline on every seed, worse on
    every seed, and neither."""
    head = (f"clients whose test {metric_label(metric)} is better / worse than with {baseline} on each of "
            f"{seeds} seed(s)")
    return "\n".join([head, *text(counts_rows(counts))])


def tuning_rows(studies: dict[str, StudySummary], objective: str,
                facts: dict[str, dict[str, Any]] | None = None) -> Rows:
    """Per pipeline's study: its tuned dimensions and budget (trials finished, of which beyond an edge and pruned,
    the rounds they trained), the chosen configuration's objective and which rule chose it, the objective's p10 /
    p50 / p90 over completed trials, whether it still improved in the last quarter of trials, and the chosen values
    (flagged where still in the outer tenth of their range)."""
    rows = [["pipeline", "dims", "trials (edge, pruned)", "rounds", f"best {objective}", "chosen by", "p10", "p50",
             "p90", "improving late", "chosen"]]
    for name, study in studies.items():
        fact = (facts or {}).get(name)
        edges = fact["at_edge"] if fact else {}
        chosen = ", ".join(f"{_short(k)}={_value(v)}" + (f" [{edges[k]} edge]" if k in edges else "")
                           for k, v in study.chosen.items()) or "none completed: as written"
        budget = [str(fact["dimensions"]), f"{fact['finished']} ({fact['beyond_edge']}, {fact['pruned']})",
                  f"{fact['rounds']:,}"] if fact else ["", f"{study.trials} (, {study.pruned})", ""]
        rows.append([name, *budget, _number(study.best), fact["chosen_origin"] if fact else "", _number(study.p10),
                     _number(study.p50), _number(study.p90), "yes" if study.improving_late else "no", chosen])
    return rows


def format_tuning(studies: dict[str, StudySummary], objective: str, seeds: list[int],
                  facts: dict[str, dict[str, Any]] | None = None) -> str:
    """What each pipeline's study chose, what it spent, and how much its result depends on its settings."""
    head = (f"tuning: one study per pipeline on the validation {objective} of seed(s) {seeds}: trial 0 as written, "
            "then Sobol points, then TPE; a best value in the outer tenth of a range grew the range and spent "
            "further trials beyond its edge ('edge'); a chosen value still there is flagged [low/high edge]; "
            "improving late: its best still rose in the last quarter of trials (more trials may help)")
    return "\n".join([textwrap.fill(head, 118), *text(tuning_rows(studies, objective, facts))])


def _short(key: str) -> str:
    """A searched key without its stage index: stages.1.params.lr_v -> 1.lr_v."""
    parts = key.split(".")
    return f"{parts[1]}.{parts[-1]}" if parts[0] == "stages" and len(parts) > 2 else key


def _value(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _number(value: float) -> str:
    return f"{value:.4f}" if np.isfinite(value) else ""


def pm(mean: float, sd: float, sign: bool = False) -> str:
    """mean ± sd at 4 decimals (a mean that rounds to zero is printed without a sign's minus)."""
    mean = round(mean, 4) + 0.0
    value = f"{mean:+.4f}" if sign else f"{mean:.4f}"
    return value if np.isnan(sd) else f"{value} ± {sd:.4f}"
