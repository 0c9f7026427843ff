"""Who runs what of a comparison. Its work is units: each pipeline's tuning study (brought to N finished trials by
tuning.Search, which several processes share), then each (variant, pipeline, seed) run. A process claims a run
through a named lease in the platform database, renewed while it trains, so any number of processes (this one, queue
workers, a Slurm array) share one comparison and none runs a unit twice; a finished run is found by its tags under
the comparison's MLflow run, so a comparison stopped (Ctrl+C, SIGTERM) or killed loses at most the runs in flight
and picks up the rest when it runs again. A run whose stage diverged counts as done (its seed has no score)."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna
from mlflow import MlflowClient
from mlflow.entities import Run
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from fedpilot.compare.events import Event, RunDone, RunStarted, StudyStarted, TrialDone, UnitsDone
from fedpilot.compare.note import comparison_params
from fedpilot.compare.plan import TUNED, WRITTEN, Plan
from fedpilot.db import connect, engine_options
from fedpilot.errors import NoSuchRun, StageFailed
from fedpilot.leases import NamedLease
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.pipeline.signals import Stopped, stop_asked, stop_on_signals
from fedpilot.stats.study import StudySummary, study_summary
from fedpilot.studies.edges import EDGES
from fedpilot.tracking import (
    COMPARE_TAG,
    PIPELINE_TAG,
    RESUMABLE_TAG,
    Tracker,
    close_orphans,
    schema_init_lock,
)
from fedpilot.tuning import Search, StudyFacts, StudyScope, study_facts

COMPARE_RUN_TAG = "fedpilot.compare_run"  # a comparison's pipeline run: the comparison's run id
VARIANT_TAG = "fedpilot.compare_variant"  # tuned | written
KEY_TAG = "fedpilot.compare_key"  # a comparison's run: the hash of its plan (a rerun continues the run)
PLAN_ARTIFACT = "comparison_plan.json"
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
        COMPARE_TAG: comparison.name, "fedpilot.baseline": plan.baseline, KEY_TAG: plan.key}).info.run_id
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
        raise NoSuchRun("--resume", run_id, "not a comparison's run (tag fedpilot.compare, no fedpilot.pipeline)")
    if PLAN_ARTIFACT not in {a.path for a in client.list_artifacts(run_id)}:
        raise NoSuchRun("--resume", run_id, "this comparison recorded no plan (it was made by an older fedpilot)")
    with tempfile.TemporaryDirectory() as tmp:
        return Plan.from_json(json.loads(Path(client.download_artifacts(run_id, PLAN_ARTIFACT, tmp)).read_text()))


def runs_of(tracker: Tracker, run_id: str) -> Iterator[Run]:
    """Every pipeline run a comparison started (any status), page by page."""
    token = None
    while True:
        page = tracker.client.search_runs([tracker.experiment_id], f"tags.`{COMPARE_RUN_TAG}` = '{run_id}'",
                                          max_results=1000, page_token=token)
        yield from page
        token = page.token
        if not token:
            return


def unit_of(run: Run) -> Unit:
    tags = run.data.tags
    return Unit(tags[VARIANT_TAG], tags[PIPELINE_TAG], int(tags["fedpilot.seed"]))


def finished_runs(tracker: Tracker, run_id: str) -> dict[Unit, Run]:
    """Each unit's run that is done: FINISHED, else FAILED for good (its stage diverged: no score)."""
    done: dict[Unit, Run] = {}
    for run in runs_of(tracker, run_id):
        status, unit = run.info.status, unit_of(run)
        ended = status == "FINISHED" or (status == "FAILED" and run.data.tags.get(RESUMABLE_TAG) == "false")
        if ended and (unit not in done or status == "FINISHED"):
            done[unit] = run
    return done


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
            self.storage = RDBStorage(storage_url, engine_kwargs=engine_options(storage_url)) if plan.tuning else None
        self.units = [Unit(variant, pipeline, seed) for pipeline in plan.specs for variant in plan.variants
                      for seed in plan.seeds]
        self.units += self._cached_written() if plan.variants == (TUNED,) else []

    def run(self) -> None:
        """Study and run every unit this process can claim, waiting out those other processes hold, until all are
        done. SIGINT or SIGTERM stop it after the current round of the current run (Stopped)."""
        with stop_on_signals():
            self._units()

    def _units(self) -> None:
        while True:
            done = finished_runs(self.tracker, self.run_id)
            left = [u for u in self.units if u not in done]
            self.events(UnitsDone(len(self.units) - len(left), len(self.units),
                                  tuple(p for p in self.plan.tuning if self.studied(p))))
            if not left:
                return
            busy = False
            for pipeline in self.plan.specs:
                if self.plan.tuning and not self.studied(pipeline):
                    _unless_stopped()
                    busy |= self._tune(pipeline)
                ready = [u for u in left if u.pipeline == pipeline and (u.variant == WRITTEN or self.studied(pipeline))]
                for unit in ready:
                    _unless_stopped()
                    busy |= self._run(unit)
            if not busy:
                time.sleep(POLL_SECONDS)

    # ---- the studies ---------------------------------------------------------------------------------------
    def _study(self, pipeline: str) -> optuna.Study | None:
        """The pipeline's study (None before its first trial)."""
        try:
            return optuna.load_study(study_name=self.plan.tuning[pipeline].search.study, storage=self.storage)
        except KeyError:
            return None

    def _trials(self, pipeline: str) -> list[optuna.trial.FrozenTrial]:
        """The pipeline's study's trials in number order (none before its first)."""
        study = self._study(pipeline)
        return [] if study is None else sorted(study.get_trials(deepcopy=False), key=lambda t: t.number)

    def studied(self, pipeline: str) -> bool:
        """Whether the pipeline's study is done: its N finished trials, its edges decided and their trials finished."""
        study = self._study(pipeline)
        if study is None or EDGES not in study.user_attrs:
            return False
        trials = study.get_trials(deepcopy=False)
        finished = [t for t in trials if t.state.name in FINISHED]
        busy = any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)
        return len(finished) >= self.plan.tuning[pipeline].search.trials and not busy

    def _tune(self, pipeline: str) -> bool:
        """Run the trials of the pipeline's study that are left to start (none while other processes' are running);
        whether it started any."""
        study = self._study(pipeline)
        trials = [] if study is None else study.get_trials(deepcopy=False)
        started = [t for t in trials if t.state != TrialState.FAIL]
        decided = study is not None and EDGES in study.user_attrs
        if len(started) >= self.plan.tuning[pipeline].search.trials and decided and \
                not any(t.state == TrialState.WAITING for t in trials):
            return False
        spec = self.plan.tuning[pipeline]
        scope = StudyScope(parent=self.run_id, seeds=tuple(self.plan.comparison.tuning_seeds()),
                           noise=tuple(self.plan.comparison.noise_seeds()),
                           first=self.plan.first_trial(pipeline), wait=False, report=False,
                           attrs={"mlflow_comparison_run": self.run_id, "comparison": self.plan.comparison.name,
                                  "pipeline": pipeline, "tracking_uri": self.tracker.uri},
                           callbacks=(lambda study, trial: self.events(TrialDone(
                               pipeline, trial.number, trial.value if trial.state == TrialState.COMPLETE else None)),))
        best = self.summary(pipeline).best
        self.events(StudyStarted(pipeline, sum(t.state.name in FINISHED for t in trials),
                                 spec.search.trials, best if np.isfinite(best) else None))
        self.echo(f"tuning {pipeline}: study {spec.search.study}, space {', '.join(spec.search.space)}")
        Search(spec, self.storage_url, spec.search.trials, spec.search.study, self.cache_dir,
               self.heartbeat, self.echo, scope).run()
        return True

    def summary(self, pipeline: str) -> StudySummary:
        """The pipeline's study over its finished trials, in number order: the N it was asked for and those beyond
        an edge (its objective's direction from the spec)."""
        spec = self.plan.tuning[pipeline]
        finished = [t for t in self._trials(pipeline) if t.state.name in FINISHED]
        pairs = [(t.value if t.state == TrialState.COMPLETE else None, dict(t.params)) for t in finished]
        return study_summary(spec.search.study, pairs, spec.search.objective[0].direction == "maximize",
                             [s.name for s in spec.stages])

    def facts(self, pipeline: str) -> StudyFacts:
        """What the pipeline's study spent and where its choice lies (study_facts)."""
        spec, study = self.plan.tuning[pipeline], self._study(pipeline)
        return study_facts(spec.search.space, study.get_trials(deepcopy=False), study.user_attrs,
                           spec.search.objective[0].direction == "maximize")

    # ---- the runs ------------------------------------------------------------------------------------------
    def _run(self, unit: Unit) -> bool:
        """Claim and run one unit (unless another process holds it, or finished it meanwhile); whether it did."""
        lease = NamedLease(self.database, f"compare:{self.run_id}:{unit.name}", 3 * self.heartbeat)
        if not lease.try_acquire():
            return False
        with lease.kept():
            if unit in finished_runs(self.tracker, self.run_id):
                return False
            self._close_orphans(unit)
            values = self.summary(unit.pipeline).chosen if unit.variant == TUNED else None
            runner = PipelineRunner(self.plan.spec(unit.pipeline, unit.seed, values), cache_dir=self.cache_dir,
                                    progress=self.progress)
            tags = {COMPARE_TAG: self.plan.comparison.name, COMPARE_RUN_TAG: self.run_id, VARIANT_TAG: unit.variant,
                    "fedpilot.seed": str(unit.seed)}
            variant = f" {unit.variant}" if self.plan.tuning else ""
            label = f"seed {unit.seed} {unit.pipeline}{variant}"
            self.events(RunStarted(unit.pipeline, unit.seed, unit.variant))
            try:
                result = runner.run(parent=self.run_id, tags=tags, name=f"{unit.pipeline} seed {unit.seed}{variant}")
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

    def _close_orphans(self, unit: Unit) -> None:
        """A unit's runs left RUNNING by a process that died: KILLED (their unit is run again)."""
        for run in runs_of(self.tracker, self.run_id):
            if run.info.status == "RUNNING" and unit_of(run) == unit:
                close_orphans(self.tracker.uri, run.info.run_id, "the comparison process running it died")

    def _cached_written(self) -> list[Unit]:
        """The pipelines as written whose every stage the stage cache holds on every comparison seed: their untuned
        scores cost nothing, so the table shows them."""
        return [Unit(WRITTEN, pipeline, seed) for pipeline, by_seed in self.plan.specs.items()
                if all(PipelineRunner(spec, cache_dir=self.cache_dir, progress=False).cached()
                       for spec in by_seed.values()) for seed in by_seed]



def _unless_stopped() -> None:
    """Raise Stopped when a stop signal came between two runs (a run's own rounds stop themselves)."""
    signum = stop_asked()
    if signum is not None:
        raise Stopped(128 + signum)
