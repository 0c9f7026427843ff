"""HeteroFL: Diao, Ding, Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients", ICLR 2021 (a baseline of pFedGate, Chen et al., ICML 2023, with its setting
there: the full model for 10% of the
clients and half of it for the others).

Client i has a width rate p_i and trains the sub-model made of the first ceil(p_i d) hidden units of every layer of
the global model (the output layer keeps every class, the input every feature); it sends the entries of its
sub-model and the server averages each entry over the clients whose sub-models hold it. A client uses its own
sub-model, in training and in evaluation. Every rate 1 is FedAvg with a uniform mean.

Here a sub-model is the global model with the entries outside it masked to zero (an equivalent narrower network:
a masked hidden unit gets no input and passes nothing on), so a client's training never changes the entries it
does not hold, and its upload carries the per-entry mask the engine's per-index aggregation uses (pFedGate's).

Choices: rates are drawn once per client from `rates` (values and shares; algorithms/resources.py), seeded by the
pipeline seed, and kept as the per-client constant `width.rate` (a buffer of the model, Algorithm.constants); the
per-entry mean is uniform over the
holders (the authors' code); HeteroFL's static batch norm is not needed (the zoo has no batch norm) and its
"scaler" (outputs divided by p_i in training) is left out. Width scaling covers chains of Linear and Conv2d layers
with biases (`mlp`, `logreg`, `cnn`), found in call order by a forward of a zero input: the hidden units of a
convolution are its output channels, and a Linear after a channels-first flatten of C channels over S positions
keeps the S inputs of each kept channel; between two layers only activations, pooling, dropout and flatten may
act (a forward's tensor operations outside modules are not seen, so a model must not mix units there).
Recorded per client: `rate`.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fedpilot.algorithms.ranges import PFEDGATE_GRID_LR
from fedpilot.algorithms.resources import Levels
from fedpilot.api import Algorithm, AlgorithmParams, Cohort, SpecError, Tensors, Upload

# (module name, out units, in units, inputs per in unit, outputs are hidden, inputs are hidden, kernel size)
Layer = tuple[str, int, int, int, bool, bool, tuple[int, ...]]
# unit-wise, or channel-wise keeping channels first: a masked unit stays apart from the kept ones
PASS_THROUGH = (nn.ReLU, nn.LeakyReLU, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.MaxPool2d, nn.AvgPool2d,
                nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d, nn.Dropout, nn.Dropout2d, nn.Flatten, nn.Identity)


class WidthMask(nn.Module):
    """Which entries of each layer a client's sub-model holds, at its width rate p: the buffer `rate` (1: the whole
    model), which each client's own value replaces (HeteroFL's per-client constant `width.rate`)."""

    def __init__(self, layers: list[Layer]):
        super().__init__()
        self.layers = layers
        self.register_buffer("rate", torch.tensor(1.0))

    def masks(self, rate: torch.Tensor) -> Tensors:
        """0/1 masks of the sub-model at width `rate`, for every weight and bias of the layers."""
        masks = {}
        for name, out, inp, repeat, out_hidden, in_hidden, kernel in self.layers:
            rows = _first(rate, out) if out_hidden else torch.ones(out, device=rate.device)
            cols = _first(rate, inp, repeat) if in_hidden else torch.ones(inp * repeat, device=rate.device)
            weight = rows[:, None] * cols[None, :]
            masks[f"{name}.weight"] = weight[(..., *[None] * len(kernel))].expand(*weight.shape, *kernel)
            masks[f"{name}.bias"] = rows
        return masks

    def forward(self, params: Tensors) -> Tensors:
        """The parameters of the sub-model at this client's rate (the others zero)."""
        masks = self.masks(self.rate)
        return {n: v * masks[n] if n in masks else v for n, v in params.items()}


def _first(rate: torch.Tensor, units: int, repeat: int = 1) -> torch.Tensor:
    """1 for the `repeat` entries of each of the first ceil(rate * units) of `units` units, 0 for the rest."""
    kept = torch.ceil(rate * units - 1e-6)
    return (torch.arange(units * repeat, device=rate.device) // repeat < kept).to(rate.dtype)


def _owns(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False))


def _scalable(module: nn.Module) -> bool:
    """A layer HeteroFL can narrow: Linear, or a dense Conv2d, with a bias."""
    conv = isinstance(module, nn.Conv2d) and module.groups == 1 and not module.transposed
    return (isinstance(module, nn.Linear) or conv) and module.bias is not None


def _calls(model: nn.Module, input_shape: tuple[int, ...]) -> list[tuple[str, nn.Module]]:
    """The leaf modules and parameter owners in the order a forward of one zero input calls them (in eval mode)."""
    calls: list[tuple[str, nn.Module]] = []
    hooks = [m.register_forward_hook(lambda module, args, out, name=name: calls.append((name, module)))
             for name, m in model.named_modules() if _owns(m) or not any(True for _ in m.children())]
    modes = {m: m.training for m in model.modules()}
    weight = next(model.parameters())
    try:
        model.eval()
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, device=weight.device, dtype=weight.dtype))
    finally:
        for hook in hooks:
            hook.remove()
        for m, training in modes.items():
            m.training = training
    return calls


