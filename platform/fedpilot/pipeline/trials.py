"""A pipeline's trials run together: K value sets for its stages (dotted spec keys, as a search's space names them),
each trial recorded and cached as a lone run of its pipeline would be, the stages trained once for all the trials
that share them and together for the trials that differ in them (engine/trials.py).

Stage after stage: a trial whose stage is in the stage cache (under the key a lone run of its pipeline has) reuses it;
trials whose stage is the same (the same key: the stages before the first one their values touch) train it once and
the others reuse it; the rest train side by side, round by round, in one TrialBatch (those over as many rounds), as
one computation wherever the stage's algorithm batches them and their values allow (`check_batch`), else group after
group within each round; a trial alone trains as a lone run does. Every trial has its own MLflow pipeline run, stage
runs, metrics, per-client tables and cache entries, so a batch and a lone rerun share results. A trial that diverges,
or that a callback drops from its batch (a search's rung), stops there: its runs are FAILED with what they logged
(KILLED where the callback's cause is a search's pruning), and its later stages do not run. A killed batch is not
resumed: its trials' finished stages stay in the cache, the batch in flight is lost.
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from fedpilot.algorithms import build_algorithm
from fedpilot.engine.memory import PeakMemory, release_freed_memory
from fedpilot.engine.trials import STOPPED_DIVERGED, STOPPED_DROPPED, TrialBatch
from fedpilot.errors import Diverged, SpecError, StageFailed
from fedpilot.overview import applicable
from fedpilot.pipeline.cache import stage_keys
from fedpilot.pipeline.round_metrics import RoundMetrics
from fedpilot.pipeline.runner import PipelineResult, PipelineRunner, StageOutcome
from fedpilot.spec import PipelineSpec, with_values
from fedpilot.tracking import CACHE_KEY_TAG, CACHE_TAG, set_params

BatchCallbacks = Callable[[int, list[int]], list[Callback]]  # (stage index, trials of the batch) -> callbacks


class TrialDropped(Exception):
    """A trial taken out of its batch by a callback (a search's rung): what its runs record as their error (the
    callback's own, given to `TrialBatch.drop` as `cause`, or raised by it where the trial trains alone)."""


@dataclass
class TrialOutcome:
    """One trial: its `values`, its pipeline's result as a lone run returns it (None where it stopped), and where it
    stopped (`stopped`: the stage, the rounds it trained, why, the error, and the stage's records, its validation at
    every evaluation; None: it finished)."""

    values: dict[str, Any]
    result: PipelineResult | None = None
    stopped: dict[str, Any] | None = None


@dataclass
class _Trial:
    """A trial while it runs: its runner, its pipeline run, its open runs, its stages' outcomes, the stage it is at."""

    runner: PipelineRunner
    run_id: str
    stages: Any  # its runner's _each_stage()
    outcomes: list[StageOutcome]
    at: tuple | None = None  # (index, stage, split, key, before)
    rounds: int = 0  # of its stages before the one it is at


class PipelineTrials:
    """The trials of `spec` with each of `values` (dotted keys of its stages: `stages.1.params.lr_v`) set, on one
    federation and model (built once, each trial's model its own copy), with the stage cache of `cache_dir`; a batch's
    chunks span at most `span` trials (TrialBatch; None: as many as its executor batches)."""

    def __init__(self, spec: PipelineSpec, values: Sequence[dict[str, Any]], cache_dir: Path | None = None,
                 span: int | None = None):
        if spec.devices > 1 or spec.nodes > 1:
            raise SpecError("devices", spec.devices, "trials run together on one device")
        self.values, self.span = [dict(v) for v in values], span
        self.base = PipelineRunner(spec, cache_dir, progress=False)
        self.runners = [self.runner_for(v) for v in self.values]
        self.rounds_trained = 0  # by every trial, in this process (a batch of K trials' round counts K)

    def runner_for(self, values: dict[str, Any]) -> PipelineRunner:
        """A runner of the pipeline with `values` set, sharing the base runner's data, tracker and cache."""
        runner = copy.copy(self.base)
        runner.spec = with_values(self.base.spec, values)
        runner.algorithms = [build_algorithm(s.algorithm, s.params, f"stages.{i}.algorithm")
                             for i, s in enumerate(runner.spec.stages)]
        runner.model = copy.deepcopy(self.base.model)
        runner.keys = stage_keys(runner.spec, runner.data.fingerprint, runner.device.type)  # a lone run's keys
        runner.applies = applicable(runner.spec)
        return runner

    def run(self, parent: str | None = None, tags: dict[str, str] | None = None,
            names: Sequence[str | None] | None = None, callbacks: BatchCallbacks | None = None,
            trial_tags: Sequence[dict[str, str]] | None = None,
            started: Callable[[int, str], None] = lambda k, run_id: None) -> list[TrialOutcome]:
        """Every trial, each its own pipeline run (nested under `parent`, with `tags` and its own `trial_tags`, named
        by `names`; `started(k, run_id)` as soon as trial k's run exists); `callbacks` gives the callbacks of each
        stage's training (a batch's `RoundResult.trials` are by position in the trials it is given; a callback of a
        trial trained alone stops it by raising TrialDropped). The trials' outcomes, in the order of the values."""
        names = names or [None] * len(self.runners)
        trial_tags = trial_tags or [{}] * len(self.runners)
        trials = []
        for k, (runner, name, own) in enumerate(zip(self.runners, names, trial_tags, strict=True)):
            trials.append(_Trial(runner, runner.open_run(None, parent, {**(tags or {}), **own}, name)[0],
                                 runner._each_stage(), []))
            started(k, trials[-1].run_id)
        outcomes = [TrialOutcome(v) for v in self.values]
        try:
            for index in range(len(self.base.spec.stages)):
                going = [k for k, o in enumerate(outcomes) if o.stopped is None]
                for k in going:
                    trials[k].rounds += trials[k].at[1].n_rounds if trials[k].at else 0
                    trials[k].at = next(trials[k].stages)
                self._stage(index, [(k, trials[k]) for k in going], outcomes, callbacks or (lambda i, ks: []))
            for trial, outcome in zip(trials, outcomes, strict=True):
                if outcome.stopped is None:
                    outcome.result = trial.runner.close_run(trial.run_id, trial.outcomes, False)
        except BaseException as err:  # a stop, a crash: every trial still open fails with it
            for trial, outcome in zip(trials, outcomes, strict=True):
                if outcome.stopped is None and outcome.result is None:
                    trial.runner.fail_run([trial.run_id], err)
            raise
        return outcomes

    def _stage(self, index: int, going: list[tuple[int, _Trial]], outcomes: list[TrialOutcome],
               callbacks: BatchCallbacks) -> None:
        """Stage `index` of the trials still `going`: from the cache, trained once for those that share it, or
        trained together."""
        trained, later, first = [], [], {}
        for k, trial in going:
            key = trial.at[3]
            if trial.runner.cache.has(key) or key in first:
                later.append((k, trial))
            else:
                first[key] = k
                trained.append((k, trial))
        for rounds in dict.fromkeys(trial.at[1].n_rounds for _, trial in trained):  # in lockstep, a TrialBatch
            members = [(k, trial) for k, trial in trained if trial.at[1].n_rounds == rounds]
            if len(members) == 1:
                self._alone(index, *members[0], outcomes, callbacks)
            else:
                self._together(index, members, outcomes, callbacks)
        for k, trial in later:
            if trial.runner.cache.has(trial.at[3]):
                self._reuse(index, trial)
            else:  # the trial that trained its stage stopped in it: this one stops there too
                outcomes[k].stopped = dict(outcomes[first[trial.at[3]]].stopped)
                _release(trial)

    def _reuse(self, index: int, trial: _Trial) -> None:
        _, stage, split, key, before = trial.at
        cached = trial.runner.cache.load(key)
        trial.outcomes.append(trial.runner._reuse(trial.run_id, index, stage, split, cached, key, None, before))

    def _stage_run(self, index: int, trial: _Trial) -> str:
        """The stage's run of a trial that trains it (a lone trial's `_train` logs its parameters)."""
        runner, key, stage_spec = trial.runner, trial.at[3], trial.runner.spec.stages[index]
        return runner.tracker.start_stage(trial.run_id, index, stage_spec.name, stage_spec.algorithm,
                                          {CACHE_TAG: "miss", CACHE_KEY_TAG: key})

    def _alone(self, index: int, k: int, trial: _Trial, outcomes: list[TrialOutcome],
               callbacks: BatchCallbacks) -> None:
        _, stage, split, key, before = trial.at
        run_id = self._stage_run(index, trial)
        runner = trial.runner
        runner.extra_callbacks = lambda offset: callbacks(index, [k])
        try:
            trial.outcomes.append(runner._train(trial.run_id, index, run_id, stage, split, key, False, before,
                                                trial.rounds))
        except (StageFailed, TrialDropped) as err:  # a callback of a trial alone stops it by raising TrialDropped
            runner.fail_run([trial.run_id, run_id], err)
            shutil.rmtree(runner._checkpoints(trial.run_id, index), ignore_errors=True)
            why = STOPPED_DIVERGED if isinstance(err, Diverged) else STOPPED_DROPPED if isinstance(
                err, TrialDropped) else "failed"
            outcomes[k].stopped = {"stage": index, "round": stage.global_step, "why": why, "error": str(err),
                                   "history": list(stage.history)}
            _release(trial)
        finally:
            self.rounds_trained += stage.rounds_run

    def _together(self, index: int, members: list[tuple[int, _Trial]], outcomes: list[TrialOutcome],
                  callbacks: BatchCallbacks) -> None:
        """The members' stage trained as one batch, each trial recorded and cached as if it had trained alone."""
        run_ids = [self._stage_run(index, trial) for _, trial in members]
        for (_, trial), run_id in zip(members, run_ids, strict=True):  # as a lone trial's _train logs them
            trial.runner.tracker.log_params(run_id, set_params(trial.runner.applies["stages"][index]))
        batch = TrialBatch([trial.at[1] for _, trial in members], self.span)
        folder = self.base.root / "runs" / members[0][1].run_id / f"{index}-batch"
        batch.save_changes_in(folder / "banks")
        logs = [RoundMetrics(trial.runner.tracker, run_id, j) for j, ((_, trial), run_id)
                in enumerate(zip(members, run_ids, strict=True))]
        trainer = self.base._trainer(batch, folder, [*logs, *callbacks(index, [k for k, _ in members])])
        try:
            with PeakMemory(self.base.device) as memory:
                trainer.fit(batch)
        finally:
            self.rounds_trained += sum(stage.rounds_run for stage in batch.trials)
        release_freed_memory(self.base.device)
        batch.save_changes_in(None)
        for j, ((k, trial), run_id) in enumerate(zip(members, run_ids, strict=True)):
            _, stage, split, key, before = trial.at
            if j in batch.stopped:
                self._stopped(index, k, trial, run_id, batch, j, outcomes)
                continue
            trial.runner.cache_stage(key, stage, run_id, memory.bytes)
            trial.outcomes.append(trial.runner._record(index, run_id, "miss", stage, split, memory.bytes, before))
        shutil.rmtree(folder, ignore_errors=True)

    def _stopped(self, index: int, k: int, trial: _Trial, run_id: str, batch: TrialBatch, j: int,
                 outcomes: list[TrialOutcome]) -> None:
        """Trial `k` (the batch's `j`) stopped in stage `index`: its runs fail with why, its outcome says where."""
        stop = batch.stopped[j]
        error = batch.errors.get(j) or TrialDropped(f"dropped from its batch after round {stop['round']}")
        trial.runner.fail_run([trial.run_id, run_id], error)
        outcomes[k].stopped = {"stage": index, **stop, "error": stop["error"] or str(error),
                               "history": list(batch.trials[j].history)}
        _release(trial)


def _release(trial: _Trial) -> None:
    """A stopped trial lets go of its stage (its model, banks and server state), which the trials still training would
    otherwise hold beside their own until the last of them ends."""
    trial.stages.close()
    trial.at = None
