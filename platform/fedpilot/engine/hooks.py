"""The stage's rounds as Lightning sees them: the stream of round tokens it steps through (`Rounds`), what stops
them (`RoundGuard`), what a round ended with, as one typed value, and the callback that receives it.

Loggers, progress displays and pruners subclass `RoundCallback` and implement `on_round_end` (and `on_round_start`);
they read the `RoundResult` (and `RoundStart`), never the stage's own records.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import lightning as L
from torch.utils.data import IterableDataset

from fedpilot.errors import Diverged, NothingToTrain, StageFailed


@dataclass(frozen=True)
class RoundResult:
    """What a round of a stage ended with."""

    round: int  # rounds the stage has done (Lightning's global step): the step its metrics are logged at
    metrics: Mapping[str, float]  # training stats and round time, and the evaluation's summary when one was due
    shown: Mapping[str, float] = field(default_factory=dict)  # the latest loss and val score, for a progress display
    executor: str = ""  # the executor the round ran with
    # a batch of trials (engine/trials.py): each trial still training's own result of the round, by trial index
    trials: Mapping[int, RoundResult] = field(default_factory=dict)

    @classmethod
    def of(cls, trainer: Any, stage: Any) -> RoundResult:
        """The stage's result of its latest round (a stand-in without one, holding only a `round_log`, gives that)."""
        result = getattr(stage, "round_result", None)
        if result is not None:
            return result
        return cls(trainer.global_step, MappingProxyType(dict(stage.round_log)))


@dataclass(frozen=True)
class RoundStart:
    """What a round about to run does beyond its work: `timing`, the executor candidates are timed on it first (a
    longer round)."""

    round: int  # rounds the stage has done
    timing: bool = False

    @classmethod
    def of(cls, trainer: Any, stage: Any) -> RoundStart:
        """The stage's next round (a stand-in without `upcoming`: a plain round)."""
        upcoming = getattr(stage, "upcoming", None)
        return upcoming if upcoming is not None else cls(trainer.global_step)


class RoundCallback(L.Callback):
    """A Lightning callback called at the start of every round of a stage with a `RoundStart` and at its end with the
    round's `RoundResult`."""

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.on_round_start(trainer, pl_module, RoundStart.of(trainer, pl_module))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.on_round_end(trainer, pl_module, RoundResult.of(trainer, pl_module))

    def on_round_start(self, trainer: L.Trainer, stage: L.LightningModule, start: RoundStart) -> None:
        """Called before each round."""

    def on_round_end(self, trainer: L.Trainer, stage: L.LightningModule, result: RoundResult) -> None:
        """Called after each round (its server step done, its evaluation logged when due)."""


class Rounds(IterableDataset):
    """The stage's 'data': an endless stream of round tokens (the round index is the global step); the stage refuses
    a round past its last and a round that did not move the step on (RoundGuard.check_progress), so the stream
    cannot outlive the stage's rounds."""

    def __iter__(self) -> Iterator[int]:
        while True:
            yield 0


class RoundGuard:
    """What stops a stage (`name`, of `algorithm`) instead of letting it loop or train on NaN: a round past its last
    or run again (no server step moved Lightning's step on), and a training loss or aggregated update that is not
    finite."""

    def __init__(self, name: str, algorithm: str):
        self.name, self.stage = name, f"stage {name!r} ({algorithm})"  # `stage`: how errors name it
        self.last_round: int | None = None  # the round the last training step ran
        self.last_finite_loss: float | None = None  # the latest round's training loss, named if a round diverges

    @contextmanager
    def round(self, round_idx: int) -> Iterator[None]:
        """A round that asks for work the stage cannot do (NothingToTrain) fails the stage, named."""
        try:
            yield
        except NothingToTrain as err:
            raise StageFailed(f"{self.stage}, round {round_idx + 1}: {err}") from None

    def check_progress(self, round_idx: int, rounds: int) -> None:
        """Each training step trains a new round of the stage's `rounds`: one past its last round, or one that did
        not move the step on, stops the stage instead of looping on Lightning's endless stream of rounds."""
        if round_idx >= rounds or round_idx == self.last_round:
            raise StageFailed(f"{self.stage}: round {round_idx + 1} of {rounds} would run again or past the stage's "
                              "end (the previous round did not step the server optimizer); stopped instead of looping")
        self.last_round = round_idx

    def check_finite(self, round_idx: int, train_loss: float, pseudo_grad: dict[str, Any]) -> None:
        """Stop at the first round whose training loss or aggregated update is not finite, before the server steps
        on it: a stage that goes on would train on NaN (Diverged names the stage, the round and the last finite
        loss)."""
        if not math.isfinite(train_loss):
            raise Diverged(self.name, round_idx + 1, "training loss", self.last_finite_loss)
        # A sum per tensor (no boolean copy of the update, as an isfinite pass makes, on every round): it is not
        # finite whenever an entry is not, or when the entries overflow float32 together (divergence too)
        if pseudo_grad and not math.isfinite(float(sum(g.sum() for g in pseudo_grad.values()))):
            raise Diverged(self.name, round_idx + 1, "aggregated update", train_loss)
        self.last_finite_loss = train_loss
