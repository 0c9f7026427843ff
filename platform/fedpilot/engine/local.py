"""Local SGD for many clients at once: the executors and the update rule they share.

Parameters are dicts of tensors with a leading client dimension [K, ...]. An executor runs the steps of a
batch plan: `VmapExecutor` with torch.func.vmap over clients (`VmapAutogradExecutor`: vmap for the forward pass,
autograd for the backward), `LoopExecutor` client by client with eager
autograd (faster for convolutions on CPU, where vmap becomes a slow grouped convolution), one client per
CPU core at a time; `BatchedFirstStepExecutor` the loop after a first step batched over clients that start from
the same weights (engine/shared_start.py); `BmmExecutor` models of Linear layers as batched matrix products in their
traced graph, with SGD fused into the weight gradients (engine/linear_graph.py).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from fedpilot.engine.linear_graph import NotBatched, layer_of, linear_graph, output_grads, sgd_, weight_grads
from fedpilot.engine.memory import keep_freed_memory
from fedpilot.engine.pooling import has_2d_maps, with_measured_pooling
from fedpilot.engine.protocol import Algorithm
from fedpilot.engine.shared_start import batchable, first_step_grads
from fedpilot.engine.task import Task
from fedpilot.engine.threads import for_each_client

if TYPE_CHECKING:
    from fedpilot.engine.data import AugmentParams

Params = dict[str, torch.Tensor]
Forward = Callable[[nn.Module, Params, torch.Tensor], torch.Tensor]


def plain_forward(module: nn.Module, params: Params, x: torch.Tensor) -> torch.Tensor:
    """The module's own forward with `params`."""
    return functional_call(module, params, (x,))


def models_own(forward: Forward) -> bool:
    """Whether `forward` is the model's own forward: `plain_forward` or the default `Algorithm.forward`."""
    return forward is plain_forward or getattr(forward, "__func__", None) is Algorithm.forward


@dataclass
class StepRule:
    """How a gradient becomes a step: per-parameter lr, L2 pull to a reference, clipping, weight decay.

    Order as in torch: the pull is part of the loss, clipping is on the whole gradient of one client,
    weight decay is added after clipping (torch.optim.SGD's weight_decay).
    """

    lr: dict[str, float]
    clip_norm: float | None = None
    weight_decay: float = 0.0
    prox: float = 0.0
    reference: Params = field(default_factory=dict)

    def apply_(self, params: Params, grads: Params, active: torch.Tensor) -> None:
        """One SGD step in place on `params` [K, ...] (consuming `grads`) for each client whose `active` flag is set."""
        if self.prox:
            for n, g in grads.items():
                g.add_(params[n] - self.reference[n], alpha=self.prox)
        scale = None if self.clip_norm is None and bool(active.all()) else active.to(next(iter(grads.values())).dtype)
        if self.clip_norm is not None:
            norm = torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()
            scale = scale * (self.clip_norm / (norm + 1e-6)).clamp(max=1.0)
        for n, p in params.items():
            g = grads[n] if scale is None else grads[n].mul_(_per_client(scale, p))
            if self.weight_decay:
                g.add_(p * _per_client(active.to(p.dtype), p), alpha=self.weight_decay)
            p.sub_(g, alpha=self.lr[n])

    @property
    def plain(self) -> bool:
        """Plain SGD: no clipping, weight decay or pull to a reference."""
        return self.clip_norm is None and not self.weight_decay and not self.prox

    def stepped(self, start: Params, grads: Params, active: torch.Tensor) -> Params:
        """One step from `start` [K, ...] (broadcast rows allowed) into new tensors, consuming `grads`: plain SGD of
        all clients writes into the gradients' memory in one pass, anything else steps a copy of `start`."""
        if self.plain and bool(active.all()):
            return {n: torch.add(start[n], g, alpha=-self.lr[n], out=g) for n, g in grads.items()}
        params = {n: p.clone(memory_format=torch.contiguous_format) for n, p in start.items()}
        self.apply_(params, grads, active)
        return params

    def for_client(self, k: int, params: Params) -> StepRule:
        """This rule for client k alone (its row of a per-client reference)."""
        reference = {n: r[k : k + 1] if r.dim() == params[n].dim() else r for n, r in self.reference.items()}
        return StepRule(self.lr, self.clip_norm, self.weight_decay, self.prox, reference)

    def renamed(self, names: dict[str, str]) -> StepRule:
        """The same rule for the parameters in `names` (full name -> new name), under their new names."""
        return StepRule({names[n]: v for n, v in self.lr.items() if n in names}, self.clip_norm, self.weight_decay,
                        self.prox, {names[n]: v for n, v in self.reference.items() if n in names})


