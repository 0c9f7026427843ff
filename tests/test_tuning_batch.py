"""A search's trials trained in waves (tuning.py on pipeline/trials.py): the same trials, values, states, best and
MLflow records whatever `search.batch` and whether a wave's trials batch; successive halving inside a wave
(studies/halving.py); a wave stopped mid-way leaves no trial running and resumes into the same study; a bad
`search.batch` or `tune.batch` is one line."""

from __future__ import annotations

import json
import math
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import mlflow
import optuna
import pytest
from mlflow import MlflowClient

from fedpilot.compare.plan import load_plan
from fedpilot.pipeline.trials import PipelineTrials
from fedpilot.spec import PipelineSpec
from fedpilot.studies.halving import due, losers, rung_steps
from fedpilot.tracking import CHECKPOINTS_TAG, STUDY_TAG
from fedpilot.tuning import Search, fail_stale, quiet_optuna, study_storage
from pipeline_fixtures import SMALL, cli, run_id_of, write_pipeline
from test_tuned_protocol import write_set

pytestmark = pytest.mark.slow  # trains searches

SPACE = {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": 0.3, "log": True}}
SEARCH = {"space": SPACE, "objective": {"metric": "val_acc_weighted"}, "trials": 3,  # batch 1: the reference
          "sampler": {"kind": "random", "seed": 0}, "pruner": {"kind": "none"}, "batch": 1}
TINY = {**SMALL, "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 2}],
        "search": SEARCH}
SPACE2 = {**SPACE, "stages.1.local.lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True}}
WAVES = {**TINY, "search": {**SEARCH, "space": SPACE2, "trials": 5}}  # trial 0, its three Sobol points, a draw


def spec_of(raw: dict, folder) -> PipelineSpec:
    from fedpilot.spec import load_pipeline

    return load_pipeline(write_pipeline(folder, raw, "tiny.yaml"), [])


@pytest.fixture
def env(workdir):
    quiet_optuna()
    return workdir


# ---- the rule --------------------------------------------------------------------------------------------------
def test_rungs_lie_at_a_ninth_and_a_third_of_the_searched_rounds():
    assert rung_steps(4, 18) == [6, 10]  # 4 rounds before, then 18 searched: 2 and 6 rounds into them
    assert rung_steps(0, 4) == [1, 2]  # at least a round in; ceil(4/9) = 1, ceil(4/3) = 2
    assert rung_steps(2, 2) == [3]  # one rung (1/9 and 1/3 of 2 rounds are both the first round)
    assert rung_steps(0, 1) == []  # the only round is the end: nothing to judge early


def test_a_rung_keeps_the_best_third_and_those_within_the_margin_of_the_best():
    values = {0: 0.50, 1: 0.80, 2: 0.78, 3: 0.40, 4: 0.79, 5: 0.10}
    assert losers(values, margin=0.0, maximize=True) == [0, 2, 3, 5]  # ceil(6/3) = 2 kept: 1 and 4
    assert losers(values, margin=0.025, maximize=True) == [0, 3, 5]  # 2 is 0.02 from the best: noise
    assert losers(values, margin=0.0, maximize=False) == [0, 1, 2, 4]  # minimizing: 5 and 3 are the best
    assert losers({0: math.nan, 1: 0.2, 2: 0.3}, margin=1.0, maximize=True) == [0]  # not finite: the worst, kept not
    assert losers({0: 0.1}, margin=0.0, maximize=True) == []  # one trial: kept
    assert losers({0: 0.5, 1: 0.5, 2: 0.5}, margin=0.0, maximize=True) == []  # ties with the best: all kept


def test_rungs_one_evaluation_reaches_together_are_judged_once():
    rungs = [6, 10]
    assert due(rungs, 0, 4) == 0  # before the first rung
    assert due(rungs, 0, 6) == 1 and due(rungs, 1, 8) == 1  # the first rung, then nothing new
    assert due(rungs, 1, 12) == 2 and due(rungs, 0, 12) == 2  # the second; both at once: one judgement


# ---- bad input -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("batch", "message"), [
    (0, "search.batch=0: a number of trials from 1 to 2147483647, or `auto`"),
    ("many", "search.batch='many': a number of trials from 1 to 2147483647, or `auto`"),
    (True, "search.batch=True"),
])
def test_a_bad_search_batch_is_one_line_and_exit_2(env, batch, message):
    path = write_pipeline(env, {**TINY, "search": {**SEARCH, "batch": batch}}, "bad.yaml")
    before = sorted(p.name for p in env.iterdir())
    code, output = cli("search", str(path), "--storage", f"sqlite:///{env}/optuna.db")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output and sorted(p.name for p in env.iterdir()) == before


