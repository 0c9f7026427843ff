"""The shipped search spaces over what the papers tune (step sizes, sparsity, regularization): each is used by a
shipped pipeline's `search:` block, and a short search over it runs and samples every key inside its bounds. And the
ranges every built-in algorithm declares (`space: auto`, `fedpilot compare --tune`): each names its source, holds
the values its papers recommend or tune over and every built-in pipeline's written values, and trial 0 of each
built-in pipeline is the pipeline as written."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest

from fedpilot.spec import load_pipeline
from pipeline_fixtures import cli
from tuning_fixtures import one_stage_after_pretraining

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


def test_space_auto_covers_every_builtin_algorithm():
    """Every built-in algorithm declares a valid tunable space; `space: auto` on its stage searches exactly the
    declared keys that are not budgets, each range containing the pipeline's value (relative ones centered on it)."""
    from fedpilot.algorithms import ALGORITHMS, tunable_problem
    from fedpilot.spec import PipelineSpec

    for name in ALGORITHMS.builtins:
        algorithm = ALGORITHMS[name]
        assert algorithm.tunable and tunable_problem(algorithm) is None, name
        spec = PipelineSpec.from_dict(one_stage_after_pretraining(name))
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

    raw = one_stage_after_pretraining("selffl")
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

    raw = one_stage_after_pretraining("fedavg")
    raw["search"] = {**search, "objective": "val_acc_mean"}
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("{", r"\{").replace("}", r"\}")):
        PipelineSpec.from_dict(raw)


def test_an_algorithm_declaring_nothing_tunable_is_refused_by_space_auto(monkeypatch):
    from fedpilot.algorithms import ALGORITHMS
    from fedpilot.errors import SpecError
    from fedpilot.spec import PipelineSpec

    monkeypatch.setattr(ALGORITHMS["fedavg"], "tunable", {})
    with pytest.raises(SpecError, match="stages.1.algorithm='fedavg': declares nothing tunable"):
        PipelineSpec.from_dict(one_stage_after_pretraining("fedavg"))


# ---- the declared ranges (issue 50) -------------------------------------------------------------------------------

