"""A comparison's outcome once every unit is done: the scores read back from each run's last stage, the statistics
(fedpilot.stats: the paired differences, each pipeline's verdict against the baseline with its adjusted intervals,
each study's summary and its choice's optimism), the tables, and what the comparison's MLflow run records of them:
comparison.txt, comparison.json, the summary and the verdicts as metrics, each run's id as a tag
`run.<pipeline>.<seed>`, the clients' changes across seeds, with tuning each study's summary (`<pipeline>/tune_*`
metrics, `tuned.<pipeline>.<key>` tags), and the report."""

from __future__ import annotations

import textwrap
from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd
from mlflow import MlflowClient
from mlflow.entities import Run

from fedpilot.client_effects import CHANGES_TABLE, client_changes, federation_note, participating, seed_counts
from fedpilot.compare.federation import federation_line, recorded_fingerprints
from fedpilot.compare.note import comparison_note
from fedpilot.compare.plan import TUNED, WRITTEN, Plan
from fedpilot.compare.work import Unit, Work, finished_runs
from fedpilot.metric_names import higher_is_better, scores_of
from fedpilot.report import log_report
from fedpilot.report.runs import clients_frame
from fedpilot.stats.scores import sample_steps, summarize
from fedpilot.stats.study import StudySummary
from fedpilot.stats.table import format_counts, format_table, format_tuning, format_verdicts
from fedpilot.stats.verdicts import method, optimism, verdicts
from fedpilot.tracking import NOTE_TAG, RECORD_ARTIFACT, TABLE_ARTIFACT, Tracker, stage_runs


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
    """What the runs of one variant scored: per pipeline and seed its scores, per-client test values, run id and,
    tuned, its study's objective (a validation metric of the last stage); the baseline's clients' test sample
    counts on its first seed; the units that diverged."""

    scores: dict[str, dict[int, dict[str, float]]]
    values: dict[str, dict[int, dict[str, float]]]
    runs: dict[str, dict[int, str]]
    validation: dict[str, dict[int, float]]
    test_sizes: list[int]
    diverged: list[Unit]


def outcomes(plan: Plan, tracker: Tracker, done: dict[Unit, Run], variant: str) -> Outcomes:
    """The scores of the `variant` runs that are done (a diverged one has none)."""
    client, metric = tracker.client, plan.metric
    found = Outcomes(*({p: {} for p in plan.specs} for _ in range(4)), [], [])
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
            metrics = client.get_run(last).data.metrics
            found.scores[pipeline][seed] = run_scores(metrics, metric)
            objective = objective_of(plan, pipeline)
            if objective in metrics:
                found.validation[pipeline][seed] = float(metrics[objective])
            found.values[pipeline][seed] = client_values(client, last, metric)
            found.runs[pipeline][seed] = run.info.run_id
            if pipeline == plan.baseline and not found.test_sizes:
                found.test_sizes = client_test_sizes(client, last)
    return found


def objective_of(plan: Plan, pipeline: str) -> str | None:
    """The metric a tuned pipeline's study chose on (its last stage's, the comparison's objective); None untuned."""
    return plan.tuning[pipeline].search.objective[0].metric if pipeline in plan.tuning else None


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


@dataclass
class Statistics:
    """What a comparison computes of its outcomes (fedpilot.stats)."""

    summary: dict[str, dict[str, float]]  # pipeline -> score.stat -> value (stats.scores.summarize)
    untuned: dict[str, dict[str, float]] | None  # the same of the pipelines as written, where they ran
    verdicts: dict[str, dict[str, dict[str, Any]]]  # score -> pipeline -> its verdict (stats.verdicts)
    steps: dict[str, float]  # how far one test sample moves a client's score and the mean
    changes: pd.DataFrame  # client, pipeline, seed, change
    counts: dict[str, dict[str, int]]  # pipeline -> clients helped / hurt on every seed, mixed
    studies: dict[str, StudySummary]
    optimism: dict[str, dict[str, float]]  # tuned pipeline -> its choice's winner's curse (stats.verdicts)
    facts: dict[str, dict[str, Any]]  # tuned pipeline -> what its study spent and where its choice lies


def statistics(plan: Plan, main: Outcomes, written: dict, work: Work) -> Statistics:
    """The comparison's statistics from its outcomes (`written`: the untuned scores, where they ran)."""
    metric, baseline = plan.metric, plan.baseline
    higher = higher_is_better(metric)
    complete = {p: by_seed for p, by_seed in written.items() if len(by_seed) == len(plan.seeds)}  # on every seed
    untuned = summarize(complete, baseline, higher) if plan.tuning and baseline in complete else None
    changes = client_changes(main.values, baseline)
    counts = seed_counts(changes, [n for n in plan.specs if n != baseline], len(plan.seeds), higher)
    studies = {p: work.summary(p) for p in plan.tuning}
    gaps = {p: optimism(study.best, [main.validation[p][s] for s in sorted(main.validation[p])],
                        plan.tuning[p].search.objective[0].direction == "maximize") for p, study in studies.items()}
    return Statistics(summarize(main.scores, baseline, higher), untuned,
                      verdicts(main.scores, main.values, baseline, metric, one_federation(plan)),
                      sample_steps(main.test_sizes, metric), changes, counts, studies, gaps,
                      {p: asdict(work.facts(p)) for p in plan.tuning})


def one_federation(plan: Plan) -> bool:
    """Whether every run of the comparison trains on one federation (one `dataset.seed`, set): its clients, known
    by name, are the same on every seed."""
    seeds = {spec.dataset.seed for by_seed in plan.specs.values() for spec in by_seed.values()}
    return len(seeds) == 1 and None not in seeds


