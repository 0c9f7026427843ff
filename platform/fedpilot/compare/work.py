"""Who runs what of a comparison. Its work is units: each pipeline's tuning study (brought to N finished trials by
tuning.Search, which several processes share), then each (variant, pipeline, seed) run. A process claims a run
through a named lease in the platform database, renewed while it trains, so any number of processes (this one, queue
workers, a Slurm array) share one comparison and none runs a unit twice; a finished run is found by its tags under
the comparison's MLflow run, so a comparison stopped (Ctrl+C, SIGTERM) or killed loses at most the runs in flight
and picks up the rest when it runs again. A run whose stage diverged counts as done (its seed has no score)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from mlflow import MlflowClient
from mlflow.entities import Run
from optuna.trial import TrialState

from fedpilot.compare.events import Event, RunDone, RunStarted, StudyStarted, TrialDone, UnitsDone
from fedpilot.compare.note import comparison_params
from fedpilot.compare.plan import TUNED, WRITTEN, Plan
from fedpilot.db import connect
from fedpilot.errors import NoSuchRun, StageCrashed, StageFailed
from fedpilot.leases import NamedLease
from fedpilot.pipeline.cache import StageCache, data_fingerprint, stage_keys
from fedpilot.pipeline.checks import resolve_device
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.pipeline.signals import Stopped, stop_asked, stop_on_signals
from fedpilot.settings import cache_root
from fedpilot.stats.study import StudySummary, study_summary
from fedpilot.studies.edges import EDGES
from fedpilot.tracking import (
    BASELINE_TAG,
    COMPARE_RUN_TAG,
    COMPARE_TAG,
    KEY_TAG,
    PIPELINE_TAG,
    PLAN_ARTIFACT,
    RESUMABLE_TAG,
    SEED_TAG,
    VARIANT_TAG,
    Tracker,
    close_orphans,
    read_json,
    recorded_executions,
    schema_init_lock,
)
from fedpilot.tuning import Search, StudyFacts, StudyScope, fail_stale, study_facts, study_storage

__all__ = ["COMPARE_RUN_TAG", "KEY_TAG", "VARIANT_TAG", "Unit", "Work", "find_run", "finished_runs", "start_run"]
POLL_SECONDS = 2.0  # a process with nothing to claim looks again after this long
FINISHED = ("COMPLETE", "PRUNED")


@dataclass(frozen=True)
class Unit:
    """One run of a comparison: `variant` of `pipeline` on `seed`."""

    variant: str
    pipeline: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.variant}/{self.pipeline}/{self.seed}"


def find_run(tracker: Tracker, plan: Plan) -> str | None:
    """The newest unfinished run of this very comparison (same plan), which a rerun of its command continues."""
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.`{KEY_TAG}` = '{plan.key}'",
                                      order_by=["attributes.start_time DESC"])
    return next((r.info.run_id for r in runs if r.info.status != "FINISHED"), None)


def start_run(tracker: Tracker, plan: Plan) -> str:
    """A new comparison run: its plan (what --resume continues), the set's settings as params."""
    comparison = plan.comparison
    run_id = tracker.client.create_run(tracker.experiment_id, run_name=f"compare-{comparison.name}", tags={
        COMPARE_TAG: comparison.name, BASELINE_TAG: plan.baseline, KEY_TAG: plan.key}).info.run_id
    tracker.log_params(run_id, comparison_params(plan))
    tracker.client.log_dict(run_id, plan.to_json(), PLAN_ARTIFACT)
    return run_id


def recorded_plan(client: MlflowClient, run_id: str) -> Plan:
    """The plan a comparison run recorded (`fedpilot compare --resume RUN_ID`)."""
    try:
        run = client.get_run(run_id)
    except Exception as err:  # MlflowException for an unknown id
        raise NoSuchRun("--resume", run_id, f"no such run ({type(err).__name__})") from None
    if COMPARE_TAG not in run.data.tags or PIPELINE_TAG in run.data.tags:
        raise NoSuchRun("--resume", run_id, f"not a comparison's run (tag {COMPARE_TAG}, no {PIPELINE_TAG})")
    recorded = read_json(client, run_id, PLAN_ARTIFACT)
    if recorded is None:
        raise NoSuchRun("--resume", run_id, "this comparison recorded no plan (it was made by an older fedpilot)")
    return Plan.from_json(recorded)


