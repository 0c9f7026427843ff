"""`fedpilot compare SET.yaml`: a named set of pipelines over N seeds, as one table and one MLflow run.

A set file names its pipelines (paths relative to the file), the baseline the others are compared with, the seeds,
and optionally overrides applied to every pipeline:

    name: digits-k2                       # the MLflow experiment every run of the comparison goes to
    baseline: digits-k2-baselines         # the `name` of one of the pipelines
    seeds: 3                              # seeds 0, 1, 2 (or a list)
    pipelines: [../digits-k2-baselines.yaml, ../digits-k2-ditto.yaml]

Each pipeline runs once per seed with its `seed` set to it (a different partition and initialisation, the same for
every pipeline of that seed, so a shared pretraining stage is trained once per seed and reused from the stage
cache). The score of a run is its last stage's distribution of per-client test accuracy: its mean and its p10
(the 10th percentile over clients). Per pipeline the table gives each score's mean and sd over the seeds, and the
paired difference with the baseline on the same seed (mean, sd, and the seeds on which the pipeline is better and
worse; the others are ties).
Every pipeline run is nested under the comparison's run, which records the table (comparison.txt), the values
of every run (comparison.json), the summary as metrics and each run's id as a tag `run.<pipeline>.<seed>`.
Where the runs record them, the table gains the novel clients' and the selected models' mean (mean ± sd over seeds).
Under the table, the set's resolution: the smallest difference of the mean test metric it tells from noise, the
larger of twice the sd of the paired differences over seeds (median over the pipelines) and the step one test sample
of the median client makes in the mean over clients (for accuracy); recorded as `resolution.*` metrics.

Per client (by name), each pipeline's change against the baseline on each seed goes to the table
`clients_across_seeds.json` (client, pipeline, seed, change), and the clients helped on every seed, hurt on every
seed and neither to `<pipeline>/clients_helped_every_seed`, `_hurt_every_seed` and `<pipeline>/clients_mixed`
(fedpilot.client_effects); the comparison's `report.html` draws them. Unless the set fixes `dataset.seed`, each
seed is also another federation, and a client's name other data: the report says which.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, ValidationError, field_validator

from fedpilot.client_effects import CHANGES_TABLE, client_changes, federation_note, participating, seed_counts
from fedpilot.errors import SpecError, from_validation, within
from fedpilot.metric_names import HEADLINE_STATS, NOVEL, SELECTED, higher_is_better, metric_label
from fedpilot.names import check_name
from fedpilot.pipeline.checks import prepare
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.report import log_report
from fedpilot.report.runs import clients_frame
from fedpilot.schema import Strict
from fedpilot.settings import check_cache, check_tracking, tracking_uri
from fedpilot.spec import PipelineSpec, load_pipeline, read_user_yaml
from fedpilot.tracking import COMPARE_TAG, Tracker

MAX_SEEDS = 1000  # every seed runs each pipeline of the set, all checked before the first runs: more is a typo


def scores_of(metric: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The scores of a run by its task's primary `metric`: the headline ones (test mean and p10, compared with the
    baseline) and those shown where recorded (the novel clients' mean, the selected models' mean)."""
    return (tuple(f"test_{metric}_{stat}" for stat in HEADLINE_STATS),
            (f"{NOVEL}_test_{metric}_mean", f"{SELECTED}_test_{metric}_mean"))


class ComparisonSpec(Strict):
    """A set file: its name, baseline, seeds (a count or a list of 1 to MAX_SEEDS), pipeline files and overrides for
    all of them."""

    name: str
    baseline: str
    seeds: int | list[int] = Field(3)  # each checked as a pipeline's seed
    pipelines: list[str] = Field(min_length=1)
    overrides: list[str] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        return check_name("name", name)

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, seeds: int | list[int]) -> int | list[int]:
        if not 1 <= (seeds if isinstance(seeds, int) else len(seeds)) <= MAX_SEEDS:
            raise ValueError(f"at least one seed, and at most {MAX_SEEDS:,}")
        return seeds

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)