def assemble(plan: Plan, run_id: str, tracker: Tracker, work: Work) -> ComparisonResult:
    """The comparison's table from its finished runs, recorded on its run, which is then FINISHED."""
    done = finished_runs(tracker, run_id)
    main = outcomes(plan, tracker, done, TUNED if plan.tuning else WRITTEN)
    found = statistics(plan, main, outcomes(plan, tracker, done, WRITTEN).scores, work)
    federation = " ".join(filter(None, [federation_line(plan), federation_note(
        {n: {s: spec.dataset.seed for s, spec in by_seed.items()} for n, by_seed in plan.specs.items()})]))
    table = tables(plan, main, found, federation)
    record(tracker, run_id, plan, main, found, federation, table,
           recorded_fingerprints(tracker.client, tracker.experiment_id, plan, list(done.values())))
    tracker.finish(run_id)
    return ComparisonResult(run_id, table, main.scores, main.runs, found.counts, tracker.uri, tracker.experiment_id)


def tables(plan: Plan, main: Outcomes, found: Statistics, federation: str) -> str:
    """The comparison as text: the pipelines, the verdicts, the clients, the studies, the notes."""
    metric, baseline, seeds = plan.metric, plan.baseline, len(plan.seeds)
    parts = [format_table(found.summary, baseline, seeds, metric, found.untuned, bool(plan.tuning), found.verdicts),
             format_verdicts(found.verdicts, baseline, metric, found.steps),
             format_counts(found.counts, baseline, seeds, metric)]
    if found.studies:
        parts.append(format_tuning(found.studies, plan.tuning[baseline].search.objective[0].metric,
                                   plan.comparison.tuning_seeds(), found.optimism, found.facts))
    parts += [_diverged_note(main.diverged), textwrap.fill(federation, 118),
              *([] if plan.comparison.baseline else [f"the baseline is {baseline}, the set's first pipeline"])]
    return "\n\n".join(p for p in parts if p)


def _diverged_note(diverged: list[Unit]) -> str:
    """Which runs diverged (their seeds have no score), if any."""
    if not diverged:
        return ""
    shown = ", ".join(f"{u.pipeline} on seed {u.seed}" for u in diverged)
    return textwrap.fill(f"diverged (no score on that seed): {shown}", 118)


def metrics_of(found: Statistics) -> dict[str, float]:
    """The comparison's numbers as MLflow metrics: the summary `<pipeline>.<score>.<stat>`, the verdicts
    `<pipeline>.<score>.<key>` (resolved as 1 or 0), the clients' counts, the sample steps, the untuned summary,
    and per study `<pipeline>/tune_*` with its optimism."""
    metrics = {f"{name}.{key}": value for name, row in found.summary.items() for key, value in row.items()}
    metrics |= {f"{name}.{score}.{key}": float(value) for score, rows in found.verdicts.items()
                for name, row in rows.items() for key, value in row.items() if value is not None}
    metrics |= {f"{name}/clients_{key}": n for name, row in found.counts.items() for key, n in row.items()}
    metrics |= {f"sample_step.{key}": v for key, v in found.steps.items()}
    metrics |= {f"{name}.untuned.{key}": v for name, row in (found.untuned or {}).items() for key, v in row.items()}
    for name, study in found.studies.items():
        metrics |= {f"{name}/tune_{key}": float(getattr(study, key))
                    for key in ("best", "p10", "p50", "p90", "trials", "pruned", "improving_late")}
        metrics |= {f"{name}/tune_{key}": v for key, v in found.optimism[name].items()}
    return {k: v for k, v in metrics.items() if v == v}  # NaN: not measured (one seed, no completed trial)


def record(tracker: Tracker, run_id: str, plan: Plan, main: Outcomes, found: Statistics, federation: str,
           table: str, federations: dict[str, dict[str, str]]) -> None:
    """What the comparison's run keeps of its outcome (the module's docstring lists it)."""
    tracker.log_metrics(run_id, metrics_of(found))
    for name, study in found.studies.items():
        for step, best in enumerate(study.best_so_far, start=1):  # the UI charts best-so-far against trials
            tracker.log_metrics(run_id, {f"{name}/tune_best_so_far": best}, step=step)
        tracker.set_tags(run_id, {f"tuned.{name}.{key}": str(v) for key, v in study.chosen.items()})
    tracker.set_tags(run_id, {f"run.{name}.{seed}": rid for name, by_seed in main.runs.items()
                              for seed, rid in by_seed.items()})
    tracker.client.log_table(run_id, found.changes.to_dict(orient="list"), CHANGES_TABLE)
    tracker.client.log_text(run_id, table, TABLE_ARTIFACT)
    tracker.set_tags(run_id, {NOTE_TAG: comparison_note(plan, table)})
    objective = next(iter(plan.tuning.values())).search.objective[0].metric if plan.tuning else None
    tracker.client.log_dict(run_id, {
        "baseline": plan.baseline, "metric": plan.metric, "seeds": plan.seeds, "federation": federation,
        "scores": main.scores, "runs": main.runs, "summary": found.summary, "counts": found.counts,
        "verdicts": found.verdicts, "method": method(plan.metric, len(plan.specs) - 1, one_federation(plan)),
        "sample_step": found.steps, "diverged": [u.name for u in main.diverged], "untuned": found.untuned,
        "tuning": {name: study.to_json() for name, study in found.studies.items()},
        "validation": main.validation if plan.tuning else {}, "optimism": found.optimism,
        "tuning_seeds": plan.comparison.tuning_seeds() if plan.tuning else [], "objective": objective,
        "study_facts": found.facts, "federations": federations},
        RECORD_ARTIFACT)
    log_report(tracker.client, run_id)
