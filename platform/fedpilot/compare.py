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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field, ValidationError, field_validator

from fedpilot.errors import SpecError, from_validation, within
from fedpilot.metric_names import HEADLINE_STATS
from fedpilot.names import check_name
from fedpilot.pipeline.checks import prepare
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.schema import Strict
from fedpilot.settings import check_cache, check_tracking, tracking_uri
from fedpilot.spec import PipelineSpec, load_pipeline, read_user_yaml
from fedpilot.tracking import Tracker

SCORES = tuple(f"test_acc_{stat}" for stat in HEADLINE_STATS)  # test_acc_mean, test_acc_p10
MAX_SEEDS = 1000  # every seed runs each pipeline of the set, all checked before the first runs: more is a typo
COMPARE_TAG = "fedpilot.compare"


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
    runs: dict[str, dict[int, str]] = {name: {} for name in specs}
    try:
        for seed in comparison.seed_list():
            for name, by_seed in specs.items():
                runner = PipelineRunner(by_seed[seed], cache_dir=cache_dir, progress=progress)
                result = runner.run(parent=run_id, tags={COMPARE_TAG: comparison.name, "fedpilot.seed": str(seed)})
                scores[name][seed] = {s: float(result.stages[-1].metrics[s]) for s in SCORES}
                runs[name][seed] = result.run_id
                tracker.set_tags(run_id, {f"run.{name}.{seed}": result.run_id})
                echo(f"seed {seed} {name}: " + ", ".join(f"{s}={v:.4f}" for s, v in scores[name][seed].items()))
        summary = summarize(scores, comparison.baseline)
        table = format_table(summary, comparison.baseline, len(comparison.seed_list()))
        tracker.log_metrics(run_id, {f"{name}.{key}": value for name, row in summary.items()
                                     for key, value in row.items()})
        tracker.client.log_text(run_id, table, "comparison.txt")
        tracker.client.log_dict(run_id, {"baseline": comparison.baseline, "scores": scores, "runs": runs,
                                         "summary": summary}, "comparison.json")
        tracker.finish(run_id)
    except BaseException as err:
        tracker.fail([run_id], err)
        raise
    return ComparisonResult(run_id, table, scores, runs)


def summarize(scores: dict[str, dict[int, dict[str, float]]], baseline: str) -> dict[str, dict[str, float]]:
    """Per pipeline and score: mean and sd over seeds, and the paired difference with the baseline (mean, sd, the
    fractions of seeds on which the pipeline is better and worse; the rest are ties)."""
    summary = {}
    for name, by_seed in scores.items():
        seeds = sorted(by_seed)
        row: dict[str, float] = {}
        for score in SCORES:
            values = np.array([by_seed[s][score] for s in seeds])
            diffs = values - np.array([scores[baseline][s][score] for s in seeds])
            row.update({f"{score}.mean": float(values.mean()), f"{score}.sd": _sd(values),
                        f"{score}.diff_mean": float(diffs.mean()), f"{score}.diff_sd": _sd(diffs),
                        f"{score}.better": float((diffs > 0).mean()), f"{score}.worse": float((diffs < 0).mean())})
        summary[name] = row
    return summary


def _sd(values: np.ndarray) -> float:
    """Sample standard deviation over seeds (NaN with one seed)."""
    return float(values.std(ddof=1)) if len(values) > 1 else float("nan")


def format_table(summary: dict[str, dict[str, Any]], baseline: str, seeds: int) -> str:
    """The comparison as text: per pipeline, mean +- sd over seeds of each score and of its difference with the
    baseline, with the numbers of seeds on which it is better and worse (the others are ties)."""
    rows = [["pipeline", *[cell for s in SCORES for cell in (s, "vs baseline")]]]
    for name, row in summary.items():
        cells = [name]
        for s in SCORES:
            cells.append(_pm(row[f"{s}.mean"], row[f"{s}.sd"]))
            cells.append("" if name == baseline else
                         f"{_pm(row[f'{s}.diff_mean'], row[f'{s}.diff_sd'], sign=True)} "
                         f"({round(row[f'{s}.better'] * seeds)} better, {round(row[f'{s}.worse'] * seeds)} worse)")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [f"per-client test accuracy of each pipeline's last stage, {seeds} seed(s); baseline {baseline}"]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
              .rstrip() for r in rows]
    return "\n".join(lines)


def _pm(mean: float, sd: float, sign: bool = False) -> str:
    """mean ± sd at 4 decimals (a mean that rounds to zero is printed without a sign's minus)."""
    mean = round(mean, 4) + 0.0
    value = f"{mean:+.4f}" if sign else f"{mean:.4f}"
    return value if np.isnan(sd) else f"{value} ± {sd:.4f}"
