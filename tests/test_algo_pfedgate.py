"""pFedGate: the budget always holds with block 0 kept, gates learn, sparse uploads, engine paths agree."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.pfedgate import BlockGate
from fedpilot.engine import LocalConfig, StageConfig
from fedpilot.errors import SpecError
from fedpilot.models import build_model
from test_engine_equivalence import assert_close, run_stage

GATE = ["gate.norm.weight", "gate.norm.bias", "gate.gates.weight", "gate.gates.bias", "gate.importance.weight",
        "gate.importance.bias"]


def gated_mlp(s: float = 0.5, blocks: int = 4):
    """A 16-24-4 MLP with a pFedGate gating layer, built like the pipeline builds it."""
    model = build_model("mlp", (16,), 4, hidden=[24])
    build_algorithm("pfedgate", {"s": s, "blocks": blocks}).prepare_model(model, (16,))
    return model


@pytest.mark.parametrize(("s", "blocks"), [(0.5, 5), (0.3, 10), (1.0, 3), (0.1, 20)])
def test_selection_always_meets_the_budget_and_keeps_block_zero(s, blocks):
    gate = gated_mlp(s, blocks).gate
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        chosen = gate.select(torch.rand(len(gate.block_size), generator=gen))
        kept = float((chosen * gate.block_size).sum() / gate.block_size.sum())
        assert kept <= s + 1e-6
        assert bool(chosen[gate.forced].all())
    assert float(gate.select(torch.ones(len(gate.block_size))).sum()) == len(gate.block_size) or s < 1


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
    with pytest.raises(SpecError, match="s_min"):
        BlockGate(16, {"w": torch.Size([100])}, blocks=4, s=0.01, s_min=0.05)
    with pytest.raises(ValueError, match="s_min=0.6 must be <= s=0.5"):
        build_algorithm("pfedgate", {"s": 0.5, "s_min": 0.6})


def test_vmap_and_loop_match_sequential():
    local = LocalConfig(steps=2, batch_size=3, lr=0.1)  # full batches: the gate pools the same samples everywhere
    reference = run_stage("pfedgate", GATE, {"s": 0.5}, "sequential", 1, local, gated_mlp)
    for execution, chunk in [("vmap", 7), ("vmap", 3), ("loop", 2)]:
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
    assert {"model_density", "upload_density", "upload_bytes"} <= set(table.columns)
