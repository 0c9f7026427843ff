"""Issue 50: a tuned comparison that a reviewer accepts. A study is shared only by plans that would run the very same
trials; every seed of a tuned comparison trains on one federation (or on federations whose test samples no tuning
seed ever trained or validated on), checked before any work and again from the records; trial 0 is the pipeline as
written for every built-in algorithm; a choice near an edge grows its range; the pruner's margin is the noise
between seeds and it waits for the finished curves to stop crossing (slow starters are kept)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml

from fedpilot.compare.federation import build_all, check_disjoint, check_recorded, fingerprints
from fedpilot.compare.plan import load_plan
from fedpilot.errors import RunError, SpecError
from fedpilot.spec import PipelineSpec, with_values, written_values
from fedpilot.studies.edges import EDGES, edge_of, grown
from fedpilot.studies.points import BEYOND_EDGE, ORIGIN, position, sobol_points, startup_count
from fedpilot.studies.pruner import MarginPruner, seed_margin, settled_step
from fedpilot.tuning import Search, study_facts
from pipeline_fixtures import write_pipeline
from tuning_fixtures import TUNED_BASE, one_stage_after_pretraining, pruned_at, study_with

BASE = TUNED_BASE


def write_set(folder: Path, name: str = "pair", seeds: int | list[int] = 2, overrides: list[str] | None = None,
              tune: dict | None = None) -> Path:
    write_pipeline(folder, {**BASE, "name": "base"}, "base.yaml")
    write_pipeline(folder, {**BASE, "name": "other", "stages": [BASE["stages"][0], {**BASE["stages"][1],
                                                                                      "algorithm": "fedalt"}]},
                   "other.yaml")
    comparison = {"name": name, "seeds": seeds, "pipelines": ["base.yaml", "other.yaml"],
                  "overrides": overrides or [], **({"tune": {"trials": 3, **tune}} if tune is not None else {})}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(comparison))
    return path


def test_sets_share_a_study_only_when_it_would_run_the_same_trials(tmp_path):
    """Issue 50's case: a set with seeds 0-2 tuned on [3, 4] and a set with seeds [4, 5] tuned on [3] agreed on
    their first tuning seed and shared a study (the second chose on its own comparison seed 4)."""
    first = load_plan(write_set(tmp_path, "a", seeds=3, tune={"seeds": [3, 4]}))
    second = load_plan(write_set(tmp_path, "b", seeds=[4, 5], tune={"seeds": [3]}))
    for pipeline in ("base", "other"):
        assert first.tuning[pipeline].search.study != second.tuning[pipeline].search.study
    again = load_plan(write_set(tmp_path, "a", seeds=3, tune={"seeds": [3, 4]}))
    assert again.tuning["base"].search.study == first.tuning["base"].search.study  # a rerun continues its study
    others = [load_plan(write_set(tmp_path, "a", seeds=3, tune={"seeds": [3, 4], "trials": 5})),  # another budget
              load_plan(write_set(tmp_path, "a", seeds=3, overrides=["dataset.seed=1"], tune={"seeds": [3, 4]})),
              load_plan(write_set(tmp_path, "a", seeds=3, tune={"seeds": [3, 4], "objective": "val_acc_p10"}))]
    assert len({first.tuning["base"].search.study, *(p.tuning["base"].search.study for p in others)}) == 4


def test_a_tuned_set_that_leaves_dataset_seed_unset_trains_every_seed_on_one_federation(tmp_path):
    plan = load_plan(write_set(tmp_path, tune={"trials": 2}))
    assert plan.fixed == ["base", "other"]
    built = build_all(plan, tmp_path / "data")
    assert {(p, s) for p, s in built} == {(p, s) for p in ("base", "other") for s in (0, 1, 2, 3)}  # 2, 3: studies
    assert len({data.fingerprint for data in built.values()}) == 1  # one federation, tuning and comparison seeds
    check_disjoint(plan, built)
    assert load_plan(write_set(tmp_path)).specs["base"][0].dataset.seed is None  # untuned: the set as written


def test_train_val_splits_keep_every_comparison_seeds_test_samples_out_of_tuning(tmp_path):
    plan = load_plan(write_set(tmp_path, tune={"splits": "train_val"}))
    built = build_all(plan, tmp_path / "data")
    assert len({data.fingerprint for data in built.values()}) == 4  # each seed re-cuts train / val
    tests = [np.concatenate(built[("base", seed)].samples("test")) for seed in (0, 1, 2, 3)]
    assert all(np.array_equal(tests[0], t) for t in tests)  # the same clients and test samples on every seed
    check_disjoint(plan, built)
    check_recorded(plan, fingerprints(plan, built), tmp_path / "data")  # the records rebuilt: the same splits
    recorded = fingerprints(plan, built)
    recorded["base"]["1"] = recorded["base"]["0"]
    with pytest.raises(RunError, match="base seed 1"):
        check_recorded(plan, recorded, tmp_path / "data")
    redrawn = load_plan(write_set(tmp_path, tune={"splits": "redraw"}))  # every seed its own federation: a leak
    with pytest.raises(SpecError, match=r"tune.splits='redraw': base: \d+ of \d+ test samples of seed 0 are train "
                                        r"or val samples at tuning seed 2"):
        check_disjoint(redrawn, build_all(redrawn, tmp_path / "data"))


def test_trial_0_is_the_pipeline_as_written_for_every_builtin_algorithm():
    from fedpilot.algorithms import ALGORITHMS

    for name in ALGORITHMS.builtins:
        spec = PipelineSpec.from_dict(one_stage_after_pretraining(name))
        first = written_values(spec)
        assert set(first) == set(spec.search.space), name  # every searched key has its written value in range
        plain = spec.model_copy(update={"search": None})
        stage = plain.resolved()["stages"][1]
        # a null key runs its declared fallback's value (a personal lr: local.lr), which trial 0 writes out
        nulls = {f"stages.1.{key}": stage[t.fallback.split(".")[0]][t.fallback.split(".")[1]]
                 for key, t in ALGORITHMS[name].tunable.items()
                 if f"stages.1.{key}" in first and stage[key.split(".")[0]][key.split(".")[1]] is None}
        assert with_values(plain, first).resolved() == with_values(plain, nulls).resolved(), name


def test_a_choice_at_an_edge_grows_its_range_and_spends_further_trials_there(tmp_path, new_mlflow_store,
                                                                             monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", new_mlflow_store(tmp_path))
    raw = {**{k: v for k, v in BASE.items() if k != "defaults"}, "name": "edge",
           "dataset": {"source": {"kind": "digits"}, **BASE["dataset"]}, "model": {"name": "mlp", "hidden": [8]},
           "search": {"space": {"stages.1.local.lr": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
                      "objective": "val_acc_mean", "trials": 3, "edge_trials": 2}}
    search = Search(PipelineSpec.from_dict(raw), f"sqlite:///{tmp_path}/s.db", echo=lambda line: None)
    distribution = optuna.distributions.FloatDistribution(0.001, 0.1, log=True)
    for lr, value in ((0.002, 0.5), (0.01, 0.6), (0.095, 0.8)):  # the best at 0.095: in the outer tenth
        search.study.add_trial(optuna.trial.create_trial(params={"stages.1.local.lr": lr},
                                                         distributions={"stages.1.local.lr": distribution},
                                                         value=value))
    search._grow_edges()
    waiting = search.study.get_trials(states=(optuna.trial.TrialState.WAITING,))
    beyond = [t.params["stages.1.local.lr"] if t.params else t.system_attrs["fixed_params"]["stages.1.local.lr"]
              for t in waiting]
    assert len(beyond) == 2 and all(lr > 0.1 for lr in beyond) and all(t.user_attrs[ORIGIN] == BEYOND_EDGE
                                                                       for t in waiting)
    grown_range = search.study.user_attrs[EDGES]["stages.1.local.lr"]
    assert grown_range["side"] == "high" and grown_range["high"] == pytest.approx(max(beyond))
    assert search.space()["stages.1.local.lr"].high == pytest.approx(max(beyond))
    facts = study_facts(search.search.space, search.study.get_trials(), search.study.user_attrs, maximize=True)
    assert facts.grown == {"stages.1.local.lr": "high"} and facts.at_edge == {}  # inside the grown range
    # a linear range cannot grow: a choice at its edge stays, flagged
    linear = search.search.space["stages.1.local.lr"].model_copy(update={"log": False})
    assert study_facts({"stages.1.local.lr": linear}, search.study.get_trials(), {}, True).at_edge == {
        "stages.1.local.lr": "high"}


def test_the_grown_range_and_the_start_up_points():
    from fedpilot.spec import Param

    lr = Param(type="float", low=0.01, high=1.0, log=True)
    wider, values = grown(lr, "high", 2)
    assert values == pytest.approx([10**0.25, 10**0.5]) and wider.high == pytest.approx(10**0.5)
    assert edge_of(lr, 0.011) == "low" and edge_of(lr, 0.9) == "high" and edge_of(lr, 0.1) is None
    assert startup_count(1, 8, True) == 2 and startup_count(2, 8, True) == 4 and startup_count(4, 6, True) == 5
    points = sobol_points({"a": lr, "b": Param(type="int", low=1, high=4)}, 4, seed=7)
    assert all(0.01 <= p["a"] <= 1 and p["b"] in (1, 2, 3, 4) for p in points)
    # a balanced block: one point in each quarter of the log range
    assert sorted(int(position(lr, p["a"]) * 4) for p in points) == [0, 1, 2, 3]
    assert sobol_points({"a": lr}, 4, seed=7) != sobol_points({"a": lr}, 4, seed=8)  # scrambled per study


ROUNDS = (60, 80, 100, 120, 130, 140, 160, 180, 200)
# trial 0 on two seeds: its evaluations differ by about 0.004 between seeds (a margin of ~0.008)
NOISE = {"2": [[r, 0.95 + 0.0002 * i] for i, r in enumerate(ROUNDS)],
         "3": [[r, 0.95 + 0.0002 * i + (0.004 if i % 2 else -0.004)] for i, r in enumerate(ROUNDS)]}


def _curve(values: list[float]) -> dict[int, float]:
    return dict(zip(ROUNDS, values, strict=True))


def test_the_fedsim_slow_starter_that_finished_best_is_kept():
    """Shift, FedSim (issue 50): a trial at 0.957 at round 130 finished best at 0.986. Once a finished slow starter
    has overtaken the others late, the curves settle only at the end: a trial as slow at round 130 is not pruned,
    while one clearly worse at the end still is."""
    fast = _curve([0.960, 0.966, 0.970, 0.972, 0.973, 0.975, 0.976, 0.977, 0.978])
    slow = _curve([0.930, 0.940, 0.948, 0.953, 0.957, 0.966, 0.977, 0.984, 0.990])
    study = study_with([fast, slow, _curve([v - 0.002 for v in fast.values()])], NOISE)
    margin = seed_margin(study.get_trials())
    assert 0.006 < margin < 0.01
    assert settled_step(study.get_trials(), margin) == 140  # the slow starter was behind until round 140
    pruner = MarginPruner(startup=2, warmup=100, margin=None)
    assert pruned_at(pruner, study, slow) is None
    assert pruned_at(pruner, study, _curve([v - 0.05 for v in fast.values()])) == 160


def test_the_fedalt_trial_at_0963_is_not_pruned_at_round_130():
    """Shift, FedAlt (issue 50): a trial at 0.963 was pruned at round 130 by the old rule, on a margin inflated by the
    shared pretraining's evaluations of another study. Here: finished curves whose order changes up to round 140,
    the margin measured from trial 0's two seeds; the trial is kept past 130 and judged once the curves settle."""
    first = _curve([0.955, 0.962, 0.967, 0.970, 0.972, 0.974, 0.976, 0.977, 0.978])
    second = _curve([0.958, 0.966, 0.970, 0.973, 0.974, 0.971, 0.969, 0.967, 0.966])  # crosses below at 140
    study = study_with([first, second], NOISE)
    pruner = MarginPruner(startup=2, warmup=100, margin=None)
    late = _curve([0.950, 0.955, 0.960, 0.962, 0.963, 0.970, 0.976, 0.979, 0.981])
    assert settled_step(study.get_trials(), seed_margin(study.get_trials())) == 130  # ahead until round 130
    assert pruned_at(pruner, study, late) is None
    assert pruned_at(pruner, study_with([first, second]), late) is None  # no margin measured: no pruning


