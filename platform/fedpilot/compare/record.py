"""A comparison's outcome once every unit is done: the scores read back from each run's last stage, the statistics
(compare.stats), the tables (compare.table), and what the comparison's MLflow run records of them: comparison.txt,
comparison.json, the summary as metrics, each run's id as a tag `run.<pipeline>.<seed>`, the clients' changes
across seeds, with tuning each study's summary (`<pipeline>/tune_*` metrics, `tuned.<pipeline>.<key>` tags), and
the report."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Run

from fedpilot.client_effects import CHANGES_TABLE, client_changes, federation_note, participating, seed_counts
from fedpilot.compare.plan import TUNED, WRITTEN, Plan
from fedpilot.compare.stats import StudySummary, resolution, summarize
from fedpilot.compare.table import format_counts, format_resolution, format_table, format_tuning
from fedpilot.compare.work import Unit, Work, finished_runs
from fedpilot.metric_names import higher_is_better, scores_of
from fedpilot.report import log_report
from fedpilot.report.runs import clients_frame
from fedpilot.tracking import RECORD_ARTIFACT, TABLE_ARTIFACT, Tracker, stage_runs


@dataclass
class ComparisonResult:
    run_id: str
    table: str
    scores: dict[str, dict[int, dict[str, float]]]  # pipeline -> seed -> score -> value
    runs: dict[str, dict[int, str]]  # pipeline -> seed -> its pipeline run id
    counts: dict[str, dict[str, int]]  # non-baseline pipeline -> clients helped / hurt on every seed, mixed
    tracking_uri: str
    experiment_id: str


@dataclass
class Outcomes:
    """What the runs of one variant scored: per pipeline and seed its scores, per-client test values and run id;
    the baseline's clients' test sample counts on its first seed; the units that diverged."""

    scores: dict[str, dict[int, dict[str, float]]]
    values: dict[str, dict[int, dict[str, float]]]
    runs: dict[str, dict[int, str]]
    test_sizes: list[int]
    diverged: list[Unit]


def outcomes(plan: Plan, tracker: Tracker, done: dict[Unit, Run], variant: str) -> Outcomes:
    """The scores of the `variant` runs that are done (a diverged one has none)."""
    client, metric = tracker.client, plan.metric
    found = Outcomes({p: {} for p in plan.specs}, {p: {} for p in plan.specs}, {p: {} for p in plan.specs}, [], [])
    for seed in plan.seeds:
        for pipeline in plan.specs:
            unit = Unit(variant, pipeline, seed)
            run = done.get(unit)
            if run is None:
                continue
            if run.info.status != "FINISHED":
                found.diverged.append(unit)
                continue
            last = last_stage(client, tracker.experiment_id, run.info.run_id)
            found.scores[pipeline][seed] = run_scores(client.get_run(last).data.metrics, metric)
            found.values[pipeline][seed] = client_values(client, last, metric)
            found.runs[pipeline][seed] = run.info.run_id
            if pipeline == plan.baseline and not found.test_sizes:
                found.test_sizes = client_test_sizes(client, last)
    return found


def last_stage(client: MlflowClient, experiment_id: str, pipeline_run: str) -> str:
    """The run of a pipeline run's last stage (the newest run of its largest stage index)."""
    newest = stage_runs(client, experiment_id, pipeline_run)
    return newest[max(newest)].info.run_id


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


