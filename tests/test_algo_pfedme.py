"""pFedMe: the personal model is the Moreau envelope's proximal point, the client's w steps towards it and the server
mixes with beta (Algorithm 1); engine paths agree."""

from __future__ import annotations

import torch
from torch import nn

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.testing import EXECUTIONS
from test_algo_fedprox import local_gradient, norm
from test_engine_equivalence import assert_close

ALL = [n for n, _ in TinyMLP().named_parameters()]


class SmoothMLP(TinyMLP):
    """TinyMLP with tanh: a smooth loss, whose proximal problem gradient descent solves to any precision (with ReLU's
    kinks the iterates settle at a residual ~0.2 of the starting gradient, however many steps)."""

    def __init__(self):
        super().__init__()
        self.body[2] = nn.Tanh()


def pfedme_stage(params: dict, local: LocalConfig, execution: str = "vmap", chunk: int = 7, rounds: int = 3,
                 per_round: int | None = 7, server_lr: float = 1.0,
                 model_type: type[nn.Module] = TinyMLP) -> tuple[FederatedStage, dict]:
    torch.manual_seed(0)
    model = model_type()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = StageConfig(rounds=rounds, clients_per_round=per_round, local=local, max_parallel_clients=chunk,
                      server={"lr": server_lr})
    stage = stage_for(model, ALL, ToyData(), build_algorithm("pfedme", params), cfg, seed=3)
    stage.executor_choice.pin(execution)
    fit(stage)
    return stage, start


def state(stage: FederatedStage) -> dict:
    return {**{f"global.{n}": p.detach() for n, p in stage.model.named_parameters()},
            **{f"personal.{n}": stage.bank.tensor(n) for n in ALL}}


def test_vmap_and_loop_match_sequential():
    params, local = {"lam": 2.0, "local_rounds": 2, "inner_steps": 2}, LocalConfig(batch_size=4, lr=0.05)
    reference = state(pfedme_stage(params, local, "sequential", 1)[0])
    for execution, chunk in EXECUTIONS:
        assert_close(state(pfedme_stage(params, local, execution, chunk)[0]), reference)


def test_one_round_follows_algorithm_1():
    """R = 1, one client, gradient descent (a batch larger than any client's train set: every inner step sees all of
    its samples): theta = argmin f_i(theta) + lam/2 ||theta - w^t||^2 (its gradient vanishes at theta), and the new
    global model is w^t - beta eta lam (w^t - theta)."""
    lam, eta, beta = 1.0, 0.1, 0.5
    params = {"lam": lam, "local_rounds": 1, "inner_steps": 100, "lr_personal": 0.2}
    stage, start = pfedme_stage(params, LocalConfig(batch_size=64, lr=eta), rounds=1, per_round=1, server_lr=beta,
                                model_type=SmoothMLP)
    client = int(stage.sample_cohort(0))
    theta = {n: stage.bank.tensor(n)[client] for n in ALL}
    envelope = {n: g + lam * (theta[n] - start[n]) for n, g in local_gradient(theta, client, SmoothMLP()).items()}
    assert norm(envelope) < 1e-3 * norm(local_gradient(start, client, SmoothMLP()))  # measured 1.6e-5
    expected = {f"global.{n}": start[n] - beta * eta * lam * (start[n] - theta[n]) for n in ALL}
    assert_close({k: v for k, v in state(stage).items() if k.startswith("global.")}, expected)