def test_a_sets_tune_batch_is_each_studys_search_batch_and_not_part_of_its_name(tmp_path):
    plan = load_plan(write_set(tmp_path, tune={"batch": 4}))
    alone = load_plan(write_set(tmp_path, tune={}))
    for pipeline in ("base", "other"):
        assert plan.tuning[pipeline].search.batch == 4 and alone.tuning[pipeline].search.batch == "auto"  # default
        assert plan.tuning[pipeline].search.study == alone.tuning[pipeline].search.study  # the same trials


# ---- the driver ------------------------------------------------------------------------------------------------
def trial_runs(client: MlflowClient, search_run: str) -> dict[str, dict]:
    """The search's trial runs by name: their tags (but the study's name and the cache folder) and status."""
    experiment = client.get_run(search_run).info.experiment_id
    runs = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{search_run}'")
    shown = {r.info.run_id: {k: v for k, v in r.data.tags.items() if k.startswith("fedpilot.")
                             and k not in (STUDY_TAG, CHECKPOINTS_TAG)} for r in runs}
    return {r.info.run_name: {"tags": shown[r.info.run_id], "status": r.info.status} for r in runs}


def searched(env, raw: dict, study: str, batch, monkeypatch, alone: bool = False) -> tuple:
    """A search of `raw` with `search.batch` at `batch` (`alone`: every trial of a wave its own computation, in
    lockstep, as a TrialBatch trains trials that cannot batch): its result, its trials, and the (trials, span) of each
    PipelineTrials it ran."""
    spec = spec_of({**raw, "search": {**raw["search"], "batch": batch}}, env)
    sizes, run = [], PipelineTrials.run
    with monkeypatch.context() as patch:
        patch.setattr(PipelineTrials, "run", lambda self, *a, **k: sizes.append((len(self.values), self.span)) or
                      run(self, *a, **k))
        if alone:
            patch.setattr("fedpilot.engine.trials.batch_groups", lambda stages: [[k] for k in range(len(stages))])
        search = Search(spec, f"sqlite:///{env}/optuna.db", study=study, cache_dir=env / study, echo=lambda line: None)
        result = search.run()
    return result, search.study.get_trials(), sizes


def assert_same_study(a: tuple, b: tuple) -> None:
    """Two searches' results and trials are the same: points, states, values and curves (to float tolerance: a
    batched computation's sums are a lone one's to rounding), attributes, best, rounds, MLflow trial runs."""
    (result_a, trials_a, _), (result_b, trials_b, _) = a, b
    assert [t.params for t in trials_a] == [t.params for t in trials_b]
    assert [t.state for t in trials_a] == [t.state for t in trials_b]
    assert all(math.isclose(x.value, y.value, abs_tol=1e-6) for x, y in zip(trials_a, trials_b, strict=True))
    for x, y in zip(trials_a, trials_b, strict=True):
        assert [x.user_attrs.get(k) for k in ("rounds", "origin", "noise", "wave")] == \
               [y.user_attrs.get(k) for k in ("rounds", "origin", "noise", "wave")]
        assert sorted(x.intermediate_values) == sorted(y.intermediate_values)
        curves = [[v for curve in t.user_attrs["curves"].values() for _, v in curve] for t in (x, y)]
        assert all(math.isclose(p, q, abs_tol=1e-6) for p, q in zip(*curves, strict=True))
    assert result_a.best_params == result_b.best_params and result_a.rounds_trained == result_b.rounds_trained
    assert (result_a.finished, result_a.pruned) == (result_b.finished, result_b.pruned)
    client = MlflowClient()
    assert trial_runs(client, result_a.run_id) == trial_runs(client, result_b.run_id)  # names, tags, statuses


