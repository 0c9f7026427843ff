"""FederatedStage: a LightningModule whose training_step is one federated round over a sampled cohort."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

from fedpilot.engine.accel import AUTO, choose, executor_candidates
from fedpilot.engine.accel.timing import TRIAL_STEPS, best_time, clients_per_call, fastest
from fedpilot.engine.bank import ClientBank, starting_bank
from fedpilot.engine.batches import draw_without_replacement
from fedpilot.engine.cohort import Cohort, RoundWork
from fedpilot.engine.config import StageConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.evaluate import evaluate_clients
from fedpilot.engine.executor import Executor, Params, plain_forward
from fedpilot.engine.hooks import RoundResult
from fedpilot.engine.memory import data_fits, release_freed_memory
from fedpilot.engine.metrics import summarize
from fedpilot.engine.novel import NovelClients, beyond_participants
from fedpilot.engine.protocol import Algorithm, ReducibleAggregator, RoundInfo
from fedpilot.engine.task import CLASSIFICATION, Task
from fedpilot.errors import Diverged, NothingToTrain, StageFailed
from fedpilot.metric_names import COHORT, COHORT_STATS
from fedpilot.models.split import ParamSplit


class _Rounds(IterableDataset):
    """The stage's 'data': an endless stream of round tokens (the round index is the global step); the stage refuses
    a round past its last and a round that did not move the step on (FederatedStage.check_progress), so the stream
    cannot outlive the stage's rounds."""

    def __iter__(self) -> Iterator[int]:
        while True:
            yield 0


