"""Searches: bad search specs, exact trial counts across processes, resume by name, retries, pruning, MLflow."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from contextlib import closing

import optuna
import pytest
from mlflow import MlflowClient

from fedpilot.errors import UserError
from fedpilot.schema import SEED_MAX
from fedpilot.spec import PipelineSpec
from fedpilot.tuning import (
    PruneOnEvaluation,
    Search,
    draws_before,
    fail_interrupted,
    make_pruner,
    make_sampler,
    quiet_optuna,
    suggest,
)
from pipeline_fixtures import PLOTTED, SMALL, cli, run_id_of, write_pipeline
from tuning_fixtures import pruned_at, study_with

pytestmark = pytest.mark.slow  # starts services or processes (conftest runs these files first)

SPACE = {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": 0.3, "log": True}}
SEARCH = {"space": SPACE, "objective": {"metric": "val_acc_weighted"}, "trials": 3,
          "sampler": {"kind": "random", "seed": 0}, "pruner": {"kind": "none"}}
TINY = {**SMALL, "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": 2}],
        "search": SEARCH}


def spec_with(search: dict) -> dict:
    raw = {k: v for k, v in SMALL.items() if k != "defaults"}
    return {**raw, "dataset": {"source": {"kind": "digits"}, **SMALL["dataset"]},
            "model": {"name": "mlp", "hidden": [32]}, "search": search}


@pytest.mark.parametrize(("search", "message"), [
    ({**SEARCH, "space": {"stages.1.params.lr_w": SPACE["stages.1.params.lr_v"]}},
     r"search.space.stages.1.params.lr_w='lr_w': not a key of the pipeline.*did you mean 'lr_v'"),
    ({**SEARCH, "space": {"stages.0.local.lr": {"type": "float", "low": 0.5, "high": 0.1}}},
     r"search.space.stages.0.local.lr=.*low=0.5 > high=0.1"),
    ({**SEARCH, "space": {"stages.0.local.lr": {"type": "float", "low": 0, "high": 0.1, "log": True}}},
     r"log scale needs low > 0"),
    ({**SEARCH, "space": {"stages.0.local.lr": {"type": "float", "low": 0, "high": 0.1}}},
     r"search.space.stages.0.local.lr=0.0: gives an invalid pipeline: stages.0.local.lr=0.0"),
    ({**SEARCH, "space": {"stages.0.algorithm": {"type": "categorical", "choices": ["fedavg", "fednova"]}}},
     r"search.space.stages.0.algorithm='fednova'"),
    ({**SEARCH, "objective": {"metric": "test_acc_mean"}}, r"never optimize test metrics"),
    ({**SEARCH, "objective": {"metric": "val_acc_p10", "stage": "polish"}},
     r"search.objective.0.stage='polish': no such stage"),
    ({**SEARCH, "objective": {"metric": "val_accuracy"}}, r"search.objective.metric='val_accuracy'.*val_acc_mean"),
    ({**SEARCH, "spaces": {}}, r"search.spaces=\{\}: unknown key.*did you mean 'space'"),
])
def test_bad_search_specs_name_the_key(search, message):
    with pytest.raises(UserError, match=message):
        PipelineSpec.from_dict(spec_with(search))


def test_search_cli_errors_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    no_search = write_pipeline(tmp_path)
    code, output = cli("search", str(no_search))
    assert code == 2 and "search=None: the pipeline has no `search:` block" in output
    code, output = cli("search", str(write_pipeline(tmp_path, TINY, "t.yaml")), "--storage", "redis://x")
    assert code == 2 and "--storage='redis://x'" in output
    assert not (tmp_path / "fedpilot.db").exists()


@pytest.fixture
def env(workdir):
    quiet_optuna()
    return workdir


def test_search_records_trials_under_one_run_and_resumes_by_name(env):
    path = write_pipeline(env, {**TINY, "tracking": PLOTTED["tracking"]}, "tiny.yaml")  # the search's plots too
    storage = f"sqlite:///{env}/optuna.db"
    code, output = cli("search", str(path), "--storage", storage)
    assert code == 0, output
    study = optuna.load_study(study_name="small", storage=storage)
    assert len(study.get_trials(states=(optuna.trial.TrialState.COMPLETE,))) == 3
    code, again = cli("search", str(path), "--storage", storage, "--trials", "4")
    assert code == 0, again
    assert run_id_of(again) == run_id_of(output)  # the same study keeps its search run
    trials = study.get_trials()
    assert [t.number for t in trials] == [0, 1, 2, 3] and all(t.state.name == "COMPLETE" for t in trials)

    client = MlflowClient()
    search_run = client.get_run(run_id_of(output))
    assert search_run.data.tags["fedpilot.search"] == "small"
    assert search_run.data.tags["best_trial"] == str(study.best_trial.number)
    assert float(search_run.data.tags["best.stages.1.params.lr_v"]) == study.best_params["stages.1.params.lr_v"]
    assert search_run.data.metrics["best_val_acc_weighted"] == pytest.approx(study.best_value)
    plots = {a.path for a in client.list_artifacts(search_run.info.run_id, "plots")}
    assert {"plots/optimization_history.png", "plots/intermediate_values.png"} <= plots
    trial_runs = client.search_runs(search_run.info.experiment_id,
                                    f"tags.mlflow.parentRunId = '{search_run.info.run_id}'")
    # trial 0 also trains the noise seed (the pruner's margin: the noise between seeds)
    assert sorted(int(r.data.tags["fedpilot.trial"]) for r in trial_runs) == [0, 0, 1, 2, 3]
    noise = [r for r in trial_runs if r.data.tags.get("fedpilot.noise_seed") == "true"]
    assert [(r.data.tags["fedpilot.trial"], r.data.tags["fedpilot.seed"]) for r in noise] == [("0", "1")]
    pretrain_cache = []
    for trial_run in trial_runs:
        stages = client.search_runs(search_run.info.experiment_id,
                                    f"tags.mlflow.parentRunId = '{trial_run.info.run_id}'")
        pretrain_cache += [s.data.tags["fedpilot.cache"] for s in stages if s.data.tags["fedpilot.stage"] == "pretrain"]
    # the space only touches stage 1: pretrain runs once per seed (the search's and the noise seed)
    assert sorted(pretrain_cache) == ["hit"] * 3 + ["miss"] * 2


def test_a_trial_below_the_median_is_pruned_and_its_run_killed(env):
    search = {**SEARCH, "space": {"stages.1.local.lr": {"type": "categorical", "choices": [0.2, 1e-6]}},
              "pruner": {"kind": "median", "startup_trials": 1, "warmup_rounds": 0, "margin": 0}}
    spec = PipelineSpec.from_dict({**spec_with(search), "stages": [
        {**SMALL["stages"][0], "rounds": 2},
        {**SMALL["stages"][1], "rounds": 6, "params": {"lr_v": 1e-6}}]})
    runner = Search(spec, f"sqlite:///{env}/optuna.db", trials=2, echo=lambda line: None)
    runner.study.enqueue_trial({"stages.1.local.lr": 0.2})
    runner.study.enqueue_trial({"stages.1.local.lr": 1e-6})
    result = runner.run()
    states = [t.state.name for t in runner.study.get_trials()]
    assert states == ["COMPLETE", "PRUNED"] and result.pruned == 1
    assert result.rounds_trained < 2 + 6 + 6  # the pruned trial stopped before its last round
    client = MlflowClient()
    pruned = client.search_runs(client.get_run(result.run_id).info.experiment_id, "tags.`fedpilot.trial` = '1'")[0]
    assert pruned.info.status == "KILLED"


def test_prune_callback_reports_rounds_across_stages():
    reports = []

    class Trial:
        def report(self, value, step):
            reports.append((value, step))

        def should_prune(self):
            return len(reports) > 1

    class Module:
        round_log = {"val_acc_weighted": 0.5}

    class Trainer:
        global_step = 10

    callback = PruneOnEvaluation(Trial(), "val_acc_weighted", offset=100)
    callback.on_train_batch_end(Trainer(), Module())
    with pytest.raises(optuna.TrialPruned):
        callback.on_train_batch_end(Trainer(), Module())
    assert reports == [(0.5, 110), (0.5, 110)]


def _worker(db: str, store: str, tmp_path, grace: float = 5, heartbeat: float = 2) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": store, "FEDPILOT_CACHE": str(tmp_path / "cache")}
    return subprocess.Popen([sys.executable, "-m", "fedpilot.cli", "worker", "--db", db, "--exit-when-idle",
                             "--poll-seconds", "0.5", "--heartbeat-seconds", str(heartbeat),
                             "--grace-seconds", str(grace)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _jobs(db: str) -> list[dict]:
    code, output = cli("jobs", "--db", db, "--json")
    assert code == 0, output
    return json.loads(output)


def _job_output(db: str, job: dict) -> str:
    """What a failed job left: its error and its child's stderr (for an assertion message)."""
    code, output = cli("jobs", "show", str(job["id"]), "--db", db, "--json")
    shown = json.loads(output) if code == 0 else {"error": output}
    return f"job {job['id']} {job['status']}: {shown['error']}\n{shown.get('stderr_tail') or ''}"


