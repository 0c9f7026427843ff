"""Hyperparameter searches: an Optuna study over a pipeline's spec keys, each trial a whole pipeline run.

`fedpilot search PIPELINE --trials N` brings the study (in an SQL storage; resumable by name) to N finished
trials, also when several processes work on the same study at once: a short lease row per study in the same
database serializes the moment a trial is created, so exactly N trials finish, none twice. Trials send
heartbeats; a trial whose process died goes stale, is failed by Optuna and re-enqueued with the same
parameters (RetryHeartbeatStaleTrialCallback), and the next process to look runs it. Trials reuse the
stage cache, so stages the space does not touch (usually pretraining) run once for the whole study.

A study starts with trial 0 (a comparison's pipeline as written) and scrambled Sobol points, then follows Optuna's
TPE (studies/points.py); trial 0 also trains a second seed, whose evaluations measure the noise the pruner's margin
is made of (studies/pruner.py); once its trials are done, a best value near an edge of its range grows the range
and spends `edge_trials` further trials beyond it (studies/edges.py).

A study's trials come in waves that its design fixes, whatever the machine: trial 0 alone (its noise seed measures
the margin), the other start-up points together, each TPE draw alone (drawn from every trial told before it), the
trials beyond an edge together. A wave's trials train together, round by round (pipeline/trials.py: one batched
computation wherever the algorithm and their values allow, else side by side), each recorded and told as a lone
trial, judged by the pruner against the trials of earlier waves only, and against each other at the rungs of
successive halving (studies/halving.py). `batch` says only how many of a wave's trials one chunk's computation spans
(`auto`: as many as the executor timed fastest batches; 1: each trial's rows on their own), so it changes how fast a
study runs, never what it finds.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback, fail_stale_trials
from optuna.trial import TrialState

from fedpilot.db import engine_options
from fedpilot.engine.hooks import RoundCallback, RoundResult
from fedpilot.engine.trials import TrialBatch
from fedpilot.errors import Diverged, SearchError, SpecError
from fedpilot.leases import NamedLease
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.pipeline.trials import PipelineTrials, TrialDropped
from fedpilot.report import log_report
from fedpilot.schema import SEED_MAX
from fedpilot.settings import check_database, tracking_uri
from fedpilot.spec import Param, PipelineSpec, with_values
from fedpilot.stats.keys import key_labels
from fedpilot.studies.edges import EDGES, edge_of, extensible, flags, grown, with_grown
from fedpilot.studies.halving import due, losers, rung_steps
from fedpilot.studies.points import BEYOND_EDGE, ORIGIN, SOBOL, TPE, WRITTEN, sobol_points, startup_count
from fedpilot.studies.pruner import CURVES, MarginPruner, curve_attr, seed_margin
from fedpilot.tracking import (
    NOISE_SEED_TAG,
    PIPELINE_TAG,
    SEARCH_TAG,
    SEED_TAG,
    STOPPED,
    STUDY_TAG,
    TRIAL_TAG,
    Tracker,
    close_orphans,
    schema_init_lock,
)

STARTED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
MAX_RETRIES = 3  # a trial whose process died or was stopped runs again with its parameters at most this often


def study_storage(url: str, heartbeat_seconds: int) -> RDBStorage:
    """The Optuna storage of `url` (under schema_init_lock), whose trials beat every `heartbeat_seconds`: a trial
    silent for 3 beats is stale, and failed and retried with its parameters (a WAITING copy) by whoever opens its
    study next (fail_stale)."""
    return RDBStorage(url, heartbeat_interval=heartbeat_seconds, grace_period=3 * heartbeat_seconds,
                      engine_kwargs=engine_options(url),
                      heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES))


def fail_stale(study: optuna.Study) -> None:
    """Fail the study's stale trials (their process died, or stopped without saying so) and retry them: what every
    opener of a study does first (a search, a worker's or a scheduled one, a comparison), so that no trial no process
    runs any more holds the study up."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        fail_stale_trials(study)


def fail_interrupted(study: optuna.Study, trial_id: int, caught: bool) -> None:
    """A trial this process stopped: failed here (SIGINT, SIGTERM: a SystemExit, which Optuna does not catch, leaves
    it RUNNING) or by Optuna (`caught`: a second Ctrl+C, a KeyboardInterrupt), then retried with its parameters at
    once, as a stale one is: the next process to open the study runs it again without waiting for it to go stale."""
    storage = study._storage
    try:
        failed = storage.get_trial(trial_id).state == TrialState.RUNNING and storage.set_trial_state_values(
            trial_id, state=TrialState.FAIL)
    except optuna.exceptions.UpdateFinishedTrialError:  # another process found it stale first, and retried it
        failed = False
    trial = storage.get_trial(trial_id)
    if failed or (caught and trial.state == TrialState.FAIL):
        RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRIES)(study, copy.deepcopy(trial))


def draws_before(trials: list[optuna.trial.FrozenTrial]) -> int:
    """The trial count a study's next draw is seeded with: its trials but those failed and retried (each retry
    names the trials it stands for in `retry_history`), so that a study stopped inside a trial and resumed draws the
    points it would have drawn uninterrupted (its verdict does not depend on where it was stopped). A trial failed
    for good (diverged, out of retries) still counts: the next draw is a new one."""
    retried = {number for trial in trials for number in trial.system_attrs.get("retry_history", ())}
    return len(trials) - len(retried)