def load_comparison(path: Path, seeds: int | None = None, overrides: list[str] | None = None,
                    cache_dir: Path | None = None) -> tuple[ComparisonSpec, dict[str, dict[int, PipelineSpec]]]:
    """The set and every (pipeline, seed) spec, each checked as `fedpilot run` checks it (dataset and model built
    into the cache) before anything is recorded; `seeds` (a count) and `overrides` replace / extend the file's."""
    root = check_cache(cache_dir)
    check_tracking(reach=True)  # the comparison's own run
    if not path.is_file():
        raise SpecError("set", str(path), "no such file")
    try:
        comparison = ComparisonSpec.model_validate(read_user_yaml(path))
    except ValidationError as err:
        raise from_validation(err, ComparisonSpec) from None
    if seeds is not None:
        comparison.seeds = within("--seeds", seeds, 1, MAX_SEEDS)
    extra = [*comparison.overrides, *(overrides or []), f"tracking.experiment={comparison.name}"]
    specs: dict[str, dict[int, PipelineSpec]] = {}
    for i, relative in enumerate(comparison.pipelines):
        file = path.parent / relative
        if not file.is_file():
            raise SpecError(f"pipelines.{i}", relative, f"no such file (relative to {path.parent})")
        runs = {seed: load_pipeline(file, [*extra, f"seed={seed}"]) for seed in comparison.seed_list()}
        name = runs[comparison.seed_list()[0]].name
        if name in specs:
            raise SpecError(f"pipelines.{i}", relative, f"a second pipeline named {name!r}")
        specs[name] = runs
    if comparison.baseline not in specs:
        raise SpecError("baseline", comparison.baseline, "not the name of a pipeline of the set", allowed=list(specs))
    for runs in specs.values():
        for spec in runs.values():
            check_tracking(spec.tracking.uri)
            prepare(spec, root)
    return comparison, specs


@dataclass
class ComparisonResult:
    run_id: str
    table: str
    scores: dict[str, dict[int, dict[str, float]]]  # pipeline -> seed -> score -> value
    runs: dict[str, dict[int, str]]  # pipeline -> seed -> its pipeline run id
    counts: dict[str, dict[str, int]]  # non-baseline pipeline -> clients helped / hurt on every seed, mixed
    tracking_uri: str
    experiment_id: str