def _per_client(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A [K] tensor shaped to broadcast over a [K, ...] parameter."""
    return values.view(-1, *[1] * (like.dim() - 1))


def _as_is(rows: torch.Tensor) -> torch.Tensor:
    return rows


@dataclass
class Batches:
    """Steps' inputs are `prepare(source[index[rows, s]])`, augmented by the plan's `augment` parameters; labels and
    0/1 weights are already laid out [K, S, B]."""

    source: torch.Tensor
    index: torch.Tensor
    labels: torch.Tensor
    weight: torch.Tensor
    active: torch.Tensor
    prepare: Callable[[torch.Tensor], torch.Tensor] = _as_is
    augment: AugmentParams | None = None

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

    def add(self, loss: torch.Tensor, metric: torch.Tensor, active: torch.Tensor) -> None:
        on = active.to(loss.dtype)
        self.loss += loss.detach() * on
        self.metric += metric.detach() * on
        self.steps += on


def client_grad(module: nn.Module, forward: Forward, task: Task) -> Callable[..., tuple[Params, tuple]]:
    """grad(trainable, per_client_frozen, shared_frozen, x, y, w) of one client, with (loss, metric) as aux."""

    def loss(trainable: Params, frozen: Params, fixed: Params, x, y, w):
        value, metric = task.loss(forward(module, {**trainable, **frozen, **fixed}, x), y, w)
        return value, (value, metric)

    return grad(loss, has_aux=True)


def clients_grad(module: nn.Module, forward: Forward, task: Task) -> Callable[..., tuple[Params, tuple]]:
    """The gradients of every client at once [K, ...] with each client's (loss, metric), by autograd through the
    vmapped losses: a client's loss depends only on its own rows, so the gradient of the clients' summed loss holds
    each client's gradient in its row. Parameters nothing depends on get zeros, as under vmap(grad)."""
    losses = vmap(lambda trainable, frozen, fixed, x, y, w: task.loss(forward(module, {**trainable, **frozen, **fixed},
                                                                                 x), y, w),
                  in_dims=(0, 0, None, 0, 0, 0), randomness="different")

    def step(trainable: Params, frozen: Params, fixed: Params, x, y, w):
        leaves = {n: p.detach().requires_grad_() for n, p in trainable.items()}
        with torch.enable_grad():
            value, metric = losses(leaves, frozen, fixed, x, y, w)
            grads = torch.autograd.grad(value.sum(), list(leaves.values()), materialize_grads=True)
        return dict(zip(leaves, grads, strict=True)), (value.detach(), metric.detach())

    return step


def eager_client_grad(module: nn.Module, forward: Forward, task: Task,
                      layout: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., tuple[Params, tuple]]:
    """`client_grad` with plain autograd, parameters and inputs in `layout` (as they are, or channels-last)."""
    run = eager_client_pass(module, forward, task, layout)

    def step(trainable: Params, frozen: Params, fixed: Params, x, y, w):
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

    def run(trainable: Params, through: Params, frozen: Params, fixed: Params, x, y, w):
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
                         layout: Callable[[torch.Tensor], torch.Tensor], rule: StepRule) -> Callable[..., tuple]:
    """step(mine, frozen, fixed, x, y, w, active): one step of `rule` in place on one client's parameters `mine`
    ([1, ...] rows of the cohort's buffers), with its (loss, metric). Plain SGD under the model's own forward updates
    each trained Linear layer as W -= lr G^T A, with no weight gradient in memory (as `bmm` does for all clients);
    everything else steps its gradient."""
    run = eager_client_pass(module, forward, task, layout)
    linears = {name for name, m in module.named_modules() if isinstance(m, nn.Linear)} if (
        rule.plain and models_own(forward)) else set()

    def step(mine: Params, frozen: Params, fixed: Params, x, y, w, active):
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


