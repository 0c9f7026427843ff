"""The first local step of clients that all start from the same weights, as one batch over the clients.

FedAvg's clients (and those of every algorithm that trains the broadcast model) take their first local step at the
same weights, so that step's forward pass and the gradients flowing back through the layers can run once over all
the clients' samples: large-batch kernels, each weight read once. Only the weight gradients are per client: a Linear
layer's by one batched matmul over the clients, a Conv2d layer's by the convolution's weight gradient on each
client's rows (on the engine's per-client threads). Clients that differ only in Linear layers of their own (a personal
head: the shared phase of FedAlt and FedRep, FedSim's joint step) are batched too: such a layer runs as one batched
matmul of each client's rows with its own weights. `bench/first_step.py` measures it against the per-client steps.

It applies to models whose parameters all belong to Linear and zero-padded Conv2d layers and that hold no buffers
(batch statistics would mix the clients' samples), and only where each layer with trained weights is applied once
to inputs that hold the samples along their first dimension; otherwise `first_step_grads` says so and the caller
steps the clients one by one. A model that mixes samples without parameters or buffers (a hand-written batch norm)
is outside what can be checked: its first step would see every client's samples.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedpilot.engine.accel.threads import for_each_client
from fedpilot.engine.task import Task

Tensors = dict[str, torch.Tensor]


def _int_padding(conv: nn.Conv2d) -> tuple[int, ...] | None:
    """The padding a Conv2d applies, as numbers (None for 'same' where torch pads unevenly)."""
    if conv.padding == "valid":
        return (0, 0)
    if conv.padding == "same":
        total = [d * (k - 1) for d, k in zip(conv.dilation, conv.kernel_size, strict=True)]
        return None if any(t % 2 for t in total) else tuple(t // 2 for t in total)
    return tuple(conv.padding)


def _has_per_client_gradient(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) or (isinstance(layer, nn.Conv2d) and layer.padding_mode == "zeros"
                                            and _int_padding(layer) is not None)


def batchable(module: nn.Module) -> bool:
    """Whether the first step of `module` can be batched over clients: no buffers, and every parameter a weight or
    bias of a Linear or zero-padded Conv2d layer of its own (no weight shared between layers)."""
    owned = [f"{name}.{p}" for name, layer in module.named_modules() if _has_per_client_gradient(layer)
             for p, _ in layer.named_parameters(recurse=False)]
    return not any(True for _ in module.buffers()) and sorted(owned) == sorted(n for n, _ in module.named_parameters())


def _linear_per_client(x: torch.Tensor, out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       clients: int) -> torch.Tensor:
    """A Linear layer applied to each client's rows of x [K * B, ..., in] with its own weight [K, out, in] and bias
    [K, out], in the shape of the shared layer's output `out`."""
    a = x.unflatten(0, (clients, -1)).flatten(1, -2)
    w = weight.transpose(1, 2)
    y = torch.bmm(a, w) if bias is None else torch.baddbmm(bias.unsqueeze(1), a, w)
    return y.view(out.shape)


