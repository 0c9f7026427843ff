"""Run a pipeline: build the data and the model once, then train (or reuse from the stage cache) each stage.

Each stage starts from the previous stage's shared model and personal bank. A finished stage is saved in
the stage cache under a hash of everything that determines its result (dataset fingerprint, model, seed,
its own resolved spec and split, the previous stage's key, the device type); a rerun that changes only a
later stage reuses the earlier ones and records where they came from (tag `fedpilot.cache_source`).
`max_parallel_clients`, `execution` and stage names are left out of the hash: they change how a stage
runs, not what it computes (equal within float tolerance, tests/test_engine_equivalence.py).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import psutil
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.strategies import DDPStrategy
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from fedpilot.algorithms import build_algorithm
from fedpilot.data import FederatedData, build_federated_data
from fedpilot.data.federated import cache_root
from fedpilot.data.summary import describe
from fedpilot.engine.memory import release_freed_memory
from fedpilot.engine.metrics import distribution
from fedpilot.engine.stage import FederatedStage, carry_bank, splits_across_processes
from fedpilot.errors import SpecError
from fedpilot.models import ParamSplit, apply_split, build_model
from fedpilot.names import safe_path
from fedpilot.spec import PipelineSpec, StageSpec
from fedpilot.tracking import CACHE_TAG, SPEC_ARTIFACT, RoundMetrics, Tracker, flatten, tracking_uri

CACHE_FORMAT = 1
NOT_IN_KEY = {"name", "max_parallel_clients", "execution"}
SPLITS = ("val", "test")


@dataclass
class StageOutcome:
    """What one stage produced: its run, whether it came from the cache, per-client accuracy, final metrics."""

    index: int
    name: str
    cache: str
    run_id: str
    accuracy: dict[str, np.ndarray]
    metrics: dict[str, float]


@dataclass
class PipelineResult:
    run_id: str
    tracking_uri: str
    experiment_id: str
    stages: list[StageOutcome]


class StageCache:
    """Finished stages on disk: <cache root>/stages/<key>.pt, written atomically."""

    def __init__(self, root: Path):
        self.dir = root / "stages"

    def load(self, key: str) -> dict[str, Any] | None:
        path = self.dir / f"{key}.pt"
        return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None

    def save(self, key: str, payload: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        os.close(fd)
        os.chmod(tmp, 0o644)
        torch.save(payload, tmp)
        os.replace(tmp, self.dir / f"{key}.pt")


class RoundProgress(TQDMProgressBar):
    """Lightning's progress bar counting the stage's rounds, with the latest loss and val accuracy."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label

    @property
    def train_description(self) -> str:
        return self.label

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.train_progress_bar.reset(total=trainer.max_steps)
        self.train_progress_bar.n = trainer.global_step  # a resumed stage starts part-way
        self.train_progress_bar.set_description(self.label)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=True)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise SpecError("device", requested, "no CUDA device is available here", allowed=["auto", "cpu"])
    return torch.device("cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
                        else "cpu")


def check_devices(spec: PipelineSpec, device: torch.device, algorithms: list[Any]) -> None:
    """`devices` > 1 (DDP) needs that many GPUs on a GPU, and stages whose server aggregate is made of sums."""
    if spec.devices == 1:
        return
    if device.type == "cuda" and spec.devices > torch.cuda.device_count():
        raise SpecError("devices", spec.devices, f"only {torch.cuda.device_count()} CUDA devices are visible here")
    for i, algorithm in enumerate(algorithms):
        if not splits_across_processes(algorithm):
            raise SpecError(f"stages.{i}.algorithm", spec.stages[i].algorithm, "its server keeps every client's "
                            "upload, so its rounds cannot be split across devices; run this pipeline with devices: 1")


def stage_split(spec: PipelineSpec, stage: StageSpec, algorithm_part: str | None) -> tuple[str | list[str], int]:
    """(split, adapter_dim) of a stage: the algorithm's own part, else the stage's, else the pipeline's."""
    chosen = stage.personalization or spec.personalization
    return (algorithm_part or chosen.split), chosen.adapter_dim


def stage_key(previous: str, data: FederatedData, spec: PipelineSpec, index: int, split: Any, device: str,
              code: str) -> str:
    """The cache key of stage `index`: everything its result depends on (`code`: the code_fingerprint of what runs
    it), chained to the previous stage's key."""
    stage = spec.stages[index]
    payload = {"format": CACHE_FORMAT, "code": code, "fedpilot": version("fedpilot"), "previous": previous,
               "data": data.fingerprint, "model": spec.model.model_dump(mode="json"), "seed": spec.seed,
               "index": index, "stage": stage.model_dump(mode="json", exclude=NOT_IN_KEY), "split": split,
               "eval_every": stage.eval_every or spec.evaluation.every, "device": device}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