def suggest(trial: optuna.Trial, key: str, param: Param) -> Any:
    """The trial's value for one space dimension."""
    if param.type == "categorical":
        return trial.suggest_categorical(key, param.choices)
    if param.type == "int":
        return trial.suggest_int(key, int(param.low), int(param.high), step=int(param.step or 1), log=param.log)
    return trial.suggest_float(key, param.low, param.high, step=param.step, log=param.log)


NOISE = "noise"  # a trial's user attribute: it also trains the study's noise seed(s)
WAVE = "wave"  # a trial's user attribute: the wave it trains in (module docstring)


def make_sampler(spec: PipelineSpec, offset: int = 0, design: int = 0,
                 startup: int = 0) -> optuna.samplers.BaseSampler:
    """The search's sampler seeded with `seed + design + offset` (`design`: the study's own, `design_seed`; `offset`:
    the trials drawn before, draws_before: distinct seeds across processes), wrapped into the seeds numpy's
    RandomState takes (0 to SEED_MAX). TPE models the trials once the `startup` ones (trial 0 and the Sobol points)
    are done."""
    sampler = spec.search.sampler
    seed = (sampler.seed + design + offset) % (SEED_MAX + 1)
    if sampler.kind == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if sampler.kind == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed)
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, n_startup_trials=max(1, startup))


def design_seed(spec: PipelineSpec, seeds: tuple[int, ...]) -> int:
    """A seed of the study's own, from what decides its trials but their number (the pipeline, its space,
    objective, sampler and pruner, the seeds it trains on; not how many trials train together): two studies never try
    the same relative points, and a study asked for more trials starts with the same ones (the stage cache then has
    them)."""
    what = {k: v for k, v in spec.resolved().items() if k != "tracking"}
    what["search"] = {k: v for k, v in what["search"].items() if k not in ("trials", "study", "batch")}
    blob = json.dumps({"spec": what, "seeds": list(seeds)}, sort_keys=True).encode()
    return int(hashlib.sha256(blob).hexdigest()[:8], 16)


def make_pruner(spec: PipelineSpec, trials: int) -> optuna.pruners.BasePruner:
    """The search's pruner for a study of `trials` trials, its `auto` settings resolved (search_spec.PrunerSpec)."""
    pruner = spec.search.pruner
    if pruner.kind == "none" or len(spec.search.objective) > 1:
        return optuna.pruners.NopPruner()
    before, searched = searched_rounds(spec)
    warmup = before + math.ceil(searched / 2) if pruner.warmup_rounds == "auto" else pruner.warmup_rounds
    if pruner.kind == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=max(1, warmup), max_resource=before + searched)
    startup = max(2, math.ceil(trials / 3)) if pruner.startup_trials == "auto" else pruner.startup_trials
    return MarginPruner(startup, warmup, None if pruner.margin == "auto" else pruner.margin)


def searched_rounds(spec: PipelineSpec) -> tuple[int, int]:
    """(the rounds of the stages before the first one the space touches, the rounds from it to the end)."""
    stages = [key.split(".")[1] for key in spec.search.space if key.startswith("stages.")]
    touched = [int(i) for i in stages if i.isdigit()]
    first = min(touched) if len(touched) == len(spec.search.space) else 0
    rounds = [stage.rounds for stage in spec.stages]
    return sum(rounds[:first]), sum(rounds[first:])


@dataclass
class Evaluations:
    """What a trial's searched stages did on one seed: the objective at each evaluation, (step, value), and the
    rounds they trained (a study's budget, the same whichever process trained the shared stages)."""

    curve: list[tuple[int, float]] = field(default_factory=list)
    rounds: int = 0


class PruneOnEvaluation(RoundCallback):
    """Counts a stage's rounds and records the objective's metric at each of its evaluations in `seen` and, given a
    `trial`, reports it and prunes the trial when Optuna says so.

    Steps count rounds across the pipeline (a stage's rounds are offset by those of the stages before it), so
    every trial reports the same steps whatever stages it reused from the cache.
    """

    def __init__(self, trial: optuna.Trial | None, metric: str, offset: int, seen: Evaluations | None = None):
        self.trial, self.metric, self.offset = trial, metric, offset
        self.seen = Evaluations() if seen is None else seen

    def on_round_end(self, trainer: Any, stage: Any, result: RoundResult) -> None:
        pruned = self.evaluated(result)
        if pruned:
            raise optuna.TrialPruned(pruned)

    def evaluated(self, result: RoundResult) -> str | None:
        """The trial's round `result` counted and its evaluation recorded and reported; why Optuna prunes the trial
        now (None: it goes on)."""
        self.seen.rounds += 1
        value = result.metrics.get(self.metric)
        if value is None or not math.isfinite(value):
            return None
        step = self.offset + result.round
        self.seen.curve.append((step, value))
        if self.trial is None:
            return None
        self.trial.report(value, step)
        return f"pruned at round {step}: {self.metric}={value:.4f}" if self.trial.should_prune() else None


class Pruned(TrialDropped, optuna.TrialPruned):
    """A trial of a batch pruned (Optuna's pruner, or a rung of successive halving): dropped from its batch, its
    runs KILLED as a lone pruned trial's are."""


