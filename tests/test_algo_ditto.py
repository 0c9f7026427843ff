"""Ditto: the global copy is exactly FedAvg, personal copies are pulled towards it, engine paths agree."""

from __future__ import annotations

import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import assert_close, run_stage

LOCAL = LocalConfig(epochs=1, batch_size=4, lr=0.1)
ALL = [n for n, _ in TinyMLP().named_parameters()]


def ditto_stage(lam: float, algorithm: str = "ditto") -> FederatedStage:
    torch.manual_seed(0)
    names = ALL if algorithm == "ditto" else []
    stage = stage_for(TinyMLP(), names, ToyData(), build_algorithm(algorithm, {"lam": lam} if names else {}),
                           StageConfig(rounds=4, clients_per_round=6, local=LOCAL, eval_every=4), seed=5)
    fit(stage)
    return stage


def test_vmap_and_loop_match_sequential():
    reference = run_stage("ditto", None, {"lam": 0.5}, "sequential", 1, LOCAL)
    for execution, chunk in EXECUTIONS:
        got = run_stage("ditto", None, {"lam": 0.5}, execution, chunk, LOCAL)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


def test_the_global_copy_is_fedavg_and_personal_copies_are_pulled_to_it():
    fedavg = dict(ditto_stage(0.0, "fedavg").model.named_parameters())
    loose, tight = ditto_stage(0.0), ditto_stage(10.0)
    for name, value in loose.model.named_parameters():
        torch.testing.assert_close(value, fedavg[name])  # the same batches: the global update is FedAvg's

    def spread(stage: FederatedStage) -> float:
        """Mean distance of the visited clients' personal copies to the global model."""
        params = dict(stage.model.named_parameters())
        distance = sum((stage.bank.tensor(n) - params[n].detach()).flatten(1).pow(2).sum(1) for n in ALL).sqrt()
        return float(distance[distance > 0].mean())

    assert spread(tight) < 0.75 * spread(loose)  # (distances to the final global model, which moved on)
    assert loose.client_metrics["test"]["acc"].shape == (12,)  # evaluated with the personal copies


def test_shared_and_personal_memory_both_count_the_whole_model():
    stage = ditto_stage(0.1)
    assert stage.shared_names == stage.personal_names == ALL
