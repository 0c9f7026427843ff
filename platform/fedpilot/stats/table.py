"""A comparison's tables as rows of cells, printed as text (`fedpilot compare`, comparison.txt) and shown as HTML
tables (the comparison's report): the pipelines against the baseline, each verdict's intervals, the clients helped
and hurt on every seed, and with tuning what each study chose and how much its choice's validation fell on fresh
seeds."""

from __future__ import annotations

import math
import textwrap
from typing import Any

import numpy as np
import pandas as pd

from fedpilot.metric_names import CLIENT_COUNTS, metric_label, scores_of
from fedpilot.stats.intervals import ALPHA
from fedpilot.stats.keys import key_labels
from fedpilot.stats.scores import in_points
from fedpilot.stats.study import StudySummary
from fedpilot.stats.verdicts import DIFFERENCE

Rows = list[list[str]]  # the first row is the header
Verdicts = dict[str, dict[str, dict[str, Any]]]  # score -> pipeline -> its verdict (stats.verdicts)


def aligned(rows: Rows, right: tuple[int, ...] = ()) -> list[str]:
    """Rows of cells as lines of aligned columns (right-aligned where `right` says), the first row a header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in
                      enumerate(zip(row, widths, strict=True))).rstrip() for row in rows]


def text(rows: Rows) -> list[str]:
    """Rows as aligned text lines: the first column left-aligned, the others right-aligned."""
    return aligned(rows, right=tuple(range(1, len(rows[0]))))


def frame(rows: Rows) -> pd.DataFrame:
    """Rows as a table for the report's HTML."""
    return pd.DataFrame(rows[1:], columns=rows[0])


def difference(value: float, metric: str, sign: bool = True) -> str:
    """A difference of `metric` as shown: in percentage points (2 decimals) for accuracy, else at 4 decimals."""
    if not math.isfinite(value):
        return "" if math.isnan(value) else f"{value:+}" if sign else str(value)
    shown = round(value * 100, 2) + 0.0 if in_points(metric) else round(value, 4) + 0.0  # no "-0.00"
    return f"{shown:{'+' if sign else ''}.{2 if in_points(metric) else 4}f}"


def unit(metric: str) -> str:
    return " pp" if in_points(metric) else ""


def hull(verdict: dict[str, Any]) -> tuple[float, float]:
    """The adjusted interval a verdict is read by: the outer ends of its Holm-adjusted t and bootstrap intervals."""
    lows = [verdict[k] for k in ("t_holm_low", "boot_holm_low") if not math.isnan(verdict[k])]
    highs = [verdict[k] for k in ("t_holm_high", "boot_holm_high") if not math.isnan(verdict[k])]
    return (min(lows), max(highs)) if lows and highs else (math.nan, math.nan)


def verdict_cell(verdict: dict[str, Any] | None, metric: str) -> str:
    """A pipeline's difference with the baseline and its adjusted interval, `resolved` where it excludes 0."""
    if verdict is None:
        return ""
    low, high = hull(verdict)
    interval = f" [{difference(low, metric)}, {difference(high, metric)}]" if not math.isnan(low) else ""
    return f"{difference(verdict['diff_mean'], metric)}{interval}{unit(metric)}" + (" resolved" if verdict["resolved"]
                                                                                else "")


def pipelines_rows(summary: dict[str, dict[str, Any]], baseline: str, metric: str,
                   untuned: dict[str, dict[str, float]] | None = None, verdicts: Verdicts | None = None) -> Rows:
    """Per pipeline, mean ± sd over seeds of each headline score and, but for the baseline, its difference with
    the baseline and adjusted interval (verdict_cell); the untuned test mean where it ran; then mean ± sd of the
    other scores any pipeline recorded (novel clients, selected models)."""
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
            cells.append(verdict_cell((verdicts or {}).get(s, {}).get(name), metric))
        if shown_untuned:
            other = untuned.get(name, {})
            cells.append(pm(other[f"{mean}.mean"], other[f"{mean}.sd"]) if f"{mean}.mean" in other else "")
        cells += [pm(row[f"{s}.mean"], row[f"{s}.sd"]) if f"{s}.mean" in row else "" for s in extra]
        rows.append(cells)
    return rows


