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


def _one_stage_after_pretraining(algorithm: str) -> dict:
    """The quickstart composed, its stage 1 running `algorithm` with its defaults, searched with `space: auto`."""
    from fedpilot.spec.compose import compose_pipeline

    raw = compose_pipeline(ROOT / "pipelines" / "quickstart.yaml", [])
    raw["stages"] = [raw["stages"][0], {"name": "tuned", "algorithm": algorithm, "rounds": 2,
                                        "local": {"lr": 0.04}}]
    raw["search"] = {"space": "auto", "stages": ["tuned"], "objective": "val_acc_mean"}
    return raw


def test_space_auto_covers_every_builtin_algorithm():
    """Every built-in algorithm declares a valid tunable space; `space: auto` on its stage searches exactly the
    declared keys that are not budgets, each range containing the pipeline's value (relative ones centered on it)."""
    from fedpilot.algorithms import ALGORITHMS, tunable_problem
    from fedpilot.spec import PipelineSpec

    for name in ALGORITHMS.builtins:
        algorithm = ALGORITHMS[name]
        assert algorithm.tunable and tunable_problem(algorithm) is None, name
        spec = PipelineSpec.from_dict(_one_stage_after_pretraining(name))
        declared = {f"stages.1.{k}" for k, t in algorithm.tunable.items() if not t.budget}
        assert set(spec.search.space) == declared, name
        values = spec.resolved()["stages"][1]
        for key, param in spec.search.space.items():
            block, field = key.split(".")[2:]
            tunable = algorithm.tunable[f"{block}.{field}"]
            value = values[block][field]
            if value is None:
                value = values[tunable.fallback.split(".")[0]][tunable.fallback.split(".")[1]]
            if param.type == "categorical":
                assert value in param.choices, (name, key)
            else:
                assert param.low <= value <= param.high, (name, key)
            if tunable.around:
                assert param.low == pytest.approx(value / tunable.around) and param.log, (name, key)


def test_space_auto_leaves_budgets_unless_asked_and_a_written_space_wins():
    from fedpilot.spec import PipelineSpec

    raw = _one_stage_after_pretraining("selffl")
    assert set(PipelineSpec.from_dict(raw).search.space) == {"stages.1.local.lr"}
    raw["search"]["tune_budget"] = True
    space = PipelineSpec.from_dict(raw).search.space
    assert space["stages.1.params.l_max"].type == "int" and (space["stages.1.params.l_max"].low,
                                                           space["stages.1.params.l_max"].high) == (1, 40)
    raw["search"] = {"space": {"stages.1.params.l_max": {"type": "int", "low": 2, "high": 8}},
                     "objective": "val_acc_mean"}
    assert set(PipelineSpec.from_dict(raw).search.space) == {"stages.1.params.l_max"}


@pytest.mark.parametrize(("search", "message"), [
    ({"space": "auto", "stages": ["nope"]}, "search.stages.0='nope': no such stage"),
    ({"space": "autumn"}, "search.space='autumn': give the keys to search with their ranges, or `auto`"),
    ({"space": {}}, "search.space={}: give the keys"),
    ({"space": {"stages.1.local.lr": {"type": "float", "low": 0.1, "high": 1}}, "tune_budget": True},
     "search.tune_budget=True: applies to `space: auto` only"),
])
def test_space_auto_refusals_name_the_key(search, message):
    from fedpilot.errors import SpecError
    from fedpilot.spec import PipelineSpec

    raw = _one_stage_after_pretraining("fedavg")
    raw["search"] = {**search, "objective": "val_acc_mean"}
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("{", r"\{").replace("}", r"\}")):
        PipelineSpec.from_dict(raw)


def test_an_algorithm_declaring_nothing_tunable_is_refused_by_space_auto(monkeypatch):
    from fedpilot.algorithms import ALGORITHMS
    from fedpilot.errors import SpecError
    from fedpilot.spec import PipelineSpec

    monkeypatch.setattr(ALGORITHMS["fedavg"], "tunable", {})
    with pytest.raises(SpecError, match="stages.1.algorithm='fedavg': declares nothing tunable"):
        PipelineSpec.from_dict(_one_stage_after_pretraining("fedavg"))


def test_the_docs_list_what_each_algorithm_tunes():
    from fedpilot.algorithms import ALGORITHMS

    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = text[text.index("## What each algorithm tunes"):].split("\n## ")[0]
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines() if line.startswith("| `")}
    for name in ALGORITHMS.builtins:
        assert all(f"`{key}`" in rows[name] for key in ALGORITHMS[name].tunable), name
