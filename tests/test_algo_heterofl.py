"""HeteroFL: each client trains its width-p_i sub-model, the server averages each entry over the clients holding it,
clients use their sub-model; engine paths agree; models it cannot width-scale are refused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.resources import Levels
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.errors import SpecError
from fedpilot.models.options import MODELS
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import assert_close

RATE = ["width.rate"]
RATES = {"rates": {"values": [1.0, 0.5], "shares": [0.5, 0.5]}}
FULL_BATCH = LocalConfig(steps=3, batch_size=64, lr=0.2)


def small_cnn() -> nn.Module:
    """The built-in cnn on CNN_DATA's 1x4x16 images: 32 and 64 channels, 64 x 4 positions into a hidden layer of 8."""
    return MODELS["cnn"]((1, 4, 16), 4, hidden=8)


CNN_DATA = {"model": small_cnn, "data": ToyData(dim=64, image=True), "input_shape": (1, 4, 16)}


def hetero_stage(local: LocalConfig, cohort: tuple[int, ...] | None = None, execution: str = "vmap",
                 chunk: int = 7, rounds: int = 1, model: Callable[[], nn.Module] = TinyMLP,
                 data: ToyData | None = None, input_shape: tuple[int, ...] = (16,)) -> FederatedStage:
    torch.manual_seed(0)
    net = model()
    algorithm = build_algorithm("heterofl", RATES)
    algorithm.prepare_model(net, input_shape)
    cfg = StageConfig(rounds=rounds, clients_per_round=7, local=local, max_parallel_clients=chunk)
    stage = stage_for(net, RATE, data or ToyData(), algorithm, cfg, seed=1)
    stage.executor_choice.pin(execution)
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


def test_on_a_cnn_vmap_and_loop_match_sequential():
    local = LocalConfig(epochs=1, batch_size=4, lr=0.05)
    reference = hetero_stage(local, execution="sequential", chunk=1, rounds=2, **CNN_DATA)
    for execution, chunk in (("vmap", 4), ("vmap_autograd", 3), ("loop", 4)):
        got = hetero_stage(local, execution=execution, chunk=chunk, rounds=2, **CNN_DATA)
        assert_close(shared(got), shared(reference))
        assert torch.equal(got.state_bank.tensor("rate"), reference.state_bank.tensor("rate"))


def test_the_half_width_cnn_is_the_cnn_of_half_the_channels():
    """At rate 0.5 the masked cnn (1x8x8 inputs: 64 channels x 4 positions into the hidden layer) computes what the
    cnn of 16 and 32 channels and 8 hidden units computes with the kept entries: the hidden Linear's columns are the
    4 positions of each of the first 32 channels (channels-first flatten)."""
    torch.manual_seed(0)
    model = MODELS["cnn"]((1, 8, 8), 3, hidden=16)
    algorithm = build_algorithm("heterofl")
    algorithm.prepare_model(model, (1, 8, 8))
    params = {n: p.detach() for n, p in model.named_parameters()}
    narrow = nn.Sequential(nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                           nn.Flatten(), nn.Linear(32 * 4, 8), nn.ReLU(), nn.Linear(8, 3))
    kept = {"0.weight": params["body.0.weight"][:16], "0.bias": params["body.0.bias"][:16],
            "3.weight": params["body.3.weight"][:32, :16], "3.bias": params["body.3.bias"][:32],
            "7.weight": params["body.7.weight"][:8, :32 * 4], "7.bias": params["body.7.bias"][:8],
            "9.weight": params["head.weight"][:, :8], "9.bias": params["head.bias"]}
    narrow.load_state_dict(kept)
    x = torch.randn(5, 1, 8, 8)
    half = algorithm.forward(model, {**params, "width.rate": torch.tensor(0.5)}, x)
    torch.testing.assert_close(half, narrow(x))
    full = algorithm.forward(model, {**params, "width.rate": torch.tensor(1.0)}, x)
    torch.testing.assert_close(full, model(x))  # rate 1 is the whole model


def test_a_half_width_client_trains_only_its_sub_model_of_a_cnn():
    """A half-width client alone: of each layer of the cnn it changes the entries of its 16 and 32 channels and 4
    hidden units (the hidden Linear's columns: 4 positions of each of the first 32 channels), and no other."""
    torch.manual_seed(0)
    start = {n: p.detach().clone() for n, p in small_cnn().named_parameters()}
    after = shared(hetero_stage(FULL_BATCH, (HALF,), **CNN_DATA))
    kept = {"body.0.weight": (slice(16),), "body.0.bias": (slice(16),), "body.3.weight": (slice(32), slice(16)),
            "body.3.bias": (slice(32),), "body.7.weight": (slice(4), slice(32 * 4)), "body.7.bias": (slice(4),),
            "head.weight": (slice(None), slice(4)), "head.bias": (slice(None),)}
    assert set(kept) == set(start)
    for name, index in kept.items():
        inside = torch.zeros_like(start[name], dtype=torch.bool)
        inside[index] = True
        changed = after[name] != start[name]
        assert not changed[~inside].any(), name
        assert changed[inside].any(), name


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.norm, self.head = nn.Conv2d(1, 4, 3, padding=1), nn.GroupNorm(2, 4), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.norm(self.conv(x)), 1))


class Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.head = nn.LSTM(4, 8, batch_first=True), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][:, -1])


class Doubled(nn.Module):
    """Its head reads each hidden unit twice (a concatenation the layers do not show)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(16, 8), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.body(x)
        return self.head(torch.cat([hidden, hidden], 1))


@pytest.mark.parametrize(("model", "input_shape", "message"), [
    (Grouped, (1, 4, 4), r"Linear and dense Conv2d layers with biases .*\['Conv2d', 'GroupNorm', 'Linear'\]"),
    (Recurrent, (3, 4), r"Linear and dense Conv2d layers with biases .*\['LSTM', 'Linear'\]"),
    (lambda: nn.Sequential(nn.Linear(16, 8), nn.Softmax(1), nn.Linear(8, 4)), (16,), r"1 \(Softmax\) between layers"),
    (Doubled, (16,), "head takes 16 inputs from the 8 units of body"),
], ids=["groupnorm", "lstm", "softmax-between", "broken-chain"])
def test_models_it_cannot_width_scale_are_refused(model, input_shape, message):
    with pytest.raises(SpecError, match=message):
        build_algorithm("heterofl").prepare_model(model(), input_shape)
