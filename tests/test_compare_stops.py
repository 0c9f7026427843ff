"""A tuned comparison stopped inside the last trial of a study (issue 51): Ctrl+C fails the trial and retries it
with its parameters at once, kill -9 leaves it to go stale; either way the same command again finishes the study
and every run, and no trial stays RUNNING for ever."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import optuna
import pytest
import yaml
from mlflow import MlflowClient

from fedpilot.tracking import COMPARE_RUN_TAG, STAGE_INDEX_TAG, STUDY_TAG, TRIAL_TAG
from pipeline_fixtures import cli, run_id_of, write_pipeline
from tuning_fixtures import TUNED_BASE

# The first study's trials are long enough to be stopped inside: the stop is sent within a poll (0.1 s and the
# queries) of the tuned stage's start, and its 100 rounds take 1.4 s on a 2-core Xeon; the rest stays short.
SLOW = {**TUNED_BASE, "name": "base", "stages": [TUNED_BASE["stages"][0], {**TUNED_BASE["stages"][1], "rounds": 100}]}
OTHER = {**TUNED_BASE, "name": "other", "stages": [TUNED_BASE["stages"][0],
                                                   {**TUNED_BASE["stages"][1], "algorithm": "fedalt"}]}


def write_set(folder) -> str:
    write_pipeline(folder, SLOW, "base.yaml")
    write_pipeline(folder, OTHER, "other.yaml")
    comparison = {"name": "pair", "seeds": 2, "pipelines": ["base.yaml", "other.yaml"],
                  "tune": {"trials": 2, "edge_trials": 0, "sampler": {"kind": "random", "seed": 0},
                           "pruner": {"kind": "none"}}}
    (folder / "pair.yaml").write_text(yaml.safe_dump(comparison))
    return str(folder / "pair.yaml")


def training_trial(storage: str, number: int, within: float, proc: subprocess.Popen) -> str:
    """The first study of `storage` once its trial `number` is RUNNING and training its tuned stage, the one after
    the shared pretraining (its stage run exists: the stage has begun), waiting at most `within` seconds."""
    deadline, client = time.monotonic() + within, MlflowClient()
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = optuna.get_all_study_names(storage)
        except Exception:  # the storage's tables do not exist yet
            names = []
        for name in names:
            trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
            if len(trials) > number and trials[number].state == optuna.trial.TrialState.RUNNING and stage_begun(
                    client, name, number):
                return name
        time.sleep(0.1)
    raise AssertionError(f"no trial {number} trained within {within} s ({proc.poll()=})")


def stage_begun(client: MlflowClient, study: str, number: int) -> bool:
    """Whether trial `number` of `study` has a run for its stage 1 (the stage after the shared pretraining)."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    trial = client.search_runs(experiments, f"tags.`{TRIAL_TAG}` = '{number}' and tags.`{STUDY_TAG}` = '{study}'")
    return any(client.search_runs(experiments, f"tags.`mlflow.parentRunId` = '{run.info.run_id}' and "
                                               f"tags.`{STAGE_INDEX_TAG}` = '1'") for run in trial)


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_comparison_stopped_inside_the_last_trial_of_a_study_runs_again_to_the_end(workdir, stop):
    """Ctrl+C (or kill -9) once the last trial of the first study trains: that trial does not stay RUNNING for ever
    (a stop fails it and retries it with its parameters at once; a dead process's trial goes stale and is retried
    by whoever opens the study next), so the same command again finishes the study and every run."""
    storage = f"sqlite:///{workdir}/studies.db"
    command = ["compare", write_set(workdir), "--storage", storage, "--heartbeat-seconds", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "fedpilot.cli", *command], cwd=workdir, env=os.environ.copy(),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        study_name = training_trial(storage, number=1, within=300, proc=proc)
        assert proc.poll() is None, "the comparison ended before it could be stopped"
    finally:
        os.kill(proc.pid, stop)
        _, stderr = proc.communicate(timeout=120)
    stopped = optuna.load_study(study_name=study_name, storage=storage).get_trials(deepcopy=False)[1]
    assert stopped.state == optuna.trial.TrialState.FAIL if stop == signal.SIGINT else stopped.state.name in (
        "RUNNING", "FAIL"), (stopped.state, stderr[-3000:])
    code, output = cli(*command)  # the same command again, here (what it finds is what the stopped one left)
    assert code == 0, output[-3000:]
    trials = optuna.load_study(study_name=study_name, storage=storage).get_trials(deepcopy=False)
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 2 and finished[-1].params == stopped.params  # the stopped trial, retried
    assert not any(t.state == optuna.trial.TrialState.RUNNING for t in trials)
    client, run_id = MlflowClient(), run_id_of(output)
    runs = client.search_runs([client.get_run(run_id).info.experiment_id], f"tags.`{COMPARE_RUN_TAG}` = '{run_id}'")
    assert sorted((r.data.tags["fedpilot.pipeline"], r.data.tags["fedpilot.seed"]) for r in runs
                  if r.info.status == "FINISHED") == [(p, s) for p in ("base", "other") for s in ("0", "1")]