def run_comparison(comparison: ComparisonSpec, specs: dict[str, dict[int, PipelineSpec]],
                   cache_dir: Path | None = None, progress: bool = False,
                   echo: Callable[[str], None] = print) -> ComparisonResult:
    """Every pipeline on every seed, nested under one comparison run; then the table, printed and recorded."""
    tracker = Tracker(tracking_uri(), comparison.name)
    run_id = tracker.client.create_run(tracker.experiment_id, run_name=f"compare-{comparison.name}", tags={
        COMPARE_TAG: comparison.name, "fedpilot.baseline": comparison.baseline}).info.run_id
    tracker.log_params(run_id, {"seeds": comparison.seed_list(), "baseline": comparison.baseline,
                                "pipelines": list(specs), "overrides": comparison.overrides})
    scores: dict[str, dict[int, dict[str, float]]] = {name: {} for name in specs}
    values: dict[str, dict[int, dict[str, float]]] = {name: {} for name in specs}  # per-client test values
    test_sizes: list[int] = []  # the baseline's clients' test samples on the first seed (the set's granularity)
    runs: dict[str, dict[int, str]] = {name: {} for name in specs}
    seeds, metric = comparison.seed_list(), "acc"
    try:
        for seed in seeds:
            for name, by_seed in specs.items():
                runner = PipelineRunner(by_seed[seed], cache_dir=cache_dir, progress=progress)
                metric = runner.task.primary
                result = runner.run(parent=run_id, tags={COMPARE_TAG: comparison.name, "fedpilot.seed": str(seed)})
                last = result.stages[-1].run_id  # what the comparison scores: the pipeline's last stage
                scores[name][seed] = run_scores(tracker.client.get_run(last).data.metrics, metric)
                values[name][seed] = client_values(tracker.client, last, metric)
                if name == comparison.baseline and not test_sizes:
                    test_sizes = client_test_sizes(tracker.client, last)
                runs[name][seed] = result.run_id
                tracker.set_tags(run_id, {f"run.{name}.{seed}": result.run_id})
                echo(f"seed {seed} {name}: " + ", ".join(f"{s}={v:.4f}" for s, v in scores[name][seed].items()))
        higher = higher_is_better(metric)
        summary = summarize(scores, comparison.baseline, higher)
        changes = client_changes(values, comparison.baseline)
        counts = seed_counts(changes, [n for n in specs if n != comparison.baseline], len(seeds), higher)
        federation = federation_note({n: {s: spec.dataset.seed for s, spec in by_seed.items()}
                                      for n, by_seed in specs.items()})
        resolved = resolution(summary, comparison.baseline, test_sizes, metric)
        table = "\n\n".join([format_table(summary, comparison.baseline, len(seeds), metric),
                              format_resolution(resolved, len(seeds), metric),
                              format_counts(counts, comparison.baseline, len(seeds), metric),
                              textwrap.fill(federation, 118)])
        tracker.log_metrics(run_id, {f"{name}.{key}": value for name, row in summary.items()
                                     for key, value in row.items()})
        tracker.log_metrics(run_id, {f"{name}/clients_{key}": n for name, row in counts.items()
                                     for key, n in row.items()})
        tracker.log_metrics(run_id, {f"resolution.{key}": v for key, v in resolved.items() if np.isfinite(v)})
        tracker.client.log_table(run_id, changes.to_dict(orient="list"), CHANGES_TABLE)
        tracker.client.log_text(run_id, table, "comparison.txt")
        tracker.client.log_dict(run_id, {"baseline": comparison.baseline, "metric": metric, "seeds": seeds,
                                         "federation": federation, "scores": scores, "runs": runs,
                                         "summary": summary, "counts": counts, "resolution": resolved},
                              "comparison.json")
        log_report(tracker.client, run_id)
        tracker.finish(run_id)
    except BaseException as err:
        tracker.fail([run_id], err)
        raise
    return ComparisonResult(run_id, table, scores, runs, counts, tracker.uri, tracker.experiment_id)


def run_scores(metrics: dict[str, float], metric: str) -> dict[str, float]:
    """A stage run's scores (scores_of): the headline ones, and the others it recorded."""
    headline, extra = scores_of(metric)
    return {s: float(metrics[s]) for s in headline} | {s: float(metrics[s]) for s in extra if s in metrics}


def client_values(client: Any, run_id: str, metric: str) -> dict[str, float]:
    """Each participating client's test `metric` in a stage run's per-client table, by the client's name."""
    frame = participating(clients_frame(client, run_id))
    return dict(zip(frame["name"].astype(str), frame[f"test_{metric}"].astype(float), strict=True))


def client_test_sizes(client: Any, run_id: str) -> list[int]:
    """Each participating client's number of test samples in a stage run's per-client table."""
    return [int(n) for n in participating(clients_frame(client, run_id))["test_samples"]]


def resolution(summary: dict[str, dict[str, float]], baseline: str, test_sizes: list[int],
               metric: str) -> dict[str, float]:
    """The smallest difference of the mean test `metric` the set can tell from noise: twice the sd over seeds of
    the paired differences with the baseline (median and largest over the pipelines; NaN with one seed), and for a
    metric counted in samples (accuracy) the step one test sample makes: a client's (median client) and the mean
    over clients' (the median client's sample in a mean over every client). `smallest` is the larger of the median
    paired 2 sd and the mean's step."""
    score = f"test_{metric}_mean.diff_sd"
    spreads = [2 * row[score] for name, row in summary.items() if name != baseline and np.isfinite(row.get(score, np.nan))]
    paired = float(np.median(spreads)) if spreads else float("nan")
    counted = metric == "acc" and len(test_sizes) > 0 and min(test_sizes) > 0
    client_step = 1 / float(np.median(test_sizes)) if counted else float("nan")
    mean_step = client_step / len(test_sizes) if counted else float("nan")
    smallest = float(np.nanmax([paired, mean_step])) if spreads or counted else float("nan")
    return {"paired_2sd": paired, "paired_2sd_max": float(max(spreads)) if spreads else float("nan"),
            "client_step": client_step, "mean_step": mean_step, "smallest": smallest}


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


