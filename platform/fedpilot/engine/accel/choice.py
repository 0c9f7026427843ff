"""Which executor a stage runs: the one `execution:` names, or under `auto` the candidate the stage's first round times
fastest (or leanest where the fastest is not believably faster), and how many clients a chunk of its rounds takes.
The choice keeps its own record, logged with the stage, and its own checkpoint state, so that a resumed stage goes on
with the executor and chunks it chose (same numbers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from fedpilot.engine.accel.executors import AUTO, choose, executor_candidates
from fedpilot.engine.accel.timing import (
    MATERIAL_MEMORY,
    TRIAL_STEPS,
    Timed,
    best_time,
    clients_per_call,
    fastest,
)
from fedpilot.engine.ddp import distributed
from fedpilot.engine.executor import ExecutionPlan, Forward, plain_forward
from fedpilot.engine.memory import memory_in_use, release_freed_memory
from fedpilot.engine.protocol import Algorithm, ReducibleAggregator
from fedpilot.engine.task import Task

# The choices timed in this process, by workload (ExecutorChoice.time), the oldest dropped past TIMED_KEPT
TIMED: dict[str, tuple[tuple[str, dict[str, float], dict[str, int]], dict[str, int], int | None]] = {}
TIMED_KEPT = 64


class TimingRun(Protocol):
    """The local work of a round's first chunk of clients, on copies of their rows (what it computes is thrown away):
    `run(executors, steps, clients, per_chunk)` runs the first `clients` of the chunk (None: all), `per_chunk` at a
    time (None: at once), `steps` steps a phase."""

    clients: int  # the chunk's
    client_bytes: int  # what a chunk holds of each of its clients: shared and personal values, state

    def __call__(self, plan: ExecutionPlan, steps: int, clients: int | None = None,
                 per_chunk: int | None = None) -> None: ...


class ExecutorChoice:
    """The executor of a stage's local work and evaluation (`name`), applying the model with the `algorithm`'s
    `forward`, and under `auto`, once timed, what each candidate measured: `seconds` and `peak_bytes` on the first
    round's first chunk, `clients_per_call` of those that batch clients, and `timing_s`, what the timing took; and
    `clients_per_chunk`, the clients a chunk of the rounds takes (None: the stage's `max_parallel_clients`). What the
    rounds run is one frozen `ExecutionPlan` (`plan`)."""

    def __init__(self, requested: str, model: nn.Module, algorithm: Algorithm, task: Task):
        self.requested, self.model, self.task = requested, model, task
        self.models_forward = algorithm.models_forward
        self.forward: Forward = plain_forward if algorithm.models_forward else algorithm.forward
        self.name = requested  # "auto" until the first round times the candidates
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        self.clients_per_call: dict[str, int] = {}
        self.clients_per_chunk: int | None = None
        self.folds = isinstance(algorithm.aggregator(), ReducibleAggregator)  # sums: each chunk folded in, freed
        self.timing_s: float | None = None
        self.reused = False  # the choice of an earlier timing of the same workload (`time`)
        self._built: dict[tuple, ExecutionPlan] = {}
        self.span: int | None = None  # the most trials a chunk's rows come from (a batch of trials': TrialBatch)

    @property
    def pending(self) -> bool:
        """Whether the next round first times the candidates (`execution: auto`, not yet chosen)."""
        return self.name == AUTO

    def pin(self, name: str, per_call: int | None = None) -> None:
        """Run executor `name` (also `sequential`, the tests' reference), batching `per_call` clients a call."""
        self.name, self.clients_per_call, self.clients_per_chunk = name, {name: per_call} if per_call else {}, None

    def plan(self, device: torch.device, trials: int = 1) -> ExecutionPlan:
        """What the rounds run on `device`, for `trials` trials' rows: the chosen executors (a timed choice was timed on
        whole-model work, so head-only work keeps the rule of thumb for the head), chunks and their span of trials."""
        return replace(self.build(self.name, bool(self.seconds), device), chunk=self.clients_per_chunk, trials=trials,
                       span=self.span)

    def build(self, name: str, timed: bool, device: torch.device, per_call: int | None = None) -> ExecutionPlan:
        """The plan of executor `name` for the stage's local work, batching at most `per_call` clients a call (by
        default as many as the timing measured, or all), and the executor of its head-only work on the body's features
        (None: head-only work runs as any other): the rule of thumb for the head where `timed`, else `name`; built
        once."""
        per_call = per_call or self.clients_per_call.get(name)
        key = (name, timed, device, per_call)
        if key not in self._built:
            own = None if self.models_forward else self.forward  # None: the model's own forward (Executor)
            executor = choose(name, self.model, device)(own, self.task, per_call)
            head = getattr(self.model, "head", None)
            kind = choose(AUTO if timed else name, head, device) if head is not None else None
            head_executor = kind(None, self.task) if kind and kind.uses_features else None
            self._built[key] = ExecutionPlan(executor, head_executor, self.forward, self.models_forward)
        return self._built[key]

    def time(self, timing_run: Callable[[], TimingRun], device: torch.device, workload: str | None = None) -> None:
        """Time the candidates on the first TRIAL_STEPS steps of every local phase of `timing_run()`'s clients, after a
        warm-up run of each on the first step (thrown away: nothing is written and the random state is restored),
        and keep the fastest for the stage, or a leaner one the fastest is not believably faster than
        (`timing.kept`). Executors that batch clients first measure how many a call takes
        (`timing.clients_per_call`), so that neither their timing nor their rounds hold more clients' work at once
        than their speed gains from, and one that its calls show to be believably slower than a warm-up of the
        others takes no warm-up or turn. bf16 is never a candidate: it changes the numbers; `precision:
        bf16-mixed` times the candidates under bf16. Under DDP every process takes rank 0's choice.
        A `workload` this process timed before (FederatedStage.workload: the same local work but for values that
        only enter arithmetic, such as a study's trials and a comparison's seeds) takes that timing's choice and
        records it as taken (`executor_timing_reused`) instead of timing again."""
        memo = workload is not None and not distributed()  # under DDP rank 0's choice is broadcast instead
        if memo and workload in TIMED:
            (self.name, seconds, peak_bytes), per_call, self.clients_per_chunk = TIMED[workload]
            self.seconds, self.peak_bytes, self.clients_per_call = dict(seconds), dict(peak_bytes), dict(per_call)
            self.timing_s, self.reused = 0.0, True
            return
        began = time.perf_counter()
        candidates = executor_candidates(self.model, device)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            runs = _Runs(self, timing_run(), device)
            timed = self._measured(candidates, runs)
        release_freed_memory(device)  # the losing candidates' buffers (vmap's can double a CNN's memory)
        chosen = [(timed, self.clients_per_call, runs.per_chunk(timed.choice))]
        if distributed():
            dist.broadcast_object_list(chosen, src=0)
        (self.name, self.seconds, self.peak_bytes), self.clients_per_call, self.clients_per_chunk = chosen[0]
        self.timing_s = time.perf_counter() - began
        if memo:
            TIMED[workload] = chosen[0]
            while len(TIMED) > TIMED_KEPT:
                TIMED.pop(next(iter(TIMED)))

    def _measured(self, candidates: list[str], runs: _Runs) -> Timed:
        """Each candidate's clients a call (those that batch clients), then `fastest`'s turns: the kept candidate,
        and the seconds of a turn of each (of a left-out one, TRIAL_STEPS of its measured step)."""
        model, device, clients = self.model, runs.device, runs.trial.clients
        sized = {name: clients_per_call(partial(runs.call_seconds, name), clients, device)
                 for name in candidates if choose(name, model, device).groups_clients}
        self.clients_per_call = {name: size.clients for name, size in sized.items()}
        known = {name: size.seconds_per_client * clients for name, size in sized.items()
                 if size.seconds_per_client is not None}  # one step a phase of the chunk: the warm-up's work
        timed = fastest(candidates, runs.run, device, weigh_memory=True, warm_up=runs.warm_up, known=known)
        left_out = {n: TRIAL_STEPS * known[n] for n in timed.seconds if n in known and n not in timed.peak_bytes}
        return timed._replace(seconds={**timed.seconds, **left_out})  # a turn's steps, at its measured step

    def record(self) -> dict[str, float]:
        """The metrics a stage logs of its choice (none for a pinned executor)."""
        return {**{f"executor_seconds_{n}": v for n, v in self.seconds.items()},
                **{f"executor_peak_bytes_{n}": v for n, v in self.peak_bytes.items()},
                **{f"executor_clients_per_call_{n}": v for n, v in self.clients_per_call.items()},
                **({"executor_timing_s": self.timing_s} if self.timing_s is not None else {}),
                **({"executor_timing_reused": 1.0} if self.reused else {})}

    def state_dict(self) -> dict[str, Any]:
        return {"execution": self.name, "executor_seconds": self.seconds, "executor_peak_bytes": self.peak_bytes,
                "clients_per_call": self.clients_per_call, "clients_per_chunk": self.clients_per_chunk,
                "executor_timing_s": self.timing_s, "executor_timing_reused": self.reused}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Under `auto`, the choice a checkpoint saved (a resumed stage goes on with it; one saved before chunks were
        chosen, with whole chunks); a pinned one stays."""
        if self.requested != AUTO:
            return
        self.name = saved.get("execution", self.name)
        self.seconds = dict(saved.get("executor_seconds", {}))
        self.peak_bytes = dict(saved.get("executor_peak_bytes", {}))
        self.clients_per_call = dict(saved.get("clients_per_call", {}))
        self.clients_per_chunk = saved.get("clients_per_chunk")
        self.timing_s = saved.get("executor_timing_s")
        self.reused = bool(saved.get("executor_timing_reused", False))


class _Runs:
    """A trial's runs by candidate name, as `fastest` and `clients_per_call` take them, in the chunks the rounds would
    take under each candidate (`per_chunk`)."""

    def __init__(self, choice: ExecutorChoice, trial: TimingRun, device: torch.device):
        self.choice, self.trial, self.device = choice, trial, device
        self.lean_chunk = max(1, int(MATERIAL_MEMORY * memory_in_use(device) // max(trial.client_bytes, 1)))

    def per_chunk(self, name: str) -> int | None:
        """The clients a chunk of the rounds takes under candidate `name` (None: the whole chunk, where the aggregate
        needs every upload at once). A reducible aggregate takes each chunk's uploads as it finishes and frees them,
        so a chunk need hold no more clients than the executor works on at once (a call's, or a thread each); it
        takes as many more such groups as keep their values under MATERIAL_MEMORY of the memory in use as the timing
        starts (fewer chunks, each starting and ending its threads, at no material memory; whole groups, so that no
        thread waits out a chunk's odd client alone)."""
        if not self.choice.folds:
            return None
        clients = self.trial.clients
        at_once = self.choice.build(name, False, self.device).executor.clients_at_once(clients, self.device)
        return min(clients, max(1, self.lean_chunk // at_once) * at_once)

    def run(self, name: str, steps: int = TRIAL_STEPS, clients: int | None = None, per_call: int | None = None) -> None:
        """The trial by candidate `name`, batching `per_call` clients a call (by default as measured); the first
        `clients` at once, or by default all of them in the rounds' chunks."""
        per_chunk = self.per_chunk(name) if clients is None else None
        self.trial(self.choice.build(name, False, self.device, per_call), steps, clients, per_chunk)

    def warm_up(self, name: str) -> None:
        """The trial's first step a phase: the first call's costs, and the same peak memory."""
        self.run(name, steps=1)

    def call_seconds(self, name: str, clients: int) -> float:
        """The first step of each local phase of the trial's first `clients` clients in one call (a first step is
        the batched one of `loop_batched_first`)."""
        return best_time(lambda: self.run(name, 1, clients, clients), self.device, repeats=1, warm=False)
