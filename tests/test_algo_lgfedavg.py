"""LG-FedAvg: local representations (the body) and global layers (the head); only the head travels; it is FedSim
with the body personal; engine paths agree."""

from __future__ import annotations

import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import INPUT, assert_close, run_stage

LOCAL = LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)


def test_vmap_and_loop_match_sequential():
    reference = run_stage("lg_fedavg", INPUT, {"lr_v": 0.2}, "sequential", 1, LOCAL)
    for execution, chunk in EXECUTIONS:
        got = run_stage("lg_fedavg", INPUT, {"lr_v": 0.2}, execution, chunk, LOCAL)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


def test_bodies_stay_local_and_only_the_head_is_uploaded():
    algorithm = build_algorithm("lg_fedavg")
    assert algorithm.personal_part == [r"body\..*"]
    torch.manual_seed(0)
    model = TinyMLP()
    body = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("body.")}
    stage = stage_for(model, INPUT, ToyData(), algorithm, StageConfig(rounds=2, clients_per_round=5, local=LOCAL))
    fit(stage)
    head_bytes = 4 * (24 * 4 + 4)
    assert stage.comm_bytes[-1] == 2 * 5 * head_bytes  # up and down: the global layers of 5 clients, nothing else
    for name, value in body.items():
        assert torch.equal(dict(model.named_parameters())[name].detach(), value)  # no shared body to average
        visited = (stage.bank.tensor(name) != value).flatten(1).any(1)
        assert 5 <= int(visited.sum()) <= 10  # each client's own representation
    same = run_stage("fedsim", INPUT, {}, "vmap", 7, LOCAL)
    assert_close(run_stage("lg_fedavg", INPUT, {}, "vmap", 7, LOCAL)[0], same[0])