def format_table(summary: dict[str, dict[str, Any]], baseline: str, seeds: int, metric: str = "acc",
                 untuned: dict[str, dict[str, float]] | None = None, tuned: bool = False,
                 verdicts: Verdicts | None = None) -> str:
    """The comparison as text: its head line, then pipelines_rows."""
    what = "tuned pipeline's" if tuned else "pipeline's"
    head = (f"per-client test {metric_label(metric)} of each {what} last stage, {seeds} seed(s); baseline {baseline}")
    return "\n".join([head, *text(pipelines_rows(summary, baseline, metric, untuned, verdicts))])


def verdict_rows(verdicts: dict[str, dict[str, Any]], metric: str) -> Rows:
    """Per pipeline, one score's verdict: its difference, the Holm-adjusted t and bootstrap intervals, the p-value
    it was adjusted on and the adjusted one, resolved, and the seeds a 0.5 pp difference needs."""
    needs = f"seeds for {difference(DIFFERENCE, metric, sign=False)}{unit(metric)}" if in_points(metric) else None
    rows = [["pipeline", f"difference{unit(metric)}", "t (seeds)", "bootstrap (seeds, clients)", "p", "p Holm",
             "resolved", *([needs] if needs else [])]]
    for name, v in verdicts.items():
        t = f"[{difference(v['t_holm_low'], metric)}, {difference(v['t_holm_high'], metric)}]"
        boot = (f"[{difference(v['boot_holm_low'], metric)}, {difference(v['boot_holm_high'], metric)}]"
                if not math.isnan(v["boot_holm_low"]) else "")
        rows.append([name, difference(v["diff_mean"], metric), t if not math.isnan(v["t_holm_low"]) else "", boot,
                     _p(v["p"]), _p(v["p_holm"]), "yes" if v["resolved"] else "no",
                     *([str(v["seeds_needed"]) if v["seeds_needed"] else "more than 10^6"] if needs else [])])
    return rows


def format_verdicts(verdicts: Verdicts, baseline: str, metric: str, steps: dict[str, float]) -> str:
    """What the intervals are and how a difference is resolved, then each headline score's verdicts."""
    family = max((len(rows) for rows in verdicts.values()), default=0)
    parts = [f"intervals: each difference is a pipeline's score minus {baseline}'s on the same seed, averaged over "
             f"seeds; [low, high] are {100 * (1 - ALPHA):.0f}% intervals adjusted by Holm's step-down for the "
             f"{family} comparison(s) with {baseline} (each score its own family): the t interval over seeds and the "
             f"hierarchical bootstrap over seeds and then clients, the table above showing the outer ends of the two. "
             f"resolved: Holm rejects \"no difference\" at {ALPHA:g} on the larger of the two p-values, so that "
             f"both adjusted intervals exclude 0."]
    if in_points(metric):
        parts.append(f"seeds for {difference(DIFFERENCE, metric, sign=False)} pp: the seeds a paired t test at "
                     f"level {ALPHA:g}/{family} needs to find a {difference(DIFFERENCE, metric, sign=False)} pp "
                     "difference with power 0.8 if the paired differences are normal with the measured sd.")
    if math.isfinite(steps.get("client", math.nan)):
        parts.append(f"one test sample moves a client's {metric_label(metric)} by {steps['client']:.4f} (median "
                     f"client) and test_{metric}_mean by {steps['mean']:.4f}.")
    lines = [textwrap.fill(" ".join(parts), 118)]
    for score, rows in verdicts.items():
        if rows:
            lines += ["", f"{score} against {baseline}", *text(verdict_rows(rows, metric))]
    return "\n".join(lines)


def counts_rows(counts: dict[str, dict[str, int]]) -> Rows:
    """Per pipeline, its clients helped on every seed, hurt on every seed, unchanged on every seed (blank in a
    record from before it was counted), and mixed."""
    return [["pipeline", "helped every seed", "hurt every seed", "unchanged every seed", "mixed"],
            *[[name, *(str(row.get(k, "")) for k in CLIENT_COUNTS)] for name, row in counts.items()]]


def format_counts(counts: dict[str, dict[str, int]], baseline: str, seeds: int, metric: str = "acc") -> str:
    """Per pipeline, its clients (by name, seen on every seed) better than the baseline on every seed, worse on
    every seed, and neither."""
    head = (f"clients whose test {metric_label(metric)} is better / worse than with {baseline} on each of "
            f"{seeds} seed(s)")
    return "\n".join([head, *text(counts_rows(counts))])


