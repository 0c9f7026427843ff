"""`fedpilot compare --tune N` (issue 43): every pipeline, baseline included, gets one Optuna study of exactly N
finished trials on the validation split of tuning seeds the comparison never judges on, trial 0 the pipeline as
written; then each best configuration runs on the comparison's seeds. The test split is never read while tuning; a
killed comparison run again finishes every run once; bad input is refused before anything exists."""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import optuna
import pytest
import yaml
from mlflow import MlflowClient

from fedpilot.client_effects import participating
from fedpilot.compare.work import COMPARE_RUN_TAG, VARIANT_TAG
from fedpilot.report.runs import clients_frame
from pipeline_fixtures import cli, run_id_of, write_pipeline
from tuning_fixtures import TUNED_BASE

ROOT = Path(__file__).resolve().parents[1]
BASE = TUNED_BASE
OTHER = {**BASE, "name": "other", "stages": [BASE["stages"][0], {**BASE["stages"][1], "algorithm": "fedalt"}]}


def write_set(folder: Path, **tune) -> str:
    write_pipeline(folder, {**BASE, "name": "base"}, "base.yaml")
    write_pipeline(folder, OTHER, "other.yaml")
    comparison = {"name": "pair", "seeds": 2, "pipelines": ["base.yaml", "other.yaml"],
                  "tune": {"trials": 3, "sampler": {"kind": "random", "seed": 0}, **tune}}
    (folder / "pair.yaml").write_text(yaml.safe_dump(comparison))
    return str(folder / "pair.yaml")


def recorded(client: MlflowClient, run_id: str, folder: Path) -> dict:
    return json.loads(Path(client.download_artifacts(run_id, "comparison.json", str(folder))).read_text())


@pytest.fixture(scope="module")
def tuned_pair(tmp_path_factory, new_mlflow_store) -> tuple[Path, str, str, str]:
    """One tuned comparison of the pair (no trials beyond an edge, `batch: 1`, and `--untuned`) in a folder
    with its own stores, which several tests read: (folder, its tracking URI, its study storage, the output)."""
    folder = tmp_path_factory.mktemp("pair")
    uri, storage = new_mlflow_store(folder), f"sqlite:///{folder}/studies.db"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("FEDPILOT_CACHE", str(folder / "cache"))
        code, output = cli("compare", write_set(folder, edge_trials=0, batch=1), "--untuned", "--storage", storage)
    assert code == 0, output
    return folder, uri, storage, output


