"""A task owns its training loss, its per-sample metrics and the names they are recorded under; the executors,
the evaluation and the records use it instead of assuming class labels."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.func import vmap

from fedpilot import metric_names

Scores = dict[str, tuple[torch.Tensor, torch.Tensor]]  # metric -> (sum over a sample's units, number of units)


class Task(ABC):
    """What a model's outputs are scored by.

    metrics: per-client metrics of an evaluation (a client's value is the sum over its samples' units divided by
    their number), recorded as `{split}_{metric}_weighted`; those in `distributions` also get the whole
    per-client distribution `{split}_{metric}_{mean,std,min,p10,...}`; the first of them is the task's primary
    metric (stage tables, plots, better/worse than the previous stage), better when higher if `higher_is_better`.
    loss: the metric training minimizes; train_metric: what training steps report as `train_{train_metric}`.
    The built-in tasks take their metric names from fedpilot.metric_names, which the torch-free spec also reads.
    """

    name: ClassVar[str]
    metrics: ClassVar[tuple[str, ...]]
    distributions: ClassVar[tuple[str, ...]]
    loss_metric: ClassVar[str] = "loss"
    train_metric: ClassVar[str]
    higher_is_better: ClassVar[bool] = True

    @property
    def primary(self) -> str:
        return self.distributions[0]

    @abstractmethod
    def scores(self, output: torch.Tensor, y: torch.Tensor) -> Scores:
        """Per sample (y's first dimension): each metric summed over the sample's units, and the units it counts."""

    def loss(self, output: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(training loss, train_metric) of a batch: means over the units of the samples with weight 1."""
        scores = self.scores(output, y)
        return _mean(*scores[self.loss_metric], w), _mean(*scores[self.train_metric], w).detach()

    def client_losses(self, output: torch.Tensor, y: torch.Tensor,
                      w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`loss` of K clients at once, each on its own batch (output, y and w with the clients first: [K, B, ...]):
        their losses and train metrics [K]. A task whose `loss` is its own has it vmapped over the clients."""
        if type(self).loss is not Task.loss:
            return vmap(self.loss)(output, y, w)
        scores = self.scores(output.flatten(0, 1), y.flatten(0, 1))
        weights = w.flatten()

        def means(metric: str) -> torch.Tensor:
            total, units = scores[metric]
            return ((total * weights).view(w.shape).sum(1)
                    / (units * weights).view(w.shape).sum(1).clamp_min(1.0))

        return means(self.loss_metric), means(self.train_metric).detach()


def _mean(total: torch.Tensor, units: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (total * w).sum() / (units * w).sum().clamp_min(1.0)


class Classification(Task):
    """Class labels [B] (or one label per position [B, T], each sample scored by the mean over its positions):
    cross-entropy loss and accuracy."""

    name = "classification"
    metrics, distributions = metric_names.task_metrics(name), metric_names.distributions(name)
    train_metric = "acc"

    def scores(self, output: torch.Tensor, y: torch.Tensor) -> Scores:
        loss = F.cross_entropy(output.flatten(0, -2).float(), y.flatten(), reduction="none").view(y.shape)
        hits = (output.argmax(-1) == y).to(loss.dtype)
        if y.dim() > 1:
            loss, hits = loss.flatten(1).mean(1), hits.flatten(1).mean(1)
        one = torch.ones_like(loss)
        return {"loss": (loss, one), "acc": (hits, one)}


class NextToken(Task):
    """Next-token prediction over windows [B, T]: the loss over every non-padding target, the accuracy over real
    tokens only (not padding, out-of-vocabulary, begin or end markers: Pillutla et al., ICML 2022, and TFF's Stack
    Overflow task), both per token (a client's accuracy is its hits over all its real tokens)."""

    name = "next_token"
    metrics, distributions = metric_names.task_metrics(name), metric_names.distributions(name)
    train_metric = "acc"

    def __init__(self, pad: int, unk: int, bos: int, eos: int):
        self.pad, self.not_scored = pad, (pad, unk, bos, eos)

    def scores(self, output: torch.Tensor, y: torch.Tensor) -> Scores:
        loss = F.cross_entropy(output.flatten(0, -2).float(), y.flatten(), reduction="none").view(y.shape)
        counted = (y != self.pad).to(loss.dtype)
        real = torch.stack([y != token for token in self.not_scored]).all(0).to(loss.dtype)
        hits = (output.argmax(-1) == y).to(loss.dtype) * real
        return {"loss": ((loss * counted).sum(1), counted.sum(1)), "acc": (hits.sum(1), real.sum(1))}


class Regression(Task):
    """Float targets [B] or [B, d]: mean squared error (the loss) and mean absolute error, per sample averaged
    over its d targets."""

    name = "regression"
    metrics, distributions = metric_names.task_metrics(name), metric_names.distributions(name)
    loss_metric = "mse"
    train_metric = "mae"
    higher_is_better = metric_names.higher_is_better(metric_names.primary(name))

    def scores(self, output: torch.Tensor, y: torch.Tensor) -> Scores:
        error = output.float().reshape(y.shape[0], -1) - y.float().reshape(y.shape[0], -1)
        one = torch.ones(y.shape[0], dtype=error.dtype, device=error.device)
        return {"mse": (error.pow(2).mean(1), one), "mae": (error.abs().mean(1), one)}


CLASSIFICATION = Classification()


def make_task(name: str, specials: dict[str, int] | None = None) -> Task:
    """The task `name` (next_token needs the token ids of pad, unk, bos, eos)."""
    if name == "next_token":
        return NextToken(**specials)
    return {"classification": CLASSIFICATION, "regression": Regression()}[name]