def tuning_rows(studies: dict[str, StudySummary], objective: str,
                optimism: dict[str, dict[str, float]] | None = None,
                facts: dict[str, dict[str, Any]] | None = None) -> Rows:
    """Per pipeline's study: with `facts` its tuned dimensions and budget (trials finished, of which beyond an edge
    and pruned, the rounds they trained) and which rule chose the winner; the chosen configuration's objective, the
    objective's p10 / p50 / p90 over completed trials, whether it still improved in the last quarter of trials, with
    `optimism` the same objective of its reruns on the comparison seeds and the optimism with its 95% interval, and
    the chosen values (stats.keys), flagged where still in the outer tenth of their range."""
    shown, budget = optimism is not None, facts is not None
    rows = [["pipeline", *(["dims", "trials (edge, pruned)", "rounds"] if budget else ["trials (pruned)"]),
             f"best {objective}", *(["chosen by"] if budget else []), "p10", "p50", "p90", "improving late",
             *(["on comparison seeds", "optimism [95%]"] if shown else []), "chosen"]]
    for name, study in studies.items():
        fact = (facts or {}).get(name) or {}
        rows.append([name, *(_budget_cells(fact, study) if budget else [f"{study.trials} ({study.pruned})"]),
                     _number(study.best), *([fact.get("chosen_origin", "")] if budget else []), _number(study.p10),
                     _number(study.p50), _number(study.p90), "yes" if study.improving_late else "no",
                     *(_optimism_cells(optimism.get(name)) if shown else []), _chosen(study, fact.get("at_edge", {}))])
    return rows


def _budget_cells(fact: dict[str, Any], study: StudySummary) -> list[str]:
    if not fact:
        return ["", f"{study.trials} (, {study.pruned})", ""]
    return [str(fact["dimensions"]), f"{fact['finished']} ({fact['beyond_edge']}, {fact['pruned']})",
            f"{fact['rounds']:,}"]


def _chosen(study: StudySummary, edges: dict[str, str]) -> str:
    """The chosen values by their readable keys, each still in the outer tenth of its range flagged."""
    labels = key_labels(list(study.chosen), study.stages)
    return ", ".join(f"{labels[k]}={_value(v)}" + (f" [{edges[k]} edge]" if k in edges else "")
                     for k, v in study.chosen.items()) or "none completed: as written"


def _optimism_cells(gap: dict[str, float] | None) -> list[str]:
    if gap is None:
        return ["", ""]
    interval = f" [{gap['low']:+.4f}, {gap['high']:+.4f}]" if math.isfinite(gap["low"]) else ""
    return [_number(gap["comparison"]), f"{gap['optimism']:+.4f}{interval}" if math.isfinite(gap["optimism"]) else ""]


def format_tuning(studies: dict[str, StudySummary], objective: str, seeds: list[int],
                  optimism: dict[str, dict[str, float]] | None = None,
                  facts: dict[str, dict[str, Any]] | None = None) -> str:
    """What each pipeline's study chose, what it spent, how much its result depends on its settings, and its
    winner's curse."""
    head = (f"tuning: one study per pipeline on the validation {objective} of seed(s) {seeds}: trial 0 as written, "
            "then Sobol points, then TPE; a best value in the outer tenth of a range grew the range and spent "
            "further trials beyond its edge ('edge'); a chosen value still there is flagged [low/high edge]; "
            "improving late: its best still rose in the last quarter of trials (more trials may help)")
    if optimism is not None:
        head += ("; optimism: the best minus the same choice's validation on the comparison seeds (positive: the "
                 "tuning seeds flattered it), mean and 95% t interval over those seeds")
    return "\n".join([textwrap.fill(head, 118), *text(tuning_rows(studies, objective, optimism, facts))])


def _value(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _number(value: float) -> str:
    return f"{value:.4f}" if np.isfinite(value) else ""


def _p(value: float) -> str:
    return f"{value:.3g}" if np.isfinite(value) else ""


def pm(mean: float, sd: float) -> str:
    """mean ± sd at 4 decimals."""
    return f"{mean:.4f}" if np.isnan(sd) else f"{mean:.4f} ± {sd:.4f}"
