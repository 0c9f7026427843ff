"""pFedGate: Chen et al., "Efficient Personalized Federated Learning via Sparse Model-Adaptation", ICML 2023
(paper 003, Sec. 5 and Algorithm 1).

Each client i owns a gating layer phi_i that maps a data batch x to block-wise gated weights; its personal
model is theta_i = theta_g * M~_i(x), the shared model scaled block by block, with at most a fraction s of
theta_g's entries kept. Per batch (Algorithm 1, line 4) the client takes one SGD step on theta_g and phi_i
through that sparse model (`cohort.sgd("all")`), then uploads only the entries of theta_g it changed; the
server averages each entry over the clients that sent it (per-index aggregation, App. A).

Gating layer (Sec. 5.2.1): the flattened input is normalised, then two fully connected paths with sigmoids
give the gated weights M in (0,1)^L and the block importances G in (0,1)^L.
Block splitting (Sec. 5.2.2): each parameter tensor (flattened, d_l entries) has a first block of
max(1, floor(d_l * s_min)) entries that is always kept, the rest split into (B - 1) equal blocks.
Sparse gated weights (Sec. 5.2.3, Eq. 6): I in {0,1}^L maximises I.G subject to |I * W| / d <= s (W: block
sizes, d: entries of theta_g); M~ = I_ST * M with the straight-through I_ST = I - G.detach() + G.

Choices where the paper is open (documented, tested in tests/test_algo_pfedgate.py):
- normalisation: LayerNorm on the flattened input stands for the paper's switchable normalisation and final
  batch norm (no batch statistics in the vectorized engine);
- pooling over a batch: per-sample M and G are averaged over the batch (one sparse model per batch, as
  theta_i = theta_g * M~ must be one model for the batch); at evaluation the batch is the client's whole split;
- knapsack solver: the greedy by importance per parameter (G_j / W_j), taking blocks in that order while they
  fit; forced first blocks come first. It always meets the budget (the paper does not name its solver);
- aggregation weights: the clients' train sample counts per entry, over the clients that uploaded it;
- a short last batch is padded (weight 0) in the vectorized engine, and padding takes part in the gate's batch
  pooling there: use `local.steps` with batch_size <= the smallest client for exact sequential equivalence.
Recorded per client (engine state bank, per-client table): `model_density` (kept fraction of theta_g on a
batch of its data, <= s), `upload_density` (fraction of theta_g entries it uploaded in its last round) and
`upload_bytes`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call, vmap

from fedpilot.api import Algorithm, AlgorithmParams, Cohort, Params, SpecError, Upload


class BlockGate(nn.Module):
    """The gating layer of one client plus the fixed block layout of the model it scales."""

    def __init__(self, input_dim: int, shapes: dict[str, torch.Size], blocks: int, s: float, s_min: float):
        super().__init__()
        self.names = list(shapes)
        sizes: list[int] = []
        forced: list[bool] = []
        for i, shape in enumerate(shapes.values()):
            d = math.prod(shape)
            first = min(d, max(1, math.floor(d * s_min)))
            rest = [len(c) for c in torch.arange(d - first).tensor_split(blocks - 1) if len(c)]
            start = len(sizes)
            sizes += [first, *rest]
            forced += [True] + [False] * len(rest)
            owner = torch.repeat_interleave(torch.arange(start, len(sizes)), torch.tensor([first, *rest]))
            self.register_buffer(f"element_block_{i}", owner.view(shape))
        self.register_buffer("block_size", torch.tensor(sizes, dtype=torch.float32))
        self.register_buffer("forced", torch.tensor(forced))
        self.budget = s * float(self.block_size.sum())
        if float(self.block_size[self.forced].sum()) > self.budget:
            raise SpecError("params.s_min", s_min, f"the always-kept first blocks exceed the budget s={s}")
        self.norm = nn.LayerNorm(input_dim)
        self.gates = nn.Linear(input_dim, len(sizes))
        self.importance = nn.Linear(input_dim, len(sizes))

    def select(self, importance: torch.Tensor) -> torch.Tensor:
        """The knapsack choice I in {0,1}^L (greedy by importance per parameter; forced blocks first)."""
        ratio = torch.where(self.forced, torch.full_like(importance, math.inf), importance / self.block_size)
        order = torch.argsort(ratio, descending=True)
        fits = (torch.cumsum(self.block_size[order], 0) <= self.budget).to(importance.dtype)
        return torch.zeros_like(importance).scatter(0, order, fits)

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch-pooled gated weights M and importances G, each [L]."""
        h = self.norm(x.flatten(1).to(self.block_size.dtype))
        return torch.sigmoid(self.gates(h)).mean(0), torch.sigmoid(self.importance(h)).mean(0)

    def forward(self, params: Params, x: torch.Tensor) -> Params:
        """The model's parameters scaled block-wise by M~ = I_ST * M for this batch."""
        m, g = self.predict(x)
        scale = (self.select(g.detach()) - g.detach() + g) * m
        return {n: params[n] * scale[getattr(self, f"element_block_{i}")] for i, n in enumerate(self.names)}

    def density(self, x: torch.Tensor) -> torch.Tensor:
        """Fraction of the model's entries kept for this batch (<= s)."""
        chosen = self.select(self.predict(x)[1])
        return (chosen * self.block_size).sum() / self.block_size.sum()


