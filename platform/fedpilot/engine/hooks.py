"""The stage's round-end hook: what a round ended with, as one typed value, and the callback that receives it.

Loggers, progress displays and pruners subclass `RoundCallback` and implement `on_round_end`; they read the
`RoundResult`, never the stage's own records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import lightning as L


@dataclass(frozen=True)
class RoundResult:
    """What a round of a stage ended with."""

    round: int  # rounds the stage has done (Lightning's global step): the step its metrics are logged at
    metrics: Mapping[str, float]  # training stats and round time, and the evaluation's summary when one was due
    shown: Mapping[str, float] = field(default_factory=dict)  # the latest loss and val score, for a progress display
    executor: str = ""  # the executor the round ran with

    @classmethod
    def of(cls, trainer: Any, stage: Any) -> RoundResult:
        """The stage's result of its latest round (a stand-in without one, holding only a `round_log`, gives that)."""
        result = getattr(stage, "round_result", None)
        if result is not None:
            return result
        return cls(trainer.global_step, MappingProxyType(dict(stage.round_log)))


class RoundCallback(L.Callback):
    """A Lightning callback called at the end of every round of a stage with the round's `RoundResult`."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.on_round_end(trainer, pl_module, RoundResult.of(trainer, pl_module))

    def on_round_end(self, trainer: L.Trainer, stage: L.LightningModule, result: RoundResult) -> None:
        """Called after each round (its server step done, its evaluation logged when due)."""
