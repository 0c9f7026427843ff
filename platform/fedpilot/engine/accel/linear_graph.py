"""Every client of a model made of Linear layers in one pass, without torch.func: the model's own graph (torch.fx)
with each Linear layer applied to each client's rows as one batched matrix product with that client's weights.

For small models a local step is dispatch and memory traffic, not arithmetic: functorch's batching of the forward
pass costs a fixed amount per step whatever the model's size (bench/README.md), and a separate SGD update reads
every client's weights and gradients once more. Here the forward pass is the traced graph, a few batched products;
autograd gives each trained layer's gradient at its output G [K, n, out], and the layer's weight gradient is
G^T A [K, out, in] with its input A, so plain SGD runs as one in-place `baddbmm_` per layer (W -= lr G^T A), with no
weight gradient in memory.

It applies to models with no buffers whose parameters all belong to Linear layers, whose forward torch.fx can trace
(no control flow on values) and takes one input, where each layer is a module call; a layer with trained weights
must run once per pass, on inputs that hold the samples along their first dimension. A traced model that breaks the
last rule at run time is found in its first pass (`NotBatched`) and stepped by vmap instead. A model that mixes
samples without parameters (a hand-written batch statistic) cannot be told apart: as with `shared_start`, its
clients would see each other's samples.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import fx, nn

from fedpilot.engine.executor import Rate
from fedpilot.engine.task import Task

Tensors = dict[str, torch.Tensor]
Graph = Callable[[torch.Tensor, Tensors, "Tape"], torch.Tensor]


class NotBatched(Exception):
    """A Linear layer ran on inputs without the K * B samples along their first dimension, or a trained one ran
    twice in a pass."""


@dataclass
class Tape:
    """One pass over K clients' B samples each: what each trained layer saw, input A [K, n, in], output [K, n, out]."""

    clients: int
    samples: int
    trained: set[str]
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def client_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tape: Tape,
                  layer: str) -> torch.Tensor:
    """The Linear `layer` on x [K * B, ..., in]: each client's rows with its own weight [K, out, in] and bias [K, out],
    or with the weight [out, in] and bias [out] all share; a trained layer's input and output go on the tape."""
    if x.shape[0] != tape.samples or layer in tape.seen:
        raise NotBatched(layer)
    a = x.reshape(tape.clients, -1, x.shape[-1])
    if weight.dim() == 2:
        shared_bias = bias is None or bias.dim() == 1
        out = F.linear(a, weight, bias if shared_bias else None)
        if not shared_bias:
            out = out + bias.unsqueeze(1)
    elif bias is None:
        out = torch.bmm(a, weight.transpose(1, 2))
    else:
        out = torch.baddbmm(bias.unsqueeze(1) if bias.dim() == 2 else bias, a, weight.transpose(1, 2))
    if layer in tape.trained:
        if not out.requires_grad:  # the first trained layer: the gradients start here
            out.requires_grad_()
        tape.seen[layer] = (a, out)
    return out.view(*x.shape[:-1], out.shape[-1])


_GRAPHS: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Graph | None]] = weakref.WeakKeyDictionary()


def linear_graph(module: nn.Module) -> Graph | None:
    """`module`'s forward as graph(x, params, tape) with its Linear layers as `client_linear`; None where it does
    not apply (see the module's docstring). Built once per module and layout of submodules (an algorithm may add
    modules to the model between stages: adapters, gates)."""
    layout = tuple((name, id(m)) for name, m in module.named_modules())
    if module not in _GRAPHS or _GRAPHS[module][0] != layout:
        _GRAPHS[module] = (layout, _build(module))
    return _GRAPHS[module][1]


def _build(module: nn.Module) -> Graph | None:
    layers = {name for name, m in module.named_modules() if isinstance(m, nn.Linear)}
    owned = {layer_of(name) for name, _ in module.named_parameters()}
    if any(True for _ in module.buffers()) or not layers or not owned <= layers:
        return None
    if isinstance(module, nn.Linear):
        return lambda x, params, tape: client_linear(x, params["weight"], params.get("bias"), tape, "")
    try:
        traced = fx.symbolic_trace(module)
    except Exception:  # noqa: BLE001  whatever stops the tracer (control flow on values, unsupported calls)
        return None
    graph, env = fx.Graph(), {}
    inputs = [node for node in traced.graph.nodes if node.op == "placeholder"]
    if len(inputs) != 1:
        return None
    x, params, tape = graph.placeholder("x"), graph.placeholder("params"), graph.placeholder("tape")
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            env[node] = x
        elif node.op == "get_attr":  # a parameter or constant used outside a Linear module call
            return None
        elif node.op == "call_module" and node.target in layers:
            linear = module.get_submodule(node.target)
            weight = graph.call_function(operator.getitem, (params, f"{node.target}.weight"))
            bias = graph.call_function(operator.getitem, (params, f"{node.target}.bias")) if (
                linear.bias is not None) else None
            env[node] = graph.call_function(client_linear, (env[node.args[0]], weight, bias, tape, node.target))
        else:
            env[node] = graph.node_copy(node, lambda arg: env[arg])
    return fx.GraphModule(traced, graph)