def precision_context(precision: str, device: torch.device) -> AbstractContextManager:
    """Lightning's `bf16-mixed`: forward passes under bfloat16 autocast, parameters, gradients and updates in
    float32; `32-true`: plain float32. Only the clients' forward passes run under it, never the aggregation."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


class Executor:
    """Runs the local steps of a batch plan for a chunk of clients, applying the model with `forward` and scoring
    it with `task`. uses_features: it can run head steps on precomputed body features."""

    name: str
    uses_features = True

    def __init__(self, forward: Forward, task: Task):
        self.forward, self.task = forward, task


class VmapExecutor(Executor):
    """All clients of a chunk in one vmapped gradient call per step."""

    name = "vmap"

    def step_grad(self, module: nn.Module) -> Callable[..., tuple[Params, tuple]]:
        """step(trainable, frozen, fixed, x, y, w) -> (every client's gradient [K, ...], (loss, metric) [K])."""
        return vmap(client_grad(module, self.forward, self.task), in_dims=(0, 0, None, 0, 0, 0),
                    randomness="different")

    def stepper(self, module: nn.Module, rule: StepRule) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """step(trainable, frozen, fixed, x, y, w, active): one step of `rule` in place on every client's `trainable`
        [K, ...], returning each client's (loss, metric) [K]."""
        step_grad = self.step_grad(module)

        def step(trainable: Params, frozen: Params, fixed: Params, x, y, w, active):
            grads, (loss, metric) = step_grad(trainable, frozen, fixed, x, y, w)
            rule.apply_(trainable, grads, active)
            return loss, metric

        return step

    def train(self, module: nn.Module, trainable: Params, frozen: Params, fixed: Params,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Params:
        keep_freed_memory(batches.source.device)
        step = self.stepper(module, rule)
        trainable = {n: p.clone() for n, p in trainable.items()}
        for s in range(batches.index.shape[1]):
            active = batches.active[:, s]
            if not bool(active.any()):
                continue
            x = batches.inputs(slice(None), s)
            loss, acc = step(trainable, frozen, fixed, x, batches.labels[:, s], batches.weight[:, s], active)
            stats.add(loss, acc, active)
        return trainable

    def gradients(self, module: nn.Module, params: Params, frozen: Params, fixed: Params, batches: Batches,
                  stats: TrainStats) -> Params:
        """Each client's mean gradient over its active steps of the plan, at `params` (nothing is updated)."""
        step_grad = self.step_grad(module)
        total = {n: torch.zeros_like(p) for n, p in params.items()}
        count = torch.zeros(batches.index.shape[0], device=batches.active.device)
        for s in range(batches.index.shape[1]):
            active = batches.active[:, s]
            if not bool(active.any()):
                continue
            x = batches.inputs(slice(None), s)
            grads, (loss, acc) = step_grad(params, frozen, fixed, x, batches.labels[:, s], batches.weight[:, s])
            for n, g in grads.items():
                total[n] += g * _per_client(active.to(g.dtype), g)
            count += active
            stats.add(loss, acc, active)
        return _mean_of_steps(total, count)


class VmapAutogradExecutor(VmapExecutor):
    """vmap for the forward pass only, plain autograd backward through it (`clients_grad`): less dispatch than
    vmap(grad) for small models, slower for convolutions on CPU (bench/README.md). A candidate the stage times."""

    name = "vmap_autograd"

    def step_grad(self, module: nn.Module) -> Callable[..., tuple[Params, tuple]]:
        return clients_grad(module, self.forward, self.task)


class BmmExecutor(VmapAutogradExecutor):
    """Models made of Linear layers: every client's layers as batched matrix products in the model's traced graph,
    plain SGD fused into the weight gradients (engine/linear_graph.py); steps the graph does not cover (another
    forward, a model it does not apply to) as `vmap_autograd`. A candidate the stage times."""

    name = "bmm"

    def graph(self, module: nn.Module) -> Callable | None:
        return linear_graph(module) if models_own(self.forward) else None

    def outputs(self, graph: Callable, trainable: Params, frozen: Params, fixed: Params, x, y, w) -> tuple:
        """The trained layers' inputs and output gradients, and the clients' (loss, metric), of one pass."""
        return output_grads(graph, self.task, {**trainable, **frozen, **fixed}, list(trainable), x, y, w)

    def step_grad(self, module: nn.Module) -> Callable[..., tuple[Params, tuple]]:
        graph, vmapped = self.graph(module), super().step_grad
        if graph is None:
            return vmapped(module)

        def step(trainable: Params, frozen: Params, fixed: Params, x, y, w):
            try:
                seen, loss, metric = self.outputs(graph, trainable, frozen, fixed, x, y, w)
            except NotBatched:
                return vmapped(module)(trainable, frozen, fixed, x, y, w)
            return weight_grads(seen, trainable), (loss, metric)

        return step

    def stepper(self, module: nn.Module, rule: StepRule) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        graph, gradient_step = self.graph(module), super().stepper(module, rule)
        if graph is None or not rule.plain:
            return gradient_step

        def step(trainable: Params, frozen: Params, fixed: Params, x, y, w, active):
            try:
                seen, loss, metric = self.outputs(graph, trainable, frozen, fixed, x, y, w)
            except NotBatched:
                return gradient_step(trainable, frozen, fixed, x, y, w, active)
            sgd_(seen, trainable, rule.lr, active)
            return loss, metric

        return step


def _own_version(t: torch.Tensor) -> torch.Tensor:
    """An alias of `t` with its own autograd version counter (a view shares its base's): the in-place steps of
    other clients on other rows of the same buffer must not invalidate this client's saved tensors."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


def _mean_of_steps(total: Params, count: torch.Tensor) -> Params:
    """Per-client sums of step gradients [K, ...] divided by each client's number of active steps."""
    return {n: t / count.clamp_min(1).view(-1, *[1] * (t.dim() - 1)) for n, t in total.items()}


class LoopExecutor(Executor):
    """One client after another, each with eager autograd over its own steps."""

    name = "loop"
    layout = staticmethod(_as_stored)

    def train(self, module: nn.Module, trainable: Params, frozen: Params, fixed: Params,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Params:
        keep_freed_memory(batches.source.device)
        trained = {n: torch.empty(p.shape, dtype=p.dtype, device=p.device) for n, p in trainable.items()}
        return self.steps_from(0, module, trained, trainable, frozen, fixed, batches, rule, stats)

    def steps_from(self, first: int, module: nn.Module, trained: Params, start: Params, frozen: Params, fixed: Params,
                   batches: Batches, rule: StepRule, stats: TrainStats) -> Params:
        """Each client's active steps of the plan from step `first` on, from its row of `start` (which may be
        `trained` itself), into its row of `trained`."""

        def client(k: int, module: nn.Module) -> None:
            step = eager_client_stepper(module, self.forward, self.task, self.layout, rule.for_client(k, start))
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

    def gradients(self, module: nn.Module, params: Params, frozen: Params, fixed: Params, batches: Batches,
                  stats: TrainStats) -> Params:
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
        return _mean_of_steps(total, count)


class ChannelsLastLoopExecutor(LoopExecutor):
    """The loop with images and convolution weights channels-last (faster on some CPUs and GPUs, slower on
    others: a candidate the stage times, never chosen by a CPU flag)."""

    name = "loop_channels_last"
    layout = staticmethod(_channels_last)


class BatchedFirstStepExecutor(LoopExecutor):
    """The loop, whose clients take their first step as one batch when they start from the same weights but for
    Linear layers of their own, such as a personal head (engine/shared_start.py); a candidate the stage times on
    models that allow it. Weights of their own need the model's own forward (an algorithm's forward may mix them
    in ways the per-client layers cannot follow)."""

    name = "loop_batched_first"

    def train(self, module: nn.Module, trainable: Params, frozen: Params, fixed: Params,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Params:
        first = batches.active[:, 0]
        clients = {**trainable, **frozen}
        same_weights = all(p.stride(0) == 0 for p in clients.values())
        step = None
        if trainable and bool(first.any()) and batchable(module) and (same_weights or models_own(self.forward)):
            keep_freed_memory(batches.source.device)
            forward = with_measured_pooling(self.forward) if has_2d_maps(module) else self.forward
            step = first_step_grads(module, forward, self.task, clients, fixed, list(trainable),
                                    batches.inputs(slice(None), 0), batches.labels[:, 0], batches.weight[:, 0])
        if step is None:
            return super().train(module, trainable, frozen, fixed, batches, rule, stats)
        grads, loss, metric = step
        trained = rule.stepped(trainable, grads, first)
        stats.add(loss, metric, first)
        return self.steps_from(1, module, trained, trained, frozen, fixed, batches, rule, stats)


# executors whose forward passes run batched over clients (evaluation vmaps the clients for them)
VMAPPED = ("vmap", "vmap_autograd", "bmm")


def executor_candidates(module: nn.Module) -> list[str]:
    """The executors a stage times on its first round: the loop, the two vmaps unless the model has recurrent layers
    (torch.func cannot vmap the fused RNN kernels); for a model of Linear layers `bmm` (`linear_graph` applies); with
    2-d convolutions the channels-last loop, and the loop with a batched first step where the model allows it
    (`shared_start.batchable`)."""
    kinds = {type(m) for m in module.modules()}
    if any(issubclass(k, nn.RNNBase) for k in kinds):
        return ["loop"]
    candidates = ["vmap", "vmap_autograd", "loop", *(["bmm"] if linear_graph(module) is not None else [])]
    if any(issubclass(k, nn.Conv2d) for k in kinds):
        candidates += ["loop_channels_last", *(["loop_batched_first"] if batchable(module) else [])]
    return candidates


def choose_execution(requested: str, module: nn.Module, device: torch.device) -> str:
    """The executor for training or evaluating `module`: `requested` (a stage's measured choice, or the user's)
    unless it is "auto", which is the rule of thumb for work no stage has timed (bench/README.md): recurrent
    layers and, on CPU, convolutions (vmap turns conv2d into a grouped convolution) per client, everything else
    (a model's head alone, a Linear, included) vmapped."""
    if requested != "auto":
        return requested
    candidates = executor_candidates(module)
    has_conv = any(isinstance(m, nn.modules.conv._ConvNd) for m in module.modules())
    return "loop" if "vmap" not in candidates or (has_conv and device.type == "cpu") else "vmap"
