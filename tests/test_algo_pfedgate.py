"""pFedGate: the budget always holds with block 0 kept, the exact knapsack and the greedy one's gap, per-client
budgets, gates learn, sparse uploads and App. A's per-index aggregation, engine paths agree."""

from __future__ import annotations

import itertools

import pytest
import torch

from engine_fixtures import ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.pfedgate import BlockGate
from fedpilot.algorithms.resources import Levels
from fedpilot.api import RoundInfo, Upload
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.errors import SpecError
from fedpilot.models.zoo import build_model
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import assert_close, run_stage

GATE = ["gate.budget", "gate.norm.weight", "gate.norm.bias", "gate.gates.weight", "gate.gates.bias",
        "gate.importance.weight", "gate.importance.bias"]


def gated_mlp(s: float = 0.5, blocks: int = 4, **params):
    """A 16-24-4 MLP with a pFedGate gating layer, built like the pipeline builds it."""
    model = build_model("mlp", (16,), 4, hidden=[24])
    build_algorithm("pfedgate", {"s": s, "blocks": blocks, **params}).prepare_model(model, (16,))
    return model


@pytest.mark.parametrize(("s", "blocks", "knapsack"), [
    (0.5, 5, "exact"), (0.5, 5, "greedy"), (0.3, 10, "greedy"), (1.0, 3, "exact"), (0.1, 20, "greedy")])
def test_selection_always_meets_the_budget_and_keeps_block_zero(s, blocks, knapsack):
    gate = gated_mlp(s, blocks, knapsack=knapsack).gate
    assert gate.exact == (knapsack == "exact")
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        chosen = gate.select(torch.rand(len(gate.block_size), generator=gen), gate.budget)
        kept = float((chosen * gate.block_size).sum() / gate.block_size.sum())
        assert kept <= s + 1e-6
        assert bool(chosen[gate.forced].all())
    assert float(gate.select(torch.ones(len(gate.block_size)), gate.budget).sum()) == len(gate.block_size) or s < 1


def digits_gate(knapsack: str, blocks: int = 5) -> BlockGate:
    """The gate of the digits pipelines' MLP (64-200-10), where `auto` solves Eq. 6 exactly (16 free blocks)."""
    shapes = {n: p.shape for n, p in build_model("mlp", (1, 8, 8), 10).named_parameters()}
    return BlockGate(64, shapes, blocks, 0.5, 0.05, knapsack)


def test_exact_knapsack_is_the_best_subset_that_fits():
    gate = digits_gate("exact", blocks=3)  # 8 free blocks: brute force over the 256 subsets by hand
    free = [j for j in range(len(gate.forced)) if not gate.forced[j]]
    size, capacity = gate.block_size, 0.5 * float(gate.block_size.sum()) - float(gate.block_size[gate.forced].sum())
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        importance = torch.rand(len(size), generator=gen)
        best = max((sum(float(importance[j]) for j in c), c) for r in range(len(free) + 1)
                   for c in itertools.combinations(free, r) if sum(float(size[j]) for j in c) <= capacity)
        chosen = gate.select(importance, torch.tensor(0.5))
        assert sorted(j for j in free if chosen[j]) == sorted(best[1])


def test_greedy_knapsack_gap_to_the_exact_solution_on_the_digits_mlp():
    """The numbers in docs/algorithms.md (pFedGate's knapsack): greedy reaches ~99.5% of the exact objective on average,
    at worst ~91%, and the exact choice is strictly better on ~38% of uniform random importance draws."""
    exact, greedy = digits_gate("auto"), digits_gate("greedy")
    assert exact.exact and not greedy.exact
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(300):
        importance = torch.rand(len(exact.block_size), generator=gen)
        best, approx = (float((g.select(importance, torch.tensor(0.5)) * importance).sum()) for g in (exact, greedy))
        assert best >= approx - 1e-5
        ratios.append(approx / best)
    ratios = torch.tensor(ratios)
    assert 0.99 < float(ratios.mean()) < 0.999 and 0.85 < float(ratios.min()) < 0.95
    assert 0.3 < float((ratios < 1 - 1e-6).float().mean()) < 0.45


