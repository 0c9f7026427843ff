"""FederatedStage: a LightningModule whose training_step is one federated round over a sampled cohort."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import lightning as L
import torch
from torch import nn

from fedpilot.engine.accel import Evaluator, ExecutorChoice
from fedpilot.engine.aggregate import server_optimizer
from fedpilot.engine.bank import ClientBank, save_changes, starting_values
from fedpilot.engine.batches import Sampling
from fedpilot.engine.cohort import Cohort, RoundWork, Trial
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.ddp import check_splits_across_processes, distributed, process_rows, share_round
from fedpilot.engine.executor import Tensors
from fedpilot.engine.hooks import RoundGuard, RoundResult, Rounds
from fedpilot.engine.memory import data_fits
from fedpilot.engine.metrics import cohort_spread
from fedpilot.engine.novel import NovelClients, beyond_participants
from fedpilot.engine.protocol import Aggregator, Algorithm, RoundInfo
from fedpilot.engine.task import CLASSIFICATION, Task
from fedpilot.models.split import ParamSplit


class FederatedStage(L.LightningModule):
    """One stage of a pipeline: `rounds` federated rounds of one algorithm on a federated dataset (`data`).

    The parameters the `split` names personal live per client in a personal bank; the others are shared and stepped
    by a torch optimizer with the aggregated client update as pseudo-gradient. The `executor_choice` (engine.accel)
    runs the clients' work; held-out clients (`novel`) and with `select` every client are evaluated beyond their
    personalized models at the end (engine.novel)."""

    def __init__(self, model: nn.Module, split: ParamSplit, data: ClientData, algorithm: Algorithm,
                 config: StageConfig, seed: int = 0, stage_index: int = 0, bank: ClientBank | None = None,
                 task: Task = CLASSIFICATION, name: str | None = None, novel: NovelClients | None = None,
                 select: bool = False):
        super().__init__()
        self.save_hyperparameters({"config": config.model_dump(), "seed": seed, "stage_index": stage_index,
                                   "algorithm": algorithm.name, "task": task.name})
        self.automatic_optimization = False
        self.model, self.split, self.data, self.algorithm, self.config = model, split, data, algorithm, config
        self.task, self.seed, self.stage_index = task, seed, stage_index
        self.novel, self.select = novel, select  # evaluated at the stage's end (engine.novel)
        self.stage_name = name or f"{algorithm.name} (stage {stage_index})"
        self.sampling = Sampling(data.n_clients, config.clients_per_round, (seed, stage_index),
                                 algorithm.visits_each_client_once, config.eval_clients)
        self.personal_names = list(split.personal_names)
        self.shared_names = list(split.numel) if algorithm.personal_copy else list(split.shared_names)  # Ditto: all
        self.register_buffer("_no_shared", torch.zeros(0))
        # the stage's start: each client's personal parameters and constants (bank.starting_values)
        self.personal_init = starting_values(model, self.personal_names, algorithm.constants)
        self.bank = bank if bank is not None else ClientBank(self.personal_init, data.n_clients,
                                                             config.host_memory_budget)
        self.state_bank = ClientBank(algorithm.client_state(), data.n_clients, config.host_memory_budget)
        self.changes_folder: Path | None = None  # set by save_changes_in()
        self.data_on_device = True  # setup() keeps a federation larger than the device's budget on the host
        self.server_state = algorithm.server_state(data.n_clients)
        self.executor_choice = ExecutorChoice(config.execution, model, algorithm, task)
        self.history: list[dict[str, Any]] = []
        self.comm_bytes: list[float] = []
        self.round_log: dict[str, float] = {}  # this round's metrics (step = rounds done); callbacks get round_result
        self.shown: dict[str, float] = {}  # the latest loss and val accuracy
        self.round_result: RoundResult | None = None  # what the latest round ended with (RoundCallback.on_round_end)
        self.rounds_run = 0  # rounds trained by this object (a resumed stage does not count the restored ones)
        self.guard = RoundGuard(self.stage_name, algorithm.name)
        self.client_metrics: dict[str, dict[str, torch.Tensor]] = {}

    @property
    def n_rounds(self) -> int:
        """Rounds this stage runs: its `rounds`, or one pass over all clients for one-visit algorithms."""
        return self.sampling.rounds(self.config.rounds)

    @property
    def execution(self) -> str:
        """The executor the stage runs (`auto` until its first round has chosen one)."""
        return self.executor_choice.name

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Rounds(), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for n, p in self.model.named_parameters() if n in set(self.shared_names)]
        return server_optimizer(self.config.server, params or [nn.Parameter(self._no_shared)])

    def setup(self, stage: str) -> None:
        check_splits_across_processes(self.algorithm)
        self.data_on_device = data_fits(lambda: self.data.nbytes(), self.device, self.config.device_data_budget)
        if self.data_on_device:
            self.data = self.data.to(self.device)

    def training_step(self, batch: int, batch_idx: int) -> None:
        round_idx = self.global_step
        self.guard.check_progress(round_idx, self.n_rounds)
        with self.guard.round(round_idx):
            if self.executor_choice.pending:
                self.executor_choice.time(partial(self.trial, round_idx), self.device)
            start = time.perf_counter()
            stats = self.run_round(round_idx)
        self.rounds_run += 1
        self.comm_bytes.append(stats["bytes_up"] + stats["bytes_down"])
        # per round what changes: the cohort and the bytes sent are reported once, with the footprints
        self.round_log = {"round_time_s": time.perf_counter() - start,
                          **{k: v for k, v in stats.items() if k not in ("clients", "bytes_up", "bytes_down")}}
        self.shown["train_loss"] = stats["train_loss"]  # not self.log: its bookkeeping is a cost on every round
        if round_idx + 1 == self.n_rounds:
            self.evaluate(["val", "test"], round_idx + 1)
            self.client_metrics.update(beyond_participants(self, ("val", "test"), self.novel, self.select))
        elif (round_idx + 1) % self.config.eval_every == 0:
            self.evaluate(["val"], round_idx + 1, self.sampling.evaluated())
        self.round_result = RoundResult(round_idx + 1, MappingProxyType(dict(self.round_log)),
                                        MappingProxyType(dict(self.shown)), self.execution)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The stage's records (the clients' metrics once evaluated), server state and executor choice, and the banks'
        chains of changes (save_changes_in)."""
        records = {"history": self.history, "comm_bytes": self.comm_bytes, "server_state": self.server_state}
        checkpoint["fedpilot"] = {**records, "client_metrics": self.client_metrics, **self.executor_choice.state_dict()}
        if self.changes_folder is not None:
            save_changes({"bank": self.bank, "state_bank": self.state_bank}, self.changes_folder, self.global_step,
                         self.trainer.is_global_zero, checkpoint["state_dict"])

    def save_changes_in(self, folder: Path | None) -> None:
        """Checkpoints save the banks as chains of their changes in `folder` (each save writes only the rows written
        since the last one) instead of every written row; None: the state holds every written row again."""
        self.changes_folder = None if folder is None else Path(folder)
        for bank in (self.bank, self.state_bank):
            bank.keep_changes(folder is not None)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("fedpilot", {})
        self.history, self.comm_bytes = list(saved.get("history", [])), list(saved.get("comm_bytes", []))
        self.server_state = dict(saved.get("server_state", self.server_state))
        self.client_metrics = dict(saved.get("client_metrics", {}))  # a stop after the last round runs none again
        self.executor_choice.load_state_dict(saved)  # a resumed stage goes on with the executor it chose

    def sample_cohort(self, round_idx: int) -> torch.Tensor:
        return self.sampling.cohort(round_idx)

    def shared_params(self) -> Tensors:
        params = dict(self.model.named_parameters())
        return {n: params[n].detach() for n in self.shared_names}

    def round_work(self, round_idx: int, clients: torch.Tensor, data: ClientData | None = None,
                   local: LocalConfig | None = None, rounds: int | None = None) -> RoundWork:
        """Round `round_idx`'s fixed parts for `clients`: the stage's model, executors and seed; by default its data
        (on the host: `clients`' samples gathered to the device), its local work and its rounds' lr schedule."""
        local, rounds = local or self.config.local, rounds or self.n_rounds
        if data is None:
            data = self.data if self.data_on_device else self.data.gather(clients, self.device)
        executor, head_executor = self.executor_choice.executors(self.device)
        return RoundWork(self.model, self.algorithm.forward, self.task, data, local,
                         local.schedule.factor(round_idx, rounds), (self.seed, self.stage_index, round_idx), executor,
                         self.split, head_executor, self.server_state, self.config.precision,
                         constants=self.algorithm.constants)

    def cohorts(self, work: RoundWork, clients: torch.Tensor, start: Tensors, rows: slice | None = None,
                chunk: int | None = None, fresh: bool = False) -> Iterator[Cohort]:
        """The `rows` (default: all) of the round's cohort `clients` as cohorts of at most `chunk` clients (default
        max_parallel_clients), with their bank rows (a stateless algorithm's personal values: `start`); `fresh`:
        every client from `start` and the algorithm's initial state (clients that never took part)."""
        shared, rows = self.shared_params(), rows or slice(0, len(clients))
        chunk, from_bank = chunk or self.config.max_parallel_clients, self.algorithm.stateful and not fresh
        for lo in range(rows.start, rows.stop, chunk):
            part = slice(lo, min(lo + chunk, rows.stop))
            ids = clients[part]
            personal = self.bank.get(ids) if from_bank else {n: v.expand(len(ids), *v.shape) for n, v in start.items()}
            state = {n: v.to(self.device).expand(len(ids), *v.shape) for n, v in self.state_bank.init.items()} \
                if fresh else self.state_bank.get(ids)
            yield Cohort(work, ids, part, clients, shared, personal, start, state)

    def trial(self, round_idx: int) -> Trial:
        """The executor candidates' trial: the round's local work of its first chunk of clients."""
        chunk = self.sample_cohort(round_idx)[: self.config.max_parallel_clients].to(self.device)
        return Trial(self.algorithm, self.round_work(round_idx, chunk), chunk, self.shared_params(),
                      {n: v.to(self.device) for n, v in self.personal_init.items()}, self.bank.get(chunk),
                      self.state_bank.get(chunk))

    def run_round(self, round_idx: int, chunk: int | None = None) -> dict[str, float]:
        """Local work of the whole cohort in chunks (of `chunk` clients; by default as the executor choice says),
        each chunk's upload added to the aggregate and dropped before the next chunk trains; then one server
        optimizer step. Under DDP every process trains its slice of the cohort (`process_rows`), then all-reduces
        the aggregate, its bank rows and the training stats (engine.ddp): every process takes the same server step."""
        clients = self.sample_cohort(round_idx).to(self.device)
        work, shared = self.round_work(round_idx, clients), self.shared_params()
        info = RoundInfo(work.seed_key, clients, shared, self.data.n_clients)
        start = {n: v.to(self.device) for n, v in self.personal_init.items()}
        aggregate, mine = self.algorithm.aggregator(), process_rows(len(clients))
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)  # read once a round: no wait on a chunk's work
        for cohort in self.cohorts(work, clients, start, mine, chunk or self.executor_choice.clients_per_chunk):
            self.train_chunk(cohort, aggregate, info)
            stats = cohort.stats
            sums += torch.stack([stats.loss.sum(), stats.metric.sum(), stats.steps.sum()]).double()
        loss, metric, steps = sums.tolist()
        if distributed():
            banks = [self.bank, self.state_bank] if self.algorithm.stateful else [self.state_bank]
            loss, metric, steps = share_round(clients, mine, aggregate, info, banks, [loss, metric, steps], self.device)
        pseudo_grad, self.server_state = aggregate.result(info, self.server_state)
        train_loss = loss / max(steps, 1.0)
        self.guard.check_finite(round_idx, train_loss, pseudo_grad)
        self.server_step(pseudo_grad)
        return {"train_loss": train_loss, f"train_{self.task.train_metric}": metric / max(steps, 1.0),
                "clients": float(len(clients)), "bytes_up": float(aggregate.upload_bytes),
                "bytes_down": float(len(clients) * sum(v.numel() * v.element_size() for v in shared.values())),
                **cohort_spread(self.state_bank, clients)}

    def train_chunk(self, cohort: Cohort, aggregate: Aggregator, info: RoundInfo) -> None:
        """One chunk's local work: its bank rows written back, its upload added to the aggregate (and, returning,
        let go of: a reducible aggregate holds sums, not the chunk's [K, ...] values)."""
        upload = self.algorithm.local_update(cohort)
        if self.algorithm.stateful:
            self.bank.put(cohort.clients, cohort.own)
        self.state_bank.put(cohort.clients, cohort.state)
        if upload.shared is not None or upload.grad is not None:
            aggregate.add(replace(upload, weight=cohort.weights if upload.weight is None else upload.weight), info)

    def server_step(self, pseudo_grad: Tensors) -> None:
        """The aggregate becomes the gradient of the shared parameters; the server optimizer steps."""
        params = dict(self.model.named_parameters())
        for name, g in pseudo_grad.items():
            params[name].grad = g.to(params[name].dtype)
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def personal_of(self, clients: torch.Tensor) -> Tensors:
        return self.bank.get(clients)

    def evaluator(self, data: ClientData | None = None) -> Evaluator:
        """The stage's evaluation of the clients of `data` (default: its own) as its chosen executor runs."""
        return Evaluator(self.executor_choice, self.split, self.data if data is None else data, self.config.precision)

    def evaluate(self, splits: list[str], round_idx: int,
                 clients: torch.Tensor | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """The task's metrics of `clients` (default: every client) on `splits`, logged as their summaries
        (Evaluator.summary); those of every client are kept for the stage's report."""
        evaluator, shown = self.evaluator(), f"val_{self.task.primary}_mean"
        results = {split: evaluator.scores(split, self.shared_params(), self.personal_of, clients) for split in splits}
        for split, scores in results.items():
            summary = evaluator.summary(split, scores, clients)
            self.round_log.update(summary)
            self.shown.update({shown: summary[shown]} if shown in summary else {})
            self.history.append({"round": round_idx, "split": split, **summary})
        if clients is None:
            self.client_metrics.update(results)
        return results
