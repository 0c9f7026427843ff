"""Evaluations beyond the participants' personalized models (issue 32): clients held out of every round (novel
clients) evaluated with the global model and after a newcomer's adaptation, and each client's choice between its
personalized and the global model on its val split."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from mlflow import MlflowClient

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms.fedalt import FedAlt
from fedpilot.algorithms.finetune import Finetune
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.novel import NovelClients
from fedpilot.engine.stage import FederatedStage
from fedpilot.engine.task import CLASSIFICATION, make_task
from fedpilot.metric_names import SELECTED_SHARE
from fedpilot.pipeline.checks import held_out_clients
from fedpilot.pipeline.stage_record import beyond_participants_metrics, selection_columns
from fedpilot.spec import load_pipeline
from fedpilot.testing import HEAD
from pipeline_fixtures import SMALL, cli, run_id_of, runs_of, write_pipeline

NOVEL_IDS = [1, 5, 9, 13]
RECIPE = LocalConfig(epochs=2, batch_size=4, lr=0.1)


def trained_with_novel(execution: str = "loop") -> tuple[FederatedStage, ToyData]:
    """FedAlt on 12 of ToyData's 16 clients for 3 rounds, clients 1, 5, 9 and 13 held out (adapted 3 at a time)."""
    full = ToyData(n_clients=16, seed=4)
    participants = [c for c in range(16) if c not in NOVEL_IDS]
    torch.manual_seed(0)
    config = StageConfig(rounds=3, clients_per_round=6, eval_every=3, execution=execution,
                         local=LocalConfig(steps=3, batch_size=4, lr=0.1))
    novel = NovelClients(full.clients(NOVEL_IDS), RECIPE, cohort=3)
    stage = stage_for(TinyMLP(), HEAD, full.clients(participants), FedAlt(), config, seed=2, stage_index=1,
                      novel=novel)
    fit(stage)
    return stage, full


@pytest.fixture(scope="module")
def trained() -> tuple[FederatedStage, ToyData]:
    return trained_with_novel()


def test_novel_clients_with_the_global_model_score_as_a_plain_forward_of_the_model(trained):
    stage, full = trained
    model = stage.model  # the model's own head is the personal part's starting value: the global model
    for k, client in enumerate(NOVEL_IDS):
        start, size = int(full.offsets["test"][client]), int(full.sizes["test"][client])
        with torch.no_grad():
            predicted = model(full.x[start : start + size]).argmax(1)
        expected = float((predicted == full.y[start : start + size]).float().mean())
        assert stage.client_metrics["novel_global_test"]["acc"][k].item() == pytest.approx(expected, abs=1e-6)


def test_the_adaptation_of_novel_clients_is_the_fine_tuning_stage_run_on_them_alone(trained):
    stage, full = trained
    alone = FederatedStage(copy.deepcopy(stage.model), stage.split, full.clients(NOVEL_IDS), Finetune(),
                           StageConfig(clients_per_round=3, local=RECIPE, eval_every=3, execution="loop"),
                           seed=2, stage_index=1)
    fit(alone)
    assert alone.n_rounds == 2  # 4 clients, 3 at a time: the cohorts the adaptation takes
    for split in ("val", "test"):
        for metric, values in alone.client_metrics[split].items():
            torch.testing.assert_close(stage.client_metrics[f"novel_{split}"][metric], values, equal_nan=True)
    assert not torch.equal(stage.client_metrics["novel_test"]["loss"],
                           stage.client_metrics["novel_global_test"]["loss"])


def test_a_vectorized_executor_adapts_novel_clients_as_the_per_client_loop(trained):
    stage, _ = trained
    vectorized, _ = trained_with_novel("vmap")
    for key in ("novel_val", "novel_test", "novel_global_test"):
        torch.testing.assert_close(vectorized.client_metrics[key]["acc"], stage.client_metrics[key]["acc"],
                                   equal_nan=True)


