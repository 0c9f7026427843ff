"""One client after another, each with eager autograd over its own steps (faster than vmap for convolutions on CPU,
where vmap becomes a slow grouped convolution), one client per CPU core at a time: `LoopExecutor`, its channels-last
variant, and `BatchedFirstStepExecutor`, the loop after a first step batched over clients that start from the same
weights (engine/accel/shared_start.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedpilot.engine.accel.linear_graph import NotBatched, layer_of, sgd_
from fedpilot.engine.accel.pooling import has_2d_maps, with_measured_pooling
from fedpilot.engine.accel.shared_start import batchable, first_step_grads
from fedpilot.engine.accel.threads import client_threads, for_each_client
from fedpilot.engine.accel.vmap import mean_of_steps
from fedpilot.engine.executor import Batches, Executor, Forward, StepRule, Tensors, TrainStats
from fedpilot.engine.memory import keep_freed_memory
from fedpilot.engine.task import Task


def eager_client_grad(module: nn.Module, forward: Forward, task: Task,
                      layout: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., tuple[Tensors, tuple]]:
    """`client_grad` with plain autograd, parameters and inputs in `layout` (as they are, or channels-last)."""
    run = eager_client_pass(module, forward, task, layout)

    def step(trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w):
        grads, _, loss, metric = run(trainable, {}, frozen, fixed, x, y, w)
        return grads, (loss, metric)

    return step


def eager_client_pass(module: nn.Module, forward: Forward, task: Task,
                      layout: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., tuple]:
    """run(trainable, through, frozen, fixed, x, y, w) of one client with plain autograd, parameters and inputs in
    `layout`: the gradients of the `trainable` parameters; for each Linear layer whose parameters are in `through`
    (applied, not differentiated), its input A and the gradient at its output G, as linear_graph gives them ([1, n,
    in], [1, n, out]); the loss and metric. Raises NotBatched when such a layer runs more than once."""
    forward = with_measured_pooling(forward) if has_2d_maps(module) else forward
    modules = dict(module.named_modules())

    def run(trainable: Tensors, through: Tensors, frozen: Tensors, fixed: Tensors, x, y, w):
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def record(layer: str) -> Callable:
            def hook(_: nn.Module, args: tuple, out: torch.Tensor) -> None:
                if layer in seen:
                    raise NotBatched(layer)
                if not out.requires_grad:  # nothing trained before it: the gradients start here
                    out.requires_grad_()
                seen[layer] = (args[0], out)
            return hook

        hooks = [modules[layer].register_forward_hook(record(layer)) for layer in {layer_of(n) for n in through}]
        try:
            leaves = {n: layout(p).detach().requires_grad_() for n, p in trainable.items()}
            others = {n: layout(p) for n, p in {**through, **frozen, **fixed}.items()}
            with torch.enable_grad():
                value, metric = task.loss(forward(module, {**leaves, **others}, layout(x)), y, w)
                found = torch.autograd.grad(value, [*leaves.values(), *(out for _, out in seen.values())],
                                            allow_unused=True, materialize_grads=True)
        finally:
            for hook in hooks:
                hook.remove()
        grads = dict(zip(leaves, found[: len(leaves)], strict=True))
        outputs = {layer: (a.detach().reshape(1, -1, a.shape[-1]), g.reshape(1, -1, g.shape[-1]))
                   for (layer, (a, _)), g in zip(seen.items(), found[len(leaves):], strict=True)}
        return grads, outputs, value.detach(), metric

    return run


def eager_client_stepper(module: nn.Module, forward: Forward, task: Task,
                         layout: Callable[[torch.Tensor], torch.Tensor], rule: StepRule,
                         models_forward: bool) -> Callable[..., tuple]:
    """step(mine, frozen, fixed, x, y, w, active): one step of `rule` in place on one client's parameters `mine`
    ([1, ...] rows of the cohort's buffers), with its (loss, metric). Plain SGD under the model's own forward
    (`models_forward`) updates each trained Linear layer as W -= lr G^T A, with no weight gradient in memory (as `bmm`
    does for all clients); everything else steps its gradient."""
    run = eager_client_pass(module, forward, task, layout)
    linears = {name for name, m in module.named_modules() if isinstance(m, nn.Linear)} if (
        rule.plain and models_forward) else set()

    def step(mine: Tensors, frozen: Tensors, fixed: Tensors, x, y, w, active):
        own = {n: _own_version(p[0]) for n, p in mine.items()}
        through = {n: p for n, p in own.items() if layer_of(n) in linears}
        try:
            grads, outputs, loss, metric = run({n: p for n, p in own.items() if n not in through}, through, frozen,
                                               fixed, x, y, w)
        except NotBatched:  # a Linear layer run twice: every gradient the usual way
            grads, outputs, loss, metric = run(own, {}, frozen, fixed, x, y, w)
        rule.apply_({n: mine[n] for n in grads}, {n: g.unsqueeze(0) for n, g in grads.items()}, active)
        sgd_(outputs, mine, rule.lr, active)
        return loss, metric

    return step


def _as_stored(t: torch.Tensor) -> torch.Tensor:
    return t


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 else t


def _own_version(t: torch.Tensor) -> torch.Tensor:
    """An alias of `t` with its own autograd version counter (a view shares its base's): the in-place steps of
    other clients on other rows of the same buffer must not invalidate this client's saved tensors."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


class LoopExecutor(Executor):
    """One client after another, each with eager autograd over its own steps."""

    name = "loop"
    layout = staticmethod(_as_stored)

    def clients_at_once(self, clients: int, device: torch.device) -> int:
        """A client per thread (`for_each_client`), or a first step's call of them where it batches one."""
        return max(super().clients_at_once(clients, device), min(clients, client_threads(device)))

    def train(self, module: nn.Module, trainable: Tensors, frozen: Tensors, fixed: Tensors,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Tensors:
        keep_freed_memory(batches.source.device)
        trained = {n: torch.empty(p.shape, dtype=p.dtype, device=p.device) for n, p in trainable.items()}
        return self.steps_from(0, module, trained, trainable, frozen, fixed, batches, rule, stats)

    def steps_from(self, first: int, module: nn.Module, trained: Tensors, start: Tensors, frozen: Tensors,
                   fixed: Tensors, batches: Batches, rule: StepRule, stats: TrainStats) -> Tensors:
        """Each client's active steps of the plan from step `first` on, from its row of `start` (which may be
        `trained` itself), into its row of `trained`."""

        def client(k: int, module: nn.Module) -> None:
            own_rule = rule.for_rows(slice(k, k + 1), start)
            step = eager_client_stepper(module, self.forward, self.task, self.layout, own_rule, self.models_forward)
            mine = {n: p[k : k + 1].copy_(start[n][k : k + 1]) for n, p in trained.items()}  # cache-hot copy
            my_frozen = {n: p[k] for n, p in frozen.items()}
            for s in (torch.nonzero(batches.active[k, first:]).flatten() + first).tolist():
                loss, acc = step(mine, my_frozen, fixed, batches.inputs(k, s), batches.labels[k, s],
                                 batches.weight[k, s], batches.active[k, s : s + 1])
                stats.loss[k] += loss
                stats.metric[k] += acc.detach()
                stats.steps[k] += 1

        for_each_client(module, client, batches.index.shape[0], batches.source.device)
        return trained

    def gradients(self, module: nn.Module, params: Tensors, frozen: Tensors, fixed: Tensors, batches: Batches,
                  stats: TrainStats) -> Tensors:
        """Each client's mean gradient over its active steps of the plan, at `params` (nothing is updated)."""
        device = batches.source.device
        keep_freed_memory(device)
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        count = torch.zeros(batches.index.shape[0], device=batches.active.device)

        def client(k: int, module: nn.Module) -> None:
            step_grad = eager_client_grad(module, self.forward, self.task, self.layout)
            mine, my_frozen = {n: p[k] for n, p in params.items()}, {n: p[k] for n, p in frozen.items()}
            for s in torch.nonzero(batches.active[k]).flatten().tolist():
                g, (loss, acc) = step_grad(mine, my_frozen, fixed, batches.inputs(k, s), batches.labels[k, s],
                                           batches.weight[k, s])
                for n, v in g.items():
                    total[n][k] += v
                count[k] += 1
                stats.loss[k] += loss
                stats.metric[k] += acc.detach()
                stats.steps[k] += 1

        for_each_client(module, client, batches.index.shape[0], device)
        return mean_of_steps(total, count)


class ChannelsLastLoopExecutor(LoopExecutor):
    """The loop with images and convolution weights channels-last (faster on some CPUs and GPUs, slower on
    others: a candidate the stage times, never chosen by a CPU flag)."""

    name = "loop_channels_last"

    @classmethod
    def supports(cls, module: nn.Module, device: torch.device) -> bool:
        """Models with 2-d convolutions (and no recurrent layers, which only the plain loop runs)."""
        return cls.has_layers(module, nn.Conv2d) and not cls.has_layers(module, nn.RNNBase)
    layout = staticmethod(_channels_last)


class BatchedFirstStepExecutor(LoopExecutor):
    """The loop, whose clients take their first step as one batch when they start from the same weights but for
    Linear layers of their own, such as a personal head (engine/shared_start.py); a candidate the stage times on
    models that allow it. Weights of their own need the model's own forward (an algorithm's forward may mix them
    in ways the per-client layers cannot follow)."""

    name = "loop_batched_first"
    groups_clients = True  # the first step's

    @classmethod
    def supports(cls, module: nn.Module, device: torch.device) -> bool:
        """Convolutional models that allow the batched first step (`shared_start.batchable`)."""
        return ChannelsLastLoopExecutor.supports(module, device) and batchable(module)

    def train(self, module: nn.Module, trainable: Tensors, frozen: Tensors, fixed: Tensors,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Tensors:
        first = batches.active[:, 0]
        clients = {**trainable, **frozen}
        same_weights = all(p.stride(0) == 0 or n in batches.trial_models for n, p in clients.items())
        step = None
        if trainable and bool(first.any()) and batchable(module) and (same_weights or self.models_forward):
            keep_freed_memory(batches.source.device)
            step = self.first_step(module, clients, fixed, list(trainable), batches)
        if step is None:
            return super().train(module, trainable, frozen, fixed, batches, rule, stats)
        grads, loss, metric = step
        trained = rule.stepped(trainable, grads, first)
        stats.add(loss, metric, first)
        return self.steps_from(1, module, trained, trained, frozen, fixed, batches, rule, stats)

    def first_step(self, module: nn.Module, clients: Tensors, fixed: Tensors, trainable: list[str],
                   batches: Batches) -> tuple[Tensors, torch.Tensor, torch.Tensor] | None:
        """`first_step_grads` of every client, batched over `clients_per_call` clients at a time."""
        forward = with_measured_pooling(self.forward) if has_2d_maps(module) else self.forward
        count, groups = batches.index.shape[0], self.first_groups(batches)
        grads: Tensors = {}
        losses, metrics = [], []
        for rows in groups:
            mine = {n: v[rows][:1].expand_as(v[rows]) if n in batches.trial_models else v[rows]
                    for n, v in clients.items()}  # a trial's rows start from its one model
            part = first_step_grads(module, forward, self.task, mine, fixed, trainable,
                                    batches.inputs(rows, 0), batches.labels[rows, 0], batches.weight[rows, 0])
            if part is None or len(groups) == 1:
                return part
            for n, g in part[0].items():  # into one buffer: never a second copy of every client's gradients
                grads.setdefault(n, g.new_empty(count, *g.shape[1:]))[rows] = g
            losses.append(part[1])
            metrics.append(part[2])
        return grads, torch.cat(losses), torch.cat(metrics)

    def first_groups(self, batches: Batches) -> list[slice]:
        """The rows the first step takes together: `clients_per_call` at a time, within each trial's rows."""
        count = batches.index.shape[0]
        if batches.trials is None:
            return self.groups(count)
        groups, lo = [], 0
        for rows in batches.trials:
            groups += [slice(lo + part.start, lo + part.stop) for part in self.groups(rows)]
            lo += rows
        return groups
