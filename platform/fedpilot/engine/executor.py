"""What an executor is: the local steps of a batch plan for a chunk of clients, under one step rule.

Parameters are dicts of tensors with a leading client dimension [K, ...]. `Executor` declares what every executor
does (`train`, `gradients`) and what it supports; the stage chooses one executor per stage and the round carries it
to the cohort. The sequential reference is `engine/sequential.py`; the fast executors and their machinery live in
`engine/accel/`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.func import functional_call

from fedpilot.engine.task import Task

if TYPE_CHECKING:
    from fedpilot.engine.data import AugmentParams

Tensors = dict[str, torch.Tensor]
Forward = Callable[[nn.Module, Tensors, torch.Tensor], torch.Tensor]


def plain_forward(module: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward with `params`."""
    return functional_call(module, params, (x,))


Rate = float | torch.Tensor  # one value for every row, or one per row of the call [K] (a batch of trials' rows)


@dataclass
class StepRule:
    """How a gradient becomes a step: per-parameter lr, L2 pull to a reference, clipping, weight decay.

    Order as in torch: the pull is part of the loss, clipping is on the whole gradient of one client,
    weight decay is added after clipping (torch.optim.SGD's weight_decay). The lrs, the clipping threshold, the weight
    decay and the pull's weight are each one number, or one per row [K] (rows of several trials of a batch, each its
    own value).
    """

    lr: dict[str, Rate]
    clip_norm: Rate | None = None
    weight_decay: Rate = 0.0
    prox: Rate = 0.0
    reference: Tensors = field(default_factory=dict)

    def apply_(self, params: Tensors, grads: Tensors, active: torch.Tensor) -> None:
        """One SGD step in place on `params` [K, ...] (consuming `grads`) for each client whose `active` flag is set."""
        for n, g in self.directions(params, grads, active).items():
            lr = self.lr[n]
            if torch.is_tensor(lr):
                params[n].sub_(g.mul_(per_client(lr, g)))
            else:
                params[n].sub_(g, alpha=lr)

    def directions(self, params: Tensors, grads: Tensors, active: torch.Tensor) -> Tensors:
        """What each parameter steps against at `params`, in the memory of `grads`: the gradient with the pull,
        clipped, with weight decay; zero for clients whose `active` flag is not set."""
        if _nonzero(self.prox):
            for n, g in grads.items():
                _add_scaled(g, params[n] - self.reference[n], self.prox)
        scale = None if self.clip_norm is None and bool(active.all()) else active.to(next(iter(grads.values())).dtype)
        if self.clip_norm is not None:
            norm = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
            limit = self.clip_norm.to(norm) if torch.is_tensor(self.clip_norm) else self.clip_norm
            scale = scale * (limit / (norm + 1e-6)).clamp(max=1.0)
        for n, g in grads.items():
            p = params[n]
            if scale is not None:
                g.mul_(per_client(scale, p))
            if _nonzero(self.weight_decay):
                _add_scaled(g, p * per_client(active.to(p.dtype), p), self.weight_decay)
        return grads

    @property
    def plain(self) -> bool:
        """Plain SGD: no clipping, weight decay or pull to a reference (per-row weights count as not plain)."""
        return self.clip_norm is None and not _nonzero(self.weight_decay) and not _nonzero(self.prox)

    def stepped(self, start: Tensors, grads: Tensors, active: torch.Tensor) -> Tensors:
        """One step from `start` [K, ...] (broadcast rows allowed) into the memory of `grads`, consuming them."""
        out = {}
        for n, g in self.directions(start, grads, active).items():
            lr = self.lr[n]
            out[n] = torch.sub(start[n], g.mul_(per_client(lr, g)), out=g) if torch.is_tensor(lr) else torch.add(
                start[n], g, alpha=-lr, out=g)
        return out

    def for_rows(self, rows: slice, params: Tensors) -> StepRule:
        """This rule for the clients of `rows` alone (their rows of a per-client reference and of per-row values)."""
        reference = {n: r[rows] if r.dim() == params[n].dim() else r for n, r in self.reference.items()}
        return StepRule({n: _rows(v, rows) for n, v in self.lr.items()}, _rows(self.clip_norm, rows),
                        _rows(self.weight_decay, rows), _rows(self.prox, rows), reference)

    def at(self, k: int) -> StepRule:
        """This rule for row `k` alone, its values as numbers (the sequential reference's optimizer takes numbers)."""
        return StepRule({n: _number(v, k) for n, v in self.lr.items()}, _number(self.clip_norm, k),
                        _number(self.weight_decay, k), _number(self.prox, k), self.reference)

    def renamed(self, names: dict[str, str]) -> StepRule:
        """The same rule for the parameters in `names` (full name -> new name), under their new names."""
        return StepRule({names[n]: v for n, v in self.lr.items() if n in names}, self.clip_norm, self.weight_decay,
                        self.prox, {names[n]: v for n, v in self.reference.items() if n in names})