class FederatedStage(L.LightningModule):
    """One stage of a pipeline: `rounds` federated rounds of one algorithm on a federated dataset.

    The model's parameters the `split` names personal live per client in a personal bank; the others are
    shared and stepped by a torch optimizer with the aggregated client update as pseudo-gradient.
    `data` has client-major tensors and per-split `offsets`/`sizes` (engine.data.ClientData); `task`
    scores the model's outputs (loss and per-client metrics). At the stage's end, clients held out of training
    (`novel`) are evaluated with the global model and after their adaptation, and with `select` every client with the
    global model too (engine.novel).
    """

    def __init__(self, model: nn.Module, split: ParamSplit, data: ClientData, algorithm: Algorithm,
                 config: StageConfig, seed: int = 0, stage_index: int = 0, bank: ClientBank | None = None,
                 task: Task = CLASSIFICATION, name: str | None = None, novel: NovelClients | None = None,
                 select: bool = False):
        super().__init__()
        self.save_hyperparameters(
            {"config": config.model_dump(), "seed": seed, "stage_index": stage_index, "algorithm": algorithm.name,
             "task": task.name})
        self.automatic_optimization = False
        self.model, self.split, self.data, self.algorithm, self.config = model, split, data, algorithm, config
        self.task, self.seed, self.stage_index = task, seed, stage_index
        self.novel, self.select = novel, select  # evaluated at the stage's end (engine.novel)
        self.stage_name = name or f"{algorithm.name} (stage {stage_index})"
        params = dict(model.named_parameters())
        self.personal_names = list(split.personal_names)
        copy = algorithm.personal_copy  # every parameter both global and personal (Ditto)
        self.shared_names = [n for n in params if copy or n not in set(self.personal_names)]
        self.register_buffer("_no_shared", torch.zeros(0))
        self.personal_init = {n: params[n].detach().clone() for n in self.personal_names}  # the stage's start
        budget = config.host_memory_budget
        self.bank = bank if bank is not None else ClientBank(self.personal_init, data.n_clients, budget)
        self.state_bank = ClientBank(algorithm.client_state(), data.n_clients, budget)
        self.changes_folder: Path | None = None  # set by save_changes_in()
        self.data_on_device = True  # setup() keeps a federation larger than the device's budget on the host
        self.server_state = algorithm.server_state(data.n_clients)
        self.execution = config.execution  # "auto" until the first round times the candidates
        self._executors: dict[tuple, tuple[Executor, Executor | None]] = {}  # see executors()
        self.executor_seconds: dict[str, float] = {}  # candidate -> seconds on the first round's first chunk
        self.executor_peak_bytes: dict[str, int] = {}  # candidate -> peak memory there
        self.clients_per_call: dict[str, int] = {}  # candidate that batches clients -> how many a call takes
        self.executor_timing_s: float | None = None  # what choosing the executor took (`auto`)
        self.history: list[dict[str, Any]] = []
        self.comm_bytes: list[float] = []
        self.round_log: dict[str, float] = {}  # this round's metrics (step = rounds done); callbacks get round_result
        self.shown: dict[str, float] = {}  # the latest loss and val accuracy
        self.round_result: RoundResult | None = None  # what the latest round ended with (RoundCallback.on_round_end)
        self.rounds_run = 0  # rounds trained by this object (a resumed stage does not count the restored ones)
        self.last_round: int | None = None  # the round the last training_step ran (check_progress)
        self.last_finite_loss: float | None = None  # the latest round's training loss, named if a round diverges
        self.client_metrics: dict[str, dict[str, torch.Tensor]] = {}

    # ---- what Lightning asks for -------------------------------------------------------------------------
    @property
    def n_rounds(self) -> int:
        """Rounds this stage runs: its `rounds`, or one pass over all clients for one-visit algorithms."""
        if self.algorithm.visits_each_client_once:
            return math.ceil(self.data.n_clients / self._cohort_size())
        return self.config.rounds

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_Rounds(), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        server = self.config.server
        params = [p for n, p in self.model.named_parameters() if n in set(self.shared_names)]
        params = params or [nn.Parameter(self._no_shared)]
        if server.optimizer == "adam":
            return torch.optim.Adam(params, lr=server.lr, betas=server.betas, eps=server.eps)
        return torch.optim.SGD(params, lr=server.lr, momentum=server.momentum)

    def setup(self, stage: str) -> None:
        if distributed() and not splits_across_processes(self.algorithm):
            raise ValueError(f"{self.hparams['algorithm']}: its server keeps every client's upload, so a round cannot "
                             f"be split across {dist.get_world_size()} processes; run it with devices: 1")
        self.data_on_device = data_fits(lambda: self.data.nbytes(), self.device, self.config.device_data_budget)
        if self.data_on_device:
            self.data = self.data.to(self.device)

    def training_step(self, batch: int, batch_idx: int) -> None:
        round_idx = self.global_step
        self.check_progress(round_idx)
        try:
            if self.times_executors:
                self.choose_executor(round_idx)
            start = time.perf_counter()
            stats = self.run_round(round_idx)
        except NothingToTrain as err:
            raise StageFailed(f"stage {self.stage_name!r} ({self.algorithm.name}), round {round_idx + 1}: {err}") \
                from None
        self.rounds_run += 1
        self.comm_bytes.append(stats["bytes_up"] + stats["bytes_down"])
        # Per round only what changes: the cohort size and the bytes sent are the stage's constants, reported once
        # with its footprints (comm_bytes_per_round).
        self.round_log = {"round_time_s": time.perf_counter() - start,
                          **{k: v for k, v in stats.items() if k not in ("clients", "bytes_up", "bytes_down")}}
        self.shown["train_loss"] = stats["train_loss"]  # not self.log: its bookkeeping is a cost on every round
        last = round_idx + 1 == self.n_rounds
        if last:
            self.evaluate(["val", "test"], round_idx + 1)
            self.client_metrics.update(beyond_participants(self, ("val", "test"), self.novel, self.select))
        elif (round_idx + 1) % self.config.eval_every == 0:
            self.evaluate(["val"], round_idx + 1, self.evaluation_sample())
        self.round_result = RoundResult(round_idx + 1, MappingProxyType(dict(self.round_log)),
                                        MappingProxyType(dict(self.shown)), self.execution)

    @property
    def times_executors(self) -> bool:
        """Whether the next round first times the executor candidates (`execution: auto`, not yet chosen)."""
        return self.execution == AUTO

    def check_progress(self, round_idx: int) -> None:
        """Each training step trains a new round of the stage: one past its last round, or one that did not move the
        step on (no server step), stops the stage instead of looping on Lightning's endless stream of rounds."""
        if round_idx >= self.n_rounds or round_idx == self.last_round:
            raise StageFailed(f"stage {self.stage_name!r} ({self.algorithm.name}): round {round_idx + 1} of "
                              f"{self.n_rounds} would run again or past the stage's end (the previous round did not "
                              "step the server optimizer); stopped instead of looping")
        self.last_round = round_idx

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The stage's records and server state; with a `changes_folder`, the banks as the chain of their changes
        since the stage started (each save writes only the rows written since the last one)."""
        checkpoint["fedpilot"] = {"history": self.history, "comm_bytes": self.comm_bytes,
                                  "server_state": self.server_state, "execution": self.execution,
                                  "executor_seconds": self.executor_seconds,
                                  "executor_peak_bytes": self.executor_peak_bytes,
                                  "clients_per_call": self.clients_per_call,
                                  "executor_timing_s": self.executor_timing_s}
        if self.changes_folder is None:
            return
        for name in ("bank", "state_bank"):
            bank = getattr(self, name)
            bank.save_changes(self.changes_folder / f"{name}-{self.global_step}.pt", self.trainer.is_global_zero)
            checkpoint["state_dict"][f"{name}._extra_state"] = bank.get_extra_state()

    def save_changes_in(self, folder: Path | None) -> None:
        """Checkpoints save the banks as chains of their changes in `folder` (each save writes only the rows written
        since the last one) instead of every written row; None: the state holds every written row again."""
        self.changes_folder = None if folder is None else Path(folder)
        for bank in (self.bank, self.state_bank):
            bank.chain = None if folder is None else bank.chain or []

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("fedpilot", {})
        self.history, self.comm_bytes = list(saved.get("history", [])), list(saved.get("comm_bytes", []))
        self.server_state = dict(saved.get("server_state", self.server_state))
        if self.config.execution == AUTO:  # a resumed stage goes on with the executor it chose (same numbers)
            self.execution = saved.get("execution", self.execution)
            self.executor_seconds = dict(saved.get("executor_seconds", {}))
            self.executor_peak_bytes = dict(saved.get("executor_peak_bytes", {}))
            self.clients_per_call = dict(saved.get("clients_per_call", {}))
            self.executor_timing_s = saved.get("executor_timing_s")

    # ---- one round -----------------------------------------------------------------------------------------
    def _cohort_size(self) -> int:
        return min(self.config.clients_per_round or self.data.n_clients, self.data.n_clients)

    def sample_cohort(self, round_idx: int) -> torch.Tensor:
        """Uniform without replacement, seeded by (seed, stage, round); one-visit algorithms take slices."""
        size, n = self._cohort_size(), self.data.n_clients
        if self.algorithm.visits_each_client_once:
            return torch.arange(round_idx * size, min(n, (round_idx + 1) * size))
        return draw_without_replacement(n, size, self.seed, self.stage_index, round_idx, 0)

    def shared_params(self) -> Params:
        params = dict(self.model.named_parameters())
        return {n: params[n].detach() for n in self.shared_names}

    def round_work(self, round_idx: int, clients: torch.Tensor) -> RoundWork:
        """The round's fixed parts; with the federation's data on the host, `clients`' samples gathered to the
        device."""
        local = self.config.local
        data = self.data if self.data_on_device else self.data.gather(clients, self.device)
        executor, head_executor = self.executors(self.execution, timed=bool(self.executor_seconds))
        return RoundWork(model=self.model, forward=self.algorithm.forward, task=self.task, data=data, local=local,
                         lr_factor=local.schedule.factor(round_idx, self.n_rounds),
                         seed_key=(self.seed, self.stage_index, round_idx), executor=executor,
                         head_executor=head_executor, split=self.split, server_state=self.server_state,
                         precision=self.config.precision)

    def executors(self, execution: str, timed: bool, per_call: int | None = None) -> tuple[Executor, Executor | None]:
        """The executor of the stage's local work under `execution`, batching at most `per_call` clients a call (by
        default as many as the stage measured, or all), and the one of its head-only work on the body's features
        (None: head-only work runs as any other), chosen once per stage. A `timed` choice was timed on whole-model
        work, so head-only work keeps the rule of thumb for the head."""
        per_call = per_call or self.clients_per_call.get(execution)
        key = (execution, timed, self.device, per_call)
        if key not in self._executors:
            executor = choose(execution, self.model, self.device)(self.algorithm.forward, self.task, per_call)
            head = getattr(self.model, "head", None)
            kind = choose(AUTO if timed else execution, head, self.device) if head is not None else None
            self._executors[key] = executor, kind(plain_forward, self.task) if kind and kind.uses_features else None
        return self._executors[key]

    def choose_executor(self, round_idx: int) -> None:
        """Time the candidate executors on the first TRIAL_STEPS steps of every local phase of the round's first
        chunk of clients, after a warm-up run of each on the first step (thrown away: nothing is written and the
        random state is restored) and keep the fastest for the stage, or a leaner one the fastest is not believably
        faster than (`timing.kept`). Executors that batch clients first measure how many a call takes
        (`timing.clients_per_call`), so that neither their timing nor their rounds hold more clients' work at once
        than their speed gains from, and one that its calls show to be believably slower than a warm-up of the
        others takes no warm-up or turn. bf16 is never a candidate: it changes the numbers; `precision: bf16-mixed`
        times the candidates under bf16. Under DDP every process takes rank 0's choice."""
        began = time.perf_counter()
        chunk = self.sample_cohort(round_idx)[: self.config.max_parallel_clients].to(self.device)
        candidates = executor_candidates(self.model, self.device)
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            run = self.trial(round_idx, chunk)
            sized = {name: clients_per_call(self.call_seconds(run, name), len(chunk), self.device)
                     for name in candidates if choose(name, self.model, self.device).groups_clients}
            self.clients_per_call = {name: size.clients for name, size in sized.items()}
            known = {name: size.seconds_per_client * len(chunk) for name, size in sized.items()
                     if size.seconds_per_client is not None}  # one step a phase of the chunk: the warm-up's work
            timed = fastest(candidates, run, self.device, weigh_memory=True, warm_up=lambda name: run(name, steps=1),
                            known=known)
        release_freed_memory(self.device)  # the losing candidates' buffers (vmap's can double a CNN's memory)
        left_out = {n: TRIAL_STEPS * known[n] for n in timed.seconds if n in known and n not in timed.peak_bytes}
        timed = timed._replace(seconds={**timed.seconds, **left_out})  # a turn's steps, at its measured step
        chosen = (timed, self.clients_per_call)
        if distributed():
            shared = [chosen]
            dist.broadcast_object_list(shared, src=0)
            chosen = shared[0]
        (self.execution, self.executor_seconds, self.executor_peak_bytes), self.clients_per_call = chosen
        self.executor_timing_s = time.perf_counter() - began

    def call_seconds(self, run: Callable[..., None], name: str) -> Callable[[int], float]:
        """seconds(n): the first step of each local phase of the chunk's first n clients by executor `name` in one
        call (a first step is the batched one of `loop_batched_first`)."""
        def seconds(clients: int) -> float:
            return best_time(lambda: run(name, steps=1, clients=clients, per_call=clients), self.device, repeats=1,
                             warm=False)
        return seconds

    def trial(self, round_idx: int, chunk: torch.Tensor) -> Callable[..., None]:
        """run(executor name, steps=TRIAL_STEPS, clients=None, per_call=None): the round's local work of the first
        `clients` of `chunk` (all: None) as one chunk, `steps` steps a phase, batching `per_call` clients a call (by
        default as measured), on copies of their banks' rows (what it computes is thrown away)."""
        work = self.round_work(round_idx, chunk)
        shared, init = self.shared_params(), {n: v.to(self.device) for n, v in self.personal_init.items()}
        personal, state = self.bank.get(chunk), self.state_bank.get(chunk)

        def run(name: str, steps: int = TRIAL_STEPS, clients: int | None = None, per_call: int | None = None) -> None:
            executor, head_executor = self.executors(name, timed=False, per_call=per_call)
            rows = slice(0, clients)
            cohort = Cohort(replace(work, executor=executor, head_executor=head_executor, step_cap=steps), chunk[rows],
                            rows, chunk, shared, {n: v[rows].clone() for n, v in personal.items()}, init,
                            {n: v[rows].clone() for n, v in state.items()})
            self.algorithm.local_update(cohort)
        return run

    def run_round(self, round_idx: int, chunk: int | None = None) -> dict[str, float]:
        """Local work of the whole cohort (in chunks), aggregation, one server optimizer step.

        Under DDP every process samples the same cohort and trains its slice of it (`process_rows`); the
        aggregate's sums, the slice's bank rows and the training stats are then all-reduced, so every process
        takes the same server step and ends the round with the same parameters and banks.
        """
        clients = self.sample_cohort(round_idx).to(self.device)
        work, shared = self.round_work(round_idx, clients), self.shared_params()
        info = RoundInfo(work.seed_key, clients, shared, self.data.n_clients)
        init = {n: v.to(self.device) for n, v in self.personal_init.items()}
        stateful = self.algorithm.stateful
        aggregate = self.algorithm.aggregator()
        chunk = chunk or self.config.max_parallel_clients
        mine = process_rows(len(clients))
        loss = metric = steps = 0.0
        for lo in range(mine.start, mine.stop, chunk):
            rows = slice(lo, min(lo + chunk, mine.stop))
            ids = clients[rows]
            personal = self.bank.get(ids) if stateful else {
                n: v.expand(len(ids), *v.shape) for n, v in init.items()}
            cohort = Cohort(work, ids, rows, clients, shared, personal, init, self.state_bank.get(ids))
            upload = self.algorithm.local_update(cohort)
            if stateful:
                self.bank.put(ids, cohort.personal)
            self.state_bank.put(ids, cohort.state)
            if upload.shared is not None or upload.grad is not None:
                aggregate.add(replace(upload, weight=cohort.weights if upload.weight is None else upload.weight),
                              info)
            loss += float(cohort.stats.loss.sum())
            metric += float(cohort.stats.metric.sum())
            steps += float(cohort.stats.steps.sum())
        if distributed():
            loss, metric, steps = self.share_round(clients, mine, aggregate, info, stateful, [loss, metric, steps])
        pseudo_grad, self.server_state = aggregate.result(info, self.server_state)
        train_loss = loss / max(steps, 1.0)
        self.check_finite(round_idx, train_loss, pseudo_grad)
        self.server_step(pseudo_grad)
        up = aggregate.upload_bytes
        return {"train_loss": train_loss, f"train_{self.task.train_metric}": metric / max(steps, 1.0),
                "clients": float(len(clients)), "bytes_up": float(up),
                "bytes_down": float(len(clients) * sum(v.numel() * v.element_size() for v in shared.values())),
                **self.cohort_spread(clients)}

    def cohort_spread(self, clients: torch.Tensor) -> dict[str, float]:
        """The spread over the round's cohort of each per-client scalar of the algorithm's state (Self-FL's steps,
        pFedGate's densities), as `cohort_{name}_{stat}` (every process has the whole cohort's rows by now)."""
        if not any(v.dim() == 0 for v in self.state_bank.init.values()):  # no per-client scalar: no gather
            return {}
        rows = self.state_bank.get(clients.cpu())
        percents = torch.tensor(list(COHORT_STATS.values()), dtype=torch.float64) / 100
        return {f"{COHORT}_{name}_{stat}": float(q) for name, values in rows.items() if values.dim() == 1
                for stat, q in zip(COHORT_STATS, torch.quantile(values.double(), percents), strict=True)}

    def check_finite(self, round_idx: int, train_loss: float, pseudo_grad: Params) -> None:
        """Stop at the first round whose training loss or aggregated update is not finite, before the server steps
        on it: a stage that goes on would train on NaN (Diverged names the stage, the round and the last finite
        loss)."""
        if not math.isfinite(train_loss):
            raise Diverged(self.stage_name, round_idx + 1, "training loss", self.last_finite_loss)
        # A sum per tensor (no boolean copy of the update, as an isfinite pass makes, on every round): it is not
        # finite whenever an entry is not, or when the entries overflow float32 together (divergence too)
        if pseudo_grad and not math.isfinite(float(sum(g.sum() for g in pseudo_grad.values()))):
            raise Diverged(self.stage_name, round_idx + 1, "aggregated update", train_loss)
        self.last_finite_loss = train_loss

    def share_round(self, clients: torch.Tensor, mine: slice, aggregate: ReducibleAggregator, info: RoundInfo,
                    stateful: bool, sums: list[float]) -> list[float]:
        """DDP: the whole cohort's aggregate and bank rows on every process; the training-stat `sums`, all-reduced."""
        aggregate.all_reduce(info, self.device)
        if stateful:
            self.bank.share_rows(clients, mine)
        self.state_bank.share_rows(clients, mine)
        totals = torch.tensor(sums, dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return totals.tolist()

    def server_step(self, pseudo_grad: Params) -> None:
        """The aggregate becomes the gradient of the shared parameters; the server optimizer steps."""
        params = dict(self.model.named_parameters())
        for name, g in pseudo_grad.items():
            params[name].grad = g.to(params[name].dtype)
        optimizer = self.optimizers()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # ---- evaluation ----------------------------------------------------------------------------------------
    def personal_of(self, clients: torch.Tensor) -> Params:
        return self.bank.get(clients)

    def evaluation_sample(self) -> torch.Tensor | None:
        """The clients evaluated during training: a sample of `eval_clients` seeded by (seed, stage), the same at
        every evaluation of the stage; None (every client) without `eval_clients`."""
        n, size = self.data.n_clients, self.config.eval_clients
        if size is None or size >= n:
            return None
        return draw_without_replacement(n, size, self.seed, self.stage_index, 0, 1)

    def evaluate(self, splits: list[str], round_idx: int,
                 clients: torch.Tensor | None = None) -> dict[str, dict[str, torch.Tensor]]:
        """The task's metrics of `clients` (default: every client) on `splits`; logs `{split}_{metric}_weighted`
        for each metric and the whole distribution `{split}_{metric}_{stat}` for the task's distributions (e.g.
        accuracy). The per-client metrics of an evaluation of every client are kept for the stage's report."""
        results = {}
        for split in splits:
            scores = evaluate_clients(self.model, self.split, self.algorithm.forward, self.task, self.shared_params(),
                                      self.personal_of, self.data, split, self.execution, clients,
                                      precision=self.config.precision)
            results[split] = {m: v.cpu() for m, v in scores.items()}
            weights = self.data.sizes[split].cpu().double()
            weights = weights if clients is None else weights[clients.cpu()]
            summary = summarize(split, results[split], weights, self.task.distributions)
            self.round_log.update(summary)
            shown = f"val_{self.task.primary}_mean"
            if split == "val" and shown in summary:
                self.shown[shown] = summary[shown]
            self.history.append({"round": round_idx, "split": split, **summary})
        if clients is None:
            self.client_metrics.update(results)
        return results


def splits_across_processes(algorithm: Algorithm) -> bool:
    """Whether the algorithm's aggregate is made of sums that DDP processes can all-reduce (a cohort split across
    devices); an aggregate that keeps every upload (robust rules, precision weights) runs in one process."""
    return isinstance(algorithm.aggregator(), ReducibleAggregator)


def distributed() -> bool:
    """Whether this process is one of several DDP processes sharing each round."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def process_rows(n: int) -> slice:
    """The rows of an n-client cohort this process trains: all of them, or under DDP its contiguous share."""
    if not distributed():
        return slice(0, n)
    world, rank = dist.get_world_size(), dist.get_rank()
    return slice(rank * n // world, (rank + 1) * n // world)


def carry_bank(previous: FederatedStage, personal_names: list[str]) -> ClientBank:
    """The starting personal bank of the next stage: a parameter personal before keeps each client's value (and
    its shared starting value for clients that never trained), a parameter that becomes personal starts as its
    current shared value (Pillutla et al., ICML 2022, App. B.2), and one new to the model (an adapter inserted since) as the
    model's own initial value."""
    current = {n: p.detach() for n, p in previous.model.named_parameters()}
    init = {n: previous.bank.init[n] if n in previous.bank.names else current[n] for n in personal_names}
    return starting_bank(init, previous.data.n_clients, previous.bank, previous.config.host_memory_budget)
