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
pipeline seed, and kept as a personal scalar `width.rate` of the model; the per-entry mean is uniform over the
holders (the authors' code); HeteroFL's static batch norm is not needed (the zoo has no batch norm) and its
"scaler" (outputs divided by p_i in training) is left out; width scaling covers models made of Linear layers
(`mlp`, `logreg`): a convolution's channels feed a flattened layer, which this generic masking does not follow.
Recorded per client: `rate`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from fedpilot.algorithms.resources import Levels, assign
from fedpilot.api import Algorithm, AlgorithmParams, Cohort, SpecError, Tensors, Upload


class WidthMask(nn.Module):
    """A client's width rate p (personal, never trained) and which entries of each Linear layer its sub-model holds."""

    def __init__(self, layers: list[tuple[str, int, int, bool, bool]]):
        super().__init__()
        self.layers = layers  # (module name, out features, in features, outputs are hidden, inputs are hidden)
        self.rate = nn.Parameter(torch.tensor(1.0))

    def masks(self, rate: torch.Tensor) -> Tensors:
        """0/1 masks of the sub-model at width `rate`, for every weight and bias of the layers."""
        masks = {}
        for name, out, inp, out_hidden, in_hidden in self.layers:
            rows = _first(rate, out) if out_hidden else torch.ones(out, device=rate.device)
            cols = _first(rate, inp) if in_hidden else torch.ones(inp, device=rate.device)
            masks[f"{name}.weight"], masks[f"{name}.bias"] = rows[:, None] * cols[None, :], rows
        return masks

    def forward(self, params: Tensors) -> Tensors:
        """The parameters of the sub-model at this client's rate (the others zero)."""
        masks = self.masks(self.rate.detach())
        return {n: v * masks[n] if n in masks else v for n, v in params.items()}


def _first(rate: torch.Tensor, size: int) -> torch.Tensor:
    """1 for the first ceil(rate * size) of `size` units, 0 for the rest."""
    kept = torch.ceil(rate * size - 1e-6)
    return (torch.arange(size, device=rate.device) < kept).to(rate.dtype)


class HeteroFLParams(AlgorithmParams):
    """rates: the clients' width rates in (0, 1] and their shares of the clients (default: pFedGate's setting, the
    full model for 10% of the clients and half the width for the others)."""

    rates: Levels = Levels(values=[1.0, 0.5], shares=[0.1, 0.9])


class HeteroFL(Algorithm):
    """Each client trains the width-p_i sub-model of the global model; per-entry mean over the clients holding it."""

    name = "heterofl"
    Params = HeteroFLParams

    @property
    def personal_part(self) -> Any:
        return [r"width\.rate"]

    def prepare_model(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        """Give the model its `width` (once): the Linear layers in order, the last one (the head) keeping its outputs,
        the first one its inputs."""
        if isinstance(getattr(model, "width", None), WidthMask):
            return
        owners = [(n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))]
        if not owners or any(not isinstance(m, nn.Linear) or m.bias is None for _, m in owners):
            kinds = sorted({type(m).__name__ for _, m in owners})
            raise SpecError("model", type(model).__name__, f"HeteroFL width-scales models made of Linear layers with "
                            f"biases (mlp, logreg); this one has {kinds}")
        last = len(owners) - 1
        layers = [(n, m.out_features, m.in_features, i < last, i > 0) for i, (n, m) in enumerate(owners)]
        model.width = WidthMask(layers).to(next(model.parameters()).device)

    def forward(self, model: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        """The client's sub-model: the model with the entries outside its width masked."""
        width = {"rate": params["width.rate"]}
        weights = {n: v for n, v in params.items() if n != "width.rate"}
        return functional_call(model, functional_call(model.width, width, (weights,)), (x,))

    def client_state(self) -> dict[str, torch.Tensor]:
        return {"rate": torch.zeros(())}

    def local_update(self, cohort: Cohort) -> Upload:
        rates = self.p.rates.per_client(cohort.round_key[0], cohort.n_clients)
        assign(cohort, "width.rate", rates)
        local = cohort.sgd("shared")  # the rate is personal: read, never trained
        mine = cohort.personal["width.rate"]
        masks = torch.vmap(cohort.model.width.masks)(mine)
        mask = {n: masks[n] if n in masks else torch.ones_like(v) for n, v in local.shared.items()}
        cohort.state = {"rate": mine}
        return Upload(shared=local.shared, mask=mask, weight=torch.ones(len(cohort), device=mine.device))