def test_a_studys_waves_train_the_same_trials_whatever_its_batch(env, monkeypatch):
    """Trial 0 alone (and its noise seed), its three Sobol points as one wave, a draw alone: `batch` 1 and `auto`,
    and the wave's trials each in its own computation, give the same study (a span between them: the engine's
    tests, tests/test_engine_trials.py)."""
    studies = {batch: searched(env, WAVES, f"batch-{batch}", batch, monkeypatch) for batch in (1, "auto")}
    studies["alone"] = searched(env, WAVES, "alone", 3, monkeypatch, alone=True)
    assert [t.user_attrs["wave"] for t in studies[1][1]] == [0, 1, 1, 1, 2]
    assert {batch: study[2] for batch, study in studies.items()} == {
        1: [(3, 1)], "auto": [(3, None)], "alone": [(3, 3)]}  # the wave, and how many a chunk spans
    for batch in ("auto", "alone"):
        assert_same_study(studies[1], studies[batch])
    assert len(trial_runs(MlflowClient(), studies[1][0].run_id)) == 6  # five trials and trial 0's noise seed


def test_tpe_the_pruner_and_halving_find_the_same_whatever_the_batch(env, monkeypatch):
    """A study whose draws follow TPE, whose pruner judges against earlier waves and whose Sobol wave is halved at
    its rungs (the margin measured by trial 0's noise seed) is the same under `batch: 1` and `auto`, and with each
    trial of a wave its own computation (halved in lockstep all the same)."""
    search = {**SEARCH, "space": SPACE2, "trials": 7, "sampler": {"kind": "tpe", "seed": 0},
              "pruner": {"kind": "median", "startup_trials": 1, "warmup_rounds": 0}}
    raw = {**TINY, "evaluation": {"every": 1}, "search": search,
           "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 6}]}
    one, auto = (searched(env, raw, f"tpe-{batch}", batch, monkeypatch) for batch in (1, "auto"))
    alone = searched(env, raw, "tpe-alone", "auto", monkeypatch, alone=True)  # as an algorithm that cannot batch
    assert_same_study(one, auto)
    assert_same_study(one, alone)
    trials = one[1]
    assert [t.user_attrs["wave"] for t in trials] == [0, 1, 1, 1, 2, 3, 4]
    assert [t.user_attrs["origin"] for t in trials[4:]] == ["tpe"] * 3
    assert any(t.state.name == "PRUNED" for t in trials), [t.state.name for t in trials]  # the rules did judge


def test_halving_drops_the_losers_of_a_batch_at_its_rungs(env):
    search = {**SEARCH, "space": {"stages.1.local.lr": {"type": "float", "low": 1e-6, "high": 0.3, "log": True}},
              "pruner": {"kind": "median", "margin": 0}, "batch": 3}
    raw = {**TINY, "evaluation": {"every": 1}, "search": search,
           "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 9,
                                                            "params": {"lr_v": 1e-6}}]}
    runner = Search(spec_of(raw, env), f"sqlite:///{env}/optuna.db", echo=lambda line: None)
    for lr in (0.2, 1e-6, 3e-6):  # one that learns, two that barely move
        runner.study.enqueue_trial({"stages.1.local.lr": lr})
    result = runner.run()
    trials = runner.study.get_trials()
    first_rung = 2 + 1  # pretraining's 2 rounds, then a ninth of the 9 searched ones
    kept = max(trials, key=lambda t: t.intermediate_values[first_rung])
    assert kept.state.name == "COMPLETE" and result.pruned == 2
    for trial in trials:
        if trial is not kept:  # pruned with the value they had at the rung, after training one round of the stage
            assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [first_rung]
            assert trial.value == trial.intermediate_values[first_rung] < kept.intermediate_values[first_rung]
            assert trial.user_attrs["rounds"] == 1
    assert kept.user_attrs["rounds"] == 9 and sorted(kept.intermediate_values) == list(range(3, 12))
    assert result.rounds_trained == 2 + 9 + 1 + 1  # the losers' rows left the computation at the rung
    client = MlflowClient()
    experiment = client.get_run(result.run_id).info.experiment_id
    for trial in trials:
        run = client.get_run(trial.user_attrs["mlflow_run_id"])
        assert run.info.status == ("FINISHED" if trial is kept else "KILLED")  # as a lone pruned trial's run
        assert client.search_runs([experiment], f"tags.fedpilot.trial = '{trial.number}'")


