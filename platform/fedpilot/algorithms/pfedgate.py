"""pFedGate: Chen et al., "Efficient Personalized Federated Learning via Sparse Model-Adaptation", ICML 2023
(Sec. 5 and Algorithm 1).

Each client i owns a gating layer phi_i that maps a data batch x to block-wise gated weights; its personal
model is theta_i = theta_g * M~_i(x), the shared model scaled block by block, with at most a fraction s of
theta_g's entries kept. Per batch (Algorithm 1, line 4) the client takes one SGD step on theta_g and phi_i
through that sparse model (`cohort.sgd("all")`), then uploads only the entries of theta_g it changed; the
server averages each entry over the clients that sent it (per-index aggregation, App. A).

Gating layer (Sec. 5.2.1): the flattened input is normalised, then two fully connected paths with sigmoids
give the gated weights M in (0,1)^L and the block importances G in (0,1)^L.
Block splitting (Sec. 5.2.2): each parameter tensor (flattened, d_l entries) has a first block of
max(1, floor(d_l * s_min)) entries that is always kept, the rest split into (B - 1) equal blocks.
Sparse gated weights (Sec. 5.2.3, Eq. 6): I in {0,1}^L maximises I.G subject to |I * W| / d <= s_i (W: block
sizes, d: entries of theta_g); M~ = I_ST * M with the straight-through I_ST = I - G.detach() + G.

Heterogeneous budgets (Alg. 1's input {s_i}, Eq. 1's size(theta_i) <= d_i): `s` is every client's budget, or
`budgets` draws one s_i per client from a set of values with given shares, as in the paper's experiments (App.
H: s = 1 for 10% of the clients and 0.5 for the others), seeded by the pipeline seed (algorithms/resources.py). A
client's s_i is a personal scalar of its gating layer (`gate.budget`, never trained), so it holds in training and
evaluation, and is recorded per client as `budget`. The paper's per-client budgets "as a dataset column" would
need per-client data attributes, which the data layer does not provide yet.

Knapsack (Eq. 6 is the exact 0/1 knapsack; the paper does not name its solver): `exact` enumerates every subset
of the free (not always-kept) blocks, 2^F of them, and keeps the most important one that fits: cheap while F is
small (the default `auto` uses it up to F = 16, e.g. a 2-layer MLP with B = 5: 4 tensors x 4 free blocks);
`greedy` takes blocks by importance per parameter (G_j / W_j) while the running size fits. The greedy solution
always meets the budget but is not optimal: on the digits pipelines' MLP (64-200-10, B = 5, s = 0.5) with uniform
random importances it falls short of the exact objective on some draws (tests/test_algo_pfedgate.py measures how
far), which is why `auto` takes the exact solver whenever enumerating is cheap.

Choices where the paper is open (documented, tested in tests/test_algo_pfedgate.py):
- normalisation: LayerNorm on the flattened input stands for the paper's switchable normalisation and final
  batch norm (no batch statistics in the vectorized engine);
- pooling over a batch: per-sample M and G are averaged over the batch (one sparse model per batch, as
  theta_i = theta_g * M~ must be one model for the batch); at evaluation the batch is the client's whole split;
- aggregation weights: the clients' train sample counts per entry, over the clients that uploaded it (App. A's
  per-index aggregation);
- a short last batch is padded (weight 0) in the vectorized engine, and padding takes part in the gate's batch
  pooling there: use `local.steps` with batch_size <= the smallest client for exact sequential equivalence.
Recorded per client (engine state bank, per-client table): `budget` (s_i), `model_density` (kept fraction of
theta_g on a batch of its data, <= s_i), `upload_density` (fraction of theta_g entries it uploaded in its last
round) and `upload_bytes`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import nn
from torch.func import functional_call, vmap

from fedpilot.algorithms.ranges import PFEDGATE_GRID_LR
from fedpilot.algorithms.resources import Levels
from fedpilot.api import Algorithm, AlgorithmParams, Cohort, SpecError, Tensors, Tunable, Upload

EXACT_MAX_FREE_BLOCKS = 16  # 2^16 subsets: `auto` solves the knapsack exactly up to here


def block_layout(shapes: dict[str, torch.Size], blocks: int, s_min: float) -> list[list[int]]:
    """Each parameter tensor's blocks (Sec. 5.2.2): their sizes, the first one always kept."""
    layout = []
    for shape in shapes.values():
        d = math.prod(shape)
        first = min(d, max(1, math.floor(d * s_min)))
        layout.append([first, *(len(c) for c in torch.arange(d - first).tensor_split(blocks - 1) if len(c))])
    return layout


def layout_problem(layout: list[list[int]], smallest_budget: float, knapsack: str) -> tuple[str, str] | None:
    """Why a block layout does not work with these options: (the option at fault, the problem), or None."""
    if sum(sizes[0] for sizes in layout) > smallest_budget * sum(sum(sizes) for sizes in layout):
        return "s_min", f"the always-kept first blocks exceed the budget s={smallest_budget}"
    free = sum(len(sizes) - 1 for sizes in layout)
    if knapsack == "exact" and free > EXACT_MAX_FREE_BLOCKS:
        return "knapsack", (f"{free} free blocks: 2^{free} subsets is too many to enumerate (at most "
                            f"{EXACT_MAX_FREE_BLOCKS}); use greedy or fewer blocks")
    return None