def test_the_novel_distributions_of_a_trained_stage(trained):
    """On the device under test too (bench/gpu/check.sh): the stage's data may stay on the accelerator."""
    stage, full = trained
    metrics = beyond_participants_metrics(stage)
    sizes = full.sizes["test"][NOVEL_IDS].double()
    acc = stage.client_metrics["novel_test"]["acc"].double()
    assert metrics["novel_test_acc_weighted"] == pytest.approx(float((acc * sizes).sum() / sizes.sum()))
    assert metrics["participation_gap_acc_mean"] == pytest.approx(
        stage.history[-1]["test_acc_mean"] - float(acc.mean()))


def fake_stage(personal_val: list[float], global_val: list[float], task_name: str = "classification"):
    """A finished stage's per-client scores as the selection reads them: the test scores are the val ones + 1 for the
    personal models and + 2 for the global model, so the chosen model is visible in the selected test scores."""
    task = make_task(task_name) if task_name != "classification" else CLASSIFICATION
    metric = task.primary
    tensor = torch.tensor
    scores = {"val": {metric: tensor(personal_val)}, "global_val": {metric: tensor(global_val)},
              "test": {metric: tensor(personal_val) + 1}, "global_test": {metric: tensor(global_val) + 2}}
    for key in scores:
        scores[key].update({m: torch.zeros(len(personal_val)) for m in task.metrics if m != metric})
    sizes = {s: torch.ones(len(personal_val), dtype=torch.long) for s in ("train", "val", "test")}
    return SimpleNamespace(client_metrics=scores, task=task, data=SimpleNamespace(sizes=sizes), history=[])


def test_selection_keeps_per_client_the_model_better_on_its_val_split():
    personal, shared = [0.9, 0.2, 0.6, 0.1, 0.5, 0.5], [0.3, 0.8, 0.4, 0.7, 0.5, float("nan")]
    stage = fake_stage(personal, shared)
    columns = selection_columns(stage)
    assert columns["selected"] == ["personal", "global", "personal", "global", "personal", "personal"]  # ties keep it
    assert columns["selected_test_acc"] == pytest.approx([1.9, 2.8, 1.6, 2.7, 1.5, 1.5])
    metrics = beyond_participants_metrics(stage)
    assert metrics[SELECTED_SHARE] == pytest.approx(4 / 6)
    assert metrics["selected_test_acc_mean"] == pytest.approx(sum([1.9, 2.8, 1.6, 2.7, 1.5, 1.5]) / 6)
    assert metrics["selected_val_acc_max"] == pytest.approx(0.9)


def test_selection_on_an_error_metric_keeps_the_lower_one():
    stage = fake_stage([1.0, 3.0], [2.0, 0.5], "regression")
    assert selection_columns(stage)["selected"] == ["personal", "global"]
    assert beyond_participants_metrics(stage)["selected_test_mse_mean"] == pytest.approx((2.0 + 2.5) / 2)


@pytest.fixture(scope="module")
def novel_run(tmp_path_factory):
    """The small pipeline (20 clients, three stages) with 20% novel clients and selection, every stage's cohorts
    recorded as the federation's clients."""
    folder = tmp_path_factory.mktemp("novel")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    spec = copy.deepcopy(SMALL)
    spec["evaluation"].update({"novel_clients": 0.2, "select": "val"})
    spec["tracking"]["plots"] = False
    sampled: dict[int, set[int]] = {}
    original = FederatedStage.sample_cohort

    def recording(stage: FederatedStage, round_idx: int) -> torch.Tensor:
        clients = original(stage, round_idx)
        offsets = stage.data.offsets["train"].cpu()[clients.cpu()]  # where their samples are: the federation's client
        sampled.setdefault(stage.stage_index, set()).update(offsets.tolist())
        return clients

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("FEDPILOT_CACHE", str(folder / "cache"))
        patch.setattr(FederatedStage, "sample_cohort", recording)
        path = write_pipeline(folder, spec)
        code, output = cli("run", str(path), "--no-progress", "--no-cache")
    assert code == 0, output
    return SimpleNamespace(spec=load_pipeline(path), output=output, runs=runs_of(MlflowClient(uri), run_id_of(output)),
                           sampled=sampled, client=MlflowClient(uri), folder=folder)