def test_a_search_waits_out_another_process_holding_the_sqlite_write_lock(env):
    """Workers share one SQLite file for the queue and the studies: a write lock held longer than sqlite3's
    default 5 s wait (a busy disk) delays a trial instead of failing the search with `database is locked`."""
    path = env / "optuna.db"
    search = Search(PipelineSpec.from_dict(spec_with(SEARCH)), f"sqlite:///{path}", trials=1, echo=lambda line: None)
    locked, held = threading.Event(), 6.0
    def hold_the_write_lock() -> None:
        with closing(sqlite3.connect(path, isolation_level=None)) as other:
            other.execute("BEGIN IMMEDIATE")
            locked.set()
            time.sleep(held)
            other.execute("COMMIT")
    trial = search.study.ask()
    holder = threading.Thread(target=hold_the_write_lock)
    holder.start()
    locked.wait()
    start = time.monotonic()
    trial.set_user_attr("mlflow_run_id", "r")  # Optuna retries creating a trial, but not this, a report or a tell
    waited = time.monotonic() - start
    holder.join()
    assert search.study.trials[0].user_attrs == {"mlflow_run_id": "r"} and waited > 0.8 * held
    search.lease.acquire()  # the platform's own engine waits just as long
    search.lease.release()


def test_two_workers_on_one_study_finish_exactly_the_requested_trials(tmp_path, db_url, new_mlflow_store):
    """On PostgreSQL the space has two dimensions: trial 0 alone, then its three Sobol points as one wave, which the
    worker that takes it trains together (issue 52: workers hand out waves, not single trials)."""
    waves = db_url.startswith("postgresql")
    space = {**SEARCH["space"], "stages.1.local.lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True}}
    path = write_pipeline(tmp_path, {**TINY, "search": {**SEARCH, "space": space} if waves else SEARCH}, "tiny.yaml")
    for _ in range(2):
        code, output = cli("submit", str(path), "--search", "--trials", "4", "--db", db_url)
        assert code == 0, output
    store = new_mlflow_store(tmp_path)
    workers = [_worker(db_url, store, tmp_path) for _ in range(2)]
    logs = [w.communicate(timeout=600)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), logs
    jobs = _jobs(db_url)
    assert [j["status"] for j in jobs] == ["succeeded", "succeeded"], [_job_output(db_url, j) for j in jobs]
    assert len({j["worker"] for j in jobs}) == 2
    trials = optuna.load_study(study_name="small", storage=db_url).get_trials()
    assert len(trials) == 4 and all(t.state.name == "COMPLETE" for t in trials)
    assert len({t.params["stages.1.params.lr_v"] for t in trials}) == 4  # no point evaluated twice
    if waves:
        told = [line for j in jobs for line in json.loads(cli("jobs", "show", str(j["id"]), "--db", db_url,
                                                              "--json")[1])["stdout_tail"].splitlines()
                if line.startswith("trial ")]
        assert len(told) == 4 and sum(line.endswith("in a wave of 3") for line in told) == 3, told


def test_a_worker_killed_mid_trial_has_its_trial_retried(tmp_path, new_mlflow_store):
    db = f"sqlite:///{tmp_path}/platform.db"
    # Rounds reach MLflow up to a second apart (RoundMetrics.flush_seconds), and a second is ~100 of these rounds
    # here: the kill comes when the pretrain stage's rounds are written (at its end), not at a later flush.
    rounds = 300
    slow = {**TINY, "evaluation": {"every": 10_000},
            "stages": [{**SMALL["stages"][0], "rounds": 2}, {**SMALL["stages"][1], "rounds": rounds}]}
    code, output = cli("submit", str(write_pipeline(tmp_path, slow, "slow.yaml")), "--search", "--trials", "1",
                       "--db", db)
    assert code == 0, output
    store = new_mlflow_store(tmp_path)
    victim = _worker(db, store, tmp_path, grace=2, heartbeat=0.5)

    def rounds_logged() -> int:
        """Rounds the trial has logged so far (read-only SQL, polled cheaply)."""
        try:
            with closing(sqlite3.connect(f"file:{tmp_path / 'mlflow.db'}?mode=ro", uri=True)) as reader:
                return reader.execute("SELECT COUNT(*) FROM metrics WHERE key = 'train_loss'").fetchone()[0]
        except sqlite3.OperationalError:  # locked by a write: ask again at the next poll
            return 0

    deadline = time.monotonic() + 120
    while rounds_logged() < 2 and time.monotonic() < deadline:  # the pretrain stage is over: the trial is mid-way
        time.sleep(0.05)
    victim.kill()  # SIGKILL: the worker and (PDEATHSIG) its `fedpilot search` child die mid-trial
    victim.wait()
    assert rounds_logged() < 2 + rounds, "the trial finished before its worker was killed"
    time.sleep(2.5)  # past the grace period (2 s) since the last heartbeat: the job counts as abandoned
    survivor = _worker(db, store, tmp_path, grace=2, heartbeat=0.5)
    log = survivor.communicate(timeout=600)[0]
    assert survivor.returncode == 0, log
    [job] = _jobs(db)
    assert job["status"] == "succeeded" and job["attempts"] == 2, job
    trials = optuna.load_study(study_name="small", storage=db).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[1].system_attrs["failed_trial"] == trials[0].number and trials[1].params == trials[0].params
    client = MlflowClient(store)  # no run is left RUNNING by the dead processes
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    dead = client.get_run(trials[0].user_attrs["mlflow_run_id"])
    assert dead.info.status == "KILLED" and "heartbeat" in dead.data.tags["fedpilot.error"]
    assert not [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    assert client.get_run(job["run_id"]).info.status == "FINISHED"  # the search run


def test_multi_objective_search_records_a_pareto_front_and_the_time_budget_stops_it(env):
    search = {**SEARCH,
              "space": {"personalization": {"type": "categorical", "choices": ["output_layer", "input_layer"]}},
              "objective": [{"metric": "val_acc_weighted", "direction": "maximize"},
                            {"metric": "personal_bytes_per_client", "direction": "minimize"}],
              "sampler": {"kind": "nsga2", "seed": 0}}
    spec = PipelineSpec.from_dict({**spec_with(search), "stages": TINY["stages"], "tracking": PLOTTED["tracking"]})
    result = Search(spec, f"sqlite:///{env}/optuna.db", trials=3, echo=lambda line: None).run()
    assert result.finished == 3 and result.pruned == 0
    client = MlflowClient()
    names = {a.path for a in client.list_artifacts(result.run_id)} | {
        a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert {"pareto_front.json", "plots/pareto_front.png"} <= names
    expected = {"output_layer": (32 + 1) * 10 * 4, "input_layer": (64 + 1) * 32 * 4}  # of the 64-32-10 MLP
    for trial in optuna.load_study(study_name="small", storage=f"sqlite:///{env}/optuna.db").get_trials():
        assert trial.values[1] == expected[trial.params["personalization"]]

    budget = PipelineSpec.from_dict({**spec_with({**SEARCH, "timeout_s": 0.5}), "stages": TINY["stages"]})
    timed = Search(budget, f"sqlite:///{env}/budget.db", trials=50, echo=lambda line: None).run()
    assert 1 <= timed.finished < 50  # a trial started before the deadline finishes, then the search stops


@pytest.mark.parametrize("kind", ["tpe", "random", "nsga2"])
def test_the_largest_sampler_seed_still_seeds_a_sampler_for_every_trial(kind):
    """Optuna's samplers seed numpy's RandomState (0 to 2**32 - 1): seed + the trial count wraps around."""
    spec = PipelineSpec.from_dict(spec_with({**SEARCH, "sampler": {"kind": kind, "seed": SEED_MAX}}))
    for offset in (0, 1, 10**6):
        make_sampler(spec, offset)


@pytest.mark.parametrize("kind", ["tpe", "random"])
def test_a_study_stopped_inside_a_trial_and_resumed_draws_what_it_draws_uninterrupted(kind):
    """The same four trials told to two studies, in one of them the second stopped inside (failed and retried with
    its parameters by the path a stop takes, fail_interrupted), then resumed (the retry first): the next draw is the
    same point in both. Seeded by the plain trial count it was not (the shift set's Self-FL study, stopped once, chose
    another step size than uninterrupted and changed the verdict)."""
    quiet_optuna()
    spec = PipelineSpec.from_dict(spec_with({**SEARCH, "sampler": {"kind": kind, "seed": 0}}))
    (key, param), = spec.search.space.items()
    told = [(0.003, 0.50), (0.05, 0.61), (0.2, 0.40), (0.01, 0.55)]

    def tell(study: optuna.Study, point: float, value: float) -> None:
        study.enqueue_trial({key: point})
        trial = study.ask()
        suggest(trial, key, param)
        study.tell(trial, value)

    def next_point(study: optuna.Study, offset: int) -> float:
        study.sampler = make_sampler(spec, offset, startup=1)
        return suggest(study.ask(), key, param)

    whole, stopped = optuna.create_study(direction="maximize"), optuna.create_study(direction="maximize")
    for point, value in told:
        tell(whole, point, value)
    tell(stopped, *told[0])
    stopped.enqueue_trial({key: told[1][0]})
    fail_interrupted(stopped, stopped.ask()._trial_id, caught=False)  # FAIL, and a WAITING retry
    retry = stopped.ask()  # resumed: the waiting retry first, with its parameters
    assert suggest(retry, key, param) == told[1][0]
    stopped.tell(retry, told[1][1])
    for point, value in told[2:]:
        tell(stopped, point, value)
    assert [t.state.name for t in stopped.trials] == ["COMPLETE", "FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]
    assert draws_before(stopped.trials) == draws_before(whole.trials) == 4
    first = next_point(whole, draws_before(whole.trials))
    assert next_point(stopped, draws_before(stopped.trials)) == first
    assert next_point(stopped, len(stopped.trials) - 1) != first  # the trial count (5 told): another point


def test_the_default_pruner_keeps_a_noisy_near_twin_of_the_best_and_prunes_a_clear_loser():
    """The case of issue 43: PFLEGO on the shift set, 50 pretraining rounds then 40 tuned ones evaluated every 10.
    Optuna's median pruner with 2 startup trials and no warm-up prunes a near-twin of the best trial at its first
    evaluation (0.811 at round 60, where it is noisy); the default (warm-up to half the tuned rounds, a margin of
    twice the noise between two seeds of trial 0) keeps it, and still prunes a configuration clearly worse at every
    evaluation."""
    from fedpilot.studies.pruner import MarginPruner, seed_margin

    finished = [{60: 0.830, 70: 0.824, 80: 0.840, 90: 0.844},  # the best trial: rho 0.125, beta 0.269
                {60: 0.822, 70: 0.834, 80: 0.829, 90: 0.838},
                {60: 0.828, 70: 0.836, 80: 0.831, 90: 0.842}]
    noise = {"2": [[60, 0.830], [70, 0.824], [80, 0.840], [90, 0.844]],  # trial 0's second seed: about 0.005 off
             "3": [[60, 0.825], [70, 0.830], [80, 0.834], [90, 0.849]]}
    twin = {60: 0.811, 70: 0.826, 80: 0.832, 90: 0.843}  # rho 0.126, beta 0.261: noisy at its first evaluation
    loser = {60: 0.70, 70: 0.72, 80: 0.73, 90: 0.74}
    assert pruned_at(optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0), study_with(finished),
                      twin) == 60  # what happened by hand
    spec = PipelineSpec.from_dict({**spec_with({**SEARCH, "trials": 6, "pruner": {"kind": "median"}}), "stages": [
        {**SMALL["stages"][0], "rounds": 50}, {**SMALL["stages"][1], "rounds": 40}]})
    pruner = make_pruner(spec, 6)
    assert isinstance(pruner, MarginPruner) and (pruner.startup, pruner.warmup, pruner.margin) == (2, 70, None)
    assert seed_margin(study_with(finished, noise=noise).get_trials()) == pytest.approx(0.0111, abs=1e-4)
    assert pruned_at(pruner, study_with(finished, noise=noise), twin) is None
    assert pruned_at(pruner, study_with(finished, noise=noise), loser) == 70
    assert pruned_at(pruner, study_with(finished), loser) is None  # no noise measured yet: no pruning
    assert pruned_at(pruner, study_with(finished[:1], noise=noise), loser) is None  # below the startup
    assert pruned_at(make_pruner(spec, 20), study_with(finished, noise=noise), loser) is None  # 7 startup ones
