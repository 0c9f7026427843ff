"""FedProx: mu = 0 is FedAvg, a client's local solution is the proximal problem's, the pull limits client drift,
engine paths agree."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import assert_close, run_stage

LOCAL = LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)
FULL_BATCH = LocalConfig(steps=100, batch_size=64, lr=0.2)  # a batch > every ToyData client: gradient descent


def test_vmap_and_loop_match_sequential():
    reference = run_stage("fedprox", [], {"mu": 0.5}, "sequential", 1, LOCAL)
    for execution, chunk in EXECUTIONS:
        got = run_stage("fedprox", [], {"mu": 0.5}, execution, chunk, LOCAL)
        assert_close(got[0], reference[0])


def test_mu_zero_is_fedavg():
    assert_close(run_stage("fedprox", [], {"mu": 0.0}, "vmap", 7, LOCAL)[0],
                 run_stage("fedavg", [], {}, "vmap", 7, LOCAL)[0])


def one_client(mu: float) -> tuple[dict, dict, int]:
    """One round of one client solving its local problem by gradient descent: (start, its solution, client)."""
    torch.manual_seed(0)
    model = TinyMLP()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage = stage_for(model, [], ToyData(), build_algorithm("fedprox", {"mu": mu}),
                      StageConfig(rounds=1, clients_per_round=1, local=FULL_BATCH))
    fit(stage)  # one client, server sgd with lr 1: the new global model is the client's
    return start, {n: p.detach() for n, p in model.named_parameters()}, int(stage.sample_cohort(0))


def local_gradient(params: dict, client: int, model: nn.Module | None = None) -> dict:
    data = ToyData()
    lo, n = int(data.offsets["train"][client]), int(data.sizes["train"][client])
    leaves = {k: v.clone().requires_grad_() for k, v in params.items()}
    loss = F.cross_entropy(functional_call(model or TinyMLP(), leaves, (data.x[lo : lo + n],)), data.y[lo : lo + n])
    return dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values())), strict=True))


def norm(params: dict) -> float:
    return float(sum(v.pow(2).sum() for v in params.values()).sqrt())


def test_the_local_solution_solves_the_proximal_problem_and_the_pull_limits_drift():
    """h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2: at the client's solution grad F_k(w) + mu (w - w^t) ~ 0, while
    grad F_k(w) itself is not; a larger mu keeps w closer to w^t."""
    drift = []
    for mu in (0.3, 1.0, 3.0):
        start, solution, client = one_client(mu)
        grad = local_gradient(solution, client)
        stationarity = {n: g + mu * (solution[n] - start[n]) for n, g in grad.items()}
        assert norm(stationarity) < 0.15 * norm(local_gradient(start, client))
        assert norm(grad) > 4 * norm(stationarity)
        drift.append(norm({n: solution[n] - start[n] for n in start}))
    assert drift[0] > drift[1] > drift[2] > 0
