"""FedRep (head epochs, then body epochs) and FedPer (= FedSim on a head split): update order, engine paths, params."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch.func import functional_call

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import HEAD, INPUT, assert_close, run_stage

LR = 0.2
EQUIVALENCE = LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)


def client_loss(params: dict, data: ToyData, i: int) -> torch.Tensor:
    """Mean cross-entropy over client i's whole train set."""
    lo, n = int(data.offsets["train"][i]), int(data.sizes["train"][i])
    return F.cross_entropy(functional_call(TinyMLP(), params, (data.x[lo : lo + n],)), data.y[lo : lo + n])


def gd_step(params: dict, train: list[str], data: ToyData, i: int) -> dict:
    """One full-batch gradient step of client i on the `train` parameters, the others frozen."""
    live = {n: v.clone().requires_grad_(n in train) for n, v in params.items()}
    grads = torch.autograd.grad(client_loss(live, data, i), [live[n] for n in train])
    return {**params, **{n: (live[n] - LR * g).detach() for n, g in zip(train, grads, strict=True)}}


def test_fedrep_trains_the_head_then_the_body_with_the_new_head_and_averages_bodies():
    torch.manual_seed(0)
    model, data = TinyMLP(), ToyData()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = StageConfig(rounds=1, local=LocalConfig(batch_size=64, lr=LR))  # full batches: one epoch = one GD step
    stage = stage_for(model, HEAD, data, build_algorithm("fedrep", {"head_epochs": 2, "body_epochs": 1}), cfg)
    fit(stage)
    body_names = [n for n in start if n not in HEAD]
    clients = [gd_step(gd_step(gd_step(start, HEAD, data, i), HEAD, data, i), body_names, data, i)
               for i in range(data.n_clients)]  # two head epochs, then one body epoch
    weight = data.sizes["train"].float() / data.sizes["train"].sum()
    expected_body = {n: torch.einsum("k,k...->...", weight, torch.stack([c[n] for c in clients])) for n in body_names}
    assert_close({n: p.detach() for n, p in stage.model.named_parameters() if n in body_names}, expected_body)
    assert_close({n: stage.bank.tensor(n) for n in HEAD}, {n: torch.stack([c[n] for c in clients]) for n in HEAD})


@pytest.mark.parametrize(("personal", "params"), [(HEAD, {"head_epochs": 3, "body_epochs": 1}),
                                                  (INPUT, {"head_epochs": 1.5, "lr_body": 0.05})])
def test_fedrep_vmap_and_loop_match_sequential(personal, params):
    reference = run_stage("fedrep", personal, params, "sequential", 1, EQUIVALENCE)
    for execution, chunk in EXECUTIONS:
        got = run_stage("fedrep", personal, params, execution, chunk, EQUIVALENCE)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


def test_fedper_is_fedsim_on_the_same_split():
    params = {"lr_v": 0.3}
    fedsim = run_stage("fedsim", HEAD, params, "vmap", 7, EQUIVALENCE)
    fedper = run_stage("fedper", HEAD, params, "vmap", 7, EQUIVALENCE)
    for got, want in zip(fedper, fedsim, strict=True):
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in got)
    reference = run_stage("fedper", HEAD, params, "sequential", 1, EQUIVALENCE)
    assert_close(fedper[0], reference[0])
    assert_close(fedper[1], reference[1])


@pytest.mark.parametrize(("algo", "params", "key"), [
    ("fedrep", {"head_epochs": 0}, "head_epochs"), ("fedrep", {"body_epochs": -1}, "body_epochs"),
    ("fedrep", {"lr_head": 0.0}, "lr_head"), ("fedrep", {"tau": 3}, "tau"), ("fedper", {"tau": 0}, "tau"),
    ("fedper", {"head_epochs": 2}, "head_epochs")])
def test_bad_params_are_refused_by_name(algo, params, key):
    with pytest.raises(ValidationError, match=key):
        build_algorithm(algo, params)