def test_every_pipeline_gets_n_trials_on_seeds_the_comparison_does_not_judge_on(tuned_pair):
    workdir, uri, storage, output = tuned_pair
    client, run_id = MlflowClient(uri), run_id_of(output)
    record = recorded(client, run_id, workdir)
    assert record["tuning_seeds"] == [2] and record["seeds"] == [0, 1] and record["objective"] == "val_acc_mean"
    experiment = client.get_run(run_id).info.experiment_id
    for pipeline, keys in (("base", {"stages.1.local.lr"}),
                           ("other", {"stages.1.params.lr_u", "stages.1.params.lr_v"})):
        study = optuna.load_study(study_name=record["tuning"][pipeline]["study"], storage=storage)
        trials = study.get_trials(states=(optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED))
        assert len(trials) == 3 and set(trials[0].params) == keys  # exactly N finished: an equal budget
        assert trials[0].params == {k: 0.05 for k in keys}  # trial 0: the pipeline as written
        assert study.metric_names == ["val_acc_mean"] and study.user_attrs["mlflow_comparison_run"] == run_id
        search = client.search_runs([experiment], f"tags.`fedpilot.search` = '{study.study_name}'")[0]
        assert search.data.tags["mlflow.parentRunId"] == run_id
        trial_seeds = {(r.data.tags["fedpilot.trial"], r.data.tags["fedpilot.seed"]) for r in client.search_runs(
            [experiment], f"tags.mlflow.parentRunId = '{search.info.run_id}'")}
        # the tuning seed only, and trial 0 on the noise seed (the pruner's margin), which no comparison judges on
        assert trial_seeds == {("0", "2"), ("1", "2"), ("2", "2"), ("0", "3")}
        chosen = {k.removeprefix(f"tuned.{pipeline}."): float(v) for k, v in client.get_run(run_id).data.tags.items()
                  if k.startswith(f"tuned.{pipeline}.")}
        assert chosen == pytest.approx(study.best_params)
    finals = client.search_runs([experiment], f"tags.`{COMPARE_RUN_TAG}` = '{run_id}'")
    assert sorted((r.data.tags["fedpilot.pipeline"], r.data.tags[VARIANT_TAG], r.data.tags["fedpilot.seed"])
                  for r in finals) == sorted((p, v, s) for p in ("base", "other") for v in ("tuned", "written")
                                             for s in ("0", "1"))  # judged on seeds 0 and 1 only
    metrics = client.get_run(run_id).data.metrics
    assert metrics["other/tune_trials"] == 3 and metrics["base/tune_best"] == pytest.approx(
        max(record["tuning"]["base"]["values"]))
    history = [m.value for m in client.get_metric_history(run_id, "base/tune_best_so_far")]
    assert len(history) == 3 and history == sorted(history)
    written = [record_of(client, experiment, run_id, "other", "written", seed) for seed in (0, 1)]
    assert metrics["other.untuned.test_acc_mean.mean"] == pytest.approx(np.mean(written))
    assert "untuned test_acc_mean" in output and "tuning: one study per pipeline" in output
    assert "more.params.lr_u=" in output and "more.local.lr=" in output  # keys as stage name and whole key
    trial_names = {r.info.run_name for r in client.search_runs([experiment], "tags.`fedpilot.trial` = '0'")}
    assert "base trial 0: more.local.lr=0.05 seed 2" in trial_names
    # the winner's curse: the study's best on the tuning seed against the choice's validation on seeds 0 and 1
    for pipeline in ("base", "other"):
        reruns = [validation_of(client, experiment, run_id, pipeline, seed) for seed in (0, 1)]
        assert [record["validation"][pipeline][str(s)] for s in (0, 1)] == pytest.approx(reruns)
        gap = record["optimism"][pipeline]
        assert gap["tuning"] == record["tuning"][pipeline]["best"] and gap["seeds"] == 2
        assert gap["optimism"] == pytest.approx(gap["tuning"] - np.mean(reruns), abs=1e-6)  # the table: float32
        assert metrics[f"{pipeline}/tune_optimism"] == pytest.approx(gap["optimism"])
    assert "the baseline is base, the set's first pipeline" in output  # the set names none
    page = Path(client.download_artifacts(run_id, "report.html", str(workdir))).read_text()
    for title in ("Paired difference with base", "Tuning: the best value against the trials",
                  "Tuning: what each study chose"):
        assert title in page
    assert "<pre>" not in page.split("Paired difference")[0]  # the table is an HTML table


def unit_run(client: MlflowClient, experiment: str, run_id: str, pipeline: str, variant: str, seed: int):
    """One of the comparison's runs: `variant` of `pipeline` on `seed`."""
    return client.search_runs([experiment], f"tags.`{COMPARE_RUN_TAG}` = '{run_id}' and tags.`{VARIANT_TAG}` = "
                              f"'{variant}' and tags.`fedpilot.pipeline` = '{pipeline}' and tags.`fedpilot.seed` = "
                              f"'{seed}'")[0]


def record_of(client: MlflowClient, experiment: str, run_id: str, pipeline: str, variant: str, seed: int) -> float:
    """The final test mean of one of the comparison's runs."""
    return unit_run(client, experiment, run_id, pipeline, variant, seed).data.metrics["final_test_acc_mean"]


def validation_of(client: MlflowClient, experiment: str, run_id: str, pipeline: str, seed: int) -> float:
    """The mean over a tuned run's clients of their validation accuracy at its last stage's end, from its per-client
    table: what the study's objective (val_acc_mean) measures, recomputed."""
    run = unit_run(client, experiment, run_id, pipeline, "tuned", seed)
    stages = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{run.info.run_id}'")
    last = max(stages, key=lambda r: int(r.data.tags["fedpilot.stage_index"]))
    return float(participating(clients_frame(client, last.info.run_id))["val_acc"].mean())


