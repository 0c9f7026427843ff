"""PipelineRunner: build the data and the model once, then train (or reuse from the stage cache) each stage in order,
each starting from the previous stage's shared model and personal bank, recording everything in MLflow."""

from __future__ import annotations

import gc
import shutil
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from fedpilot.algorithms import ALGORITHMS
from fedpilot.data.federated import staging
from fedpilot.data.summary import describe
from fedpilot.engine.bank import carry_bank
from fedpilot.engine.config import AUTO
from fedpilot.engine.hooks import RoundGuard
from fedpilot.engine.memory import PeakMemory, release_freed_memory
from fedpilot.engine.novel import NovelClients
from fedpilot.engine.stage import FederatedStage
from fedpilot.errors import StageCrashed, StageFailed, UserError, raised_at
from fedpilot.models.split import ParamSplit, apply_split
from fedpilot.names import safe_path
from fedpilot.overview import applicable
from fedpilot.overview import summary as what_runs
from fedpilot.pipeline.cache import StageCache, novel_recipe, stage_keys
from fedpilot.pipeline.checks import prepare, stage_split, under_slurm
from fedpilot.pipeline.progress import RoundProgress
from fedpilot.pipeline.round_metrics import RoundMetrics, execution_tags
from fedpilot.pipeline.signals import CheckpointOnStop, stop_on_signals
from fedpilot.pipeline.stage_record import SPLITS, stage_record
from fedpilot.report import log_report
from fedpilot.report.pipeline_page import pipeline_note
from fedpilot.settings import cache_root, tracking_uri
from fedpilot.spec import PipelineSpec
from fedpilot.tracking import (
    CACHE_KEY_TAG,
    CACHE_SOURCE_TAG,
    CACHE_TAG,
    ERROR_ARTIFACT,
    NOTE_TAG,
    RESUMABLE_TAG,
    STOPPED,
    Tracker,
    recorded_executions,
    set_params,
)


@dataclass
class StageOutcome:
    """What one stage produced: its run, whether it came from the cache, the per-client values of the task's primary
    metric by split (accuracy; mean squared error for regression), final metrics."""

    index: int
    name: str
    cache: str
    run_id: str
    primary: dict[str, np.ndarray]
    metrics: dict[str, float]


@dataclass
class PipelineResult:
    run_id: str
    tracking_uri: str
    experiment_id: str
    stages: list[StageOutcome]


