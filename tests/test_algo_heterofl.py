"""HeteroFL: each client trains its width-p_i sub-model, the server averages each entry over the clients holding it,
clients use their sub-model; engine paths agree; models it cannot width-scale are refused."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import TinyCNN, TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.resources import Levels
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.errors import SpecError
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import assert_close

RATE = ["width.rate"]
RATES = {"rates": {"values": [1.0, 0.5], "shares": [0.5, 0.5]}}
FULL_BATCH = LocalConfig(steps=3, batch_size=64, lr=0.2)


def hetero_stage(local: LocalConfig, cohort: tuple[int, ...] | None = None, execution: str = "vmap",
                 chunk: int = 7, rounds: int = 1) -> FederatedStage:
    torch.manual_seed(0)
    model = TinyMLP()
    algorithm = build_algorithm("heterofl", RATES)
    algorithm.prepare_model(model, (16,))
    cfg = StageConfig(rounds=rounds, clients_per_round=7, local=local, max_parallel_clients=chunk)
    stage = stage_for(model, RATE, ToyData(), algorithm, cfg, seed=1)
    stage.execution = execution
    if cohort is not None:
        stage.sample_cohort = lambda round_idx: torch.tensor(cohort)
    fit(stage)
    return stage


def shared(stage: FederatedStage) -> dict:
    return {n: p.detach() for n, p in stage.model.named_parameters() if n not in RATE}


RATE_OF = Levels(**RATES["rates"]).per_client(1, 12)
FULL, HALF = (int(torch.nonzero(RATE_OF.eq(r))[0]) for r in (1.0, 0.5))


def test_vmap_and_loop_match_sequential():
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1)
    reference = hetero_stage(local, execution="sequential", chunk=1, rounds=3)
    for execution, chunk in EXECUTIONS:
        got = hetero_stage(local, execution=execution, chunk=chunk, rounds=3)
        assert_close(shared(got), shared(reference))
        assert torch.equal(got.state_bank.tensor("rate"), reference.state_bank.tensor("rate"))


def test_a_half_width_client_trains_only_its_sub_model():
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in TinyMLP().named_parameters()}
    after = shared(hetero_stage(FULL_BATCH, (HALF,)))
    changed = {n: after[n] != start[n] for n in start}
    assert not changed["body.1.weight"][12:].any() and not changed["body.1.bias"][12:].any()  # units 12..23
    assert not changed["head.weight"][:, 12:].any()  # their outgoing weights
    assert changed["body.1.weight"][:12].any() and changed["head.weight"][:, :12].any()
    assert changed["head.bias"].all()  # every class is kept


def test_each_entry_is_averaged_over_the_clients_holding_it():
    """The full and the half-width client together: an entry only the full client holds takes its value, an entry
    both hold the mean of both (full-batch steps: each client's update does not depend on the cohort)."""
    alone = {c: shared(hetero_stage(FULL_BATCH, (c,))) for c in (FULL, HALF)}
    both = shared(hetero_stage(FULL_BATCH, tuple(sorted((FULL, HALF)))))
    torch.testing.assert_close(both["body.1.weight"][12:], alone[FULL]["body.1.weight"][12:])
    torch.testing.assert_close(both["body.1.weight"][:12],
                               (alone[FULL]["body.1.weight"][:12] + alone[HALF]["body.1.weight"][:12]) / 2)
    torch.testing.assert_close(both["head.bias"], (alone[FULL]["head.bias"] + alone[HALF]["head.bias"]) / 2)


def test_clients_are_evaluated_with_their_own_sub_model():
    stage = hetero_stage(FULL_BATCH, rounds=2)
    rate = stage.state_bank.tensor("rate")
    visited = rate > 0
    assert torch.equal(rate[visited], RATE_OF[visited]) and torch.equal(stage.bank.tensor("width.rate")[visited],
                                                                        RATE_OF[visited])
    model, params = stage.model, {n: p.detach() for n, p in stage.model.named_parameters()}
    x = ToyData().x[:5]
    half = stage.algorithm.forward(model, {**params, "width.rate": torch.tensor(0.5)}, x)
    narrow = params["head.bias"] + torch.relu(x @ params["body.1.weight"][:12].T + params["body.1.bias"][:12]) \
        @ params["head.weight"][:, :12].T
    torch.testing.assert_close(half, narrow)  # the width-0.5 sub-model is the 12-unit network


def test_models_it_cannot_width_scale_are_refused():
    with pytest.raises(SpecError, match="Linear layers"):
        build_algorithm("heterofl").prepare_model(TinyCNN(), (1, 4, 4))