def test_the_choice_is_the_same_when_the_test_split_reads_as_garbage_while_tuning(tuned_pair, workdir, monkeypatch):
    """Tuned twice into two stores (the first: `tuned_pair`): the second time every test metric of every trial is
    replaced by random numbers; the studies choose the same values, so tuning never read the test split."""
    import fedpilot.pipeline.runner as runner_module
    import fedpilot.tuning as tuning

    _, uri, _, output = tuned_pair
    first = {k: v for k, v in MlflowClient(uri).get_run(run_id_of(output)).data.tags.items() if k.startswith("tuned.")}
    assert first
    set_file = write_set(workdir, edge_trials=0, batch=1)  # the same set
    real, tuning_now = runner_module.stage_record, []
    noise = np.random.default_rng(0)

    def garbled(*args, **kwargs):
        report = real(*args, **kwargs)
        if tuning_now:
            report.metrics.update({k: float(noise.random()) for k in report.metrics if k.startswith("test_")})
        return report

    def while_marked(method):  # a lone trial, or a wave of them
        def call(self, *args, **kwargs):
            tuning_now.append(True)
            try:
                return method(self, *args, **kwargs)
            finally:
                tuning_now.pop()
        return call

    monkeypatch.setattr(runner_module, "stage_record", garbled)
    monkeypatch.setattr(tuning.Search, "_trained", while_marked(tuning.Search._trained))
    monkeypatch.setattr(tuning.Search, "_batch", while_marked(tuning.Search._batch))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/second.db")
    monkeypatch.setenv("FEDPILOT_CACHE", str(workdir / "second-cache"))
    code, output = cli("compare", set_file, "--storage", f"sqlite:///{workdir}/second.db.studies")
    assert code == 0, output
    second = {k: v for k, v in MlflowClient(f"sqlite:///{workdir}/second.db").get_run(run_id_of(output)).data.tags
              .items() if k.startswith("tuned.")}
    assert second == first


def test_the_cost_script_splits_a_comparisons_time_into_studies_and_reruns(tuned_pair, capsys):
    """bench/compare_cost.py on the pair: every stage run counted once in its part (the studies: 4 trial runs of each
    pipeline, the noise seed's included; the reruns: each pipeline on seeds 0 and 1, tuned and as written); the shared
    first stage trained once per seed (2, 3, 0, 1) and taken from the cache everywhere else; the parts' wall time
    within the comparison's; each pipeline's study and reruns, in the order the comparison took them."""
    _, uri, _, output = tuned_pair
    spec = importlib.util.spec_from_file_location("compare_cost", ROOT / "bench" / "compare_cost.py")
    compare_cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare_cost)
    client = MlflowClient(uri)
    assert compare_cost.latest_comparison(client) == run_id_of(output)
    figures = compare_cost.cost(client, run_id_of(output))
    rows = {(row["part"], row["stages"]): row for row in figures["rows"]}
    runs = {key: row["trained"] + row["cached"] for key, row in rows.items()}
    assert runs == {("studies", "first stage"): 8, ("studies", "later stages"): 8,
                    ("reruns, tuned", "first stage"): 4, ("reruns, tuned", "later stages"): 4,
                    ("reruns, as written", "first stage"): 4, ("reruns, as written", "later stages"): 4}
    assert sum(row["trained"] for (_, stages), row in rows.items() if stages == "first stage") == 4
    assert rows["studies", "later stages"]["trained"] == 8  # no two trials alike: none from the cache
    first_rounds = TUNED_BASE["stages"][0]["rounds"]
    assert sum(row["rounds"] for (_, stages), row in rows.items() if stages == "first stage") == 4 * first_rounds
    assert 0 < figures["in_stages_s"] <= figures["wall_s"]
    assert all(row["wall_s"] <= figures["in_stages_s"] + 1e-9 for row in figures["rows"])
    assert figures["in_stages_s"] <= sum(row["wall_s"] for row in figures["rows"]) + 1e-9
    assert [row["pipeline"] for row in figures["pipelines"]] == ["base", "other"]  # in the order they ran
    assert all(row["study_s"] > 0 and row["reruns_s"] > 0 for row in figures["pipelines"])
    assert sum(row["study_s"] + row["reruns_s"] for row in figures["pipelines"]) <= figures["wall_s"]
    compare_cost.print_cost(figures)
    printed = capsys.readouterr().out
    assert f"comparison {run_id_of(output)}:" in printed and "outside stages" in printed