def first_step_grads(module: nn.Module, forward: Callable, task: Task, params: Tensors, fixed: Tensors,
                     trainable: list[str], x: torch.Tensor, y: torch.Tensor,
                     w: torch.Tensor) -> tuple[Tensors, torch.Tensor, torch.Tensor] | None:
    """Each client's gradient [K, ...] of the `trainable` parameters on its batch x [K, B, ...] (labels y and 0/1
    weights w [K, B]), with its loss and metric [K], at the clients' `params` [K, ...] (a broadcast's rows are
    stride-0 views of the same weights) and the shared frozen `fixed`. Linear layers with per-client weights (a
    personal head) run per client on their rows of the batch (one batched matmul); every other layer once over all the
    samples. None when a layer with per-client weights is not a Linear layer, or a layer with trained or per-client
    weights was not applied exactly once to the K * B samples."""
    clients, samples = x.shape[0], x.shape[0] * x.shape[1]
    layout = _Layout.of(module, params, trainable, clients)
    if layout is None:
        return None
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in [*layout.shared, *layout.apart]}

    def record(name: str) -> Callable:
        def hook(_: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
            seen[name].append((args[0], out))
            if name in layout.apart and args[0].shape[0] == samples:  # otherwise refused below
                own = layout.own
                return _linear_per_client(args[0], out, own[f"{name}.weight"], own.get(f"{name}.bias"), clients)
            return None
        return hook

    hooks = [layout.modules[name].register_forward_hook(record(name)) for name in seen]
    try:
        leaves = {n: v[0].detach().requires_grad_(n in trainable and n not in layout.own) for n, v in params.items()}
        leaves.update(fixed)
        with torch.enable_grad():
            output = forward(module, leaves, x.flatten(0, 1))
            loss, metric = task.client_losses(output.unflatten(0, (clients, -1)), y, w)
            if any(len(io) != 1 or io[0][0].shape[0] != samples for io in seen.values()):
                return None
            mine = [n for n in trainable if n in layout.own]
            found = torch.autograd.grad(loss.sum(), [seen[name][0][1] for name in layout.shared]
                                        + [layout.own[n] for n in mine], materialize_grads=True)
    finally:
        for hook in hooks:
            hook.remove()
    grads = {**dict(zip(mine, found[len(layout.shared):], strict=True)),
             **_weight_grads(module, layout.shared, seen, found[:len(layout.shared)], clients)}
    return {n: grads[n].to(params[n].dtype) for n in trainable}, loss.detach(), metric


class _Layout:
    """Where a first step's gradients come from: the `shared` layers with trained weights the clients share (their
    weight gradients from each client's rows of their inputs and output gradients), and the Linear layers with
    weights of each client's own (`apart`, their parameters `own`, differentiated directly)."""

    def __init__(self, modules: dict[str, nn.Module], shared: dict[str, nn.Module], apart: set[str], own: Tensors):
        self.modules, self.shared, self.apart, self.own = modules, shared, apart, own

    @classmethod
    def of(cls, module: nn.Module, params: Tensors, trainable: list[str], clients: int) -> _Layout | None:
        """The layout of `module` at the clients' `params`; None when a layer with per-client weights is not a
        Linear layer."""
        apart_names = {n for n, p in params.items() if clients > 1 and p.stride(0) != 0}
        modules = dict(module.named_modules())
        owned = {name: [f"{name}.{p}" for p, _ in layer.named_parameters(recurse=False)]
                 for name, layer in modules.items()}
        apart = {name for name, names in owned.items() if apart_names.intersection(names)}
        if any(not isinstance(modules[name], nn.Linear) for name in apart):
            return None
        shared = {name: modules[name] for name, names in owned.items()
                  if name not in apart and any(n in trainable for n in names)}
        own = {n: params[n].detach().requires_grad_(n in trainable) for name in apart for n in owned[name]}
        return cls(modules, shared, apart, own)


def _weight_grads(module: nn.Module, layers: dict[str, nn.Module], seen: dict[str, list[tuple]],
                  output_grads: tuple[torch.Tensor, ...], clients: int) -> Tensors:
    """Each client's weight and bias gradients [K, ...] of the shared `layers`, from their inputs `seen` and the
    gradients at their outputs: a Linear layer's by one batched matmul, a Conv2d's by the convolution's weight
    gradient on each client's rows (on the engine's per-client threads)."""
    grads: Tensors = {}
    convolutions = []
    for (name, layer), g in zip(layers.items(), output_grads, strict=True):
        a, g = seen[name][0][0].detach().unflatten(0, (clients, -1)), g.unflatten(0, (clients, -1))
        if isinstance(layer, nn.Linear):
            a, g = a.flatten(1, -2), g.flatten(1, -2)
            grads[f"{name}.weight"] = torch.bmm(g.transpose(1, 2), a.to(g.dtype))
            grads[f"{name}.bias"] = g.sum(1)
        else:
            grads[f"{name}.weight"] = g.new_empty(clients, *layer.weight.shape)
            grads[f"{name}.bias"] = g.sum((1, 3, 4))
            convolutions.append((name, layer, a.to(g.dtype), g))

    def client(k: int, _: nn.Module) -> None:
        for name, layer, a, g in convolutions:
            grads[f"{name}.weight"][k] = nn.grad.conv2d_weight(a[k], layer.weight.shape, g[k], layer.stride,
                                                               _int_padding(layer), layer.dilation, layer.groups)

    if convolutions:
        for_each_client(module, client, clients, convolutions[0][2].device)
    return grads