PILLUTLA_STEP_B = (1e-1, 1e-3, 1e-2)  # Pillutla et al., ICML 2022, Table 9: client lr of personalized training (b)
PFEDGATE_GRID = (0.005, 0.01, 0.03, 0.05, 0.1, 0.3, 0.5)  # Chen et al., ICML 2023, App. H: every method's lr
PAPERS = [  # (algorithms, stage key, values its papers recommend or tune over, where)
    (("fedalt", "fedsim"), "params.lr_u", PILLUTLA_STEP_B, "Pillutla et al., Table 9, step (b): SO, GLDv2, EMNIST"),
    (("fedalt", "fedsim"), "params.lr_v", PILLUTLA_STEP_B, "Pillutla et al., Table 9, step (b)"),
    (("ditto",), "local.lr", PILLUTLA_STEP_B, "Pillutla et al., Table 9, step (b)"),
    (("ditto",), "params.lr_v", PILLUTLA_STEP_B, "Pillutla et al., Table 9, step (b)"),
    (("ditto",), "params.lam", (1e-4, 1e-3, 1e-2, 1e-1, 1.0), "Pillutla et al., App. B.3: the grid, chosen 1e-3, 1e-1"),
    (("ditto",), "params.lam", (0.05, 0.1, 0.5, 0.8), "Chen et al., ICML 2023, App. H: Ditto's grid"),
    (("fedavg",), "local.lr", (1.0, 1e-2, 0.5, *PILLUTLA_STEP_B), "Pillutla et al., Table 9, steps (a) and (b)"),
    (("fedavg",), "local.lr", PFEDGATE_GRID, "Chen et al., ICML 2023, App. H"),
    (("finetune", "local"), "local.lr", (1e-1, 1e-3, 1e-2, 1e-4), "Pillutla et al., Table 9, step (c)"),
    (("finetune", "local"), "local.lr", PFEDGATE_GRID, "Chen et al., ICML 2023, App. H (FedAvg-FT)"),
    (("finetune", "local"), "params.prox", (1e-4, 1e-3, 1e-2, 1e-1, 1.0), "Pillutla et al., App. B.3 (Ditto-as-FT)"),
    (("fedper",), "params.lr_u", (0.001,), "Nikoloutsopoulos et al. 2022 (PFLEGO), Sec. 5.1: every baseline's lr"),
    (("fedper",), "params.lr_v", (0.001,), "Nikoloutsopoulos et al. 2022 (PFLEGO), Sec. 5.1"),
    (("fedrep",), "params.lr_head", (0.005, 0.01, 0.05, 0.1, 0.5, 0.001), "Chen et al., App. H; PFLEGO, Sec. 5.1"),
    (("fedrep",), "params.lr_body", (0.001, 0.01), "PFLEGO, Sec. 5.1; FedRep's own lr (Collins et al., as recalled)"),
    (("fedrep",), "params.head_epochs", (10.0,), "Collins et al., ICML 2021: 10 head epochs (as recalled)"),
    (("lg_fedavg",), "params.lr_u", PFEDGATE_GRID, "Chen et al., ICML 2023, App. H (LG-FedAvg is a baseline)"),
    (("lg_fedavg",), "params.lr_v", PFEDGATE_GRID, "Chen et al., ICML 2023, App. H"),
    (("heterofl",), "local.lr", PFEDGATE_GRID, "Chen et al., ICML 2023, App. H (HeteroFL is a baseline)"),
    (("pfedgate",), "local.lr", PFEDGATE_GRID, "Chen et al., ICML 2023, App. H and Table 7 (0.03 to 0.3)"),
    (("pfedgate",), "params.lr_gate", (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 1.5), "Chen et al., App. H: the gate's grid"),
    (("pfedgate",), "params.s", (1.0, 0.5, 0.3, 0.1), "Chen et al., Sec. 7.6, Tables 1 and 10"),
    (("pflego",), "params.rho", (0.001,), "Nikoloutsopoulos et al. 2022, Sec. 5.1 (CIFAR-10) and Fig. 4 (Omniglot)"),
    (("pflego",), "params.beta", (0.001, 0.007), "Nikoloutsopoulos et al. 2022, Sec. 5.1 and Fig. 4"),
    (("selffl", "selffl_aug"), "local.lr", (0.03, 0.01, 0.3), "Chen et al., NeurIPS 2022, Sec. 4.2 and App. G.3"),
    (("selffl", "selffl_aug"), "params.l_max", (40,), "Chen et al., NeurIPS 2022, Sec. 4.2"),
    (("ffgg", "ffgg_async", "ffgg_local", "ffgg_robust"), "params.lr_w", PILLUTLA_STEP_B,
     "Mishchenko et al. 2023, App. E, Table 2: client lr of personalized training"),
    (("ffgg_local",), "params.lr_theta", PILLUTLA_STEP_B, "Mishchenko et al. 2023, App. E, Table 2"),
    (("ffgg", "ffgg_async", "ffgg_robust"), "server.lr", (1.0,), "Mishchenko et al. 2023, App. E, Table 2 (EMNIST)"),
    (("ffgg", "ffgg_async", "ffgg_robust"), "params.grad_epochs", (1.0,), "Mishchenko et al., Alg. 1: a full gradient"),
    (("fedprox",), "params.mu", (0.001, 0.01, 0.1, 0.5, 1.0), "Li et al., MLSys 2020: their code's README grid"),
    (("fedprox",), "local.lr", (0.01, 0.03, 0.003, 0.8, 0.3), "Li et al., MLSys 2020, appendix (as recalled)"),
    (("pfedme",), "params.lam", (15.0,), "Dinh et al., NeurIPS 2020: MNIST (their code's recorded runs)"),
    (("pfedme",), "params.lam", (1e-4, 1e-3, 1e-2, 1e-1, 1.0), "Pillutla et al., App. B.3: chosen 1e-4, 1e-1"),
    (("pfedme",), "params.lam", (1e-4, 1e-3, 1e-2, 0.1, 1.0, 10.0), "Chen et al., ICML 2023, App. H: pFedMe's grid"),
    (("pfedme",), "local.lr", (0.005, *PILLUTLA_STEP_B), "Dinh et al. (their code's MNIST runs); Pillutla et al."),
    (("pfedme",), "params.lr_personal", (0.1, 0.09), "Dinh et al., NeurIPS 2020 (their code's MNIST runs)"),
    (("perfedavg",), "params.alpha", (0.005,), "pFedMe's code runs Per-FedAvg at alpha 0.005 (MNIST)"),
    (("perfedavg",), "local.lr", (0.001, 0.01, 0.03), "pFedMe's code: beta 0.001; Self-FL, Sec. 4.2: 0.01, 0.03"),
]
FORMER_EDGE_CHOICES = [  # (algorithm, key, the value a study chose at an edge of the former range: issue 50)
    ("fedsim", "params.lr_u", 8.59),  # Shakespeare FedSim-output, 8.59 of [0.1, 10]
    ("fedalt", "params.lr_v", 0.113), ("fedsim", "params.lr_v", 0.113), ("ditto", "params.lr_v", 0.113),
    ("pfedme", "params.lr_personal", 0.113), ("pfedme", "params.lr_personal", 0.00563),  # of [0.005, 0.5] (shift)
    ("pflego", "params.beta", 0.113), ("pflego", "params.rho", 0.0711),  # 0.0711 of [0.05, 5] (shift)
]
BUDGETS = {  # the stage keys that change what a client spends: its local work or its model's size
    "params.s", "params.budgets", "params.rates", "params.l_max", "params.head_epochs", "params.body_epochs",
    "params.grad_epochs", "params.tau", "params.tau_u", "params.tau_v", "params.personal_steps",
    "params.local_rounds", "params.inner_steps", "params.alt_steps", "params.optimum_steps", "local.epochs",
    "local.steps", "local.batch_size"}


