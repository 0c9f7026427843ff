"""Every client of a chunk in one vmapped gradient call per step: `VmapExecutor` (torch.func.vmap over
torch.func.grad) and `VmapAutogradExecutor` (vmap for the forward pass, autograd for the backward)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import grad, vmap

from fedpilot.engine.executor import Batches, Executor, Forward, StepRule, Tensors, TrainStats, per_client
from fedpilot.engine.memory import keep_freed_memory
from fedpilot.engine.task import Task


def client_grad(module: nn.Module, forward: Forward, task: Task) -> Callable[..., tuple[Tensors, tuple]]:
    """grad(trainable, per_client_frozen, shared_frozen, x, y, w) of one client, with (loss, metric) as aux."""

    def loss(trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w):
        value, metric = task.loss(forward(module, {**trainable, **frozen, **fixed}, x), y, w)
        return value, (value, metric)

    return grad(loss, has_aux=True)


def clients_grad(module: nn.Module, forward: Forward, task: Task) -> Callable[..., tuple[Tensors, tuple]]:
    """The gradients of every client at once [K, ...] with each client's (loss, metric), by autograd through the
    vmapped losses: a client's loss depends only on its own rows, so the gradient of the clients' summed loss holds
    each client's gradient in its row. Parameters nothing depends on get zeros, as under vmap(grad)."""
    losses = vmap(lambda trainable, frozen, fixed, x, y, w: task.loss(forward(module, {**trainable, **frozen, **fixed},
                                                                                 x), y, w),
                  in_dims=(0, 0, None, 0, 0, 0), randomness="different")

    def step(trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w):
        leaves = {n: p.detach().requires_grad_() for n, p in trainable.items()}
        with torch.enable_grad():
            value, metric = losses(leaves, frozen, fixed, x, y, w)
            grads = torch.autograd.grad(value.sum(), list(leaves.values()), materialize_grads=True)
        return dict(zip(leaves, grads, strict=True)), (value.detach(), metric.detach())

    return step


class VmapExecutor(Executor):
    """All clients of a chunk in one vmapped gradient call per step."""

    name = "vmap"
    batched = True
    groups_clients = True

    @classmethod
    def supports(cls, module: nn.Module, device: torch.device) -> bool:
        """Not recurrent layers: torch.func cannot vmap the fused RNN kernels."""
        return not cls.has_layers(module, nn.RNNBase)

    def step_grad(self, module: nn.Module) -> Callable[..., tuple[Tensors, tuple]]:
        """step(trainable, frozen, fixed, x, y, w) -> (every client's gradient [K, ...], (loss, metric) [K])."""
        return vmap(client_grad(module, self.forward, self.task), in_dims=(0, 0, None, 0, 0, 0),
                    randomness="different")

    def stepper(self, module: nn.Module, rule: StepRule) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """step(trainable, frozen, fixed, x, y, w, active): one step of `rule` in place on every client's `trainable`
        [K, ...], returning each client's (loss, metric) [K]."""
        step_grad = self.step_grad(module)

        def step(trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w, active):
            grads, (loss, metric) = step_grad(trainable, frozen, fixed, x, y, w)
            rule.apply_(trainable, grads, active)
            return loss, metric

        return step

    def train(self, module: nn.Module, trainable: Tensors, frozen: Tensors, fixed: Tensors,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Tensors:
        keep_freed_memory(batches.source.device)
        trainable = {n: p.clone() for n, p in trainable.items()}
        groups = [(rows, self.stepper(module, rule.for_rows(rows, trainable)), stats.rows(rows),
                   client_rows(trainable, rows), client_rows(frozen, rows))  # views: the steps update trainable
                  for rows in self.groups(batches.index.shape[0])]
        for s in range(batches.index.shape[1]):
            for rows, step, their_stats, their_trainable, their_frozen in groups:
                active = batches.active[rows, s]
                if not bool(active.any()):
                    continue
                loss, acc = step(their_trainable, their_frozen, fixed, batches.inputs(rows, s),
                                 batches.labels[rows, s], batches.weight[rows, s], active)
                their_stats.add(loss, acc, active)
        return trainable

    def gradients(self, module: nn.Module, params: Tensors, frozen: Tensors, fixed: Tensors, batches: Batches,
                  stats: TrainStats) -> Tensors:
        """Each client's mean gradient over its active steps of the plan, at `params` (nothing is updated)."""
        step_grad = self.step_grad(module)
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        count = torch.zeros(batches.index.shape[0], device=batches.active.device)
        groups = [(rows, stats.rows(rows), client_rows(params, rows), client_rows(frozen, rows))
                  for rows in self.groups(batches.index.shape[0])]
        for s in range(batches.index.shape[1]):
            for rows, their_stats, their_params, their_frozen in groups:
                active = batches.active[rows, s]
                if not bool(active.any()):
                    continue
                grads, (loss, acc) = step_grad(their_params, their_frozen, fixed, batches.inputs(rows, s),
                                               batches.labels[rows, s], batches.weight[rows, s])
                for n, g in grads.items():
                    total[n][rows] += g * per_client(active.to(g.dtype), g)
                count[rows] += active
                their_stats.add(loss, acc, active)
        return mean_of_steps(total, count)


class VmapAutogradExecutor(VmapExecutor):
    """vmap for the forward pass only, plain autograd backward through it (`clients_grad`): less dispatch than
    vmap(grad) for small models, slower for convolutions on CPU (bench/README.md). A candidate the stage times."""

    name = "vmap_autograd"

    def step_grad(self, module: nn.Module) -> Callable[..., tuple[Tensors, tuple]]:
        return clients_grad(module, self.forward, self.task)


def client_rows(params: Tensors, rows: slice) -> Tensors:
    """The clients of `rows` of per-client parameters [K, ...] (views)."""
    return {n: p[rows] for n, p in params.items()}


def mean_of_steps(total: Tensors, count: torch.Tensor) -> Tensors:
    """Per-client sums of step gradients [K, ...] divided by each client's number of active steps."""
    return {n: t / per_client(count.clamp_min(1), t) for n, t in total.items()}