class PipelineRunner:
    """Runs one PipelineSpec end to end; `run()` returns the MLflow parent run and every stage's outcome."""

    def __init__(self, spec: PipelineSpec, cache_dir: Path | None = None, progress: bool = True,
                 use_cache: bool = True, extra_callbacks: Callable[[int], list[Callback]] | None = None,
                 executions: dict[int, dict[str, Any]] | None = None):
        """`extra_callbacks(round_offset)`: more callbacks for each trained stage, given the rounds of the stages
        before it (a search's pruning callback). `executions`: how a stage under `execution: auto` runs instead of
        timing the candidates, by stage index (what an earlier run of the same spec recorded, tracking's
        EXECUTION_TAG: its executor, clients per call and per chunk), so that a rerun computes the same numbers."""
        self.spec, self.progress, self.use_cache = spec, progress, use_cache
        BUILT.add(self)
        self.root = Path(cache_dir) if cache_dir else cache_root()
        self.cache = StageCache(self.root)
        with staging():  # every input check, before any run is created; the model's memory is one of them
            prepared = prepare(spec, self.root)
            self.data, self.tensors, self.task = prepared.data, prepared.tensors, prepared.task
            self.participants, self.novel, self.novel_tensors = (prepared.participants, prepared.novel,
                                                                 prepared.novel_tensors)
            self.model, self.algorithms, self.device = prepared.model, prepared.algorithms, prepared.device
        self.applies = applicable(spec)  # the spec's keys that apply, which its runs log as params
        self.keys = stage_keys(spec, self.data.fingerprint, self.device.type)
        self.executions = {i: pin for i, pin in (executions or {}).items() if pin.get("execution", AUTO) != AUTO}
        self.uri = tracking_uri(spec.tracking.uri)
        self.tracker = Tracker(self.uri, spec.tracking.experiment or spec.name)
        self.extra_callbacks = extra_callbacks or (lambda round_offset: [])
        self.rounds_trained = 0
        self.run_id: str | None = None  # the pipeline's MLflow run once run() created or resumed it
        self.rank = rank_zero_only.rank  # > 0: a DDP process Lightning started for `devices` > 1 (see follow)
        self._at: tuple[int, RoundGuard | None] = (0, None)  # the stage being built (None) or run: its errors

    # ---- the pipeline --------------------------------------------------------------------------------------
    def run(self, resume: str | None = None, parent: str | None = None, tags: dict[str, str] | None = None,
            started: Callable[[str], None] = lambda run_id: None, name: str | None = None) -> PipelineResult:
        """Run (or resume) the pipeline; `parent` nests its run under another (a search), with extra `tags`; `name`
        names its run (default: the pipeline's name; say what differs: overrides, a trial's parameters).
        `started(run_id)` is called as soon as the pipeline's run exists (a job's result file, a trial's record).
        SIGINT or SIGTERM stop it after the current round with a checkpoint: its runs are KILLED, `--resume` goes on.
        A run of its own (not nested) ends with its report (`report.html`) when the pipeline has `tracking.plots`."""
        spec = self.spec
        with_report = spec.tracking.plots and parent is None
        free_what_earlier_runs_left(self.device, besides=self)
        run_id, previous_runs = self.open_run(resume, parent, tags, name)
        parent = run_id
        started(run_id)
        open_runs = [parent]
        try:
            with self.tracker.system_metrics(parent, spec.tracking.system_metrics), stop_on_signals():
                outcomes = self._stages(parent, previous_runs, open_runs)
            return self.close_run(parent, outcomes, with_report)
        except BaseException as err:
            self.fail_run(open_runs, err)
            raise

    def open_run(self, resume: str | None, parent: str | None, tags: dict[str, str] | None,
                 name: str | None) -> tuple[str, dict[int, Any]]:
        """The pipeline's MLflow run, created (nested under `parent`, with `tags`, named `name`) or resumed, and the
        stage runs a resumed one holds."""
        if resume:
            run_id, previous_runs = resume, self.tracker.stage_runs(resume)
            self.tracker.resume(run_id)
            self.executions = {**self._recorded_executions(resume), **self.executions}
        else:
            extra = {**(tags or {}), **({MLFLOW_PARENT_RUN_ID: parent} if parent else {})}
            run_id, previous_runs = self.tracker.start_pipeline(
                self.spec.resolved(), describe(self.data), str((self.root / "runs").resolve()), extra, name,
                self.applies), {}
        self.run_id = run_id
        if not resume and self.data.folder is not None and (self.data.folder / "tokenizer.json").is_file():
            self.tracker.client.log_artifact(run_id, str(self.data.folder / "tokenizer.json"), "data")
        return run_id, previous_runs

    def _recorded_executions(self, parent: str) -> dict[int, dict[str, Any]]:
        """How each stage of the resumed run `parent` ran, as it recorded it, where the stage has no checkpoint (one
        restores its choice itself)."""
        return {i: pin for i, pin in recorded_executions(self.tracker.client, self.tracker.experiment_id,
                                                         parent).items()
                if not (self._checkpoints(parent, i) / "last.ckpt").is_file()}

    def close_run(self, parent: str, outcomes: list[StageOutcome], with_report: bool) -> PipelineResult:
        """The finished pipeline's records in its run `parent` (its stages' results, its note, its report), the run
        finished and its checkpoints gone."""
        spec = self.spec
        summary = [{"stage": o.name, "cache": o.cache, **{k: o.metrics[k] for k in sorted(o.metrics)}}
                   for o in outcomes]
        self.tracker.log_pipeline_results(parent, {o.name: o.primary["test"] for o in outcomes}, summary,
                                          spec.tracking.plots, self.task.primary)
        self.tracker.set_tags(parent, {NOTE_TAG: pipeline_note([(o.name, o.cache, o.metrics) for o in outcomes],
                                                               what_runs(spec, self.data.n_clients, hint=False))})
        if with_report:
            log_report(self.tracker.client, parent)
        self.tracker.finish(parent)
        shutil.rmtree(self.root / "runs" / parent, ignore_errors=True)
        return PipelineResult(parent, self.uri, self.tracker.experiment_id, outcomes)

    def fail_run(self, open_runs: list[str], err: BaseException) -> None:
        """`open_runs` (the pipeline's run first) failed with `err`: FAILED (KILLED for a stop); a crash keeps its
        whole traceback in the innermost run's error.txt; a failed stage is not resumable (it would fail the same way
        again) and leaves no checkpoints."""
        self.tracker.fail(open_runs, err)
        if isinstance(err, StageCrashed):
            err.traceback_at = self.tracker.artifact_location(open_runs[-1], ERROR_ARTIFACT)
        elif isinstance(err, StageFailed):
            self.tracker.set_tags(open_runs[0], {RESUMABLE_TAG: "false"})
            shutil.rmtree(self.root / "runs" / open_runs[0], ignore_errors=True)

    def cached(self) -> bool:
        """Whether the stage cache holds every stage of the pipeline (a run would train nothing)."""
        return all(self.cache.has(key) for key in self.keys)

    def follow(self, resume: str | None = None) -> None:
        """What a DDP process other than rank 0 runs (Lightning starts them at the first stage trained with
        `devices` > 1, re-running the same command): the same stages in the same order, training each with rank 0
        (every process takes a slice of each cohort). It records nothing: the MLflow runs, the stage cache and
        the checkpoints are rank 0's."""
        previous_runs = self.tracker.stage_runs(resume) if resume else {}
        with stop_on_signals():  # a stop asked of any process stops them all after the same round
            for i, stage, _, key, _ in self._each_stage():
                cached = self.cache.load(key)
                if cached is not None:
                    stage.load_state_dict(cached["state"])
                    continue
                last = self._checkpoints(resume, i) / "last.ckpt" if resume else None
                resuming = i in previous_runs and last is not None and last.is_file()
                saving = self.root / "runs"  # rank 0 writes the checkpoints to its own folder
                trainer = self._trainer(stage, saving, [CheckpointOnStop(saving / "last.ckpt")])
                trainer.fit(stage, ckpt_path=str(last) if resuming else None)

    def _checkpoints(self, parent: str, index: int) -> Path:
        """The checkpoint folder of stage `index` of the pipeline run `parent` while it trains (under root/runs)."""
        return safe_path(self.root / "runs", parent, f"{index}-{self.spec.stages[index].name}")

    def _stage(self, i: int, before: FederatedStage | None) -> FederatedStage:
        """Stage i on the model as the previous stages left it: the algorithm's additions, its split and its
        starting personal bank (from `before`); under `execution: auto`, the executor `executions` pins."""
        spec, stage_spec, algorithm = self.spec, self.spec.stages[i], self.algorithms[i]
        split_spec, dim = stage_split(spec, stage_spec, algorithm.personal_part)
        torch.manual_seed(spec.seed * 1000 + i)  # adapters or gates added for this stage start the same every run
        algorithm.prepare_model(self.model, self.data.feature_shape)
        split = apply_split(self.model, split_spec, dim)
        novel, select = self._novel_clients(i), spec.evaluation.select == "val" and i == len(spec.stages) - 1
        config = stage_spec.engine_config(spec.evaluation)
        own = [*split.personal_names, *sorted(algorithm.constants)]  # what each client holds of its own
        bank = None if before is None else carry_bank(before.bank, before.model, own, before.config.host_memory_budget)
        stage = FederatedStage(self.model, split, self.tensors, algorithm, config, spec.seed, i, bank, self.task,
                               stage_spec.name, novel, select)
        BUILT.add(stage)
        if i in self.executions:  # as a checkpoint restores it: a choice `execution: auto` need not time
            stage.executor_choice.load_state_dict(self.executions[i])
        return stage

    def _novel_clients(self, i: int) -> NovelClients | None:
        """Stage i's held-out clients and how they adapt: the pipeline's fine-tuning recipe (its first `finetune`
        stage's local work and cohort), else stage i's own."""
        if self.novel_tensors is None:
            return None
        recipe = novel_recipe(self.spec, i)
        return NovelClients(self.novel_tensors, recipe.local, recipe.clients_per_round)

    def _each_stage(self) -> Iterator[tuple[int, FederatedStage, ParamSplit, str, FederatedStage | None]]:
        """Each stage in order (index, stage, split, cache key, the stage before it), built once the one before it
        has run: every process runs the pipeline's stages through this one loop (`run` and `follow`)."""
        before = None
        for i in range(len(self.spec.stages)):
            self._at = (i, None)
            stage = self._stage(i, before)
            self._at = (i, stage.guard)  # its guard, not the stage: a closed loop (a stopped trial) holds no stage
            yield i, stage, stage.split, self.keys[i], before
            before = stage

    def _stages(self, parent: str, previous_runs: dict[int, Any], open_runs: list[str]) -> list[StageOutcome]:
        """Each stage's outcome, reused or trained; code that raises while a stage is built or trained (a plugin's,
        or fedpilot's own) is a StageCrashed naming the stage, its algorithm's origin and the round."""
        try:
            return self._outcomes(parent, previous_runs, open_runs)
        except (UserError, StageFailed, *STOPPED):
            raise
        except Exception as err:
            i, guard = self._at
            spec = self.spec.stages[i]
            last = guard.last_round if guard is not None else None
            raise StageCrashed(spec.name, ALGORITHMS.origin(spec.algorithm), None if last is None else last + 1, err,
                               raised_at(err)) from err
        finally:
            self._at = (0, None)  # the runner outlives its stages

    def _outcomes(self, parent: str, previous_runs: dict[int, Any], open_runs: list[str]) -> list[StageOutcome]:
        outcomes, offset = [], 0
        for i, stage, split, key, before in self._each_stage():
            stage_spec, earlier = self.spec.stages[i], previous_runs.get(i)
            if earlier is not None and earlier.info.status != "FINISHED":
                self.tracker.resume(earlier.info.run_id)
            cached = self.cache.load(key) if self.use_cache else None
            if cached is not None:
                outcome = self._reuse(parent, i, stage, split, cached, key, earlier, before)
            else:
                run_id = earlier.info.run_id if earlier is not None else self.tracker.start_stage(
                    parent, i, stage_spec.name, stage_spec.algorithm, {CACHE_TAG: "miss", CACHE_KEY_TAG: key})
                open_runs.append(run_id)
                outcome = self._train(parent, i, run_id, stage, split, key, earlier is not None, before, offset)
                open_runs.remove(run_id)
            outcomes.append(outcome)
            offset += stage.n_rounds
        return outcomes

    # ---- one stage -----------------------------------------------------------------------------------------
    def _train(self, parent: str, index: int, run_id: str, stage: FederatedStage, split: ParamSplit, key: str,
               resuming: bool, before: FederatedStage | None, offset: int) -> StageOutcome:
        name = self.spec.stages[index].name
        checkpoints = self._checkpoints(parent, index)
        last = checkpoints / "last.ckpt"
        if not resuming:
            self.tracker.log_params(run_id, set_params(self.applies["stages"][index]))
        callbacks = [RoundMetrics(self.tracker, run_id), *self.extra_callbacks(offset), CheckpointOnStop(last)]
        if self.progress:
            callbacks.append(RoundProgress(f"[{index + 1}/{len(self.spec.stages)}] {name}"))
        stage.save_changes_in(checkpoints / "banks")
        trainer = self._trainer(stage, checkpoints, callbacks)
        try:
            with PeakMemory(self.device) as memory:
                trainer.fit(stage, ckpt_path=str(last) if resuming and last.is_file() else None)
        finally:
            self.rounds_trained += stage.rounds_run
        release_freed_memory(self.device)  # the rounds' kept buffers: the report starts from the memory in use
        stage.save_changes_in(None)  # the cache keeps every written row: the checkpoints go
        peak = memory.bytes
        self.cache_stage(key, stage, run_id, peak)
        shutil.rmtree(checkpoints, ignore_errors=True)
        return self._record(index, run_id, "miss", stage, split, peak, before)

    def cache_stage(self, key: str, stage: FederatedStage, run_id: str, peak: int) -> None:
        """A trained stage into the stage cache under `key` (what `_reuse` loads): its state and records, its run."""
        self.cache.save(key, {"state": stage.state_dict(), "history": stage.history, "comm_bytes": stage.comm_bytes,
                              "client_metrics": stage.client_metrics, "run_id": run_id, "peak_memory_bytes": peak})

    def _reuse(self, parent: str, index: int, stage: FederatedStage, split: ParamSplit, cached: dict[str, Any],
               key: str, earlier: Any, before: FederatedStage | None) -> StageOutcome:
        """A stage from the cache: load its state; log it as a new stage run, or finish the resumed run's own."""
        stage.load_state_dict(cached["state"])
        stage.history, stage.comm_bytes = cached["history"], cached["comm_bytes"]
        stage.client_metrics = cached["client_metrics"]
        spec_stage = self.spec.stages[index]
        if earlier is not None and earlier.info.status == "FINISHED":
            return self._record(index, earlier.info.run_id, earlier.data.tags.get(CACHE_TAG, "hit"), stage, split,
                                cached["peak_memory_bytes"], before, log=False)
        if earlier is not None:  # the stage finished, its process died before recording it: record it in its run
            run_id, cache = earlier.info.run_id, earlier.data.tags.get(CACHE_TAG, "hit")
            self.tracker.log_history(run_id, stage.history)
            return self._record(index, run_id, cache, stage, split, cached["peak_memory_bytes"], before)
        run_id = self.tracker.start_stage(parent, index, spec_stage.name, spec_stage.algorithm, {
            CACHE_TAG: "hit", CACHE_KEY_TAG: key, CACHE_SOURCE_TAG: cached["run_id"]})
        self.tracker.log_params(run_id, set_params(self.applies["stages"][index]))
        self.tracker.log_history(run_id, stage.history)
        return self._record(index, run_id, "hit", stage, split, cached["peak_memory_bytes"], before)

    def _trainer(self, stage: FederatedStage, checkpoints: Path, callbacks: list[Callback]) -> L.Trainer:
        """The stage's Trainer: checkpoints every `eval_every` rounds; DDP over `devices` processes (on each of
        `nodes` nodes) when more than one. In a Slurm job, Lightning's SLURM environment gives the ranks (srun started
        the processes) but not its own requeue: fedpilot stops after a round with a checkpoint (pipeline.signals)."""
        every = stage.config.eval_every
        saving = ModelCheckpoint(dirpath=checkpoints, save_last=True, save_top_k=0, every_n_train_steps=every)
        devices, nodes = self.spec.devices, self.spec.nodes
        plugins = [SLURMEnvironment(auto_requeue=False)] if under_slurm() else None
        trainer = L.Trainer(max_steps=stage.n_rounds, accelerator=self.device.type, devices=devices, num_nodes=nodes,
                            strategy=DDPStrategy(forward_sync_buffers=False) if devices * nodes > 1 else "auto",
                            plugins=plugins, logger=False, callbacks=[*callbacks, saving],
                            enable_progress_bar=self.progress, enable_model_summary=False,
                            default_root_dir=checkpoints)
        BUILT.add(trainer)  # the cycle only a collection frees holds it and its stage (a batch stage too)
        return trainer

    def _record(self, index: int, run_id: str, cache: str, stage: FederatedStage, split: ParamSplit, peak: int,
                before: FederatedStage | None, log: bool = True) -> StageOutcome:
        """Log a finished stage's report (final metrics, footprints, per-client table, plots) to its run and finish
        it (unless `log` is off: a resumed run already holds it)."""
        name = self.spec.stages[index].name
        report = stage_record(stage, split, self.data.client_names, peak, before, self.participants, self.novel)
        if log:
            previous = (self.spec.stages[index - 1].name, {s: before.client_metrics[s][stage.task.primary].numpy()
                                                           for s in SPLITS}) if before is not None else None
            test = next(e for e in reversed(stage.history) if e["split"] == "test")  # the stage's end
            extra = {**{k: v for k, v in test.items() if k not in ("round", "split")}, **report.memory,
                     **{k: v for k, v in report.metrics.items() if "_frac_" in k or not k.startswith(SPLITS)},
                     **stage.execution_record()}
            self.tracker.set_tags(run_id, execution_tags(stage))  # chosen on the first round
            self.tracker.log_stage_results(run_id, name, report.clients, extra, previous, self.spec.tracking.plots,
                                           stage.task.primary)
            self.tracker.finish(run_id)
        return StageOutcome(index, name, cache, run_id, report.primary, {**report.metrics, **report.memory})


# Every runner, stage and trainer a run in this process built, held weakly: once each is gone (freed as its last
# reference went), nothing of an earlier run is left for the garbage collector, and the full collection, which scans
# everything the process holds (every module imported, every test run before it), can be skipped.
BUILT: weakref.WeakSet = weakref.WeakSet()

# What a process has loaded once it can run a pipeline (torch, Lightning, MLflow, fedpilot's modules) lives as long as
# the process: frozen out of the garbage collector's sight, the full collections (the one above, Python's own) scan
# what runs made, not them (tests/conftest.py freezes the test modules alike). No collection first: it would cost
# every short command a full scan for the little garbage the imports left.
gc.freeze()


def free_what_earlier_runs_left(device: torch.device, besides: PipelineRunner) -> None:
    """Free what earlier runs in this process left for the garbage collector before a run (`besides`) allocates: a
    finished stage and its trainer hold each other, and a trial pruned or stopped left them to its exception, so only
    a full collection frees them (Python runs one rarely): in a study's or a comparison's process, each run's peak
    stood on what the runs before it left (docs/benchmarks.md). The allocator's freed memory goes back to the system
    too."""
    if any(built is not besides for built in BUILT):
        gc.collect()
    release_freed_memory(device)
