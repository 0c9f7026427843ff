"""Per-FedAvg (first order): each local meta-step is w - beta grad f(w - alpha grad f(w)); engine paths agree."""

from __future__ import annotations

import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.testing import EXECUTIONS
from test_algo_fedprox import local_gradient
from test_engine_equivalence import assert_close, run_stage


def test_vmap_and_loop_match_sequential():
    local = LocalConfig(batch_size=4, lr=0.1)
    reference = run_stage("perfedavg", [], {"tau": 2, "alpha": 0.05}, "sequential", 1, local)
    for execution, chunk in EXECUTIONS:
        assert_close(run_stage("perfedavg", [], {"tau": 2, "alpha": 0.05}, execution, chunk, local)[0], reference[0])


def test_local_meta_steps_are_first_order_maml():
    """Two meta-steps of one client with full-batch gradients, by autograd; the server takes its model."""
    alpha, beta = 0.3, 0.2
    torch.manual_seed(0)
    model = TinyMLP()
    w = {n: p.detach().clone() for n, p in model.named_parameters()}
    stage = stage_for(model, [], ToyData(), build_algorithm("perfedavg", {"alpha": alpha, "tau": 2}),
                      StageConfig(rounds=1, clients_per_round=1, local=LocalConfig(batch_size=64, lr=beta)))
    fit(stage)
    client = int(stage.sample_cohort(0))
    for _ in range(2):
        temp = {n: v - alpha * g for (n, v), g in zip(w.items(), local_gradient(w, client).values(), strict=True)}
        w = {n: v - beta * local_gradient(temp, client)[n] for n, v in w.items()}
    assert_close({n: p.detach() for n, p in model.named_parameters()}, w)
