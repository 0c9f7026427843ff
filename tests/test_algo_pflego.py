"""PFLEGO: a round is the exact SGD step on L = sum_i alpha_i l_i of Algorithm 1; engine paths agree; bad params."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.func import functional_call

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.pflego import Pflego
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import HEAD, INPUT, assert_close, run_stage

FULL_BATCH = LocalConfig(batch_size=64, lr=0.1)  # > every ToyData client's train set: each step is full-batch GD
RHO = 0.3


def client_loss(params: dict, data: ToyData, i: int) -> torch.Tensor:
    """l_i: mean cross-entropy over client i's whole train set."""
    lo, n = int(data.offsets["train"][i]), int(data.sizes["train"][i])
    return F.cross_entropy(functional_call(TinyMLP(), params, (data.x[lo : lo + n],)), data.y[lo : lo + n])


def expected_round(start: dict, data: ToyData, sampled: list[int], tau: int, beta: float) -> tuple[dict, dict]:
    """Algorithm 1 by hand: (theta after the server step, every client's head) from autograd on l_i."""
    body = {n: v for n, v in start.items() if n not in HEAD}
    alpha = data.sizes["train"].double() / data.sizes["train"].sum()
    unbiased = data.n_clients / len(sampled)
    heads = {n: start[n].expand(data.n_clients, *start[n].shape).clone() for n in HEAD}
    theta_grad = {n: torch.zeros_like(v) for n, v in body.items()}
    for i in sampled:
        head = {n: heads[n][i].clone().requires_grad_() for n in HEAD}
        for _ in range(tau - 1):
            grads = torch.autograd.grad(client_loss({**body, **head}, data, i), list(head.values()))
            head = {n: (w - beta * g).detach().requires_grad_() for (n, w), g in zip(head.items(), grads, strict=True)}
        theta = {n: v.clone().requires_grad_() for n, v in body.items()}
        grads = torch.autograd.grad(client_loss({**theta, **head}, data, i), [*theta.values(), *head.values()])
        scale = float(alpha[i]) * unbiased
        for (n, _), g in zip(theta.items(), grads[: len(theta)], strict=True):
            theta_grad[n] += scale * g
        for (n, w), g in zip(head.items(), grads[len(theta) :], strict=True):
            heads[n][i] = (w - RHO * scale * g).detach()
    return {n: v - RHO * theta_grad[n] for n, v in body.items()}, heads


def one_round(params: dict, clients_per_round: int | None) -> tuple[FederatedStage, dict]:
    """A one-round PFLEGO stage (server sgd with lr rho) and the model's starting parameters."""
    torch.manual_seed(0)
    model = TinyMLP()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = StageConfig(rounds=1, clients_per_round=clients_per_round, local=FULL_BATCH)  # server: sgd, lr 1
    stage = stage_for(model, HEAD, ToyData(), build_algorithm("pflego", {"rho": RHO, **params}), cfg)
    fit(stage)
    return stage, start


def assert_round(stage: FederatedStage, expected: tuple[dict, dict]) -> None:
    theta = {n: p.detach() for n, p in stage.model.named_parameters() if n not in HEAD}
    assert_round_values((theta, {n: stage.bank.tensor(n) for n in HEAD}), expected)


