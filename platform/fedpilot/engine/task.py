"""A task owns its training loss, its per-sample metrics and the names they are recorded under; the executors,
the evaluation and the records use it instead of assuming class labels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F


class Task(ABC):
    """What a model's outputs are scored by.

    metrics: per-client metrics of an evaluation, recorded as `{split}_{metric}_weighted`; those in
    `distributions` also get the whole per-client distribution `{split}_{metric}_{mean,std,min,p10,...}`.
    train_metric: the metric training steps report as `train_{train_metric}` next to `train_loss`.
    """

    name: ClassVar[str]
    metrics: ClassVar[tuple[str, ...]]
    distributions: ClassVar[tuple[str, ...]]
    train_metric: ClassVar[str]

    @abstractmethod
    def scores(self, output: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Per sample (y's first dimensions): the sum of each metric over the sample's units, and the number of
        units (1 for a label; real tokens of a sequence)."""

    def loss(self, output: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(training loss, train_metric) of a batch: means over the units of the samples with weight 1."""
        values, units = self.scores(output, y)
        total = (units * w).sum().clamp_min(1.0)
        return (values["loss"] * w).sum() / total, (values[self.train_metric].detach() * w).sum() / total


class Classification(Task):
    """Class labels [B] (or one label per position [B, T], each sample scored by the mean over its positions):
    cross-entropy loss and accuracy."""

    name = "classification"
    metrics = ("acc", "loss")
    distributions = ("acc",)
    train_metric = "acc"

    def scores(self, output: torch.Tensor, y: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        loss = F.cross_entropy(output.flatten(0, -2).float(), y.flatten(), reduction="none").view(y.shape)
        hits = (output.argmax(-1) == y).to(loss.dtype)
        if y.dim() > 1:
            loss, hits = loss.flatten(1).mean(1), hits.flatten(1).mean(1)
        return {"loss": loss, "acc": hits}, torch.ones_like(loss)


CLASSIFICATION = Classification()
