"""FederatedStage: a LightningModule whose training_step is one federated round over a sampled cohort."""

from __future__ import annotations

import time
from collections.abc import Iterator
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
from fedpilot.engine.cohort import Cohort, RoundWork
from fedpilot.engine.config import LocalConfig, ServerConfig, StageConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.ddp import check_splits_across_processes, distributed, share_round
from fedpilot.engine.executor import Tensors
from fedpilot.engine.hooks import RoundGuard, RoundResult, Rounds, RoundStart
from fedpilot.engine.memory import data_fits
from fedpilot.engine.metrics import cohort_spread
from fedpilot.engine.novel import NovelClients, beyond_participants
from fedpilot.engine.protocol import Algorithm, RoundInfo
from fedpilot.engine.rounds import TrialRound, begin_round, chunks, run_round
from fedpilot.engine.task import CLASSIFICATION, Task
from fedpilot.engine.values import TrialValues
from fedpilot.errors import Diverged
from fedpilot.models.split import ParamSplit

# Stage settings that no round's local work reads (what the executor timing measures)
NOT_LOCAL_WORK = frozenset({"rounds", "eval_every", "eval_clients"})


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

    def execution_record(self) -> dict[str, float]:
        """What the stage records of its executor choice (`executor_*` metrics; none for a pinned executor)."""
        return self.executor_choice.record()

    def workload(self) -> str:
        """What decides how fast each executor runs the stage's local work (ExecutorChoice.time's memo of timed
        choices): the algorithm and its settings but the values that only enter arithmetic (Algorithm.arithmetic:
        step sizes, weights) and those of no round's local work (rounds, evaluation), the model and its split, the
        task, the device, and the data's shapes (a row, clients, samples, the largest client's to a power of two)."""
        kind = type(self.algorithm)
        settings = {f"{block}.{key}": value for block in ("local", "server")
                    for key, value in getattr(self.config, block).model_dump().items()}
        settings |= {f"params.{key}": value for key, value in self.algorithm.params.model_dump().items()}
        settings |= self.config.model_dump(exclude={"local", "server", *NOT_LOCAL_WORK})
        sizes = self.data.sizes["train"]
        return repr((f"{kind.__module__}.{kind.__qualname__}", sorted((k, v) for k, v in settings.items()
                                                                     if not kind.arithmetic(k)),
                     str(self.model), [(n, tuple(p.shape), p.dtype) for n, p in self.model.named_parameters()],
                     self.personal_names, self.shared_names, self.task.name, str(self.device),
                     tuple(self.data.x.shape[1:]), self.data.x.dtype, self.data.n_clients, int(sizes.sum()),
                     int(sizes.max()).bit_length()))

    @property
    def upcoming(self) -> RoundStart:
        """Its next round (RoundCallback.on_round_start): the first under `execution: auto` times the candidates."""
        return RoundStart(self.global_step, self.executor_choice.pending)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Rounds(), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return server_optimizer([self.server_group()])

    def server_group(self) -> tuple[ServerConfig, list[nn.Parameter]]:
        """What the server optimizer steps: the stage's server settings and its shared parameters."""
        params = [p for n, p in self.model.named_parameters() if n in set(self.shared_names)]
        return self.config.server, params or [nn.Parameter(self._no_shared)]

    def setup(self, stage: str) -> None:
        check_splits_across_processes(self.algorithm)
        self.data_on_device = data_fits(lambda: self.data.nbytes(), self.device, self.config.device_data_budget)
        if self.data_on_device:
            self.data = self.data.to(self.device)

    def training_step(self, batch: int, batch_idx: int) -> None:
        round_idx = self.global_step
        with begin_round([self], round_idx, self.algorithm):
            start = time.perf_counter()
            stats = self.run_round(round_idx)
        self.finish_round(round_idx, stats, time.perf_counter() - start)

    def finish_round(self, round_idx: int, stats: dict[str, float], seconds: float) -> None:
        """What a trained round ends with: its records, the evaluation when one is due, its `round_result`."""
        self.rounds_run += 1
        self.comm_bytes.append(stats["bytes_up"] + stats["bytes_down"])
        # per round what changes: the cohort and the bytes sent are reported once, with the footprints
        self.round_log = {"round_time_s": seconds,
                          **{k: v for k, v in stats.items() if k not in ("clients", "bytes_up", "bytes_down")}}
        self.shown["train_loss"] = stats["train_loss"]  # not self.log: its bookkeeping is a cost on every round
        if round_idx + 1 == self.n_rounds:
            self.evaluate(["val", "test"], round_idx + 1)
            self.client_metrics.update(beyond_participants(self, ("val", "test"), self.novel, self.select))
        elif (round_idx + 1) % self.config.eval_every == 0:
            self.evaluate(["val"], round_idx + 1, self.sampling.evaluated())
        self.round_result = RoundResult(round_idx + 1, MappingProxyType(dict(self.round_log)),
                                        MappingProxyType(dict(self.shown)), self.execution)

    def records(self) -> dict[str, Any]:
        """What a checkpoint keeps of the stage besides its modules: its records (the clients' metrics once
        evaluated) and server state."""
        return {"history": self.history, "comm_bytes": self.comm_bytes, "server_state": self.server_state,
                "client_metrics": self.client_metrics}

    def load_records(self, saved: dict[str, Any]) -> None:
        self.history, self.comm_bytes = list(saved.get("history", [])), list(saved.get("comm_bytes", []))
        self.server_state = dict(saved.get("server_state", self.server_state))
        self.client_metrics = dict(saved.get("client_metrics", {}))  # a stop after the last round runs none again

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The stage's records, server state and executor choice, and the banks' chains of changes
        (save_changes_in)."""
        checkpoint["fedpilot"] = {**self.records(), **self.executor_choice.state_dict()}
        self.save_bank_changes(self.global_step, self.trainer.is_global_zero, checkpoint["state_dict"])

    def save_bank_changes(self, step: int, write: bool, state: dict[str, Any], prefix: str = "") -> None:
        """Under save_changes_in, each bank's rows written since the last save as the next link of its chain (`write`:
        this process writes it), named in the checkpoint's `state` (the stage's modules under `prefix`)."""
        if self.changes_folder is not None:
            save_changes({"bank": self.bank, "state_bank": self.state_bank}, self.changes_folder, step, write, state,
                         prefix)

    def save_changes_in(self, folder: Path | None) -> None:
        """Checkpoints save the banks as chains of their changes in `folder` (each save writes only the rows written
        since the last one) instead of every written row; None: the state holds every written row again."""
        self.changes_folder = None if folder is None else Path(folder)
        for bank in (self.bank, self.state_bank):
            bank.keep_changes(folder is not None)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("fedpilot", {})
        self.load_records(saved)
        self.executor_choice.load_state_dict(saved)  # a resumed stage goes on with the executor it chose

    def sample_cohort(self, round_idx: int) -> torch.Tensor:
        return self.sampling.cohort(round_idx)

    def shared_params(self) -> Tensors:
        params = dict(self.model.named_parameters())
        return {n: params[n].detach() for n in self.shared_names}

    def round_work(self, round_idx: int, clients: torch.Tensor, data: ClientData | None = None,
                   local: LocalConfig | None = None, rounds: int | None = None, trials: int = 1) -> RoundWork:
        """Round `round_idx`'s fixed parts for `clients` (of each of `trials` trials): the stage's model, execution
        plan and seed; by default its data (on the host: `clients`' samples gathered to the device), its local work
        and its rounds' lr schedule."""
        local, rounds = local or self.config.local, rounds or self.n_rounds
        if data is None:
            data = self.data if self.data_on_device else self.data.gather(clients, self.device)
        return RoundWork(self.model, self.task, data, local, local.schedule.factor(round_idx, rounds),
                         (self.seed, self.stage_index, round_idx), self.executor_choice.plan(self.device, trials),
                         self.split, self.config.precision, constants=self.algorithm.constants)

    def trial_values(self, local: LocalConfig | None = None) -> TrialValues:
        """The values its clients train with: `local` (default: the stage's own block), the algorithm's params, the
        server's state as it stands."""
        return TrialValues(local or self.config.local, self.algorithm.params, self.server_state)

    def client_start(self) -> Tensors:
        """Each client's own values before its first visit (its personal parameters and constants), on the device."""
        return {n: v.to(self.device) for n, v in self.personal_init.items()}

    def round_part(self, work: RoundWork, clients: torch.Tensor) -> TrialRound:
        """This stage's part of a training round of the cohort `clients` on `work`."""
        shared = self.shared_params()
        return TrialRound(self, self.trial_values(), shared, self.client_start(),
                          info=RoundInfo(work.seed_key, clients, shared, self.data.n_clients),
                          aggregate=self.algorithm.aggregator(),
                          sums=torch.zeros(3, dtype=torch.float64, device=self.device))

    def client_rows(self, ids: torch.Tensor, start: Tensors, fresh: bool = False) -> tuple[Tensors, Tensors]:
        """The own values and state of clients `ids` from the banks (a stateless algorithm's own values: `start`);
        `fresh`: `start` and the algorithm's initial state (clients that never took part)."""
        personal = self.bank.get(ids) if self.algorithm.stateful and not fresh else {
            n: v.expand(len(ids), *v.shape) for n, v in start.items()}
        state = {n: v.to(self.device).expand(len(ids), *v.shape) for n, v in self.state_bank.init.items()} \
            if fresh else self.state_bank.get(ids)
        return personal, state

    def keep_rows(self, ids: torch.Tensor, own: Tensors, state: Tensors) -> None:
        """Clients `ids`' new own values (kept only by a stateful algorithm) and state, into the banks."""
        if self.algorithm.stateful:
            self.bank.put(ids, own)
        self.state_bank.put(ids, state)

    def cohorts(self, work: RoundWork, clients: torch.Tensor, start: Tensors, rows: slice | None = None,
                chunk: int | None = None, fresh: bool = False) -> Iterator[Cohort]:
        """The `rows` (default: all) of the round's cohort `clients` as cohorts of at most `chunk` clients (default
        max_parallel_clients), with their bank rows (a stateless algorithm's personal values: `start`); `fresh`:
        every client from `start` and the algorithm's initial state (clients that never took part)."""
        part = TrialRound(self, self.trial_values(work.local), self.shared_params(), start, fresh)
        for cohort, _ in chunks([part], work, clients, rows or slice(0, len(clients)),
                                chunk or self.config.max_parallel_clients):
            yield cohort

    def run_round(self, round_idx: int, chunk: int | None = None) -> dict[str, float]:
        """Local work of the whole cohort in chunks (of `chunk` clients; by default as the executor choice says),
        each chunk's upload added to the aggregate and dropped before the next chunk trains; then one server
        optimizer step. Under DDP every process trains its slice of the cohort (`process_rows`), then all-reduces
        the aggregate, its bank rows and the training stats (engine.ddp): every process takes the same server step."""
        stats = run_round([self], round_idx, self.algorithm, self.optimizers(), chunk)[0]
        if isinstance(stats, Diverged):
            raise stats
        return stats

    def end_round(self, part: TrialRound, round_idx: int, clients: torch.Tensor, mine: slice) -> dict[str, float]:
        """The round's end for this stage, its rows trained (`part`): its aggregate's result (under DDP after the
        processes' aggregates, bank rows and sums are all-reduced) as the gradient of its shared parameters, which
        the server optimizer then steps on, and the round's stats."""
        loss, metric, steps = part.sums.tolist()
        if distributed():
            banks = [self.bank, self.state_bank] if self.algorithm.stateful else [self.state_bank]
            loss, metric, steps = share_round(clients, mine, part.aggregate, part.info, banks, [loss, metric, steps],
                                              self.device)
        pseudo_grad, self.server_state = part.aggregate.result(part.info, self.server_state)
        train_loss = loss / max(steps, 1.0)
        self.guard.check_finite(round_idx, train_loss, pseudo_grad)
        params = dict(self.model.named_parameters())
        for name, g in pseudo_grad.items():
            params[name].grad = g.to(params[name].dtype)
        return {"train_loss": train_loss, f"train_{self.task.train_metric}": metric / max(steps, 1.0),
                "clients": float(len(clients)), "bytes_up": float(part.aggregate.upload_bytes),
                "bytes_down": float(len(clients) * sum(v.numel() * v.element_size() for v in part.shared.values())),
                **cohort_spread(self.state_bank, clients)}

    @staticmethod
    def server_step(optimizer: torch.optim.Optimizer) -> None:
        """The server `optimizer` steps on the gradients the round's aggregates became (end_round)."""
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