def _nonzero(value: Rate) -> bool:
    """Whether a value is to be applied: a nonzero number, or any per-row values."""
    return torch.is_tensor(value) or bool(value)


def _add_scaled(g: torch.Tensor, term: torch.Tensor, weight: Rate) -> None:
    """g += weight * term, `weight` one number or one per row."""
    if torch.is_tensor(weight):
        g.addcmul_(term, per_client(weight, g))
    else:
        g.add_(term, alpha=weight)


def _rows(value: Rate | None, rows: slice) -> Rate | None:
    return value[rows] if torch.is_tensor(value) else value


def _number(value: Rate | None, k: int) -> float | None:
    return float(value[k]) if torch.is_tensor(value) else value


def per_client(values: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """A [K] tensor shaped [K, 1, ...] to broadcast against a [K, ...] tensor `like`, on its device and, for
    floating-point values, in its dtype (a mask stays boolean, counts integer); a number stays as it is (one value
    for every row: a hyperparameter that is one number outside a batch of trials)."""
    if not torch.is_tensor(values):
        return values
    dtype = like.dtype if values.is_floating_point() else values.dtype
    return values.to(like.device, dtype).view(-1, *[1] * (like.dim() - 1))


def _as_is(rows: torch.Tensor) -> torch.Tensor:
    return rows


@dataclass
class Batches:
    """Steps' inputs are `prepare(source[index[rows, s]])`, augmented by the plan's `augment` parameters; labels and
    0/1 weights are already laid out [K, S, B]. In a chunk of several trials' rows, `trials` holds the rows of each
    trial, in order, and `trial_models` the parameter names whose rows hold their trial's one value (its global
    model): rows that start from the same weights (a batched first step takes them together)."""

    source: torch.Tensor
    index: torch.Tensor
    labels: torch.Tensor
    weight: torch.Tensor
    active: torch.Tensor
    prepare: Callable[[torch.Tensor], torch.Tensor] = _as_is
    augment: AugmentParams | None = None
    trials: tuple[int, ...] | None = None
    trial_models: frozenset[str] = frozenset()

    def inputs(self, rows: Any, steps: Any) -> torch.Tensor:
        """Model inputs of the planned samples [rows, steps] (each an int or a slice)."""
        x = self.prepare(self.source[self.index[rows, steps]])
        return x if self.augment is None else self.augment.apply(x, rows, steps)


@dataclass
class TrainStats:
    """Per-client sums over the active local steps: loss, the task's train metric on the batch, and the number of
    steps."""

    loss: torch.Tensor
    metric: torch.Tensor
    steps: torch.Tensor

    @classmethod
    def zeros(cls, k: int, device: torch.device) -> TrainStats:
        return cls(*(torch.zeros(k, device=device) for _ in range(3)))

    def rows(self, rows: slice) -> TrainStats:
        """The sums of the clients of `rows` (views: adding to them adds to these)."""
        return TrainStats(self.loss[rows], self.metric[rows], self.steps[rows])

    def add(self, loss: torch.Tensor, metric: torch.Tensor, active: torch.Tensor) -> None:
        on = active.to(loss.dtype)
        self.loss += loss.detach() * on
        self.metric += metric.detach() * on
        self.steps += on


def precision_context(precision: str, device: torch.device) -> AbstractContextManager:
    """Lightning's `bf16-mixed`: forward passes under bfloat16 autocast, parameters, gradients and updates in
    float32; `32-true`: plain float32. Only the clients' forward passes run under it, never the aggregation."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


class Executor(ABC):
    """Runs the local steps of a batch plan for a chunk of clients, applying the model with `forward` and scoring
    it with `task`. Every executor reaches the sequential reference's numbers on the same plan.

    Class attributes: `name`, its `execution:` value; `uses_features`, it can run head steps on precomputed body
    features; `batched`, its forward passes run batched over clients (evaluation then vmaps the clients);
    `groups_clients`, its memory grows with the clients one call batches, at most `clients_per_call` of them (None:
    the whole chunk), a number the stage measures (`timing.clients_per_call`).

    `forward` None: the model's own forward applies (`models_forward`; Algorithm.models_forward), which lets an
    executor run the model's layers its own way; else the algorithm's, as written.
    """

    name: ClassVar[str]
    uses_features: ClassVar[bool] = True
    batched: ClassVar[bool] = False
    groups_clients: ClassVar[bool] = False

    def __init__(self, forward: Forward | None, task: Task, clients_per_call: int | None = None):
        self.models_forward = forward is None
        self.forward: Forward = plain_forward if forward is None else forward
        self.task, self.clients_per_call = task, clients_per_call

    def clients_at_once(self, clients: int, device: torch.device) -> int:
        """How many of a chunk's `clients` it works on at once on `device`: a call's (at most `clients_per_call`)
        where it batches clients, else one."""
        return min(clients, self.clients_per_call or clients) if self.groups_clients else 1

    def groups(self, clients: int) -> list[slice]:
        """The rows of `clients` in groups of at most `clients_per_call`, each batched in one call."""
        size = self.clients_per_call or clients
        return [slice(lo, min(lo + size, clients)) for lo in range(0, clients, size)]

    @classmethod
    def supports(cls, module: nn.Module, device: torch.device) -> bool:
        """Whether it can run `module` on `device` (a stage times only the executors that can)."""
        return True

    @staticmethod
    def has_layers(module: nn.Module, kind: type[nn.Module]) -> bool:
        """Whether `module` holds a layer of `kind` (or of a subclass): what `supports` looks for."""
        return any(isinstance(m, kind) for m in module.modules())

    @abstractmethod
    def train(self, module: nn.Module, trainable: Tensors, frozen: Tensors, fixed: Tensors,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Tensors:
        """Each client's `trainable` parameters [K, ...] after its active steps of the plan under `rule` (`frozen`:
        per-client [K, ...] parameters not trained, `fixed`: broadcast ones); adds the steps' loss to `stats`."""

    @abstractmethod
    def gradients(self, module: nn.Module, params: Tensors, frozen: Tensors, fixed: Tensors, batches: Batches,
                  stats: TrainStats) -> Tensors:
        """Each client's mean gradient over its active steps of the plan, at `params` (nothing is updated)."""


@dataclass(frozen=True)
class ExecutionPlan:
    """How a stage's rounds run, as its executor choice decided (engine/accel/choice.py): the `executor` of its local
    work and, for head-only work on the body's features, `head` (None: such work runs as any other); whether the
    model's own forward applies (`models_forward`, else the algorithm's `forward`); the rows a chunk of a round takes
    (`chunk`; None: the stage's `max_parallel_clients`); how many trials' rows a round trains (`trials`: one, or a
    batch's K, trial after trial) and how many trials one chunk's rows may come from (`span`; None: as many as the
    executor batches, 1: each trial's rows computed on their own, as alone). `RoundWork` holds it; a resumed stage
    rebuilds the same one from the choice's checkpoint state and its batch's span."""

    executor: Executor
    head: Executor | None
    forward: Forward
    models_forward: bool
    chunk: int | None = None
    trials: int = 1
    span: int | None = None