# Packages whose code never enters a stage key: the Python runtime and pinned libraries (their versions do).
NOT_OUR_CODE = {"builtins", "abc", "typing", "torch", "pydantic", "functools", "collections"}


def code_fingerprint(*components: object) -> str:
    """sha256 of the source of the code a stage computes with: fedpilot's engine, models and data packages, and
    the modules defining each component's class and bases (the algorithm; the model and its submodules, which is
    where a plugin's own code lives). An edited model or algorithm gives the stage a new cache key."""
    from fedpilot import data, engine, models

    files = {f for package in (engine, models, data) for f in Path(package.__file__).parent.glob("*.py")}
    classes = {cls for c in components for obj in ([*c.modules()] if isinstance(c, torch.nn.Module) else [c])
               for cls in type(obj).__mro__}
    for cls in classes:
        module = sys.modules.get(cls.__module__)
        if cls.__module__.split(".")[0] not in NOT_OUR_CODE and getattr(module, "__file__", None):
            files.add(Path(module.__file__))
    digest = hashlib.sha256(torch.__version__.encode())
    for file in sorted(files):
        digest.update(str(file.name).encode() + file.read_bytes())
    return digest.hexdigest()[:32]


class Stopped(SystemExit):
    """A pipeline stopped on SIGINT/SIGTERM after a round, with a checkpoint (exit code 128 + the signal)."""


_STOP: dict[str, int] = {}  # the signal that asked the running pipeline to stop, if any


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """While the block runs, SIGINT and SIGTERM ask the training stage to stop after its current round
    (CheckpointOnStop); a second Ctrl+C stops at once. Outside the main thread nothing is installed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()

    def ask(signum: int, frame: Any) -> None:
        if _STOP and signum == signal.SIGINT:
            raise KeyboardInterrupt
        _STOP["signal"] = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this round with a checkpoint (Ctrl+C again: at "
              "once)", file=sys.stderr, flush=True)

    previous = {s: signal.signal(s, ask) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class CheckpointOnStop(Callback):
    """After a round, if a stop was asked (stop_on_signals): save the checkpoint `path` and stop (runs KILLED)."""

    def __init__(self, path: Path):
        self.path = path

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if _STOP:
            trainer.save_checkpoint(self.path)
            signum = _STOP["signal"]
            raise Stopped(128 + signum)


class PeakMemory:
    """Peak memory while a block runs: torch's peak CUDA allocation on a GPU, else the process's resident set
    size sampled every 20 ms, from a start where the allocator has given back what is free (so each stage gets
    its own peak, not the process's lifetime maximum, also when the engine keeps freed memory between rounds)."""

    def __init__(self, device: torch.device, interval: float = 0.02):
        self.device, self.interval = device, interval
        self.bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        process = psutil.Process()
        while True:
            self.bytes = max(self.bytes, process.memory_info().rss)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            release_freed_memory()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))


@dataclass
class Prepared:
    """What every check of a pipeline builds: the federated data, the model, the stages' algorithms, the device."""

    data: FederatedData
    model: torch.nn.Module
    algorithms: list[Any]
    device: torch.device


def prepare(spec: PipelineSpec, root: Path) -> Prepared:
    """Build what a pipeline needs and run every check that can fail on the user's input (data, model options,
    cohort sizes, algorithms, devices, personalization), before any run is created. `fedpilot validate` and
    `fedpilot run` both call it; `root` is the cache root (the dataset is cached under root/data)."""
    device = resolve_device(spec.device)
    data = build_federated_data(spec.dataset, spec.seed, root / "data")
    for i, stage in enumerate(spec.stages):
        if stage.clients_per_round is not None and stage.clients_per_round > data.n_clients:
            raise SpecError(f"stages.{i}.clients_per_round", stage.clients_per_round,
                            f"the federation has only {data.n_clients} clients")
    torch.manual_seed(spec.seed)
    model = build_model(spec.model.name, data.feature_shape, data.num_classes, **spec.model.options)
    algorithms = [build_algorithm(s.algorithm, s.params, f"stages.{i}.algorithm") for i, s in enumerate(spec.stages)]
    check_devices(spec, device, algorithms)
    probe = copy.deepcopy(model)
    for i, stage in enumerate(spec.stages):
        split, dim = stage_split(spec, stage, algorithms[i].personal_part)
        try:
            algorithms[i].prepare_model(probe, data.feature_shape)
            apply_split(probe, split, dim)
        except SpecError as err:
            raise SpecError(f"stages.{i}.personalization" if stage.personalization else err.key,
                            err.value, err.problem, err.allowed) from None
    return Prepared(data, model, algorithms, device)