class BatchEvaluations(RoundCallback):
    """PruneOnEvaluation for each trial of a batch (`members`, by position in the batch; a trial trained alone: one
    member), and successive halving at the `rungs` (steps; studies/halving.py) within `margin` (None: no halving):
    a trial pruned or losing at a rung leaves the batch (`TrialBatch.drop`), one trained alone stops (Pruned)."""

    def __init__(self, members: list[PruneOnEvaluation], rungs: list[int], margin: float | None, maximize: bool):
        self.members, self.rungs, self.margin, self.maximize = members, rungs, margin, maximize
        self.passed = 0  # rungs judged

    def on_round_end(self, trainer: Any, stage: Any, result: RoundResult) -> None:
        batched = isinstance(stage, TrialBatch)
        rounds = result.trials if batched else {0: result}
        pruned = {j: why for j, r in rounds.items() if (why := self.members[j].evaluated(r))}
        pruned |= {j: why for j, why in self._halved(rounds).items() if j not in pruned}
        if pruned and not batched:
            raise Pruned(pruned[0])
        for j, why in sorted(pruned.items()):
            stage.drop([j], cause=Pruned(why))

    def _halved(self, rounds: Mapping[int, RoundResult]) -> dict[int, str]:
        """The trials losing at a rung this round reaches (with why), judged on the evaluation it made."""
        metric = self.members[0].metric
        values = {j: r.metrics.get(metric, math.nan) for j, r in rounds.items()}
        steps = [self.members[j].offset + r.round for j, r in rounds.items() if metric in r.metrics]
        if self.margin is None or len(values) < 2 or not steps:
            return {}
        passed = due(self.rungs, self.passed, max(steps))
        if passed == self.passed:
            return {}
        self.passed = passed
        return {j: f"halved at round {max(steps)}: {metric}={values[j]:.4f}, not within the best third or "
                   f"{self.margin:.4f} of the best" for j in losers(values, self.margin, self.maximize)}


@dataclass(frozen=True)
class StudyScope:
    """Where a search runs beyond its own pipeline (a comparison's tuning): its MLflow run nested under `parent`;
    each trial trained on every one of `seeds` (default: the spec's), its objective their mean, pruned on the first;
    trial 0 also trained on `noise` (default: the spec's seed and the next) to measure the noise between seeds;
    trial 0 the values `first` (the pipeline as written); the study's user attributes `attrs`; `wait` off: a process
    leaves the trials others are running to them and returns; `report` off: no report.html of the best trials;
    `callbacks` are Optuna's, called after each trial this process ran (a comparison's display)."""

    parent: str | None = None
    seeds: tuple[int, ...] = ()
    noise: tuple[int, ...] = ()
    first: dict[str, Any] | None = None
    attrs: dict[str, str] = field(default_factory=dict)
    wait: bool = True
    report: bool = True
    callbacks: tuple[Callable[[optuna.Study, optuna.trial.FrozenTrial], None], ...] = ()  # Optuna's, after a trial


@dataclass
class StudyFacts:
    """What a study spent and where its choice lies: its tuned dimensions; its finished trials, those beyond an
    edge among them, those pruned; the rounds the searched stages of every trial trained (a pruned one up to where
    it stopped, trial 0's noise seed included); the pruner's margin (None: not measured); which rule chose the best
    trial's values (written, sobol, tpe, edge); the ranges grown beyond an edge (key -> side) and the chosen values
    still in the outer tenth of their final range (key -> side: flagged)."""

    dimensions: int
    finished: int
    beyond_edge: int
    pruned: int
    rounds: int
    margin: float | None
    chosen_origin: str
    grown: dict[str, str]
    at_edge: dict[str, str]


def study_facts(space: dict[str, Param], trials: list[optuna.trial.FrozenTrial], attrs: dict[str, Any],
                maximize: bool) -> StudyFacts:
    """A study's StudyFacts from its trials and user attributes."""
    finished = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)]
    complete = [t for t in finished if t.state == TrialState.COMPLETE and t.value is not None]
    best = max(complete, key=lambda t: t.value if maximize else -t.value, default=None)
    grown_ranges = attrs.get(EDGES, {})
    return StudyFacts(len(space), len(finished), sum(t.user_attrs.get(ORIGIN) == BEYOND_EDGE for t in finished),
                      sum(t.state == TrialState.PRUNED for t in finished),
                      sum(int(t.user_attrs.get("rounds", 0)) for t in trials), seed_margin(trials),
                      best.user_attrs.get(ORIGIN, "") if best else "",
                      {key: grown["side"] for key, grown in grown_ranges.items()},
                      flags(with_grown(space, grown_ranges), best.params) if best else {})


@dataclass
class SearchResult:
    study: str
    run_id: str
    finished: int
    pruned: int
    best_values: list[float]
    best_params: dict[str, Any]
    rounds_trained: int


