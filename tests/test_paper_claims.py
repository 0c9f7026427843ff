"""Pillutla et al. (ICML 2022)'s claims through the engine, on problems small enough for the suite: FedAlt
beats FedSim in the regime its analysis names (Sec. 3.3), and partial personalization gets most of full
personalization's gain (Sec. 4).

(The other papers' claims are tested with their algorithms: PFLEGO's exact SGD step in expectation in
test_algo_pflego.py, Self-FL's posterior on the scalar problem in test_algo_selffl.py, pFedGate's per-index
aggregation on its worked example in test_algo_pfedgate.py.)"""

from __future__ import annotations

import torch
from torch import nn

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.task import Scores, Task

HEAD = ["head.weight", "head.bias"]


# ---- FedAlt vs FedSim ------------------------------------------------------------------------------------------
class Squared(Task):
    """Least squares (y - output)^2 / 2; `acc` (within 0.5) only so the stage's evaluation has its metric."""

    name, metrics, distributions, train_metric = "squared", ("acc", "loss"), ("acc",), "acc"

    def scores(self, output: torch.Tensor, y: torch.Tensor) -> Scores:
        loss = (output - y).pow(2) / 2
        one = torch.ones_like(loss)
        return {"loss": (loss, one), "acc": (((output - y).abs() < 0.5).to(loss.dtype), one)}


class Offset(nn.Module):
    """A shared linear model u plus a personal offset v_i: output = x.u + v_i."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.shared = nn.Linear(dim, 1, bias=False)
        self.offset = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.shared(x).squeeze(-1) + self.offset


class OffsetData(ClientData):
    """12 clients of 20 train samples, y = x.a + c_i + noise: the offsets c_i (sd 2) make the clients' gradients
    for u differ (delta^2 > 0) until each v_i has absorbed its c_i; inputs with a client mean mu_i (norm ~ `shift`)
    couple u and v_i (chi^2 > 0: the cross term of the Hessian is mu_i)."""

    def __init__(self, seed: int, shift: float, n: int = 12, dim: int = 8):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.full((n,), 24)
        owner = torch.repeat_interleave(torch.arange(n), sizes)
        mean = shift * torch.randn(n, dim, generator=g) / dim**0.5
        a, c = torch.randn(dim, generator=g), 2.0 * torch.randn(n, generator=g)
        x = torch.randn(int(sizes.sum()), dim, generator=g) + mean[owner]
        start = torch.cumsum(sizes, 0) - sizes
        super().__init__(x, x @ a + c[owner] + 0.1 * torch.randn(len(owner), generator=g),
                         {"train": start, "val": start + 20, "test": start + 22},
                         {"train": torch.full((n,), 20), "val": torch.full((n,), 2), "test": torch.full((n,), 2)})

    def objective(self, u: torch.Tensor, v: torch.Tensor) -> float:
        """F(u, V) = (1/n) sum_i F_i(u, v_i) on the train splits (the paper's Eq. 4)."""
        index = self.offsets["train"][:, None] + torch.arange(20)
        return float(((self.x[index] @ u + v[:, None] - self.y[index]).pow(2) / 2).mean())


def alt_over_sim(seed: int, shift: float) -> float:
    """F reached by FedSim / F reached by FedAlt: same data, step sizes, rounds and local steps (tau_u = tau_v =
    tau = 5 full-batch steps), 4 of 12 clients a round."""
    data = OffsetData(seed, shift)
    reached = {}
    for algorithm in ("fedalt", "fedsim"):
        torch.manual_seed(seed)
        model = Offset()
        cfg = StageConfig(rounds=15, clients_per_round=4, local=LocalConfig(steps=5, batch_size=64, lr=0.1),
                          eval_every=15)
        fit(stage := stage_for(model, ["offset"], data, build_algorithm(algorithm), cfg, seed=seed, task=Squared()))
        reached[algorithm] = data.objective(model.shared.weight.detach()[0], stage.bank.tensor("offset"))
    return reached["fedsim"] / reached["fedalt"]


def test_fedalt_beats_fedsim_with_full_batches_heterogeneous_and_coupled_clients():
    """Sec. 3.3: with sigma_u ~ sigma_v ~ 0 (full-batch local steps on few samples), heterogeneous clients and
    partial participation, FedAlt's bound beats FedSim's by (1 + chi^2)^(1/2): FedSim's shared steps are taken with
    personal parameters that have not absorbed the client's heterogeneity yet. FedAlt reaches a lower objective on
    every seed, and the gap grows with the coupling chi^2."""
    coupled = [alt_over_sim(seed, shift=2.0) for seed in range(3)]
    assert min(coupled) > 1.5  # measured: 2.3, 3.3, 4.6 (centred below: 1.2, 1.5, 1.4)
    centred = [alt_over_sim(seed, shift=0.0) for seed in range(3)]  # chi^2 ~ 0 (only sampling noise couples)
    assert min(centred) > 1.0 and sum(coupled) > 1.5 * sum(centred)


# ---- partial vs full personalization --------------------------------------------------------------------------
class PermutedData(ToyData):
    """ToyData whose clients name the classes differently (a seeded permutation each): a shared representation and
    per-client output layers explain the data; the whole model is the same for everyone but its last layer."""

    def __init__(self, seed: int):
        super().__init__(seed=seed)
        g = torch.Generator().manual_seed(100 + seed)
        names = torch.stack([torch.randperm(4, generator=g) for _ in range(self.n_clients)])
        owner = torch.repeat_interleave(torch.arange(self.n_clients),
                                        self.sizes["train"] + self.sizes["val"] + self.sizes["test"])
        self.y = names[owner, self.y]


def gains(seed: int) -> tuple[float, float]:
    """Mean test accuracy gained over FedAvg by partial (FedAlt, personal output layer: 20% of the parameters) and
    by full (Ditto, a personal copy of the whole model) personalization, after the same FedAvg warm start."""
    data, local = PermutedData(seed), LocalConfig(epochs=1, batch_size=5, lr=0.1)
    torch.manual_seed(seed)
    model = TinyMLP()
    cfg = StageConfig(rounds=20, clients_per_round=6, local=local, eval_every=20)
    fit(pretrain := stage_for(model, [], data, build_algorithm("fedavg"), cfg, seed=seed))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    accuracy = {}
    for algorithm, personal in (("fedalt", HEAD), ("ditto", [n for n in start])):
        model.load_state_dict(start, strict=False)
        fit(stage := stage_for(model, personal, data, build_algorithm(algorithm), cfg, seed=seed))
        accuracy[algorithm] = float(stage.client_metrics["test"]["acc"].nanmean())
    base = float(pretrain.client_metrics["test"]["acc"].nanmean())
    return accuracy["fedalt"] - base, accuracy["ditto"] - base


def test_partial_personalization_gets_most_of_the_full_gain():
    """Sec. 4: personalizing the output layer alone obtains most of the accuracy gain of personalizing the whole
    model (measured over 3 seeds: 107% of it; per seed 100%, 81%, 149%)."""
    partial, full = zip(*(gains(seed) for seed in range(3)), strict=True)
    assert min(full) > 0.05 and min(partial) > 0.05  # personalization helps both ways
    assert sum(partial) >= 0.8 * sum(full)