class BlockGate(nn.Module):
    """The gating layer of one client, the fixed block layout of the model it scales, and its budget s_i: a buffer
    holding `s`, which each client's own value replaces (pFedGate's per-client constant `gate.budget`)."""

    def __init__(self, input_dim: int, shapes: dict[str, torch.Size], blocks: int, s: float, s_min: float,
                 knapsack: str = "auto", smallest_budget: float | None = None):
        super().__init__()
        self.names = list(shapes)
        layout = block_layout(shapes, blocks, s_min)
        problem = layout_problem(layout, s if smallest_budget is None else smallest_budget, knapsack)
        if problem is not None:  # options a spec gives are checked before the gate is built (PFedGate.prepare_model)
            raise ValueError(f"{problem[0]}: {problem[1]}")
        sizes: list[int] = []
        forced: list[bool] = []
        for i, (shape, tensor_blocks) in enumerate(zip(shapes.values(), layout, strict=True)):
            start = len(sizes)
            sizes += tensor_blocks
            forced += [True] + [False] * (len(tensor_blocks) - 1)
            owner = torch.repeat_interleave(torch.arange(start, len(sizes)), torch.tensor(tensor_blocks))
            self.register_buffer(f"element_block_{i}", owner.view(shape))
        self.register_buffer("block_size", torch.tensor(sizes, dtype=torch.float32))
        self.register_buffer("forced", torch.tensor(forced))
        self.exact = self._knapsack(knapsack)
        self.register_buffer("budget", torch.tensor(float(s)))  # s_i: each client's own value replaces it
        self.norm = nn.LayerNorm(input_dim)
        self.gates = nn.Linear(input_dim, len(sizes))
        self.importance = nn.Linear(input_dim, len(sizes))

    def _knapsack(self, knapsack: str) -> bool:
        """Whether Eq. 6 is solved exactly; then every subset of the free blocks and its size, as buffers."""
        free = torch.nonzero(~self.forced).flatten()
        exact = knapsack == "exact" or (knapsack == "auto" and len(free) <= EXACT_MAX_FREE_BLOCKS)
        if exact:
            bits = torch.arange(2 ** len(free))[:, None].bitwise_right_shift(torch.arange(len(free))) & 1
            self.register_buffer("subsets", bits.float(), persistent=False)  # [2^F, F]
            self.register_buffer("placement", nn.functional.one_hot(free, len(self.forced)).float(), persistent=False)
            self.register_buffer("subset_size", self.subsets @ self.block_size[free], persistent=False)
        return exact

    def select(self, importance: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        """The knapsack choice I in {0,1}^L under the budget fraction s_i; forced blocks always in."""
        capacity = budget * self.block_size.sum()
        if self.exact:
            fits = self.subset_size <= capacity - self.block_size[self.forced].sum()
            value = torch.where(fits, self.subsets @ (self.placement @ importance), -math.inf)
            best = self.subsets.index_select(0, value.argmax().view(1))[0]
            return self.forced.to(importance.dtype) + best @ self.placement
        ratio = torch.where(self.forced, torch.full_like(importance, math.inf), importance / self.block_size)
        order = torch.argsort(ratio, descending=True)
        fits = (torch.cumsum(self.block_size[order], 0) <= capacity).to(importance.dtype)
        return torch.zeros_like(importance).scatter(0, order, fits)

    def predict(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch-pooled gated weights M and importances G, each [L]."""
        h = self.norm(x.flatten(1).to(self.block_size.dtype))
        return torch.sigmoid(self.gates(h)).mean(0), torch.sigmoid(self.importance(h)).mean(0)

    def forward(self, params: Tensors, x: torch.Tensor) -> Tensors:
        """The model's parameters scaled block-wise by M~ = I_ST * M for this batch."""
        m, g = self.predict(x)
        scale = (self.select(g.detach(), self.budget) - g.detach() + g) * m
        return {n: params[n] * scale[getattr(self, f"element_block_{i}")] for i, n in enumerate(self.names)}

    def density(self, x: torch.Tensor) -> torch.Tensor:
        """Fraction of the model's entries kept for this batch (<= s_i)."""
        chosen = self.select(self.predict(x)[1], self.budget)
        return (chosen * self.block_size).sum() / self.block_size.sum()


class _Density(nn.Module):
    """`BlockGate.density` as a forward, so torch.func.functional_call can run it with a client's gate."""

    def __init__(self, gate: BlockGate):
        super().__init__()
        self.gate = gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate.density(x)


class PFedGateParams(AlgorithmParams):
    """s: sparsity budget (kept fraction of the shared model) of every client, or with `budgets` of a client
    before its first participation; budgets: per-client s_i from a set of values and their shares of the clients
    (e.g. {values: [1.0, 0.5], shares: [0.1, 0.9]}); blocks: B per parameter tensor; s_min: size of the always-kept
    first block; lr_gate: the gating layer's step size (null = the stage's local.lr); knapsack: how Eq. 6 is
    solved (auto: exact up to 16 free blocks, else greedy)."""

    s: float = Field(0.5, gt=0, le=1)
    budgets: Levels | None = None
    blocks: int = Field(5, ge=2)
    s_min: float = Field(0.05, gt=0, le=1)
    lr_gate: float | None = Field(None, gt=0)
    knapsack: Literal["auto", "exact", "greedy"] = "auto"

    @model_validator(mode="after")
    def _min_within_budget(self) -> PFedGateParams:
        if self.s_min > self.smallest_budget:
            raise ValueError(f"s_min={self.s_min} must be <= every budget (smallest: {self.smallest_budget})")
        return self

    @property
    def smallest_budget(self) -> float:
        return min([self.s, *(self.budgets.values if self.budgets else [])])


class PFedGate(Algorithm):
    """Sparse personalized models from per-client gating layers over a shared model; sparse uploads. Each client's
    budget s_i is a per-client constant, `gate.budget` (Algorithm.constants)."""

    name = "pfedgate"
    Params = PFedGateParams
    tunable = {"local.lr": PFEDGATE_GRID_LR,
               "params.lr_gate": Tunable(1e-3, 10.0, fallback="local.lr", source=(
                   "Chen et al., ICML 2023, App. H: the gating layer's lr on the grid 0.01-1.5 (Table 7: 0.05-1.5); "
                   "fedpilot: widened to 1e-3 and 10")),
               "params.s": Tunable(0.1, 1.0, log=False, budget=True, source=(
                   "Chen et al., ICML 2023, Sec. 7.6 and Table 10: s from 1 down to 0.1"))}
    constants = frozenset({"gate.budget"})

    @property
    def personal_part(self) -> Any:
        return [r"gate\..*"]

    def prepare_model(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
        """Give the model its gating layer `gate` (once; a later pFedGate stage reuses it), its options checked
        against the model's parameters first (a SpecError naming the option)."""
        if isinstance(getattr(model, "gate", None), BlockGate):
            return
        shapes, p = {n: v.shape for n, v in model.named_parameters()}, self.params
        problem = layout_problem(block_layout(shapes, p.blocks, p.s_min), p.smallest_budget, p.knapsack)
        if problem is not None:
            raise SpecError(f"params.{problem[0]}", getattr(p, problem[0]), problem[1])
        gate = BlockGate(math.prod(input_shape), shapes, p.blocks, p.s, p.s_min, p.knapsack, p.smallest_budget)
        model.gate = gate.to(next(model.parameters()).device)

    def forward(self, model: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
        """The model with its weights scaled block-wise by this batch's sparse gated weights M~ (Eq. 6); `params`
        holds the client's gate (`gate.*`, its budget too) next to the model's own parameters."""
        gate = {n.removeprefix("gate."): v for n, v in params.items() if n.startswith("gate.")}
        weights = {n: v for n, v in params.items() if not n.startswith("gate.")}
        return functional_call(model, functional_call(model.gate, gate, (weights, x)), (x,))

    def client_state(self) -> dict[str, torch.Tensor]:
        return {"budget": torch.zeros(()), "model_density": torch.zeros(()), "upload_density": torch.zeros(()),
                "upload_bytes": torch.zeros(())}

    def local_update(self, cohort: Cohort) -> Upload:
        cohort.constants = {"gate.budget": self.budgets(cohort)}
        local = cohort.sgd("all", lr={"shared": None, "personal": self.params.lr_gate})
        cohort.personal = local.personal
        mask = {n: (v != cohort.shared[n]).to(v.dtype) for n, v in local.shared.items()}
        sent = sum(m.flatten(1).sum(1) for m in mask.values())
        total = sum(v.numel() for v in cohort.shared.values())
        element = next(iter(cohort.shared.values())).element_size()
        cohort.state = {"budget": cohort.constants["gate.budget"], "model_density": self._density(cohort),
                        "upload_density": sent / total, "upload_bytes": sent * element}
        return Upload(shared=local.shared, mask=mask)

    def adapt(self, cohort: Cohort) -> None:
        """A novel client trains its gating layer alone, on its own budget, with the global model fixed (Chen et al.,
        ICML 2023, novel clients' participation)."""
        cohort.constants = {"gate.budget": self.budgets(cohort)}
        cohort.personal = cohort.sgd("personal", lr={"shared": None, "personal": self.params.lr_gate}).personal

    def budgets(self, cohort: Cohort) -> torch.Tensor:
        """The chunk's clients' s_i [K]: the single s, or drawn from `budgets` by the pipeline's seed."""
        if self.params.budgets is None:
            return torch.full((len(cohort),), self.params.s, device=cohort.clients.device)
        return self.params.budgets.of(cohort)

    def _density(self, cohort: Cohort) -> torch.Tensor:
        """Each client's kept fraction of the shared model on its first training batch, with its own gate."""
        module = _Density(cohort.model.gate)
        return vmap(lambda own, xb: functional_call(module, own, (xb,)))(cohort.own, cohort.train_inputs(
            cohort.local.batch_size))