class Search:
    """Runs trials of one study until it has `trials` finished ones (or the time budget is spent)."""

    def __init__(self, spec: PipelineSpec, storage_url: str, trials: int | None = None, study: str | None = None,
                 cache_dir: Path | None = None, heartbeat_seconds: int = 10,
                 echo: Callable[[str], None] = print, scope: StudyScope = StudyScope()):
        if spec.search is None:
            raise SearchError("search", None, "the pipeline has no `search:` block (space, objective, trials)")
        if spec.devices > 1 or spec.nodes > 1:
            raise SearchError("devices" if spec.devices > 1 else "nodes", max(spec.devices, spec.nodes),
                              "a search trains its trials in this process: set devices: 1 "
                              "(start more workers for trials in parallel)")
        self.spec, self.search, self.cache_dir, self.echo, self.scope = spec, spec.search, cache_dir, echo, scope
        self.trials = trials or self.search.trials
        self.study_name = study or self.search.study
        self.seeds = scope.seeds or (spec.seed,)
        given = scope.noise or self.seeds
        self.noise = given if len(given) > 1 else (spec.seed, spec.seed + 1 if spec.seed < SEED_MAX else spec.seed - 1)
        self.design = design_seed(spec, self.seeds)
        self.startup = startup_count(len(self.search.space), self.trials, scope.first is not None)
        check_database("--storage", storage_url)
        directions = [o.direction for o in self.search.objective]
        with schema_init_lock(storage_url):
            self.study = optuna.create_study(storage=study_storage(storage_url, heartbeat_seconds),
                                             study_name=self.study_name, sampler=self._sampler(0),
                                             pruner=make_pruner(spec, self.trials), directions=directions,
                                             load_if_exists=True)
            self.lease = NamedLease(storage_url, self.study_name)
        fail_stale(self.study)  # opened: a trial no process runs any more is failed and retried at once
        if [d.name.lower() for d in self.study.directions] != directions:
            raise SearchError("search.objective", directions, f"study {self.study_name!r} exists with directions "
                            f"{[d.name.lower() for d in self.study.directions]}; use another --study name")
        self.study.set_metric_names([o.metric for o in self.search.objective])  # Optuna's dashboard shows them
        for key, value in scope.attrs.items():
            self.study.set_user_attr(key, value)
        self.tracker = Tracker(tracking_uri(spec.tracking.uri), spec.tracking.experiment or spec.name)
        self.run_id = self.lease.mlflow_run(self._create_search_run, self.tracker.client.delete_run)
        self.rounds_trained = 0
        self._closed: set[str] = set()  # runs of dead trials already marked KILLED
        self._running: list[int] = []  # the ids of the trials this process runs (one, or a wave's)

    # ---- the loop ------------------------------------------------------------------------------------------
    def run(self) -> SearchResult:
        """Trials until the study has `trials` finished ones; the search run is RUNNING meanwhile, then FINISHED
        (FAILED or KILLED if this process fails or is stopped)."""
        self.tracker.client.update_run(self.run_id, status="RUNNING")
        try:
            result = self._trials()
        except BaseException as err:
            for trial_id in self._running if isinstance(err, STOPPED) else ():
                fail_interrupted(self.study, trial_id, caught=isinstance(err, KeyboardInterrupt))
            self.tracker.fail([self.run_id], err)
            raise
        self.tracker.finish(self.run_id)
        return result

    def _trials(self) -> SearchResult:
        deadline = time.monotonic() + self.search.timeout_s if self.search.timeout_s else math.inf
        while time.monotonic() < deadline:
            self.lease.acquire()
            fail_stale(self.study)  # a dead process's trial: FAIL, and a WAITING retry with its params
            self._close_dead_trials()
            if not self.study.get_trials(deepcopy=False):
                self._start()  # under the lease: the study's first trials
            trials = self.study.get_trials(deepcopy=False, states=STARTED)
            if len(trials) >= self.trials and not _busy(trials) and EDGES not in self.study.user_attrs:
                self._grow_edges()
                trials = self.study.get_trials(deepcopy=False, states=STARTED)
            waiting = [t for t in trials if t.state == TrialState.WAITING]
            if waiting or len(trials) < self.trials:
                self._next(wave_size(waiting) if waiting else 1)
                self._log_best()
                continue
            self.lease.release()
            if not self.scope.wait or not any(t.state == TrialState.RUNNING for t in trials):
                break
            time.sleep(1.0)  # other processes' trials are running; one may still fail and need a retry
        self.lease.release()
        self._log_best(plots=self.spec.tracking.plots)
        if self.scope.report:
            self._log_report()
        return self._result()

    def _next(self, count: int) -> None:
        """The next wave of `count` trials (waiting ones first), created under the lease, which is released once they
        exist: one through Optuna's optimize, several asked at once and trained together (`_batch`)."""
        if count > 1:
            self._batch(self._ask(count))
            return
        self._seed_next_draw()
        try:
            self.study.optimize(self._objective, n_trials=1, callbacks=list(self.scope.callbacks))
        except optuna.exceptions.UpdateFinishedTrialError:
            self.echo(OUTLIVED)
        self._running = []  # told; a stop raised out of optimize leaves it set (run: fail_interrupted)

    def _ask(self, count: int) -> list[optuna.Trial]:
        """`count` trials asked (Optuna's ask takes the waiting ones first), each point drawn by the sampler seeded
        with the trials drawn before as a lone trial's is (draws_before), each beating at once (a trial that never
        beat is never stale)."""
        asked = []
        for _ in range(count):
            self._seed_next_draw()
            with warnings.catch_warnings():  # that ask's trials get no heartbeat: these beat (heartbeats)
                warnings.filterwarnings("ignore", "Heartbeat of storage is supposed to be used with Study.optimize")
                asked.append(self.study.ask())
            self._running.append(asked[-1]._trial_id)
            self.study._storage.record_heartbeat(asked[-1]._trial_id)
        return asked

    def _sampler(self, offset: int) -> optuna.samplers.BaseSampler:
        return make_sampler(self.spec, offset, self.design, self.startup + (self.scope.first is not None))

    def _seed_next_draw(self) -> None:
        """The study's sampler seeded with the trials drawn before (draws_before), a count the lease makes unique: a
        single process is reproducible, and two processes never draw the same point."""
        self.study.sampler = self._sampler(draws_before(self.study.get_trials(deepcopy=False)))

    def _start(self) -> None:
        """The study's first trials, enqueued: trial 0 (the pipeline as written, where given) and the Sobol points;
        the first of them also trains the noise seed, alone (wave 0), the others after it as one wave."""
        points = [({**self.scope.first}, WRITTEN)] if self.scope.first is not None else []
        points += [(p, SOBOL) for p in sobol_points(self.search.space, self.startup, self.design)]
        for i, (values, origin) in enumerate(points):
            self.study.enqueue_trial(values, user_attrs={ORIGIN: origin, NOISE: i == 0, WAVE: min(i, 1)})

    def _new_wave(self) -> int:
        """The number of a wave after every wave of the study's trials."""
        return 1 + max((t.user_attrs.get(WAVE, -1) for t in self.study.get_trials(deepcopy=False)), default=-1)

    def space(self) -> dict[str, Param]:
        """The searched space, with the ranges this study grew beyond an edge."""
        return with_grown(self.search.space, self.study.user_attrs.get(EDGES, {}))

    def _grow_edges(self) -> None:
        """Once the study's trials are done: each value of the best trial in the outer tenth of a range that can
        grow (log scale) grows the range beyond that edge, where `edge_trials` further trials go, the other values
        at the best trial's (recorded in the study's EDGES attribute, decided once)."""
        complete = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        grown_ranges: dict[str, dict[str, Any]] = {}
        wave = self._new_wave()  # the trials beyond the edges: one wave
        if complete and len(self.search.objective) == 1 and self.search.edge_trials:
            best = self.study.best_trial.params
            for key, param in self.search.space.items():
                side = edge_of(param, best[key]) if key in best and extensible(param) else None
                wider, values = grown(param, side, self.search.edge_trials) if side else (param, [])
                values = [v for v in values if self._valid(key, v)]
                if values:
                    grown_ranges[key] = {"side": side, "low": min(wider.low, *values),
                                         "high": max(wider.high, *values)}
                for value in values:
                    self.study.enqueue_trial({**best, key: value},
                                             user_attrs={ORIGIN: BEYOND_EDGE, NOISE: False, WAVE: wave})
        self.study.set_user_attr(EDGES, grown_ranges)

    def _valid(self, key: str, value: Any) -> bool:
        """Whether a pipeline with `key` at `value` is valid (a range may not grow past what its key allows)."""
        try:
            with_values(self.spec.model_copy(update={"search": None}), {key: value})
        except SpecError:
            return False
        return True

    def _values(self, trial: optuna.Trial) -> dict[str, Any]:
        """The trial's point in the space, and which rule chose it (a trial asked of the sampler: the sampler)."""
        values = {key: suggest(trial, key, param) for key, param in self.space().items()}
        if ORIGIN not in trial.user_attrs:
            trial.set_user_attr(ORIGIN, TPE if self.search.sampler.kind == "tpe" else self.search.sampler.kind)
        return values

    def _objective(self, trial: optuna.Trial) -> float | list[float]:
        if WAVE not in trial.user_attrs:  # a new draw (under the lease): a wave of its own
            trial.set_user_attr(WAVE, self._new_wave())
        self.lease.release()
        self._running = [trial._trial_id]
        values = self._values(trial)
        seeds = self.seeds
        extra = [s for s in self.noise if s not in seeds] if trial.user_attrs.get(NOISE) else []
        start, seen = time.perf_counter(), {}
        try:
            objectives = np.mean([self._trained(trial, values, seed, seen, first=i == 0)
                                  for i, seed in enumerate(seeds)], 0)
            for seed in extra:  # the noise seed: its evaluations only, for the pruner's margin
                self._trained(trial, values, seed, seen, first=False)
        except optuna.TrialPruned:
            self._said(trial.number, values, "pruned", time.perf_counter() - start)
            raise
        except Diverged as err:  # a step size too large for the space: the trial counts, as the worst, and the
            # search goes on (its run is FAILED); a failed trial would be retried for ever
            self._said(trial.number, values, "diverged", time.perf_counter() - start, f": {err}")
            raise optuna.TrialPruned(str(err)) from None
        self._said(trial.number, values, self._shown(objectives), time.perf_counter() - start)
        return float(objectives[0]) if len(objectives) == 1 else [float(v) for v in objectives]

    def _shown(self, objectives: Any) -> str:
        """A trial's objectives as its line shows them, with the seeds they are the mean over."""
        return ", ".join(f"{o.metric}={v:.4f}" for o, v in zip(self.search.objective, objectives, strict=True)) + (
            f" over seeds {list(self.seeds)}" if len(self.seeds) > 1 else "")

    def _said(self, number: int, values: dict[str, Any], outcome: str, seconds: float, tail: str = "") -> None:
        self.echo(f"trial {number}: {_short(values)} -> {outcome} ({seconds:.1f} s){tail}")

    def _trained(self, trial: optuna.Trial, values: dict[str, Any], seed: int, seen: dict[int, Evaluations],
                 first: bool) -> list[float]:
        """The objectives of the trial's pipeline trained on `seed` (pruned on the first seed's evaluations; each
        seed's Evaluations kept in `seen` and the trial's CURVES and rounds attributes)."""
        spec = with_values(self.spec, {**values, "seed": seed})
        evaluations = seen.setdefault(seed, Evaluations())
        runner = PipelineRunner(spec, cache_dir=self.cache_dir, progress=False,
                                extra_callbacks=self._evaluation_callbacks(trial if first else None, evaluations))
        started = (lambda run_id: trial.set_user_attr("mlflow_run_id", run_id)) if first else (lambda run_id: None)
        try:
            result = runner.run(parent=self.run_id, tags=self._tags(trial, seed), started=started,
                                name=self._run_name(trial, values, seed, first))
        finally:
            self.rounds_trained += runner.rounds_trained
            _record_evaluations(trial, seen)
        return [self._value(result, o) for o in self.search.objective]

    def _run_name(self, trial: optuna.Trial, values: dict[str, Any], seed: int, first: bool) -> str:
        """The MLflow name of the trial's pipeline run on `seed` (its first seed's bare where the search has one)."""
        return trial_name(self.spec.name, trial.number, values, [s.name for s in self.spec.stages]) + (
            "" if first and not self.scope.seeds else f" seed {seed}") + (" (noise)" if seed not in self.seeds else "")

    def _tags(self, trial: optuna.Trial, seed: int) -> dict[str, str]:
        return {TRIAL_TAG: str(trial.number), STUDY_TAG: self.study_name, SEED_TAG: str(seed),
                **({NOISE_SEED_TAG: "true"} if seed not in self.seeds else {})}

    # ---- a wave of trials --------------------------------------------------------------------------------
    def _batch(self, asked: list[optuna.Trial]) -> None:
        """The `asked` trials (the lease released: they exist) trained together on each tuning seed in turn, those
        still going on the next, trial 0 on its noise seed last (pipeline/trials.py), with heartbeats; each then
        told as a lone trial is. A crash fails them; a stop leaves them to run() (failed, and retried)."""
        self.lease.release()
        flights, start = [_InFlight(trial, self._values(trial)) for trial in asked], time.perf_counter()
        wave = asked[0].user_attrs.get(WAVE)
        self.echo(f"wave {'by hand' if wave is None else wave}: trials {', '.join(str(t.number) for t in asked)} "
                  "train together")
        try:
            with heartbeats(self.study._storage, self._running):
                for i, seed in enumerate(self.seeds):
                    self._batch_on(seed, [f for f in flights if f.stopped is None], first=i == 0)
                noisy = [f for f in flights if f.stopped is None and f.trial.user_attrs.get(NOISE)]
                for seed in [s for s in self.noise if s not in self.seeds] if noisy else []:
                    self._batch_on(seed, noisy, first=False)
        except Exception:
            for trial in asked:  # what optimize does with a trial that raised
                if self.study._storage.get_trial(trial._trial_id).state == TrialState.RUNNING:
                    self.study._storage.set_trial_state_values(trial._trial_id, state=TrialState.FAIL)
            self._running = []
            raise
        for flight in flights:
            self._tell(flight, time.perf_counter() - start, len(flights))
        self._running = []

    def _batch_on(self, seed: int, flights: list[_InFlight], first: bool) -> None:
        """The `flights` trained together on `seed` (pruned and halved on the first seed's evaluations), each
        trial's outcome, evaluations and rounds kept as `_trained` keeps a lone trial's."""
        span = None if self.search.batch == "auto" else self.search.batch
        trials = PipelineTrials(with_values(self.spec, {"seed": seed}), [f.values for f in flights], self.cache_dir,
                                span)
        started = (lambda j, run_id: flights[j].trial.set_user_attr("mlflow_run_id", run_id)) if first else (
            lambda j, run_id: None)
        try:
            outcomes = trials.run(self.run_id, None, [self._run_name(f.trial, f.values, seed, first) for f in flights],
                                  self._batch_callbacks(trials, flights, seed, first),
                                  [self._tags(f.trial, seed) for f in flights], started)
        finally:
            self.rounds_trained += trials.rounds_trained
            for flight in flights:
                _record_evaluations(flight.trial, flight.seen)
        for flight, outcome in zip(flights, outcomes, strict=True):
            flight.stopped = outcome.stopped
            if outcome.result is not None and seed in self.seeds:
                flight.objectives.append([self._value(outcome.result, o) for o in self.search.objective])

    def _batch_callbacks(self, trials: PipelineTrials, flights: list[_InFlight], seed: int,
                         first: bool) -> Callable[[int, list[int]], list[RoundCallback]]:
        """Per trained stage and its trials (positions in `flights`): as `_evaluation_callbacks` for each, and on
        the first seed successive halving within the noise margin (once the study has one; studies/halving.py)."""
        objective, (before, searched) = self.search.objective[0], searched_rounds(self.spec)
        judged = len(self.search.objective) == 1 and objective.metric.startswith("val_")
        margin = self._halving_margin() if first else None
        rungs = rung_steps(before, searched)

        def callbacks(index: int, positions: list[int]) -> list[RoundCallback]:
            offsets = [sum(s.rounds for s in trials.runners[k].spec.stages[:index]) for k in positions]
            if min(offsets) < before or not judged:  # a stage before the searched ones reports nothing
                return []
            members = [PruneOnEvaluation(flights[k].trial if first else None, objective.metric, offset,
                                         flights[k].seen.setdefault(seed, Evaluations()))
                       for k, offset in zip(positions, offsets, strict=True)]
            return [BatchEvaluations(members, rungs, margin, objective.direction == "maximize")]
        return callbacks

    def _halving_margin(self) -> float | None:
        """The margin a rung keeps a trial within of the best: the pruner's (`auto`: twice the noise between seeds,
        None until trial 0's noise seed measured it); None without a pruner."""
        pruner = self.search.pruner
        if pruner.kind == "none":
            return None
        return float(pruner.margin) if pruner.margin != "auto" else seed_margin(self.study.get_trials(deepcopy=False))

    def _tell(self, flight: _InFlight, seconds: float, size: int) -> None:
        """A trial of a wave told as optimize tells a lone one: COMPLETE with its mean over the seeds, PRUNED
        (pruned, halved or diverged: its intermediate values kept) or FAIL; its line said, the scope's callbacks
        called."""
        stopped, tail = flight.stopped, f" in a wave of {size}"
        try:
            if stopped is None:
                objectives = np.mean(flight.objectives, 0)
                told = self.study.tell(flight.trial, [float(v) for v in objectives])
                outcome = self._shown(objectives)
            else:
                state = TrialState.FAIL if stopped["why"] == "failed" else TrialState.PRUNED
                told = self.study.tell(flight.trial, state=state)
                outcome, tail = ("failed" if state == TrialState.FAIL else "pruned"), f"{tail}: {stopped['error']}"
        except optuna.exceptions.UpdateFinishedTrialError:
            self.echo(OUTLIVED)
            return
        self._said(flight.trial.number, flight.values, outcome, seconds, tail)
        for callback in self.scope.callbacks:
            callback(self.study, told)

    def _close_dead_trials(self) -> None:
        """The MLflow runs of trials whose process died (failed as stale) are KILLED instead of RUNNING for ever."""
        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.FAIL,)):
            run_id = trial.user_attrs.get("mlflow_run_id")
            if run_id and run_id not in self._closed:
                close_orphans(self.tracker.uri, run_id, f"trial {trial.number}'s process died (no heartbeat)")
                self._closed.add(run_id)

    def _evaluation_callbacks(self, trial: optuna.Trial | None,
                              seen: Evaluations) -> Callable[[int], list[RoundCallback]]:
        """Per trained stage (given its round offset in the pipeline): for a searched stage, the callback that
        keeps its rounds and evaluations in `seen` and, given the `trial`, prunes it, if the objective allows. A stage
        before the searched ones (shared, and trained only by the first study to need it) reports nothing."""
        metric, before = self.search.objective[0].metric, searched_rounds(self.spec)[0]
        judged = len(self.search.objective) == 1 and metric.startswith("val_")
        return lambda offset: [PruneOnEvaluation(trial, metric, offset, seen)] if judged and offset >= before else []

    def _value(self, result: Any, objective: Any) -> float:
        names = [s.name for s in self.spec.stages]
        index = objective.stage if isinstance(objective.stage, int) else names.index(objective.stage)
        return float(result.stages[index].metrics[objective.metric])

    # ---- MLflow --------------------------------------------------------------------------------------------
    def _create_search_run(self) -> str:
        client = self.tracker.client
        nested = {MLFLOW_PARENT_RUN_ID: self.scope.parent} if self.scope.parent else {}
        run = client.create_run(self.tracker.experiment_id, run_name=f"search-{self.study_name}",
                                tags={SEARCH_TAG: self.study_name, PIPELINE_TAG: self.spec.name, **nested})
        space = {f"space.{k}": json.dumps(v.model_dump(exclude_none=True)) for k, v in self.search.space.items()}
        objective = {f"objective.{i}": f"{o.direction} {o.metric} of stage {o.stage}"
                     for i, o in enumerate(self.search.objective)}
        self.tracker.log_params(run.info.run_id, {**space, **objective, "sampler": self.search.sampler.kind,
                                                  "pruner": self.search.pruner.kind})
        return run.info.run_id

    def _log_best(self, plots: bool = False) -> None:
        """Best trial(s) so far on the search run (value as metrics, params as tags); plots at the end."""
        client, done = self.tracker.client, self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not done:
            return
        self.tracker.log_metrics(self.run_id, {"finished_trials": len(done)}, step=len(done))
        if len(self.search.objective) == 1:
            best = self.study.best_trial
            self.tracker.log_metrics(self.run_id, {f"best_{self.search.objective[0].metric}": best.value},
                                     step=len(done))
            self.tracker.set_tags(self.run_id, {"best_trial": str(best.number),
                                                **{f"best.{k}": str(v) for k, v in best.params.items()}})
            client.log_dict(self.run_id, {"trial": best.number, "value": best.value, "params": best.params},
                            "best.json")
        else:
            front = [{"trial": t.number, "values": t.values, "params": t.params} for t in self.study.best_trials]
            client.log_dict(self.run_id, front, "pareto_front.json")
        if plots:
            self._log_plots()

    def _log_plots(self) -> None:
        from matplotlib import pyplot as plt
        from optuna.visualization import matplotlib as ov

        names = [o.metric for o in self.search.objective]
        figures: dict[str, Callable[[], Any]] = {}
        if len(names) == 1:
            figures["optimization_history"] = lambda: ov.plot_optimization_history(self.study, target_name=names[0])
            if any(t.intermediate_values for t in self.study.get_trials(deepcopy=False)):
                figures["intermediate_values"] = lambda: ov.plot_intermediate_values(self.study)
            if len(self.search.space) > 1 and len(self.study.get_trials(states=(TrialState.COMPLETE,))) > 2:
                figures["param_importances"] = lambda: ov.plot_param_importances(self.study)
        else:
            figures["pareto_front"] = lambda: ov.plot_pareto_front(self.study, target_names=names)
        for name, plot in figures.items():
            axes = plot()
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
            figure.set_size_inches(8, 5)
            self.tracker.client.log_figure(self.run_id, figure, f"plots/{name}.png")
            plt.close(figure)  # pyplot keeps every figure it made: a comparison's many studies would pile them up

    def _log_report(self, top: int = 5) -> None:
        """The search run's `report.html`: its best finished trials side by side (the Pareto front's when several
        objectives); trials themselves log no report."""
        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
                if "mlflow_run_id" in t.user_attrs]
        if not done or not self.spec.tracking.plots:
            return
        if len(self.search.objective) == 1:
            sign = -1 if self.search.objective[0].direction == "maximize" else 1
            ranked = sorted(done, key=lambda t: sign * t.value)
        else:
            ranked = [t for t in self.study.best_trials if "mlflow_run_id" in t.user_attrs]
        log_report(self.tracker.client, self.run_id, [t.user_attrs["mlflow_run_id"] for t in ranked[:top]])

    def _result(self) -> SearchResult:
        finished = self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
        pruned = sum(t.state == TrialState.PRUNED for t in finished)
        best_values, best_params = [], {}
        if any(t.state == TrialState.COMPLETE for t in finished):
            best = self.study.best_trials[0]
            best_values, best_params = list(best.values), dict(best.params)
        return SearchResult(self.study_name, self.run_id, len(finished), pruned, best_values, best_params,
                            self.rounds_trained)