def layer_of(name: str) -> str:
    """The module that owns the parameter `name` ("" for the root)."""
    return name.rpartition(".")[0]


def output_grads(graph: Graph, task: Task, params: Tensors, trained: list[str], x: torch.Tensor, y: torch.Tensor,
                 w: torch.Tensor) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor]:
    """One pass of K clients on x [K, B, ...] (labels y, 0/1 weights w [K, B]) at `params` (per-client [K, ...] or
    shared): for each layer of `trained` parameters that ran, its input A and the gradient of the clients' losses at
    its output G ([K, n, in], [K, n, out]), and each client's loss and metric [K]."""
    clients = x.shape[0]
    tape = Tape(clients, clients * x.shape[1], {layer_of(n) for n in trained})
    with torch.enable_grad():
        out = graph(x.flatten(0, 1), params, tape)
        if out.shape[0] != tape.samples:
            raise NotBatched("output")
        loss, metric = task.client_losses(out.unflatten(0, (clients, -1)), y, w)
        seen = list(tape.seen)
        grads = torch.autograd.grad(loss.sum(), [tape.seen[layer][1] for layer in seen], allow_unused=True,
                                    materialize_grads=True) if seen else []
    return ({layer: (tape.seen[layer][0].detach(), g) for layer, g in zip(seen, grads, strict=True)}, loss.detach(),
            metric)


def weight_grads(seen: dict[str, tuple[torch.Tensor, torch.Tensor]], params: Tensors) -> Tensors:
    """Each client's gradient [K, ...] of every parameter in `params` from its layer's input and output gradient
    (zeros for a layer that did not run)."""
    grads = {}
    for name, p in params.items():
        if layer_of(name) not in seen:
            grads[name] = torch.zeros_like(p)
            continue
        a, g = seen[layer_of(name)]
        grads[name] = (torch.bmm(g.transpose(1, 2), a.to(g.dtype)) if name.endswith("weight") else g.sum(1)).to(p.dtype)
    return grads


def sgd_(seen: dict[str, tuple[torch.Tensor, torch.Tensor]], params: Tensors, lr: dict[str, Rate],
         active: torch.Tensor) -> None:
    """Plain SGD in place on `params` [K, ...] of the layers in `seen`, for the clients whose `active` flag is set:
    W -= lr G^T A in one pass (no weight gradient in memory), b -= lr G summed over the rows; an lr of one per row
    [K] scales each client's rows of G."""
    scale = None if bool(active.all()) else active.view(-1, 1, 1)
    with torch.autocast(active.device.type, enabled=False):
        for layer, (a, g) in seen.items():
            weight, bias = (f"{layer}.{part}" if layer else part for part in ("weight", "bias"))
            if weight in params:
                p = params[weight]
                rows, alpha = _scaled(g, scale, lr[weight])
                p.baddbmm_(rows.transpose(1, 2).to(p.dtype), a.to(p.dtype), alpha=-alpha)
            if bias in params:
                rows, alpha = _scaled(g, scale, lr[bias])
                params[bias].sub_(rows.sum(1).to(params[bias].dtype), alpha=alpha)


def _scaled(g: torch.Tensor, scale: torch.Tensor | None, lr: Rate) -> tuple[torch.Tensor, float]:
    """(G with inactive clients' rows zeroed, lr) for one lr; (G with each client's rows times its lr, 1) for one lr
    per row."""
    if torch.is_tensor(lr):
        factor = lr.view(-1, 1, 1) if scale is None else lr.view(-1, 1, 1) * scale
        return g * factor.to(g.device, g.dtype), 1.0
    return (g if scale is None else g * scale.to(g.dtype)), lr