class PipelineRunner:
    """Runs one PipelineSpec end to end; `run()` returns the MLflow parent run and every stage's outcome."""

    def __init__(self, spec: PipelineSpec, cache_dir: Path | None = None, progress: bool = True,
                 use_cache: bool = True):
        self.spec, self.progress, self.use_cache = spec, progress, use_cache
        self.root = Path(cache_dir) if cache_dir else cache_root()
        self.cache = StageCache(self.root)
        prepared = prepare(spec, self.root)  # every input check, before any run is created
        self.data, self.model, self.algorithms, self.device = (prepared.data, prepared.model, prepared.algorithms,
                                                               prepared.device)
        self.uri = tracking_uri(spec.tracking.uri)
        self.tracker = Tracker(self.uri, spec.tracking.experiment or spec.name)
        self.extra_callbacks: Callable[[int], list[Callback]] = lambda round_offset: []
        self.rounds_trained = 0
        self.run_id: str | None = None  # the pipeline's MLflow run once run() created or resumed it
        self.rank = rank_zero_only.rank  # > 0: a DDP process Lightning started for `devices` > 1 (see follow)

    # ---- the pipeline --------------------------------------------------------------------------------------
    def run(self, resume: str | None = None, parent: str | None = None, tags: dict[str, str] | None = None,
            started: Callable[[str], None] = lambda run_id: None) -> PipelineResult:
        """Run (or resume) the pipeline; `parent` nests its run under another (a search), with extra `tags`;
        `started(run_id)` is called as soon as the pipeline's run exists (a job's result file, a trial's record).
        SIGINT or SIGTERM stop it after the current round with a checkpoint: its runs are KILLED, `--resume` goes on."""
        spec = self.spec
        if resume:
            run_id, previous_runs = resume, self.tracker.stage_runs(resume)
            self.tracker.resume(run_id)
        else:
            extra = {**(tags or {}), **({MLFLOW_PARENT_RUN_ID: parent} if parent else {})}
            run_id, previous_runs = self.tracker.start_pipeline(
                spec.resolved(), describe(self.data), str((self.root / "runs").resolve()), extra), {}
        self.run_id = parent = run_id
        started(run_id)
        open_runs = [parent]
        try:
            with self.tracker.system_metrics(parent, spec.tracking.system_metrics), stop_on_signals():
                outcomes = self._stages(parent, previous_runs, open_runs)
            summary = [{"stage": o.name, "cache": o.cache, **{k: o.metrics[k] for k in sorted(o.metrics)}}
                       for o in outcomes]
            self.tracker.log_pipeline_results(parent, {o.name: o.accuracy["test"] for o in outcomes}, summary,
                                              spec.tracking.plots)
            self.tracker.finish(parent)
            shutil.rmtree(self.root / "runs" / parent, ignore_errors=True)
        except BaseException as err:
            self.tracker.fail(open_runs, err)
            raise
        return PipelineResult(parent, self.uri, self.tracker.experiment_id, outcomes)

    def follow(self, resume: str | None = None) -> None:
        """What a DDP process other than rank 0 runs (Lightning starts them at the first stage trained with
        `devices` > 1, re-running the same command): the same stages in the same order, training each with rank 0
        (every process takes a slice of each cohort). It records nothing: the MLflow runs, the stage cache and
        the checkpoints are rank 0's."""
        previous_runs = self.tracker.stage_runs(resume) if resume else {}
        key, before = "", None
        for i in range(len(self.spec.stages)):
            stage, _, key = self._stage(i, key, before)
            cached = self.cache.load(key)
            if cached is not None:
                stage.load_state_dict(cached["state"])
            else:
                last = self._checkpoints(resume, i) / "last.ckpt" if resume else None
                resuming = i in previous_runs and last is not None and last.is_file()
                trainer = self._trainer(stage, self.root / "runs", [])  # saving goes to rank 0's folder
                trainer.fit(stage, ckpt_path=str(last) if resuming else None)
            before = stage

    def _checkpoints(self, parent: str, index: int) -> Path:
        """The checkpoint folder of stage `index` of the pipeline run `parent` while it trains (under root/runs)."""
        return safe_path(self.root / "runs", parent, f"{index}-{self.spec.stages[index].name}")

    def _stage(self, i: int, key: str, before: FederatedStage | None) -> tuple[FederatedStage, ParamSplit, str]:
        """Stage i on the model as the previous stages left it: the algorithm's additions, its split, its cache key
        (chained to the previous stage's `key`) and its starting personal bank (from `before`)."""
        spec, stage_spec, algorithm = self.spec, self.spec.stages[i], self.algorithms[i]
        split_spec, dim = stage_split(spec, stage_spec, algorithm.personal_part)
        torch.manual_seed(spec.seed * 1000 + i)  # adapters or gates added for this stage start the same every run
        algorithm.prepare_model(self.model, self.data.feature_shape)
        split = apply_split(self.model, split_spec, dim)
        key = stage_key(key, self.data, spec, i, split_spec, self.device.type, code_fingerprint(algorithm, self.model))
        config = stage_spec.engine_config(spec.evaluation.every)
        bank = carry_bank(before, split.personal_names) if before is not None else None
        stage = FederatedStage(self.model, split, self.data, algorithm, config, spec.seed, i, bank)
        return stage, split, key

    def _stages(self, parent: str, previous_runs: dict[int, Any], open_runs: list[str]) -> list[StageOutcome]:
        spec, key, before, outcomes, offset = self.spec, "", None, [], 0
        for i, stage_spec in enumerate(spec.stages):
            stage, split, key = self._stage(i, key, before)
            earlier = previous_runs.get(i)
            if earlier is not None and earlier.info.status != "FINISHED":
                self.tracker.resume(earlier.info.run_id)
            cached = self.cache.load(key) if self.use_cache else None
            if cached is not None:
                outcome = self._reuse(parent, i, stage, split, cached, key, earlier, before)
            else:
                run_id = earlier.info.run_id if earlier is not None else self.tracker.start_stage(
                    parent, i, stage_spec.name, stage_spec.algorithm, {CACHE_TAG: "miss", "fedpilot.cache_key": key})
                open_runs.append(run_id)
                outcome = self._train(parent, i, run_id, stage, split, key, earlier is not None, before, offset)
                open_runs.remove(run_id)
            outcomes.append(outcome)
            before = stage
            offset += stage.n_rounds
        return outcomes

    # ---- one stage -----------------------------------------------------------------------------------------
    def _train(self, parent: str, index: int, run_id: str, stage: FederatedStage, split: ParamSplit, key: str,
               resuming: bool, before: FederatedStage | None, offset: int) -> StageOutcome:
        name = self.spec.stages[index].name
        checkpoints = self._checkpoints(parent, index)
        last = checkpoints / "last.ckpt"
        if not resuming:
            self.tracker.log_params(run_id, flatten(self.spec.resolved()["stages"][index]))
        callbacks = [RoundMetrics(self.tracker, run_id), *self.extra_callbacks(offset), CheckpointOnStop(last)]
        if self.progress:
            callbacks.append(RoundProgress(f"[{index + 1}/{len(self.spec.stages)}] {name}"))
        trainer = self._trainer(stage, checkpoints, callbacks)
        try:
            with PeakMemory(self.device) as memory:
                trainer.fit(stage, ckpt_path=str(last) if resuming and last.is_file() else None)
        finally:
            self.rounds_trained += stage.rounds_run
        peak = memory.bytes
        self.cache.save(key, {"state": stage.state_dict(), "history": stage.history, "comm_bytes": stage.comm_bytes,
                              "client_metrics": stage.client_metrics, "run_id": run_id, "peak_memory_bytes": peak})
        shutil.rmtree(checkpoints, ignore_errors=True)
        return self._record(index, run_id, "miss", stage, split, peak, before)

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
            CACHE_TAG: "hit", "fedpilot.cache_key": key, "fedpilot.cache_source": cached["run_id"]})
        self.tracker.log_params(run_id, flatten(self.spec.resolved()["stages"][index]))
        self.tracker.log_history(run_id, stage.history)
        return self._record(index, run_id, "hit", stage, split, cached["peak_memory_bytes"], before)

    def _trainer(self, stage: FederatedStage, checkpoints: Path, callbacks: list[Callback]) -> L.Trainer:
        """The stage's Trainer: checkpoints every `eval_every` rounds; DDP over `devices` processes when > 1."""
        every = stage.config.eval_every
        saving = ModelCheckpoint(dirpath=checkpoints, save_last=True, save_top_k=0, every_n_train_steps=every)
        devices = self.spec.devices
        return L.Trainer(max_steps=stage.n_rounds, accelerator=self.device.type, devices=devices,
                         strategy=DDPStrategy(forward_sync_buffers=False) if devices > 1 else "auto",
                         logger=False, callbacks=[*callbacks, saving], enable_progress_bar=self.progress,
                         enable_model_summary=False, default_root_dir=checkpoints)

    def _record(self, index: int, run_id: str, cache: str, stage: FederatedStage, split: ParamSplit, peak: int,
                before: FederatedStage | None, log: bool = True) -> StageOutcome:
        """Final metrics, memory footprints, the per-client table and plots of a finished stage."""
        name = self.spec.stages[index].name
        data = self.data
        accuracy = {s: stage.client_metrics[s]["acc"].numpy() for s in SPLITS}
        metrics: dict[str, float] = {}
        for s in SPLITS:
            weights = data.sizes[s].cpu().double()
            metrics.update({f"{s}_acc_{k}": v for k, v in distribution(stage.client_metrics[s]["acc"], weights).items()})
        report = split.report()
        shared = [p for n, p in stage.model.named_parameters() if n in set(stage.shared_names)]
        memory = {"shared_bytes": sum(p.numel() * p.element_size() for p in shared),
                  "shared_params": sum(p.numel() for p in shared),
                  "personal_bytes_per_client": report["personal_bytes_per_client"],
                  "personal_params_per_client": report["personal_params_per_client"],
                  "personal_bank_bytes": stage.bank.nbytes(),
                  "comm_bytes_per_round": float(np.mean(stage.comm_bytes)) if stage.comm_bytes else 0.0,
                  "peak_memory_bytes": peak, "rounds": stage.n_rounds}
        clients: dict[str, Any] = {"client": list(range(data.n_clients)), "name": list(data.client_names)}
        clients.update({f"{s}_samples": data.sizes[s].tolist() for s in ("train", *SPLITS)})
        clients.update({f"{s}_{m}": stage.client_metrics[s][m].tolist() for s in SPLITS for m in ("acc", "loss")})
        for state in stage.state_bank.names:
            values = stage.state_bank.tensor(state)
            if values.dim() == 1:  # per-client scalars of the algorithm (pFedGate densities, Self-FL steps)
                clients[state] = values.tolist()
                memory[f"{state}_mean"], memory[f"{state}_max"] = float(values.mean()), float(values.max())
        previous = None
        if before is not None:
            previous_acc = {s: before.client_metrics[s]["acc"].numpy() for s in SPLITS}
            previous = (self.spec.stages[index - 1].name, previous_acc)
            clients["previous_test_acc"] = previous_acc["test"].tolist()
            for s in SPLITS:
                change = accuracy[s] - previous_acc[s]
                metrics[f"{s}_acc_frac_better"] = float(np.nanmean(change > 0))
                metrics[f"{s}_acc_frac_worse"] = float(np.nanmean(change < 0))
        extra = {**memory, **{k: v for k, v in metrics.items() if "_frac_" in k}}
        if log:
            self.tracker.log_stage_results(run_id, name, clients, extra, previous, self.spec.tracking.plots)
            self.tracker.finish(run_id)
        return StageOutcome(index, name, cache, run_id, accuracy, {**metrics, **memory})


def load_resumed_spec(run_id: str, uri: str) -> dict[str, Any]:
    """The resolved spec a pipeline run recorded (for `fedpilot run --resume RUN_ID`)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    try:
        run = client.get_run(run_id)
    except Exception as err:  # mlflow raises MlflowException for an unknown id
        raise SpecError("--resume", run_id, f"no such run in {uri} ({type(err).__name__})") from None
    if "fedpilot.pipeline" not in run.data.tags:
        raise SpecError("--resume", run_id, "not a fedpilot pipeline run (its parent run has tag fedpilot.pipeline)")
    with tempfile.TemporaryDirectory() as tmp:
        return json.loads(Path(client.download_artifacts(run_id, SPEC_ARTIFACT, tmp)).read_text())


def quiet_lightning() -> None:
    """Lightning's per-fit banners and warnings that do not apply to federated stages are noise in a pipeline."""
    for name in ("lightning.pytorch", "lightning.fabric", "mlflow.system_metrics"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Our round is the manual-optimization step; its checkpoint is meant to hold the state after it.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