def _layers(model: nn.Module, calls: list[tuple[str, nn.Module]]) -> list[Layer]:
    """The width layers of a chain of Linear/Conv2d layers called in order: each takes its inputs from the previous
    one's units (a Linear after a convolution, S inputs per channel), only PASS_THROUGH modules acting between."""
    def refuse(problem: str) -> SpecError:
        return SpecError("model", type(model).__name__, f"HeteroFL width-scales chains of layers: {problem}")

    owners = [(i, n, m) for i, (n, m) in enumerate(calls) if _owns(m)]
    names = [n for _, n, _ in owners]
    if len(set(names)) < len(names):
        raise refuse(f"a layer is called twice ({sorted({n for n in names if names.count(n) > 1})})")
    unused = sorted({n for n, m in model.named_modules() if _owns(m)} - set(names))
    if unused:
        raise refuse(f"layers {unused} are not in the forward")
    between = [(n, m) for (i, _, _), (j, _, _) in pairwise(owners) for n, m in calls[i + 1:j]
               if not isinstance(m, PASS_THROUGH)]
    if between:
        raise refuse(f"{', '.join(f'{n} ({type(m).__name__})' for n, m in between)} between layers; allowed: "
                     f"activations, pooling, dropout, flatten")
    layers: list[Layer] = []
    for k, (_, name, m) in enumerate(owners):
        conv = isinstance(m, nn.Conv2d)
        out, inp = (m.out_channels, m.in_channels) if conv else (m.out_features, m.in_features)
        units, repeat = inp, 1
        if k > 0:
            before, units = owners[k - 1][2], layers[-1][1]  # the previous layer's out units
            repeat = inp // units
            if inp % units or (repeat > 1 and (conv or not isinstance(before, nn.Conv2d))):
                raise refuse(f"{name} takes {inp} inputs from the {units} units of {owners[k - 1][1]}")
        kernel = tuple(m.kernel_size) if conv else ()
        layers.append((name, out, units, repeat, k < len(owners) - 1, k > 0, kernel))
    return layers


class HeteroFLParams(AlgorithmParams):
    """rates: the clients' width rates in (0, 1] and their shares of the clients (default: pFedGate's setting, the
    full model for 10% of the clients and half the width for the others)."""

    rates: Levels = Levels(values=[1.0, 0.5], shares=[0.1, 0.9])


class HeteroFL(Algorithm):
    """Each client trains the width-p_i sub-model of the global model; per-entry mean over the clients holding it."""

    name = "heterofl"
    Params = HeteroFLParams
    tunable = {"local.lr": PFEDGATE_GRID_LR}  # HeteroFL: a pFedGate baseline; its width rates stay as written
    constants = frozenset({"width.rate"})

    @property
    def personal_part(self) -> Any:
        return "none"  # a client's own is its rate, a per-client constant, not a parameter

    def prepare_model(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        """Give the model its `width` (once): its Linear/Conv2d layers in call order, the last one (the head) keeping
        its outputs, the first one its inputs."""
        if isinstance(getattr(model, "width", None), WidthMask):
            return
        owners = [m for m in model.modules() if _owns(m)]
        if not owners or not all(_scalable(m) for m in owners):
            kinds = sorted({type(m).__name__ for m in owners})
            raise SpecError("model", type(model).__name__, f"HeteroFL width-scales models made of Linear and "
                            f"dense Conv2d layers with biases (mlp, logreg, cnn); this one has {kinds}")
        layers = _layers(model, _calls(model, input_shape))
        model.width = WidthMask(layers).to(next(model.parameters()).device)

    def forward(self, model: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        """The client's sub-model: the model with the entries outside its width masked (at its rate `width.rate`,
        else, for the model as it stands, the buffer's)."""
        width = {n.removeprefix("width."): v for n, v in params.items() if n.startswith("width.")}
        weights = {n: v for n, v in params.items() if not n.startswith("width.")}
        return functional_call(model, functional_call(model.width, width, (weights,)), (x,))

    def client_state(self) -> dict[str, torch.Tensor]:
        return {"rate": torch.zeros(())}

    def local_update(self, cohort: Cohort) -> Upload:
        rates = self.params.rates.of(cohort)
        cohort.constants = {"width.rate": rates}
        local = cohort.sgd("shared")
        masks = torch.vmap(cohort.model.width.masks)(rates)
        mask = {n: masks[n] if n in masks else torch.ones_like(v) for n, v in local.shared.items()}
        cohort.state = {"rate": rates}
        return Upload(shared=local.shared, mask=mask, weight=torch.ones(len(cohort), device=rates.device))