def _declared():
    from fedpilot.algorithms import ALGORITHMS

    return [(name, key, tunable) for name in ALGORITHMS.builtins for key, tunable in ALGORITHMS[name].tunable.items()]


def _inside(tunable, value) -> bool:
    return value in tunable.choices if tunable.choices is not None else tunable.low <= value <= tunable.high


def test_every_builtin_range_is_absolute_and_names_its_source():
    for name, key, tunable in _declared():
        assert tunable.around is None, (name, key)  # never centred on a value the pipeline wrote
        assert tunable.source and len(tunable.source) > 20, (name, key)
        assert tunable.log or tunable.choices is not None or tunable.budget, (name, key)  # step sizes: log scale


def test_the_papers_values_lie_in_the_declared_ranges():
    from fedpilot.algorithms import ALGORITHMS

    for algorithms, key, values, where in PAPERS:
        for name in algorithms:
            tunable = ALGORITHMS[name].tunable[key]
            outside = [v for v in values if not _inside(tunable, v)]
            assert not outside, f"{name} {key} {tunable.describe()} leaves out {outside} ({where})"
    assert {(name, key) for names, key, _, _ in PAPERS for name in names} == {(n, k) for n, k, _ in _declared()}


def test_the_choices_the_former_ranges_had_on_an_edge_lie_off_the_new_ones_edges():
    import math

    from fedpilot.algorithms import ALGORITHMS

    for name, key, value in FORMER_EDGE_CHOICES:
        tunable = ALGORITHMS[name].tunable[key]
        position = math.log(value / tunable.low) / math.log(tunable.high / tunable.low)
        assert tunable.log and 0.1 < position < 0.9, (name, key, value, tunable.describe(), position)


def test_what_changes_a_clients_work_or_model_size_is_declared_a_budget():
    for name, key, tunable in _declared():
        assert tunable.budget == (key in BUDGETS), (name, key)


@pytest.fixture(scope="module")
def builtin_pipelines() -> list[tuple[str, object, object]]:
    """Every built-in pipeline by the project's loader (the files as written, and each comparison set's pipelines
    with the set's overrides of stage keys: the only overrides that can change a tunable's value), with the same
    pipeline searched over `space: auto` on every stage, budgets included (what a search or a comparison resolves)."""
    from fedpilot.compare.plan import ComparisonSpec
    from fedpilot.metric_names import primary
    from fedpilot.spec import PipelineSpec, read_user_yaml

    runs = {(path, ()) for path in (ROOT / "pipelines").rglob("*.yaml") if path.parent.name != "compare"}
    for set_file in sorted((ROOT / "pipelines" / "compare").glob("*.yaml")):
        comparison = ComparisonSpec.model_validate(read_user_yaml(set_file))
        staged = tuple(o for o in comparison.overrides if o.lstrip("+~").startswith("stages"))
        runs |= {((set_file.parent / p).resolve(), staged) for p in comparison.pipelines}
    loaded = []
    for path, overrides in sorted(runs):
        spec = load_pipeline(path, list(overrides))
        search = {"space": "auto", "tune_budget": True, "objective": f"val_{primary(spec.dataset.task)}_mean"}
        loaded.append((f"{path.relative_to(ROOT)} {list(overrides)}", spec,
                       PipelineSpec.from_dict({**spec.resolved(), "search": search})))
    return loaded