def test_exact_knapsack_with_too_many_blocks_is_refused():
    digits = build_model("mlp", (1, 8, 8), 10)
    with pytest.raises(SpecError, match="params.knapsack"):  # checked before the gate is built
        build_algorithm("pfedgate", {"knapsack": "exact", "blocks": 10}).prepare_model(digits, (1, 8, 8))
    with pytest.raises(ValueError, match="knapsack"):  # the module itself raises no user error
        digits_gate("exact", blocks=10)
    assert not digits_gate("auto", blocks=10).exact  # auto falls back to greedy


def test_levels_give_exact_shares_seeded_by_the_pipeline_seed():
    levels = Levels(values=[1.0, 0.5], shares=[0.1, 0.9])  # Chen et al. (ICML 2023)'s HeteroFL setting
    drawn = levels.per_client(seed=0, n_clients=50)
    assert int((drawn == 1.0).sum()) == 5 and int((drawn == 0.5).sum()) == 45
    assert torch.equal(drawn, levels.per_client(seed=0, n_clients=50))
    assert not torch.equal(drawn, levels.per_client(seed=1, n_clients=50))
    equal = Levels(values=[0.2, 0.4, 0.6]).per_client(3, 6)  # null shares: uniform over the set
    assert torch.equal(equal.sort().values, torch.tensor([0.2, 0.2, 0.4, 0.4, 0.6, 0.6]))
    with pytest.raises(ValueError, match="sum to 1"):
        Levels(values=[1.0, 0.5], shares=[0.5, 0.6])
    with pytest.raises(ValueError, match="must be <= every budget"):
        build_algorithm("pfedgate", {"s": 0.5, "budgets": {"values": [0.5, 0.04]}})


def budget_stage(weight_decay: float = 0.0):
    """Per-client budgets on ToyData: 3 of 12 clients at s_i = 1, the others at 0.3; one local step a round."""
    torch.manual_seed(0)
    params = {"s": 0.3, "budgets": {"values": [1.0, 0.3], "shares": [0.25, 0.75]}}
    model = gated_mlp(**params)
    local = LocalConfig(steps=1, batch_size=3, weight_decay=weight_decay)
    stage = stage_for(model, GATE, ToyData(), build_algorithm("pfedgate", params),
                      StageConfig(rounds=4, clients_per_round=6, local=local), seed=2)
    fit(stage)
    return stage, Levels(**params["budgets"]).per_client(2, 12)


def test_per_client_budgets_hold_for_each_client_and_are_recorded():
    """Alg. 1's {s_i}: clients at s_i = 1 keep the whole model, the others at most s_i = 0.3, in what they train and
    upload and in their recorded density."""
    stage, expected = budget_stage()
    state, visited = stage.state_bank, stage.state_bank.tensor("budget") > 0
    assert int(visited.sum()) >= 10
    assert torch.equal(state.tensor("budget")[visited], expected[visited])
    assert torch.equal(stage.bank.tensor("gate.budget")[visited], expected[visited])
    density = state.tensor("model_density")
    assert (density[visited] <= expected[visited] + 1e-6).all()
    assert (density[visited & (expected == 1.0)] == 1.0).all()  # all blocks fit: the exact knapsack takes them
    shared = sum(p.numel() for n, p in stage.model.named_parameters() if not n.startswith("gate."))
    uploaded = state.tensor("upload_bytes")[visited] / 4
    assert (uploaded <= expected[visited] * shared + 1e-3).all()
    assert float(uploaded[expected[visited] == 1.0].max()) > 0.3 * shared


def test_training_never_moves_a_budget():
    stage, expected = budget_stage(weight_decay=0.5)  # weight decay pulls every trained parameter to 0
    visited = stage.state_bank.tensor("budget") > 0
    assert torch.equal(stage.bank.tensor("gate.budget")[visited], expected[visited])


def test_per_index_aggregation_on_the_worked_example_of_appendix_a():
    """App. A: four clients upload {0, 2}, {1, 2}, {0, 1}, {0, 1, 2} of three parameter entries; the server averages
    each entry over the clients that sent it, weighted by their sample counts."""
    masks = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    broadcast = {"w": torch.tensor([1.0, 2.0, 3.0])}
    deltas = torch.arange(12, dtype=torch.float32).view(4, 3) * masks
    weights = torch.tensor([10.0, 20.0, 30.0, 40.0])
    aggregate = build_algorithm("pfedgate").aggregator()
    info = RoundInfo((0, 0, 0), torch.arange(4), broadcast, 4)
    for chunk in (slice(0, 2), slice(2, 4)):  # two chunks of the cohort, as the engine streams them
        aggregate.add(Upload(shared={"w": broadcast["w"] - deltas[chunk]}, mask={"w": masks[chunk]},
                             weight=weights[chunk]), info)
    step, _ = aggregate.result(info, {})
    for j, senders in enumerate([[0, 2, 3], [1, 2, 3], [0, 1, 3]]):
        expected = sum(weights[k] * deltas[k, j] for k in senders) / sum(weights[k] for k in senders)
        torch.testing.assert_close(step["w"][j], expected)
    assert aggregate.upload_bytes == int(masks.sum()) * 4