def test_a_wave_stopped_midway_leaves_no_trial_running_and_resumes_into_the_same_study(env, monkeypatch):
    spec = spec_of({**WAVES, "search": {**WAVES["search"], "batch": 3}}, env)
    storage = f"sqlite:///{env}/optuna.db"
    together = PipelineTrials._together

    def stopped(self, index, members, *rest):  # Ctrl+C as the wave's searched stage starts, pretraining done
        raise KeyboardInterrupt

    monkeypatch.setattr(PipelineTrials, "_together", stopped)
    with pytest.raises(KeyboardInterrupt):
        Search(spec, storage, echo=lambda line: None).run()
    study = optuna.load_study(study_name="small", storage=storage)
    states = [t.state.name for t in study.get_trials()]
    assert states == ["COMPLETE"] + ["FAIL"] * 3 + ["WAITING"] * 3  # trial 0 told; its wave failed and retried
    client = MlflowClient()
    experiment = client.get_experiment_by_name("small").experiment_id
    assert not client.search_runs([experiment], "attributes.status = 'RUNNING'")
    monkeypatch.setattr(PipelineTrials, "_together", together)
    result = Search(spec, storage, echo=lambda line: None).run()
    trials = study.get_trials()
    failed, retried = trials[1:4], trials[4:7]
    assert [t.state.name for t in retried] == ["COMPLETE"] * 3 and result.finished == 5
    assert [t.system_attrs["failed_trial"] for t in retried] == [1, 2, 3]  # the same trials, retried
    assert [t.params for t in retried] == [t.params for t in failed]
    assert not client.search_runs([experiment], "attributes.status = 'RUNNING'")
    whole = Search(spec, storage, study="whole", cache_dir=env / "whole", echo=lambda line: None)
    whole.run()
    told = [t for t in trials if t.state.name == "COMPLETE"]  # the stop moved nothing a study finds
    uninterrupted = whole.study.get_trials()
    assert [t.params for t in told] == [t.params for t in uninterrupted]
    assert all(math.isclose(a.value, b.value, abs_tol=1e-6) for a, b in zip(told, uninterrupted, strict=True))


def test_a_tuned_comparison_in_batches_records_what_it_records_one_trial_at_a_time(workdir, new_mlflow_store,
                                                                                   monkeypatch):
    from test_compare_tuned import write_set as write_pair

    records, sizes, run = [], {1: [], 3: []}, PipelineTrials.run
    for batch in (1, 3):
        monkeypatch.setattr(PipelineTrials, "run", lambda self, *a, seen=sizes[batch], **k: seen.append(
            len(self.values)) or run(self, *a, **k))
        folder = workdir / f"batch-{batch}"
        folder.mkdir()
        uri = new_mlflow_store(folder)
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        monkeypatch.setenv("FEDPILOT_CACHE", str(folder / "cache"))  # each trains every stage itself
        mlflow.set_tracking_uri(uri)
        code, output = cli("compare", write_pair(folder, batch=batch), "--storage", f"sqlite:///{folder}/studies.db")
        assert code == 0, output
        client, run_id = MlflowClient(uri), run_id_of(output)
        records.append(json.loads(Path(client.download_artifacts(run_id, "comparison.json", str(folder))).read_text()))
        studies = [optuna.load_study(study_name=records[-1]["tuning"][p]["study"], storage=f"sqlite:///{folder}/"
                                     "studies.db") for p in ("base", "other")]
        records[-1]["trials"] = [[(t.number, t.state.name, t.params) for t in s.get_trials()] for s in studies]
    assert sizes[1] == sizes[3] and max(sizes[3]) == 2  # each study's second wave: trial 0's two Sobol points
    one, three = (flat({k: v for k, v in r.items() if k != "runs"}) for r in records)  # runs: their ids
    assert one.keys() == three.keys()  # trial 0, the Sobol points and the trials beyond an edge: the same trials,
    for key, value in one.items():  # the same scores, verdicts, studies' values and choices
        same = math.isclose(value, three[key], abs_tol=1e-6) if isinstance(value, float) else value == three[key]
        assert same, (key, value, three[key])