def table(run, client, folder: Path) -> dict[str, list]:
    """A stage run's per-client table, column by column."""
    data = json.loads(Path(client.download_artifacts(run.info.run_id, "clients.json", str(folder))).read_text())
    return {c: [row[i] for row in data["data"]] for i, c in enumerate(data["columns"])}


def test_novel_clients_are_never_sampled_and_are_the_same_in_every_stage(novel_run, tmp_path):
    spec = novel_run.spec
    novel = held_out_clients(20, spec).tolist()
    assert len(novel) == 4 and held_out_clients(20, spec).tolist() == novel  # drawn again (a resume): the same
    from fedpilot.data.federated import build_federated_data

    data = build_federated_data(spec.dataset, spec.seed, novel_run.folder / "cache" / "data")
    novel_offsets = {int(data.offsets["train"][c]) for c in novel}
    assert sorted(novel_run.sampled) == [0, 1, 2]
    for stage, offsets in novel_run.sampled.items():
        assert offsets and not offsets & novel_offsets, stage
    assert set.union(*novel_run.sampled.values()) == {int(data.offsets["train"][c]) for c in range(20)} - novel_offsets
    for run in novel_run.runs[1:]:
        columns = table(run, novel_run.client, tmp_path)
        held = [c for c, is_novel in zip(columns["client"], columns["novel"], strict=True) if is_novel]
        assert held == novel
        assert all(v is not None for v, n in zip(columns["global_test_acc"], columns["novel"], strict=True) if n)


def test_every_stage_records_the_novel_distribution_and_the_last_the_selection(novel_run, tmp_path):
    parent, *stages = novel_run.runs
    for run in stages:
        metrics = run.data.metrics
        for name in ("novel_test_acc_mean", "novel_test_acc_p10", "novel_global_test_acc_mean", "novel_val_acc_max"):
            assert 0 <= metrics[name] <= 1, name
        assert metrics["participation_gap_acc_mean"] == pytest.approx(
            metrics["test_acc_mean"] - metrics["novel_test_acc_mean"])
        assert parent.data.metrics[f"{run.data.tags['fedpilot.stage']}/novel_test_acc_mean"] == \
            metrics["novel_test_acc_mean"]
    assert "selected_test_acc_mean" not in stages[0].data.metrics
    header, *rows = novel_run.output.split("per-client test accuracy\n")[1].split("\n\n")[0].splitlines()
    assert "novel mean" in header and "participation gap" in header and "kept personal" in header
    assert f"{stages[0].data.metrics['novel_test_acc_mean']:.3f}" in rows[0]
    last = stages[-1].data.metrics
    columns = table(stages[-1], novel_run.client, tmp_path)
    kept = [s for s, n in zip(columns["selected"], columns["novel"], strict=True) if not n]
    assert last[SELECTED_SHARE] == pytest.approx(kept.count("personal") / len(kept))
    selected = [v for v, n in zip(columns["selected_test_acc"], columns["novel"], strict=True) if not n]
    assert last["selected_test_acc_mean"] == pytest.approx(sum(selected) / len(selected), abs=1e-5)


def test_a_stage_from_the_cache_records_the_same_novel_clients_and_selection(novel_run, tmp_path):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(novel_run.folder)
        patch.setenv("MLFLOW_TRACKING_URI", novel_run.client.tracking_uri)
        patch.setenv("FEDPILOT_CACHE", str(novel_run.folder / "cache"))
        code, output = cli("run", str(novel_run.folder / "small.yaml"), "--no-progress")
    assert code == 0, output
    again = runs_of(novel_run.client, run_id_of(output))
    beyond = ("novel", "selected", "participation_gap")
    for first, second in zip(novel_run.runs[1:], again[1:], strict=True):
        assert second.data.tags["fedpilot.cache"] == "hit"
        recorded = {k: v for k, v in first.data.metrics.items() if k.startswith(beyond)}
        assert recorded and {k: v for k, v in second.data.metrics.items() if k.startswith(beyond)} == recorded
        assert table(second, novel_run.client, tmp_path / "again") == table(first, novel_run.client, tmp_path)