def test_the_margin_comes_from_the_noise_between_seeds_only():
    """A study whose trials have one curve each has no margin (a curve's own wiggle is not the noise between
    seeds); the margin is twice the root-mean-square difference between two seeds' evaluations."""
    study = study_with([_curve([0.9] * 9)])
    assert seed_margin(study.get_trials()) is None
    same = {"2": [[r, 0.5] for r in ROUNDS], "3": [[r, 0.5] for r in ROUNDS]}
    assert seed_margin(study_with([_curve([0.9] * 9)], same).get_trials()) == 0.0
    assert seed_margin(study_with([_curve([0.9] * 9)], NOISE).get_trials()) == pytest.approx(2 * 0.004)


@pytest.mark.slow
def test_reordering_a_set_changes_no_pruning_decision(tmp_path, monkeypatch, new_mlflow_store):
    """The first study of a set trains the shared pretraining; its evaluations once entered trial 0's curve and
    inflated that study's margin. Now the shared stages report nothing and the margin is each study's own noise
    between seeds: the same set in the other order makes the same decisions (states, curves, margins)."""
    from mlflow import MlflowClient

    from pipeline_fixtures import cli, run_id_of

    facts = []
    for order in (["base.yaml", "other.yaml"], ["other.yaml", "base.yaml"]):
        folder = tmp_path / "-".join(order)
        folder.mkdir()
        monkeypatch.chdir(folder)
        uri = new_mlflow_store(folder)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("FEDPILOT_CACHE", str(folder / "cache"))
        path = write_set(folder, tune={"trials": 4, "edge_trials": 0,
                                       "pruner": {"kind": "median", "startup_trials": 1}})
        path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "pipelines": order}))
        code, output = cli("compare", str(path), "--seeds", "1", "--storage", f"sqlite:///{folder}/studies.db")
        assert code == 0, output
        record = MlflowClient(uri).download_artifacts(run_id_of(output), "comparison.json", str(folder))
        facts.append(json.loads(Path(record).read_text()))
        studies = {p: optuna.load_study(study_name=facts[-1]["tuning"][p]["study"],
                                        storage=f"sqlite:///{folder}/studies.db") for p in ("base", "other")}
        facts[-1]["trials"] = {p: [(t.state.name, t.intermediate_values) for t in s.get_trials()]
                               for p, s in studies.items()}
        first_steps = {p: min(s.get_trials()[0].intermediate_values) for p, s in studies.items()}
        assert all(step > 2 for step in first_steps.values())  # the 2 shared pretraining rounds report nothing
    one, two = facts
    for pipeline in ("base", "other"):
        assert [state for state, _ in one["trials"][pipeline]] == [state for state, _ in two["trials"][pipeline]]
        for (_, a), (_, b) in zip(one["trials"][pipeline], two["trials"][pipeline], strict=True):
            assert a == pytest.approx(b, abs=1e-6)
        assert one["study_facts"][pipeline]["margin"] == pytest.approx(two["study_facts"][pipeline]["margin"])