class _Density(nn.Module):
    """`BlockGate.density` as a forward, so torch.func.functional_call can run it with a client's gate."""

    def __init__(self, gate: BlockGate):
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate.density(x)


class PFedGateParams(AlgorithmParams):
    """s: sparsity budget (kept fraction of the shared model); blocks: B per parameter tensor; s_min: size of
    the always-kept first block; lr_gate: the gating layer's step size (null = the stage's local.lr)."""

    s: float = Field(0.5, gt=0, le=1)
    blocks: int = Field(5, ge=2)
    s_min: float = Field(0.05, gt=0, le=1)
    lr_gate: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _min_within_budget(self) -> PFedGateParams:
        if self.s_min > self.s:
            raise ValueError(f"s_min={self.s_min} must be <= s={self.s}")
        return self


class PFedGate(Algorithm):
    """Sparse personalized models from per-client gating layers over a shared model; sparse uploads."""

    name = "pfedgate"
    Params = PFedGateParams

    @property
    def personal_part(self) -> Any:
        return [r"gate\..*"]

    def prepare_model(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        """Give the model its gating layer `gate` (once; a later pFedGate stage reuses it)."""
        if isinstance(getattr(model, "gate", None), BlockGate):
            return
        if not hasattr(model, "body") or not hasattr(model, "head"):
            raise SpecError("model", type(model).__name__, "pFedGate needs a fedpilot model (body -> head)")
        shapes = {n: p.shape for n, p in model.named_parameters()}
        like = next(model.parameters())
        model.gate = BlockGate(math.prod(input_shape), shapes, self.p.blocks, self.p.s, self.p.s_min).to(like.device)

    def forward(self, model: nn.Module, params: Params, x: torch.Tensor) -> torch.Tensor:
        """The model with its weights scaled block-wise by this batch's sparse gated weights M~ (Eq. 6); `params`
        holds the client's gate (`gate.*`) next to the model's own parameters."""
        gate = {n.removeprefix("gate."): v for n, v in params.items() if n.startswith("gate.")}
        weights = {n: v for n, v in params.items() if not n.startswith("gate.")}
        return functional_call(model, functional_call(model.gate, gate, (weights, x)), (x,))

    def client_state(self) -> dict[str, torch.Tensor]:
        return {"model_density": torch.zeros(()), "upload_density": torch.zeros(()), "upload_bytes": torch.zeros(())}

    def local_update(self, cohort: Cohort) -> Upload:
        local = cohort.sgd("all", lr={"shared": None, "personal": self.p.lr_gate})
        cohort.personal = local.personal
        mask = {n: (v != cohort.shared[n]).to(v.dtype) for n, v in local.shared.items()}
        sent = sum(m.flatten(1).sum(1) for m in mask.values())
        total = sum(v.numel() for v in cohort.shared.values())
        element = next(iter(cohort.shared.values())).element_size()
        cohort.state = {"model_density": self._density(cohort), "upload_density": sent / total,
                        "upload_bytes": sent * element}
        return Upload(shared=local.shared, mask=mask)

    def _density(self, cohort: Cohort) -> torch.Tensor:
        """Each client's kept fraction of the shared model on its first training batch, with its own gate."""
        gate = {n.removeprefix("gate."): v for n, v in cohort.personal.items()}
        module = _Density(cohort.model.gate)
        return vmap(lambda p, xb: functional_call(module, {f"gate.{n}": v for n, v in p.items()}, (xb,)))(
            gate, cohort.train_inputs(cohort.local.batch_size))
