"""The shipped search spaces over what the papers tune (step sizes, sparsity, regularization): each is used by a
shipped pipeline's `search:` block, and a short search over it runs and samples every key inside its bounds."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from fedpilot.spec import load_pipeline
from pipeline_fixtures import cli

ROOT = Path(__file__).resolve().parents[1]
SPACES = {  # pipeline -> the keys its search block tunes
    "digits-k2-fedalt": {"stages.1.local.lr", "stages.1.params.lr_v", "stages.1.server.lr"},  # client, personal, server
    "digits-k2-pfedgate": {"stages.1.params.s", "stages.1.params.lr_gate"},  # pFedGate's budget and gate lr
    "digits-k2-ditto": {"stages.1.params.lam"},  # Ditto's lambda
    "digits-k2-fedprox": {"stages.1.params.mu"},  # FedProx's mu
    "digits-k2-baselines": {"stages.2.params.prox", "stages.2.local.lr"},  # the fine-tuning's pull and lr
}
TINY = ["dataset.partition.clients=12", "stages.0.rounds=1", "stages.1.rounds=1", "stages.1.clients_per_round=3",
        "search.pruner.kind=none", "tracking.system_metrics=false", "tracking.plots=false"]


@pytest.mark.parametrize("name", sorted(SPACES))
def test_a_shipped_space_is_searched_through_its_pipeline(name, workdir):
    path = ROOT / "pipelines" / f"{name}.yaml"
    spec = load_pipeline(path)
    space = spec.search.space
    assert set(space) == SPACES[name]
    storage = f"sqlite:///{workdir}/studies.db"
    finetune = spec.stages[-1].algorithm == "finetune"
    last = [f"stages.{len(spec.stages) - 1}.local.epochs=1"] if finetune else []
    code, output = cli("search", str(path), *TINY, *last, "--storage", storage, "--trials", "2")
    assert code == 0, output
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(states=[optuna.trial.TrialState.COMPLETE])
    assert len(trials) == 2
    for trial in trials:
        assert set(trial.params) == SPACES[name]
        for key, value in trial.params.items():
            assert space[key].low <= value <= space[key].high
    assert trials[0].params != trials[1].params