@pytest.mark.slow
def test_a_killed_comparison_run_again_finishes_every_run_once(workdir):
    """kill -9 once a final run has finished; the same command again goes on from there (its study, its finished
    runs): every (pipeline, seed) ends with one finished run, the killed one's run KILLED, each study N trials."""
    set_file, storage = write_set(workdir), f"sqlite:///{workdir}/studies.db"
    command = [sys.executable, "-m", "fedpilot.cli", "compare", set_file, "--storage", storage,
               "--heartbeat-seconds", "1"]
    proc = subprocess.Popen(command, cwd=workdir, env=os.environ.copy(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    client = MlflowClient()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and not finished_units(client):
            time.sleep(0.2)
        assert proc.poll() is None, "the comparison ended before it could be killed"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    killed_after = len(finished_units(client))
    code, output = cli("compare", set_file, "--storage", storage, "--heartbeat-seconds", "1")
    assert code == 0, output
    run_id = run_id_of(output)
    runs = client.search_runs([client.get_run(run_id).info.experiment_id], f"tags.`{COMPARE_RUN_TAG}` = '{run_id}'")
    finished = [(r.data.tags["fedpilot.pipeline"], r.data.tags["fedpilot.seed"]) for r in runs
                if r.info.status == "FINISHED" and r.data.tags[VARIANT_TAG] == "tuned"]
    assert sorted(finished) == [(p, s) for p in ("base", "other") for s in ("0", "1")], finished
    assert all(r.info.status in ("FINISHED", "KILLED") for r in runs) and killed_after >= 1
    record = recorded(client, run_id, workdir)
    for name, study in record["tuning"].items():  # N, and those beyond an edge its best lay near
        assert study["trials"] == 3 + record["study_facts"][name]["beyond_edge"]


def finished_units(client: MlflowClient) -> list:
    experiment = client.get_experiment_by_name("pair")
    if experiment is None:
        return []
    return [r for r in client.search_runs([experiment.experiment_id], f"tags.`{COMPARE_RUN_TAG}` != ''")
            if r.info.status == "FINISHED"]


@pytest.mark.parametrize(("args", "tune", "message"), [
    (["--tune", "0"], {}, "--tune=0: must be from 1"),
    ([], {"objective": "test_acc_mean"}, "tune.objective='test_acc_mean': tuning reads the validation split only"),
    ([], {"seeds": [1, 7]}, "tune.seeds=[1, 7]: overlap the comparison's seeds ([1])"),
    ([], {"trials": 0}, "tune.trials=0"),
    (["--untuned", "--seeds", "2"], {"trials": 2, "untuned": True, "pruner": {"kind": "fast"}}, "tune.pruner.kind"),
    ([], {"splits": "redraw"}, "tune.splits='redraw': base: "),  # each seed its own federation: test samples leak
    ([], {"space": {"other": {"stages.1.params.lr_u": {"type": "float", "low": 0.1, "high": 1, "log": True}}},
          "widen": False}, "tune.space.other.stages.1.params.lr_u={'type': 'float', 'low': 0.1, 'high': 1.0, 'log': "
                           "True}: leaves out the pipeline's value 0.05"),
    ([], {"space": {"nope": {"stages.1.local.lr": {"type": "float", "low": 0.1, "high": 1}}}},
     "tune.space.nope='nope': not the name of a pipeline of the set"),
    ([], {"edge_trials": -1}, "tune.edge_trials=-1"),
    ([], {"batch": 0}, "tune.batch=0"),
    ([], {"trials": -3}, "tune.trials=-3"),
    ([], {"budget": "everything"}, "tune.budget='everything'"),
])
def test_bad_tuning_exits_2_and_creates_nothing(workdir, args, tune, message):
    set_file = write_set(workdir, **tune)
    before = sorted(p.name for p in workdir.iterdir())
    code, output = cli("compare", set_file, *args, "--storage", f"sqlite:///{workdir}/studies.db")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output and sorted(p.name for p in workdir.iterdir()) == before


def test_a_pipeline_whose_algorithm_declares_nothing_tunable_is_refused(workdir, monkeypatch):
    from fedpilot.algorithms import ALGORITHMS

    monkeypatch.setattr(ALGORITHMS["fedalt"], "tunable", {})
    set_file = write_set(workdir)
    before = sorted(p.name for p in workdir.iterdir())
    code, output = cli("compare", set_file, "--storage", f"sqlite:///{workdir}/studies.db")
    assert code == 2 and "pipelines.1 (other.yaml): stages.1.algorithm='fedalt': declares nothing tunable" in output
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_the_shipped_sets_tune_every_pipeline_after_their_shared_pretraining():
    """Every pipeline of the benchmark sets gets a study over what its algorithms declare, in the stages after the
    FedAvg pretraining they all share; the tuning seed is not a comparison seed."""
    from fedpilot.compare.plan import load_plan

    for name in ("shift", "shakespeare", "shift-pfedgate", "digits-k2"):
        plan = load_plan(ROOT / "pipelines" / "compare" / f"{name}.yaml", tune=8)
        assert plan.shared == 1, name
        assert not set(plan.comparison.tuning_seeds()) & set(plan.seeds), name
        for pipeline, spec in plan.tuning.items():
            stages = {int(key.split(".")[1]) for key in spec.search.space}
            assert stages and min(stages) >= 1 and spec.search.trials == 8, (name, pipeline)


@pytest.mark.slow
def test_two_queue_workers_record_the_same_table_as_one_process(workdir, monkeypatch):
    """`--to queue --parallel 2` makes the comparison's run and two jobs; two workers share its studies and runs,
    the last records the table, and it is the table one process records (seeded, no pruning: which trial finishes
    first would decide what is pruned; `batch: 1`: each trial's rows on their own, bit for bit a lone trial's, where
    a wider span is a lone trial's to float tolerance)."""
    pinned = [{**stage, "execution": "vmap"} for stage in BASE["stages"]]
    write_pipeline(workdir, {**BASE, "name": "base", "stages": pinned}, "base.yaml")
    write_pipeline(workdir, {**OTHER, "stages": [pinned[0], {**pinned[1], "algorithm": "fedalt"}]}, "other.yaml")
    comparison = {"name": "pair", "seeds": 2, "pipelines": ["base.yaml", "other.yaml"],
                  "tune": {"trials": 3, "sampler": {"kind": "random", "seed": 0}, "pruner": {"kind": "none"},
                           "batch": 1}}
    (workdir / "pair.yaml").write_text(yaml.safe_dump(comparison))
    code, output = cli("compare", str(workdir / "pair.yaml"), "--storage", f"sqlite:///{workdir}/one.db")
    assert code == 0, output
    alone = output.split("\n\n", 1)[1].split("\nbrowse")[0]
    queue = workdir / "queue"
    queue.mkdir()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{queue}/mlflow.db", "FEDPILOT_CACHE": str(queue / "cache"),
           "FEDPILOT_DB": f"sqlite:///{queue}/fedpilot.db"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, output = cli("compare", str(workdir / "pair.yaml"), "--to", "queue", "--parallel", "2")
    assert code == 0, output
    assert len(output.strip().splitlines()[-1].split()) == 2  # the two job ids
    workers = [subprocess.Popen([sys.executable, "-m", "fedpilot.cli", "worker", "--exit-when-idle",
                                 "--poll-seconds", "0.2", "--heartbeat-seconds", "1"], cwd=queue, env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for worker in workers:
        assert worker.wait(timeout=600) == 0, worker.stderr.read()
    run_id = re.search(r"run ([0-9a-f]{32})", output).group(1)
    code, output = cli("compare", "--resume", run_id)
    assert code == 0, output
    assert output.split("\n\n", 1)[1].split("\nbrowse")[0] == alone
    from fedpilot.db import connect
    from fedpilot.jobs.queue import list_jobs

    jobs = list_jobs(connect(env["FEDPILOT_DB"]))
    assert [(j["kind"], j["status"], j["run_id"]) for j in jobs] == [("compare", "succeeded", run_id)] * 2


def test_compare_to_slurm_without_slurm_exits_2_and_creates_nothing(workdir, monkeypatch):
    monkeypatch.setenv("PATH", str(workdir / "no-slurm-here"))
    set_file = write_set(workdir)
    before = sorted(p.name for p in workdir.iterdir())
    code, output = cli("compare", set_file, "--to", "slurm", "--storage", f"sqlite:///{workdir}/studies.db")
    assert code == 2 and "error: --to='slurm': Slurm's `sbatch` is not on PATH" in output, output
    assert sorted(p.name for p in workdir.iterdir()) == before


def alive(*kinds: type) -> dict[str, int]:
    """How many objects of each of `kinds` the process holds, by name, when any: after full collections until one
    frees nothing (a finalizer run by one may let go of a cycle the next one frees: garbage, not held)."""
    while gc.collect():
        pass
    counts = Counter(kind.__name__ for obj in gc.get_objects() for kind in kinds if isinstance(obj, kind))
    return dict(counts)


def test_nothing_of_a_finished_run_trial_or_study_stays_in_the_process(workdir, monkeypatch):
    """A tuned comparison's memory is bounded by one pipeline's: once a trial or a run has finished, no runner,
    stage, trainer or model parameter of it is alive, nor left for the garbage collector when the next run starts
    training; once the comparison has finished, no search or study either, and no figure."""
    import lightning as L
    from matplotlib import pyplot as plt

    import fedpilot.compare.work as work
    import fedpilot.tuning as tuning
    from fedpilot.engine.stage import FederatedStage
    from fedpilot.pipeline.runner import PipelineRunner
    from fedpilot.pipeline.trials import PipelineTrials

    held: list[dict[str, int]] = []
    kinds = (PipelineRunner, FederatedStage, L.Trainer)

    def counted(method):
        def call(*args, **kwargs):
            held.append(census(kinds))  # before the next trial or run: what the ones before it left (a pruned
            return method(*args, **kwargs)  # trial's exception holds its stages until it has been handled)
        return call

    left: list[dict[str, int]] = []  # as a run's first stage starts, not collected: what stands under its peak
    stages = PipelineRunner._stages

    def first_stage(self, *args, **kwargs):
        left.append(dict(Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds))))
        return stages(self, *args, **kwargs)

    monkeypatch.setattr(tuning.Search, "_trained", counted(tuning.Search._trained))
    monkeypatch.setattr(tuning.Search, "_batch_on", counted(tuning.Search._batch_on))
    monkeypatch.setattr(work.Work, "_run", counted(work.Work._run))
    monkeypatch.setattr(PipelineRunner, "_stages", first_stage)
    trials_run = PipelineTrials.run

    def wave(self, *args, **kwargs):  # a wave's first stage: its runners built, nothing trained
        left.append(dict(Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds))))
        return trials_run(self, *args, **kwargs)

    monkeypatch.setattr(PipelineTrials, "run", wave)
    before = census((*kinds, tuning.Search, optuna.Study, work.Work))  # what earlier tests in this process hold
    alive_before = dict(Counter(type(o).__name__ for o in gc.get_objects() if isinstance(o, kinds)))
    gc.disable()  # whenever Python's own collector would run: the runner frees what earlier runs left itself
    try:
        code, output = cli("compare", write_set(workdir, batch=1), "--storage", f"sqlite:///{workdir}/studies.db")
    finally:  # each lone trial and each wave counted before it starts
        gc.enable()
    assert code == 0, output
    units = 2 * (2 + 1) + 2 * 2  # per study trial 0 and its noise seed alone, its Sobol wave; 4 runs
    assert held == [{k: v for k, v in before.items() if k in (*(c.__name__ for c in kinds), "parameters")}] * units, \
        (held, before)
    own = Counter(alive_before) + Counter({"PipelineRunner": 1})  # its own runner, nothing left to collect
    waves = Counter(alive_before) + Counter({"PipelineRunner": 1 + 2})  # its base runner and its two trials'
    expected = [dict(own)] * (units - 2) + [dict(waves)] * 2  # in the order the studies and runs come
    assert sorted(map(str, left)) == sorted(map(str, expected)), (left, alive_before)
    assert census((*kinds, tuning.Search, optuna.Study, work.Work)) == before
    assert plt.get_fignums() == []


def census(kinds: tuple[type, ...]) -> dict[str, int]:
    """The objects of `kinds` alive and the model parameters alive (counted, never touched: calling a method of a
    tensor or a module found this way, its storage, kept objects alive in this census's first version). A
    parameterless module, Flatten or ReLU, may outlive its run: the loop executors' worker threads keep the last
    traced graph of the model's layers, which holds no tensor."""
    import torch

    return {**alive(*kinds), "parameters": sum(isinstance(o, torch.nn.Parameter) for o in gc.get_objects())}