def summarize(scores: dict[str, dict[int, dict[str, float]]], baseline: str,
              higher: bool = True) -> dict[str, dict[str, float]]:
    """Per pipeline and score it has on every seed: mean and sd over seeds, and where the baseline has it too, the
    paired difference (mean, sd, the fractions of seeds on which the pipeline is better and worse, `higher` saying
    which way is better; the rest are ties)."""
    summary = {}
    for name, by_seed in scores.items():
        seeds = sorted(by_seed)
        row: dict[str, float] = {}
        for score in [s for s in by_seed[seeds[0]] if all(s in by_seed[seed] for seed in seeds)]:
            values = np.array([by_seed[s][score] for s in seeds])
            row.update({f"{score}.mean": float(values.mean()), f"{score}.sd": _sd(values)})
            if all(score in scores[baseline].get(s, {}) for s in seeds):
                diffs = values - np.array([scores[baseline][s][score] for s in seeds])
                gains = diffs if higher else -diffs
                row.update({f"{score}.diff_mean": float(diffs.mean()), f"{score}.diff_sd": _sd(diffs),
                            f"{score}.better": float((gains > 0).mean()), f"{score}.worse": float((gains < 0).mean())})
        summary[name] = row
    return summary


def _sd(values: np.ndarray) -> float:
    """Sample standard deviation over seeds (NaN with one seed)."""
    return float(values.std(ddof=1)) if len(values) > 1 else float("nan")


def format_table(summary: dict[str, dict[str, Any]], baseline: str, seeds: int, metric: str = "acc") -> str:
    """The comparison as text: per pipeline, mean +- sd over seeds of each headline score and of its difference with
    the baseline, with the numbers of seeds on which it is better and worse (the others are ties); then mean +- sd
    of the other scores any pipeline recorded (novel clients, selected models)."""
    headline, extra = scores_of(metric)
    extra = tuple(s for s in extra if any(f"{s}.mean" in row for row in summary.values()))
    rows = [["pipeline", *[cell for s in headline for cell in (s, "vs baseline")], *extra]]
    for name, row in summary.items():
        cells = [name]
        for s in headline:
            cells.append(_pm(row[f"{s}.mean"], row[f"{s}.sd"]))
            cells.append("" if name == baseline else
                         f"{_pm(row[f'{s}.diff_mean'], row[f'{s}.diff_sd'], sign=True)} "
                         f"({round(row[f'{s}.better'] * seeds)} better, {round(row[f'{s}.worse'] * seeds)} worse)")
        cells += [_pm(row[f"{s}.mean"], row[f"{s}.sd"]) if f"{s}.mean" in row else "" for s in extra]
        rows.append(cells)
    lines = [f"per-client test {metric_label(metric)} of each pipeline's last stage, {seeds} seed(s); "
             f"baseline {baseline}", *_aligned(rows)]
    return "\n".join(lines)


def format_counts(counts: dict[str, dict[str, int]], baseline: str, seeds: int, metric: str = "acc") -> str:
    """Per pipeline, its clients (by name, seen on every seed) better than the baseline on every seed, worse on
    every seed, and neither."""
    rows = [["pipeline", "helped every seed", "hurt every seed", "mixed"]]
    rows += [[name, *(str(row[k]) for k in ("helped_every_seed", "hurt_every_seed", "mixed"))]
             for name, row in counts.items()]
    head = f"clients whose test {metric_label(metric)} is better / worse than with {baseline} on each of {seeds} seed(s)"
    return "\n".join([head, *_aligned(rows)])


def _aligned(rows: list[list[str]]) -> list[str]:
    """Text rows in columns two spaces apart: the first left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]


def _pm(mean: float, sd: float, sign: bool = False) -> str:
    """mean ± sd at 4 decimals (a mean that rounds to zero is printed without a sign's minus)."""
    mean = round(mean, 4) + 0.0
    value = f"{mean:+.4f}" if sign else f"{mean:.4f}"
    return value if np.isnan(sd) else f"{value} ± {sd:.4f}"