OUTLIVED = "a trial outlived its heartbeat grace period and was failed by another process; it is retried"


@dataclass
class _InFlight:
    """A trial of a wave while it trains: its point, its evaluations per seed, its objectives per tuning seed
    trained, and where it stopped (TrialOutcome.stopped; None: going)."""

    trial: optuna.Trial
    values: dict[str, Any]
    seen: dict[int, Evaluations] = field(default_factory=dict)
    objectives: list[list[float]] = field(default_factory=list)
    stopped: dict[str, Any] | None = None


def _record_evaluations(trial: optuna.Trial, seen: dict[int, Evaluations]) -> None:
    """The trial's rounds trained and per seed evaluations (CURVES: the pruner's margin) as its user attributes."""
    trial.set_user_attr("rounds", sum(e.rounds for e in seen.values()))
    trial.set_user_attr(CURVES, curve_attr({s: e.curve for s, e in seen.items()}))


@contextmanager
def heartbeats(storage: Any, trial_ids: list[int]) -> Iterator[None]:
    """The heartbeats of `trial_ids` while the block runs, what optimize sends for its one trial: a wave whose
    process died goes stale, and is failed and retried, as a lone trial is."""
    interval, stop = storage.get_heartbeat_interval(), threading.Event()

    def beat() -> None:
        while interval and not stop.wait(interval):
            for trial_id in trial_ids:
                storage.record_heartbeat(trial_id)

    thread = threading.Thread(target=beat, daemon=True, name="fedpilot-heartbeats")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def wave_size(waiting: list[optuna.trial.FrozenTrial]) -> int:
    """How many of the `waiting` trials the next wave trains: those of the oldest one's wave (Optuna's ask takes the
    oldest waiting trial first); trials enqueued without a wave (by hand) are one wave."""
    wave = min(waiting, key=lambda t: t.number).user_attrs.get(WAVE)
    return sum(t.user_attrs.get(WAVE) == wave for t in waiting)


def _busy(trials: list[optuna.trial.FrozenTrial]) -> bool:
    """Whether any of `trials` is running or waiting to run."""
    return any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)


def trial_name(pipeline: str, number: int, values: dict[str, Any], stages: list[str] | None = None) -> str:
    """A trial's run name: its number and parameters, each key labelled by its stage's name (`stages`: the
    pipeline's stage names; stats.keys), e.g. `quickstart trial 3: personalize.params.lr_v=0.0123`."""
    names = key_labels(list(values), stages or [])
    shown = " ".join(f"{names[k]}={v:.3g}" if isinstance(v, float) else f"{names[k]}={v}" for k, v in values.items())
    return f"{pipeline} trial {number}: {shown}"


def _short(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def quiet_optuna() -> None:
    """Our one line per trial replaces Optuna's log (a failed trial's traceback too: the failure is one line, its
    traceback in the run's error.txt); its experimental-API warnings are not the user's concern."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