def assert_round_values(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    assert_close(got[0], expected[0])
    assert_close(got[1], expected[1])


def sgd_step_on_the_global_loss(start: dict, data: ToyData, rho: float) -> tuple[dict, dict]:
    """psi - rho grad L(psi) with L = sum_i alpha_i l_i(W_i, theta), every head starting at the model's head."""
    body = {n: v.clone().requires_grad_() for n, v in start.items() if n not in HEAD}
    heads = [{n: start[n].clone().requires_grad_() for n in HEAD} for _ in range(data.n_clients)]
    alpha = data.sizes["train"].float() / data.sizes["train"].sum()
    total = sum(alpha[i] * client_loss({**body, **heads[i]}, data, i) for i in range(data.n_clients))
    total.backward()
    theta = {n: v.detach() - rho * v.grad for n, v in body.items()}
    return theta, {n: torch.stack([h[n].detach() - rho * h[n].grad for h in heads]) for n in HEAD}


def test_tau_1_with_full_participation_is_one_sgd_step_on_the_global_loss():
    """alpha_i weights the body AND the head gradients (Eq. 5; unequal client sizes make it matter)."""
    stage, start = one_round({"tau": 1}, None)
    data = ToyData()
    assert len(set(data.sizes["train"].tolist())) > 1
    assert_round(stage, sgd_step_on_the_global_loss(start, data, RHO))


def test_the_default_is_algorithm_1_with_one_step_size_for_heads_and_body():
    torch.manual_seed(0)
    model = TinyMLP()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    algorithm = build_algorithm("pflego", {"tau": 1})  # rho: its default, on both sides
    stage = stage_for(model, HEAD, ToyData(), algorithm, StageConfig(rounds=1, local=FULL_BATCH))
    fit(stage)
    assert_round(stage, sgd_step_on_the_global_loss(start, ToyData(), algorithm.p.rho))


def test_a_round_is_the_sgd_step_on_the_global_loss_in_expectation_over_cohorts():
    """Proposition 1 with client sampling (r = 2 of I = 5): the (I/r) scaling makes the mean over every cohort the
    engine could sample of one round's update (theta and every head) the full-participation SGD step."""
    data = ToyData(n_clients=5)
    rounds = []
    for cohort in itertools.combinations(range(5), 2):
        torch.manual_seed(0)
        model = TinyMLP()
        start = {n: p.detach().clone() for n, p in model.named_parameters()}
        cfg = StageConfig(rounds=1, clients_per_round=2, local=FULL_BATCH)
        stage = stage_for(model, HEAD, data, build_algorithm("pflego", {"tau": 1, "rho": RHO}), cfg)
        stage.sample_cohort = lambda round_idx, chosen=cohort: torch.tensor(chosen)
        fit(stage)
        rounds.append(({n: p.detach() for n, p in model.named_parameters() if n not in HEAD},
                       {n: stage.bank.tensor(n).clone() for n in HEAD}))
    mean = tuple({n: torch.stack([r[part][n] for r in rounds]).mean(0) for n in rounds[0][part]} for part in (0, 1))
    assert_round_values(mean, sgd_step_on_the_global_loss(start, data, RHO))
    assert not torch.allclose(rounds[0][0]["body.1.weight"], mean[0]["body.1.weight"])  # one round alone is not


def test_partial_participation_follows_algorithm_1_with_head_steps_and_the_unbiased_sum():
    stage, start = one_round({"tau": 3, "beta": 0.5}, 5)
    sampled = stage.sample_cohort(0).tolist()
    assert len(sampled) == 5
    assert_round(stage, expected_round(start, ToyData(), sampled, tau=3, beta=0.5))


@pytest.mark.parametrize(("personal", "params"), [(HEAD, {"tau": 3}), (HEAD, {"tau": 1, "rho": 0.2}),
                                                  (INPUT, {"tau": 2, "beta": 0.05})])
def test_vmap_and_loop_match_sequential(personal, params):
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)
    reference = run_stage(Pflego(params), personal, {}, "sequential", 1, local)
    for execution, chunk in EXECUTIONS:
        got = run_stage(Pflego(params), personal, {}, execution, chunk, local)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


@pytest.mark.parametrize(("params", "key"), [({"tau": 0}, "tau"), ({"beta": 0.0}, "beta"), ({"rho": -1.0}, "rho"),
                                             ({"alpha": 0.1}, "alpha")])
def test_bad_params_are_refused_by_name(params, key):
    with pytest.raises(ValidationError, match=key):
        build_algorithm("pflego", params)