def test_every_builtin_pipelines_values_lie_in_the_declared_ranges_without_widening(builtin_pipelines):
    from fedpilot.algorithms import ALGORITHMS

    used = set()
    for label, spec, searched in builtin_pipelines:
        for key, param in searched.search.space.items():
            index, stage_key = int(key.split(".")[1]), ".".join(key.split(".")[2:])
            used.add(spec.stages[index].algorithm)
            tunable = ALGORITHMS[spec.stages[index].algorithm].tunable[stage_key]
            if tunable.choices is not None:
                assert param.choices == list(tunable.choices), (label, key, param.choices)
            else:  # the dimension is the declared range itself: nothing written lay outside it
                assert (param.low, param.high, param.log) == (tunable.low, tunable.high, tunable.log), (label, key)
    assert used == set(ALGORITHMS.builtins)  # the built-in pipelines use every built-in algorithm


def test_trial_0_is_each_builtin_pipeline_as_written(builtin_pipelines):
    """written_values (what a study enqueues as trial 0) covers every dimension, and the pipeline it gives differs
    from the file only where a null key is spelled out as the value its fallback gives it (lr_v = local.lr)."""
    from omegaconf import OmegaConf

    from fedpilot.algorithms import ALGORITHMS
    from fedpilot.spec import with_values, written_values

    for label, spec, searched in builtin_pipelines:
        values = written_values(searched)
        assert set(values) == set(searched.search.space), label
        bare = spec.model_copy(update={"search": None})
        written, trial = OmegaConf.create(bare.resolved()), OmegaConf.create(with_values(bare, values).resolved())
        for key, value in values.items():
            index, stage_key = key.split(".")[1], ".".join(key.split(".")[2:])
            fallback = ALGORITHMS[spec.stages[int(index)].algorithm].tunable[stage_key].fallback
            as_written = OmegaConf.select(written, key)
            expected = as_written if as_written is not None else OmegaConf.select(written, f"stages.{index}.{fallback}")
            assert OmegaConf.select(trial, key) == expected == value, (label, key)
            OmegaConf.update(trial, key, as_written, merge=False)
        assert OmegaConf.to_container(trial) == OmegaConf.to_container(written), label


def test_a_written_value_outside_a_declared_range_widens_it_and_trial_0_keeps_it():
    from fedpilot.spec import PipelineSpec, written_values

    raw = one_stage_after_pretraining("fedprox")
    raw["stages"][1]["local"]["lr"] = 50.0
    raw["stages"][1]["params"] = {"mu": 1e-6}
    spec = PipelineSpec.from_dict(raw)
    lr, mu = spec.search.space["stages.1.local.lr"], spec.search.space["stages.1.params.mu"]
    assert (lr.low, lr.high, mu.low, mu.high) == (1e-3, 50.0, 1e-6, 10.0)
    assert written_values(spec) == {"stages.1.local.lr": 50.0, "stages.1.params.mu": 1e-6}


def test_step_size_stays_a_decade_around_the_value_for_plugins():
    from fedpilot.api import Tunable, step_size

    relative = step_size("local.lr")
    assert relative.dimension(0.02) == {"type": "float", "low": pytest.approx(0.002), "high": pytest.approx(0.2),
                                        "log": True}
    assert relative.fallback == "local.lr" and relative.source.startswith("fedpilot:")
    assert Tunable(1e-3, 10.0).source is None  # a plugin may leave its source out
    with pytest.raises(ValueError, match="`source` names where the range comes from"):
        Tunable(1e-3, 10.0, source=" ")


def test_the_docs_table_gives_each_declared_range_its_scale_and_source():
    """docs/algorithms.md's table of what each algorithm tunes says what the code declares, row by row."""
    import re

    from fedpilot.algorithms import ALGORITHMS

    text = (ROOT / "docs" / "algorithms.md").read_text()
    table = text[text.index("## What each algorithm tunes"):].split("\n## ")[0]
    documented = set()
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`"):
            continue
        names, keys = re.findall(r"`([^`]+)`", cells[0]), re.findall(r"`([^`]+)`", cells[1].split(" (null:")[0])
        for name in names:
            for key in keys:
                tunable = ALGORITHMS[name].tunable[key]
                fallback = f" (null: `{tunable.fallback}`'s value)" if tunable.fallback else ""
                assert cells[1].endswith(fallback) and cells[2] == tunable.describe(), (name, key, cells)
                assert cells[3] == tunable.scale and cells[4] == ("**budget**" if tunable.budget else ""), (name, key)
                assert cells[5] == tunable.source, (name, key)
                documented.add((name, key))
    assert documented == {(name, key) for name, key, _ in _declared()}
