"""The shipped task pipelines run end to end, offline, on small data the tests make: next-token (Shakespeare),
text classification, regression, images with augmentation; and each hub pipeline with `dataset.source.path` pointed
at a small local dataset with the same columns. Each records its task's per-client distributions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from hub_standins import HUB, WORDS, write_hub_copies
from pipeline_fixtures import cli, run_id_of

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"hamlet": ["Ham.", "Hor.", "Oph."], "lear": ["Lear.", "Kent.", "Cor."], "tempest": ["Pros.", "Ari."]}
SMALL = ["--no-progress", "tracking.system_metrics=false", "evaluation.every=2"]


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> Path:
    """A folder of Gutenberg-style plays: speaker lines ending with a period, speeches, stage directions."""
    folder = tmp_path_factory.mktemp("plays")
    rng = np.random.default_rng(0)
    for play, roles in ROLES.items():
        speeches = [f"{roles[i % len(roles)]}\n{' '.join(rng.choice(WORDS, 12))},\n{' '.join(rng.choice(WORDS, 8))}"
                    f" [Exit.]" for i in range(60)]
        (folder / f"{play}_gut.txt").write_text("THE TRAGEDY\n\n" + "\n\n".join(speeches) + "\n")
    (folder / "sonnets_gut.txt").write_text("No speakers here.\n\nNone.\n")
    return folder


def stage_runs(client: MlflowClient, parent: str) -> list:
    runs = client.search_runs(client.get_run(parent).info.experiment_id, f"tags.mlflow.parentRunId = '{parent}'")
    return sorted(runs, key=lambda r: int(r.data.tags["fedpilot.stage_index"]))


def run_pipeline(name: str, *overrides: str) -> tuple[str, list, str]:
    code, output = cli("run", str(ROOT / "pipelines" / f"{name}.yaml"), *SMALL, *overrides)
    assert code == 0, output
    client = MlflowClient()
    parent = run_id_of(output)
    return parent, stage_runs(client, parent), output


def records(runs: list, *metrics: str) -> None:
    for run in runs:
        assert set(metrics) <= set(run.data.metrics), (run.info.run_name, sorted(run.data.metrics))


def test_next_token_pipeline_on_the_offline_shakespeare_federation(workdir, plays):
    parent, runs, output = run_pipeline(
        "shakespeare-next-token", f"dataset.source.archive={plays}", "dataset.source.plays=null",
        "dataset.partition.min_size=10", "model.d_model=16", "model.n_layers=2", "model.n_heads=2",
        "stages.0.rounds=2", "stages.1.rounds=2", "stages.0.clients_per_round=3", "stages.1.clients_per_round=3",
        "stages.2.local.epochs=1")
    assert [r.data.tags["fedpilot.stage"] for r in runs] == ["pretrain", "personalize", "finetune"]
    records(runs, "test_acc_p10", "test_acc_mean", "test_loss_p10", "test_loss_weighted", "val_acc_weighted")
    client = MlflowClient()
    personal = client.get_run(runs[1].info.run_id).data.metrics["personal_params_per_client"]
    assert 0 < personal < client.get_run(runs[1].info.run_id).data.metrics["shared_params"]  # the last block
    assert "data/tokenizer.json" in {a.path for a in client.list_artifacts(parent, "data")}
    assert "per-client test accuracy" in output and ": 8 clients, model transformer" in output
    assert 0 <= runs[2].data.metrics["test_acc_mean"] <= 1


def test_text_classification_pipeline(workdir, plays):
    _, runs, output = run_pipeline(
        "shakespeare-play", f"dataset.source.archive={plays}", "dataset.source.plays=null",
        "dataset.partition.clients=6", "dataset.partition.min_size=5", "model.d_model=16", "model.n_heads=2",
        "stages.0.rounds=2", "stages.1.rounds=2", "stages.0.clients_per_round=3", "stages.1.clients_per_round=3",
        "stages.2.local.epochs=1")
    records(runs, "test_acc_p10", "test_loss_weighted")
    assert "per-client test accuracy" in output


def test_regression_pipeline_records_errors_lower_is_better(workdir):
    _, runs, output = run_pipeline("diabetes-regression", "stages.0.rounds=6")
    records(runs, "test_mse_mean", "test_mse_p10", "test_mae_p90", "val_mse_weighted")
    finetune = runs[1].data.metrics
    assert 0 <= finetune["test_mse_frac_better"] <= 1 and "test_acc_mean" not in finetune
    assert "per-client test mean squared error" in output
    assert runs[1].data.metrics["test_mse_mean"] < runs[0].data.metrics["test_mse_mean"] * 2


def test_image_pipeline_with_augmentation(workdir):
    _, runs, _ = run_pipeline("digits-augment", "dataset.partition.clients=20", "model.hidden=16",
                              "stages.0.rounds=2", "stages.1.rounds=2", "stages.2.local.epochs=1")
    records(runs, "test_acc_p10")


# ---- the hub pipelines on local stand-ins with the hub's columns ------------------------------------------------
@pytest.fixture(scope="module")
def hub_copies(tmp_path_factory) -> dict[str, Path]:
    return write_hub_copies(tmp_path_factory.mktemp("hub"))


@pytest.mark.parametrize("pipeline", HUB)
def test_hub_pipeline_runs_on_a_local_copy_with_the_same_columns(workdir, hub_copies, pipeline):
    data, overrides = HUB[pipeline]
    _, runs, _ = run_pipeline(pipeline, f"dataset.source.path={hub_copies[data]}", *overrides)
    records(runs, "test_acc_p10", "test_acc_mean")