def test_gates_and_importances_get_gradients_through_the_sparse_model():
    model, algorithm = build_model("mlp", (16,), 4, hidden=[24]), build_algorithm("pfedgate", {"s": 0.5})
    algorithm.prepare_model(model, (16,))
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    output = algorithm.forward(model, dict(model.named_parameters()), x)  # how pFedGate applies the model
    torch.nn.functional.cross_entropy(output, y).backward()
    for name in ("gate.gates.weight", "gate.importance.weight", "body.1.weight"):
        grad = dict(model.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name  # importance: via the straight-through estimator


def test_budget_smaller_than_the_kept_first_blocks_is_refused():
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 2))  # 8 + 2 entries: each first block (1 entry) is over 5%
    with pytest.raises(SpecError, match="params.s_min"):  # checked before the gate is built
        build_algorithm("pfedgate", {"s": 0.05, "s_min": 0.05}).prepare_model(tiny, (4,))
    with pytest.raises(ValueError, match="s_min"):  # the module itself raises no user error
        BlockGate(16, {"w": torch.Size([100])}, blocks=4, s=0.01, s_min=0.05)
    with pytest.raises(ValueError, match=r"s_min=0.6 must be <= every budget \(smallest: 0.5\)"):
        build_algorithm("pfedgate", {"s": 0.5, "s_min": 0.6})


def test_vmap_and_loop_match_sequential():
    local = LocalConfig(steps=2, batch_size=3, lr=0.1)  # full batches: the gate pools the same samples everywhere
    reference = run_stage("pfedgate", GATE, {"s": 0.5}, "sequential", 1, local, gated_mlp)
    for execution, chunk in EXECUTIONS:
        got = run_stage("pfedgate", GATE, {"s": 0.5}, execution, chunk, local, gated_mlp)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


def test_uploads_are_sparse_and_recorded_per_client():
    torch.manual_seed(0)
    model = gated_mlp(0.3, 6)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not n.startswith("gate.")}
    stage = stage_for(model, GATE, ToyData(), build_algorithm("pfedgate", {"s": 0.3, "blocks": 6}),
                           StageConfig(rounds=1, clients_per_round=1, local=LocalConfig(steps=1, batch_size=3)))
    fit(stage)
    changed = sum(int((p.detach() != before[n]).sum()) for n, p in model.named_parameters() if n in before)
    assert 0 < changed <= 0.3 * sum(v.numel() for v in before.values())  # one client, one batch: <= s uploaded
    density = stage.state_bank.tensor("model_density")
    visited = density > 0
    assert int(visited.sum()) == 1 and float(density[visited]) <= 0.3 + 1e-6
    assert float(stage.state_bank.tensor("upload_bytes")[visited]) == changed * 4


def test_pipeline_records_per_client_density_and_upload_bytes(workdir):
    import mlflow
    from mlflow import MlflowClient

    from pipeline_fixtures import SMALL, cli, run_id_of, write_pipeline

    spec = {**SMALL, "stages": [SMALL["stages"][0], {"name": "gate", "algorithm": "pfedgate", "rounds": 3,
                                                     "clients_per_round": 5, "params": {"s": 0.4}}]}
    code, output = cli("run", str(write_pipeline(workdir, spec)), "--no-progress")
    assert code == 0, output
    client = MlflowClient()
    parent = client.get_run(run_id_of(output))
    [gate] = client.search_runs(parent.info.experiment_id, "tags.`fedpilot.stage` = 'gate'")
    assert 0 < gate.data.metrics["model_density_max"] <= 0.4 + 1e-6
    assert gate.data.metrics["upload_bytes_mean"] > 0
    mlflow.set_experiment(experiment_id=parent.info.experiment_id)
    table = mlflow.load_table("clients.json", run_ids=[gate.info.run_id])
    assert {"budget", "model_density", "upload_density", "upload_bytes"} <= set(table.columns)