def flat(value: object, path: str = "") -> dict[str, object]:
    """A JSON value's leaves by their path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{path}.{key}").items()}
    if isinstance(value, list | tuple):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{path}[{i}]").items()}
    return {path: value}


def test_trials_of_a_wave_that_cannot_batch_are_pruned_and_halved_as_a_batch_is(env, monkeypatch):
    """Each trial of the wave its own computation (as an algorithm that does not batch trials trains them), in
    lockstep: the pruner judges them against the wave before, the rung against each other."""
    monkeypatch.setattr("fedpilot.engine.trials.batch_groups", lambda stages: [[k] for k in range(len(stages))])
    search = {**SEARCH, "space": {"stages.1.local.lr": {"type": "float", "low": 1e-6, "high": 0.3, "log": True}},
              "pruner": {"kind": "median", "startup_trials": 1, "warmup_rounds": 0, "margin": 0}, "trials": 4}
    raw = {**TINY, "search": search, "stages": [{**SMALL["stages"][0], "rounds": 2},
                                                {**SMALL["stages"][1], "rounds": 6, "params": {"lr_v": 1e-6}}]}
    runner = Search(spec_of(raw, env), f"sqlite:///{env}/optuna.db", echo=lambda line: None)
    for wave, lr in zip((0, 1, 1, 1), (0.005, 0.05, 1e-6, 3e-6), strict=True):  # a slow one that finishes, then a
        runner.study.enqueue_trial({"stages.1.local.lr": lr}, user_attrs={"wave": wave})  # wave: one learns, two not
    result = runner.run()
    trials = runner.study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE", "PRUNED", "PRUNED"] and result.pruned == 2
    client = MlflowClient()
    for trial in trials[2:]:  # stopped before the stage's end, its runs KILLED
        assert max(trial.intermediate_values) < 2 + 6 and trial.user_attrs["rounds"] < 6
        assert client.get_run(trial.user_attrs["mlflow_run_id"]).info.status == "KILLED"


def test_a_batch_whose_process_is_killed_goes_stale_and_its_trials_are_retried(env):
    slow = {**TINY, "evaluation": {"every": 10_000}, "search": {**SEARCH, "batch": 3},
            "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 3000}]}
    path, storage = write_pipeline(env, slow, "slow.yaml"), f"sqlite:///{env}/optuna.db"
    hand = optuna.create_study(study_name="small", storage=storage, direction="maximize")
    for lr in (0.01, 0.02, 0.03):  # enqueued by hand, without a wave: one wave
        hand.enqueue_trial({"stages.1.params.lr_v": lr})
    script = ("from fedpilot.spec import load_pipeline; from fedpilot.tuning import Search; "
              f"Search(load_pipeline({str(path)!r}, []), {storage!r}, heartbeat_seconds=1).run()")
    victim = subprocess.Popen([sys.executable, "-c", script], cwd=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)

    def rounds_logged() -> int:
        """Rounds logged so far (read-only SQL, polled cheaply)."""
        try:
            with closing(sqlite3.connect(f"file:{env / 'mlflow.db'}?mode=ro", uri=True)) as reader:
                return reader.execute("SELECT COUNT(*) FROM metrics WHERE key = 'train_loss'").fetchone()[0]
        except sqlite3.OperationalError:  # not there yet, or locked by a write: ask again
            return 0

    deadline = time.monotonic() + 300
    while rounds_logged() < 2 + 3 * 2 and time.monotonic() < deadline and victim.poll() is None:
        time.sleep(0.1)  # pretraining logged, then the batch's rounds (each of its 3 trials logs its own)
    time.sleep(4)  # longer than the grace period: a batch that beats stays alive
    study = optuna.load_study(study_name="small", storage=study_storage(storage, 1))
    fail_stale(study)
    assert [t.state.name for t in study.get_trials()] == ["RUNNING"] * 3 and victim.poll() is None
    victim.kill()  # SIGKILL: no handler runs, the batch's trials are left RUNNING
    victim.wait()
    time.sleep(4)  # past the grace period (3 heartbeats of 1 s) since the batch's last beat
    again = Search(spec_of(slow, env), storage, heartbeat_seconds=1, echo=lambda line: None)  # whoever opens it next
    trials = again.study.get_trials()
    assert [t.state.name for t in trials] == ["FAIL"] * 3 + ["WAITING"] * 3  # lost: the batch in flight, retried
    assert [(t.system_attrs["failed_trial"], t.params) for t in trials[3:]] == [(t.number, t.params)
                                                                                for t in trials[:3]]


def test_fedpilot_search_trains_its_waves_together(env):
    path = write_pipeline(env, {**WAVES, "search": {**WAVES["search"], "batch": 3}}, "tiny.yaml")
    code, output = cli("search", str(path), "--storage", f"sqlite:///{env}/optuna.db")
    assert code == 0, output
    told = [line for line in output.splitlines() if line.startswith("trial ")]
    assert len(told) == 5 and all("val_acc_weighted=" in line for line in told)
    assert [line.endswith("in a wave of 3") for line in told] == [False, True, True, True, False]
    assert "wave 1: trials 1, 2, 3 train together" in output.splitlines()
