"""A batch of trials: K stages that differ only in values used in arithmetic (step sizes, pull weights, the server's
numbers), trained as one computation. Every round the K trials take the same cohort with the same minibatches
(sampling is drawn from the seed, the stage and the round); their rows, K x C trial after trial, train in chunks that
may span trials, each row with its trial's values and global model; each trial aggregates its own rows, steps its own
server (one parameter group of one server optimizer), keeps its own banks and records, and is evaluated as it would
be alone. Trial k of a batch is the computation of trial k alone (tests/test_engine_trials.py).

Trials that cannot share a computation (an algorithm that does not batch trials, values that change the work, another
algorithm) still train in lockstep, round by round: the batch's `groups` each train as one computation, group after
group, each with its own executor choice and server optimizer, so a search judges every trial of a wave at the same
round whichever algorithm it runs (studies/halving.py).

Trials can leave a running batch (`drop`): a search's rule stops the ones losing at a rung, and a trial whose
training diverges stops by itself; their rows leave the computation and their records stay as they were. The round's
`RoundResult` holds each trial's own (`trials`), with its validation summary when one was due.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import Any

import lightning as L
import torch
from torch import nn

from fedpilot.engine.aggregate import server_optimizer
from fedpilot.engine.config import StageConfig
from fedpilot.engine.ddp import distributed
from fedpilot.engine.hooks import RoundResult, Rounds, RoundStart
from fedpilot.engine.protocol import Algorithm
from fedpilot.engine.rounds import begin_round, run_round
from fedpilot.engine.stage import FederatedStage
from fedpilot.engine.values import guarded
from fedpilot.errors import Diverged

STOPPED_DROPPED, STOPPED_DIVERGED = "dropped", "diverged"


class TrialBatch(L.LightningModule):
    """The stages in `stages`, each one trial, trained as one batch (module docstring): a LightningModule whose
    training_step is one round of every trial still in it (`active`), in `groups` that each train as one computation
    (`batch_groups`: the trials that check_batch allows together; the others each a group of their own). Each trial
    keeps its stage (`trials[k]`: its model, banks, server state, records), as a stage run alone would have them;
    `stopped` says when and why a trial left the batch. `span`: the most trials one chunk's rows come from (None: as
    many as the executor batches; 1: each trial's rows computed on their own, the computation of each trial alone):
    how the rounds run, not what they compute."""

    def __init__(self, stages: Sequence[FederatedStage], span: int | None = None):
        super().__init__()
        check_lockstep(stages)
        self.automatic_optimization = False
        self.trials = nn.ModuleList(stages)
        self.groups = batch_groups(stages)
        self.algorithms = [batch_algorithm([stages[k] for k in group]) for group in self.groups]
        self.active = list(range(len(stages)))
        self.stopped: dict[int, dict[str, Any]] = {}  # trial -> {"round": rounds done, "why": ..., "error": ...}
        self.errors: dict[int, BaseException] = {}  # a diverged trial's error, or why one was dropped, in this process
        for group in self.groups:  # one executor a group: its lead's, timed on the group's first chunk
            lead = stages[group[0]]
            lead.executor_choice.span = span
            for k in group[1:]:
                stages[k].executor_choice = lead.executor_choice
        self.round_result: RoundResult | None = None

    @property
    def lead(self) -> FederatedStage:
        return self.trials[0]

    @property
    def n_rounds(self) -> int:
        return self.lead.n_rounds

    @property
    def config(self) -> StageConfig:
        """The settings its trials share (the lead's: rounds, evaluation, execution; not its values)."""
        return self.lead.config

    @property
    def execution(self) -> str:
        return self.lead.execution

    @property
    def executor_choice(self) -> Any:
        """The batch's one executor choice (its trials' stages share the lead's ExecutorChoice)."""
        return self.lead.executor_choice

    @property
    def upcoming(self) -> RoundStart:
        return RoundStart(self.global_step, self.executor_choice.pending)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(Rounds(), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """One server optimizer, a parameter group per trial: one step a round, once every group has trained (a step
        is a round to Lightning), each trial's group with its own numbers (a trial whose parameters got no gradient,
        stopped, is not stepped)."""
        return server_optimizer([stage.server_group() for stage in self.trials])

    def setup(self, stage: str) -> None:
        if distributed():
            raise ValueError("a batch of trials trains in one process: run it with devices: 1")
        self.lead.setup(stage)
        for trial in self.trials[1:]:  # one copy of the federation's data for the batch
            trial.data, trial.data_on_device = self.lead.data, self.lead.data_on_device

    def training_step(self, batch: int, batch_idx: int) -> None:
        round_idx, trained = self.global_step, []
        for group, algorithm in zip(self.groups, self.algorithms, strict=True):
            going = [k for k in group if k in self.active]
            if going:
                trained.append((going, *self._group_round(round_idx, going, algorithm)))
        start = time.perf_counter()
        self.lead.server_step(self.optimizers())  # once a round: a step is a round to Lightning
        step_s, finished = time.perf_counter() - start, {}
        for going, results, took in trained:
            for k, stats in zip(going, results, strict=True):
                if isinstance(stats, Diverged):
                    self.errors[k] = stats
                    self.drop([k], STOPPED_DIVERGED, str(stats), round_idx)
                else:
                    self.trials[k].finish_round(round_idx, stats, took + step_s)
                    finished[k] = self.trials[k].round_result
        seconds = sum(took for _, _, took in trained) + step_s
        self.round_result = RoundResult(round_idx + 1, MappingProxyType({"round_time_s": seconds}),
                                        MappingProxyType({"trials": float(len(self.active))}), self.execution,
                                        MappingProxyType(finished))

    def _group_round(self, round_idx: int, going: list[int],
                     algorithm: Algorithm) -> tuple[list[dict[str, float] | Diverged], float]:
        """Round `round_idx` of a group's trials still `going`, as one computation, up to the server's step: each
        trial's round stats (or what made it diverge), and the seconds it took."""
        stages = [self.trials[k] for k in going]
        with begin_round(stages, round_idx, algorithm):
            start = time.perf_counter()
            results = run_round(stages, round_idx, algorithm, None)
        return results, time.perf_counter() - start

    def drop(self, trials: Iterable[int], why: str = STOPPED_DROPPED, error: str = "",
             rounds: int | None = None, cause: BaseException | None = None) -> None:
        """Trials `trials` leave the batch: from the next round their rows leave the computation (the batch gets
        cheaper); their stages keep what they recorded (their validation at every evaluation so far). `rounds`:
        the rounds they trained (default: those the batch has done); `cause`: the error their runs end with (a
        search's pruning: KILLED, not FAILED)."""
        done = self.global_step if rounds is None else rounds
        for k in trials:
            if k not in self.active:
                raise ValueError(f"trial {k} is not in the batch (still training: {self.active})")
            self.active.remove(k)
            self.stopped[k] = {"round": done, "why": why, "error": error or str(cause or "")}
            if cause is not None:
                self.errors[k] = cause

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Each trial's records and server state, the batch's trials still training and those stopped, each group's
        executor choice, and each trial's banks' chains of changes (save_changes_in)."""
        checkpoint["fedpilot"] = {"trials": [stage.records() for stage in self.trials], "active": list(self.active),
                                  "stopped": dict(self.stopped),
                                  "choices": [self.trials[g[0]].executor_choice.state_dict() for g in self.groups]}
        for k, stage in enumerate(self.trials):
            stage.save_bank_changes(self.global_step, self.trainer.is_global_zero, checkpoint["state_dict"],
                                    f"trials.{k}.")

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("fedpilot", {})
        for stage, records in zip(self.trials, saved.get("trials", []), strict=False):
            stage.load_records(records)
        self.active = list(saved.get("active", self.active))
        self.stopped = dict(saved.get("stopped", {}))
        for group, choice in zip(self.groups, saved.get("choices", []), strict=False):
            self.trials[group[0]].executor_choice.load_state_dict(choice)

    def save_changes_in(self, folder: Any) -> None:
        """Each trial's checkpoints save its banks as chains of their changes in its own folder under `folder`
        (None: whole)."""
        for k, stage in enumerate(self.trials):
            stage.save_changes_in(None if folder is None else folder / f"trial-{k}")


def differences(stages: Sequence[FederatedStage]) -> dict[str, list[Any]]:
    """The stage keys whose values differ between `stages`, with each stage's value: the `local` and `server` blocks'
    fields (`local.lr`), the algorithm's params (`params.lr_v`), and the stage's other settings by name (`rounds`)."""
    lead, found = stages[0], {}
    blocks = {"local": lambda s: s.config.local, "server": lambda s: s.config.server,
              "params": lambda s: s.algorithm.params}
    for block, of in blocks.items():
        for name in type(of(lead)).model_fields:
            values = [getattr(of(stage), name) for stage in stages]
            if any(value != values[0] for value in values):
                found[f"{block}.{name}"] = values
    for name in type(lead.config).model_fields:
        values = [getattr(stage.config, name) for stage in stages]
        if name not in blocks and any(value != values[0] for value in values):
            found[name] = values
    return found


def check_batch(stages: Sequence[FederatedStage]) -> None:
    """That `stages` can train as one batch: one algorithm that batches trials (or a single stage), one model, split,
    federation, seed, stage and task, no model whose forward updates its buffers (batch norm's running statistics:
    the batch runs one module), and differences only in keys the algorithm batches (Algorithm.batchable). A
    ValueError names what stands in the way."""
    if not stages:
        raise ValueError("a batch of trials needs at least one stage")
    lead = stages[0]
    kind = type(lead.algorithm)
    if len(stages) > 1 and not kind.batches_trials:
        raise ValueError(f"{lead.algorithm.name} does not batch trials (batches_trials = False): run its trials one at "
                         "a time")
    shapes = [(n, tuple(p.shape)) for n, p in lead.model.named_parameters()]
    for stage in stages[1:]:
        same = {"algorithm": type(stage.algorithm) is kind, "federation": stage.data is lead.data,
                "model": [(n, tuple(p.shape)) for n, p in stage.model.named_parameters()] == shapes,
                "split": stage.personal_names == lead.personal_names and stage.shared_names == lead.shared_names,
                "seed and stage": (stage.seed, stage.stage_index) == (lead.seed, lead.stage_index),
                "task": stage.task.name == lead.task.name,
                "evaluation beyond participants": _same_novel(stage.novel, lead.novel) and stage.select == lead.select}
        different = [what for what, equal in same.items() if not equal]
        if different:
            raise ValueError(f"the stages of a batch of trials differ in their {', '.join(different)}")
    if any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats for m in lead.model.modules()):
        raise ValueError("a model with batch norm's running statistics does not batch trials: its forward updates "
                         "buffers of the one module the batch runs")
    differing = differences(stages)
    unbatchable = sorted(key for key in differing if not kind.batchable(key))
    if unbatchable:
        raise ValueError(f"the trials of a batch differ in {', '.join(unbatchable)}, which {lead.algorithm.name} does "
                         "not batch: run them in separate batches")
    unset = sorted(key for key, values in differing.items() if not all(_number(value) for value in values))
    if unset:
        raise ValueError(f"the trials of a batch differ in {', '.join(unset)} between numbers and values that are not "
                         "(null: a default taken elsewhere): run them in separate batches")


def check_lockstep(stages: Sequence[FederatedStage]) -> None:
    """That `stages` can train round by round side by side (TrialBatch): at least one, on one federation (the batch
    keeps one copy of its data) and over as many rounds. A ValueError names what stands in the way."""
    if not stages:
        raise ValueError("a batch of trials needs at least one stage")
    lead = stages[0]
    for stage in stages[1:]:
        same = {"federation": stage.data is lead.data, "rounds": stage.n_rounds == lead.n_rounds}
        different = [what for what, equal in same.items() if not equal]
        if different:
            raise ValueError(f"the stages of a batch of trials differ in their {', '.join(different)}")


def batch_groups(stages: Sequence[FederatedStage]) -> list[list[int]]:
    """The trials (by position) that train as one computation, each group in turn: a trial joins the first group it
    batches with (check_batch), else starts one."""
    groups: list[list[int]] = []
    for k, stage in enumerate(stages):
        for group in groups:
            try:
                check_batch([stages[j] for j in group] + [stage])
            except ValueError:
                continue
            group.append(k)
            break
        else:
            groups.append([k])
    return groups


def batch_algorithm(stages: Sequence[FederatedStage]) -> Algorithm:
    """The algorithm whose `local_update` trains a batch's chunks: the lead trial's, whose params that differ between
    the trials are `Varying` (read as one value, they fail; each row's is `cohort.params`)."""
    lead = stages[0].algorithm
    differing = {key for key in differences(stages) if key.startswith("params.")}
    if not differing:
        return lead
    algorithm = copy.copy(lead)
    algorithm.params = guarded(lead.params, differing, lead.name)
    return algorithm


def _number(value: Any) -> bool:
    """A number a row can have its own of (a pair of them: Adam's betas)."""
    if isinstance(value, tuple):
        return all(_number(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def _same_novel(a: Any, b: Any) -> bool:
    """The same held-out clients, adapted the same way (engine.novel.NovelClients), or none."""
    return a is b or (a is not None and b is not None and a.data is b.data and (a.local, a.cohort) == (b.local,
                                                                                                      b.cohort))