def runs_of(tracker: Tracker, run_id: str, unit: Unit | None = None) -> Iterator[Run]:
    """Every pipeline run a comparison started (any status), page by page; those of one `unit`, if given."""
    query = f"tags.`{COMPARE_RUN_TAG}` = '{run_id}'"
    if unit is not None:
        query += (f" and tags.`{VARIANT_TAG}` = '{unit.variant}' and tags.`{PIPELINE_TAG}` = '{unit.pipeline}' and "
                  f"tags.`{SEED_TAG}` = '{unit.seed}'")
    token = None
    while True:
        page = tracker.client.search_runs([tracker.experiment_id], query, max_results=1000, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def unit_of(run: Run) -> Unit:
    tags = run.data.tags
    return Unit(tags[VARIANT_TAG], tags[PIPELINE_TAG], int(tags[SEED_TAG]))


def finished_runs(tracker: Tracker, run_id: str, runs: Iterable[Run] | None = None) -> dict[Unit, Run]:
    """Each unit's run that is done: FINISHED, else FAILED for good (its stage diverged: no score); of `runs`
    (default: every pipeline run of the comparison)."""
    done: dict[Unit, Run] = {}
    for run in runs_of(tracker, run_id) if runs is None else runs:
        status, unit = run.info.status, unit_of(run)
        ended = status == "FINISHED" or (status == "FAILED" and run.data.tags.get(RESUMABLE_TAG) == "false")
        if ended and (unit not in done or status == "FINISHED"):
            done[unit] = run
    return done


@dataclass
class StudyLook:
    """A pipeline's study as one pass reads it: its trials in number order, and whether its edges are decided."""

    trials: list[optuna.trial.FrozenTrial]
    decided: bool


@dataclass
class Look:
    """What one pass of a comparison's loop reads of the stores, once: the units done (from every pipeline run of
    the comparison), each study as it stands."""

    done: dict[Unit, Run]
    studies: dict[str, StudyLook] = field(default_factory=dict)


class Work:
    """A comparison's work done in this process, beside any other process doing the same comparison: per pipeline
    its study (when tuned), then its runs, until every unit of the plan is done."""

    def __init__(self, plan: Plan, run_id: str, tracker: Tracker, storage_url: str, cache_dir: Path | None = None,
                 progress: bool = False, echo: Callable[[str], None] = print, heartbeat_seconds: int = 10,
                 events: Callable[[Event], None] = lambda event: None):
        self.plan, self.run_id, self.tracker, self.storage_url = plan, run_id, tracker, storage_url
        self.cache_dir, self.progress, self.echo, self.heartbeat = cache_dir, progress, echo, heartbeat_seconds
        self.events = events  # where it stands, for the command's display (compare.events)
        self.database = connect(storage_url, "--storage")
        with schema_init_lock(storage_url):
            self.storage = study_storage(storage_url, heartbeat_seconds) if plan.tuning else None
        self.units = [Unit(variant, pipeline, seed) for pipeline in plan.specs for variant in plan.variants
                      for seed in plan.seeds]
        self.units += self._cached_written() if plan.variants == (TUNED,) else []

    def run(self) -> None:
        """Study and run every unit this process can claim, waiting out those other processes hold, until all are
        done. SIGINT or SIGTERM stop it after the current round of the current run (Stopped)."""
        with stop_on_signals():
            self._units()

    def look(self) -> Look:
        """The stores as they are now, read once: the comparison's runs, and each study (stale trials failed and
        retried first: a trial no process runs any more never holds the comparison up)."""
        return Look(finished_runs(self.tracker, self.run_id),
                    {pipeline: self._read(pipeline) for pipeline in self.plan.tuning})

    def _units(self) -> None:
        while True:
            look = self.look()
            left = [u for u in self.units if u not in look.done]
            self.events(UnitsDone(len(self.units) - len(left), len(self.units),
                                  tuple(p for p in self.plan.tuning if self.studied(p, look.studies[p]))))
            if not left:
                return
            busy = False
            for pipeline in self.plan.specs:
                studied = not self.plan.tuning or self.studied(pipeline, look.studies[pipeline])
                if not studied:
                    _unless_stopped()
                    if self._tune(pipeline, look.studies[pipeline]):  # its runs at once when this process finished it
                        busy, look.studies[pipeline] = True, self._read(pipeline)
                        studied = self.studied(pipeline, look.studies[pipeline])
                for unit in [u for u in left if u.pipeline == pipeline and (u.variant == WRITTEN or studied)]:
                    _unless_stopped()
                    busy |= self._run(unit, look)
            if not busy:
                time.sleep(POLL_SECONDS)

    # ---- the studies ---------------------------------------------------------------------------------------
    def _study(self, pipeline: str) -> optuna.Study | None:
        """The pipeline's study (None before its first trial)."""
        try:
            return optuna.load_study(study_name=self.plan.tuning[pipeline].search.study, storage=self.storage)
        except KeyError:
            return None

    def _read(self, pipeline: str) -> StudyLook:
        """The pipeline's study as it stands (no trials before its first), its stale trials failed and retried
        first."""
        study = self._study(pipeline)
        if study is None:
            return StudyLook([], False)
        fail_stale(study)
        return StudyLook(sorted(study.get_trials(deepcopy=False), key=lambda t: t.number), EDGES in study.user_attrs)

    def studied(self, pipeline: str, state: StudyLook) -> bool:
        """Whether the pipeline's study is done: its N finished trials, its edges decided and their trials finished."""
        finished = [t for t in state.trials if t.state.name in FINISHED]
        busy = any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in state.trials)
        return state.decided and len(finished) >= self.plan.tuning[pipeline].search.trials and not busy

    def _tune(self, pipeline: str, state: StudyLook) -> bool:
        """Run the trials of the pipeline's study that are left to start (none while other processes' are running);
        whether it started any."""
        started = [t for t in state.trials if t.state != TrialState.FAIL]
        if len(started) >= self.plan.tuning[pipeline].search.trials and state.decided and \
                not any(t.state == TrialState.WAITING for t in state.trials):
            return False
        spec = self.plan.tuning[pipeline]
        scope = StudyScope(parent=self.run_id, seeds=tuple(self.plan.comparison.tuning_seeds()),
                           noise=tuple(self.plan.comparison.noise_seeds()),
                           first=self.plan.first_trial(pipeline), wait=False, report=False,
                           attrs={"mlflow_comparison_run": self.run_id, "comparison": self.plan.comparison.name,
                                  "pipeline": pipeline, "tracking_uri": self.tracker.uri},
                           callbacks=(lambda study, trial: self.events(TrialDone(
                               pipeline, trial.number, trial.value if trial.state == TrialState.COMPLETE else None)),))
        best = self.summary(pipeline, state.trials).best
        self.events(StudyStarted(pipeline, sum(t.state.name in FINISHED for t in state.trials),
                                 spec.search.trials, best if np.isfinite(best) else None))
        self.echo(f"tuning {pipeline}: study {spec.search.study}, space {', '.join(spec.search.space)}")
        Search(spec, self.storage_url, spec.search.trials, spec.search.study, self.cache_dir,
               self.heartbeat, self.echo, scope).run()
        return True

    def summary(self, pipeline: str, trials: list[optuna.trial.FrozenTrial] | None = None) -> StudySummary:
        """The pipeline's study over its finished trials, in number order: the N it was asked for and those beyond
        an edge (its objective's direction from the spec), of its `trials` (default: read now)."""
        spec = self.plan.tuning[pipeline]
        trials = self._read(pipeline).trials if trials is None else trials
        finished = [t for t in trials if t.state.name in FINISHED]
        pairs = [(t.value if t.state == TrialState.COMPLETE else None, dict(t.params)) for t in finished]
        return study_summary(spec.search.study, pairs, spec.search.objective[0].direction == "maximize",
                             [s.name for s in spec.stages])

    def facts(self, pipeline: str) -> StudyFacts:
        """What the pipeline's study spent and where its choice lies (study_facts)."""
        spec, study = self.plan.tuning[pipeline], self._study(pipeline)
        return study_facts(spec.search.space, study.get_trials(deepcopy=False), study.user_attrs,
                           spec.search.objective[0].direction == "maximize")

    # ---- the runs ------------------------------------------------------------------------------------------
    def _run(self, unit: Unit, look: Look) -> bool:
        """Claim and run one unit (unless another process holds it, or finished it since `look`); whether it did. A
        unit run again (its process stopped or died) runs each stage on the executor its last run chose there."""
        lease = NamedLease(self.database, f"compare:{self.run_id}:{unit.name}", 3 * self.heartbeat)
        if not lease.try_acquire():
            return False
        with lease.kept():
            earlier = list(runs_of(self.tracker, self.run_id, unit))  # this unit's runs only, under its lease
            if unit in finished_runs(self.tracker, self.run_id, earlier):
                return False
            self._close_orphans(earlier)
            values = self.summary(unit.pipeline, look.studies[unit.pipeline].trials).chosen if unit.variant == TUNED \
                else None
            runner = PipelineRunner(self.plan.spec(unit.pipeline, unit.seed, values), cache_dir=self.cache_dir,
                                    progress=self.progress, executions=self._executions(earlier))
            tags = {COMPARE_TAG: self.plan.comparison.name, COMPARE_RUN_TAG: self.run_id, VARIANT_TAG: unit.variant,
                    SEED_TAG: str(unit.seed)}
            variant = f" {unit.variant}" if self.plan.tuning else ""
            label = f"seed {unit.seed} {unit.pipeline}{variant}"
            self.events(RunStarted(unit.pipeline, unit.seed, unit.variant))
            try:
                result = runner.run(parent=self.run_id, tags=tags, name=f"{unit.pipeline} seed {unit.seed}{variant}")
            except StageCrashed:  # a plugin's or fedpilot's own failure: the comparison stops, named
                raise
            except StageFailed as err:  # diverged: recorded FAILED for good; the seed has no score
                self.echo(f"{label}: {err}")
                self.events(RunDone(unit.pipeline, unit.seed, unit.variant, None))
                return True
        metrics = result.stages[-1].metrics
        metric = runner.task.primary
        self.echo(f"{label}: " + ", ".join(f"{k}={metrics[k]:.4f}" for k in (f"test_{metric}_mean",
                                                                             f"test_{metric}_p10") if k in metrics))
        self.events(RunDone(unit.pipeline, unit.seed, unit.variant, metrics.get(f"test_{metric}_mean")))
        return True

    def _close_orphans(self, earlier: list[Run]) -> None:
        """A unit's runs left RUNNING by a process that died: KILLED (their unit is run again)."""
        for run in earlier:
            if run.info.status == "RUNNING":
                close_orphans(self.tracker.uri, run.info.run_id, "the comparison process running it died")

    def _executions(self, earlier: list[Run]) -> dict[int, dict[str, Any]]:
        """How each stage of a unit's newest earlier run ran, as it recorded it (none for a unit's first run)."""
        if not earlier:
            return {}
        newest = max(earlier, key=lambda run: run.info.start_time)
        return recorded_executions(self.tracker.client, self.tracker.experiment_id, newest.info.run_id)

    def _cached_written(self) -> list[Unit]:
        """The pipelines as written whose every stage the stage cache holds on every comparison seed (their keys
        computed, nothing built): their untuned scores cost nothing, so the table shows them."""
        cache = StageCache(self.cache_dir or cache_root())
        return [Unit(WRITTEN, pipeline, seed) for pipeline, by_seed in self.plan.specs.items()
                if all(cache.has(key) for spec in by_seed.values()
                       for key in stage_keys(spec, data_fingerprint(spec), resolve_device(spec.device).type))
                for seed in by_seed]


def _unless_stopped() -> None:
    """Raise Stopped when a stop signal came between two runs (a run's own rounds stop themselves)."""
    signum = stop_asked()
    if signum is not None:
        raise Stopped(128 + signum)