def assemble(plan: Plan, run_id: str, tracker: Tracker, work: Work) -> ComparisonResult:
    """The comparison's table from its finished runs, recorded on its run, which is then FINISHED."""
    metric, baseline, seeds = plan.metric, plan.baseline, len(plan.seeds)
    done = finished_runs(tracker, run_id)
    main = outcomes(plan, tracker, done, TUNED if plan.tuning else WRITTEN)
    higher = higher_is_better(metric)
    written = outcomes(plan, tracker, done, WRITTEN).scores
    complete = {p: by_seed for p, by_seed in written.items() if len(by_seed) == len(plan.seeds)}  # on every seed
    untuned = summarize(complete, baseline, higher) if plan.tuning and baseline in complete else None
    summary = summarize(main.scores, baseline, higher)
    changes = client_changes(main.values, baseline)
    counts = seed_counts(changes, [n for n in plan.specs if n != baseline], seeds, higher)
    federation = federation_note({n: {s: spec.dataset.seed for s, spec in by_seed.items()}
                                  for n, by_seed in plan.specs.items()})
    resolved = resolution(summary, baseline, main.test_sizes, metric)
    studies = {p: work.summary(p) for p in plan.tuning}
    parts = [format_table(summary, baseline, seeds, metric, untuned, tuned=bool(plan.tuning)),
             format_resolution(resolved, seeds, metric), format_counts(counts, baseline, seeds, metric)]
    if studies:
        parts.append(format_tuning(studies, plan.tuning[baseline].search.objective[0].metric,
                                   plan.comparison.tuning_seeds()))
    parts += [_diverged_note(main.diverged), textwrap.fill(federation, 118),
              *([] if plan.comparison.baseline else [f"the baseline is {baseline}, the set's first pipeline"])]
    table = "\n\n".join(p for p in parts if p)
    record(tracker, run_id, plan, main, summary, changes, counts, resolved, studies, untuned, federation, table)
    tracker.finish(run_id)
    return ComparisonResult(run_id, table, main.scores, main.runs, counts, tracker.uri, tracker.experiment_id)


def _diverged_note(diverged: list[Unit]) -> str:
    """Which runs diverged (their seeds have no score), if any."""
    if not diverged:
        return ""
    shown = ", ".join(f"{u.pipeline} on seed {u.seed}" for u in diverged)
    return textwrap.fill(f"diverged (no score on that seed): {shown}", 118)


def record(tracker: Tracker, run_id: str, plan: Plan, main: Outcomes, summary: dict, changes: Any,
           counts: dict, resolved: dict, studies: dict[str, StudySummary], untuned: dict | None, federation: str,
           table: str) -> None:
    """What the comparison's run keeps of its outcome (the module's docstring lists it)."""
    metrics = {f"{name}.{key}": value for name, row in summary.items() for key, value in row.items()}
    metrics |= {f"{name}/clients_{key}": n for name, row in counts.items() for key, n in row.items()}
    metrics |= {f"resolution.{key}": v for key, v in resolved.items() if np.isfinite(v)}
    metrics |= {f"{name}.untuned.{key}": v for name, row in (untuned or {}).items() for key, v in row.items()}
    for name, study in studies.items():
        metrics |= {f"{name}/tune_{key}": float(getattr(study, key))
                    for key in ("best", "p10", "p50", "p90", "trials", "pruned", "improving_late")}
        for step, best in enumerate(study.best_so_far, start=1):  # the UI charts best-so-far against trials
            tracker.log_metrics(run_id, {f"{name}/tune_best_so_far": best}, step=step)
        tracker.set_tags(run_id, {f"tuned.{name}.{key}": str(v) for key, v in study.chosen.items()})
    tracker.log_metrics(run_id, metrics)
    tracker.set_tags(run_id, {f"run.{name}.{seed}": rid for name, by_seed in main.runs.items()
                              for seed, rid in by_seed.items()})
    tracker.client.log_table(run_id, changes.to_dict(orient="list"), CHANGES_TABLE)
    tracker.client.log_text(run_id, table, TABLE_ARTIFACT)
    tracker.client.log_dict(run_id, {
        "baseline": plan.baseline, "metric": plan.metric, "seeds": plan.seeds, "federation": federation,
        "scores": main.scores, "runs": main.runs, "summary": summary, "counts": counts, "resolution": resolved,
        "diverged": [u.name for u in main.diverged], "untuned": untuned,
        "tuning": {name: study.to_json() for name, study in studies.items()},
        "tuning_seeds": plan.comparison.tuning_seeds() if plan.tuning else [],
        "objective": next(iter(plan.tuning.values())).search.objective[0].metric if plan.tuning else None},
        RECORD_ARTIFACT)
    log_report(tracker.client, run_id)
