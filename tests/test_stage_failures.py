"""What a stage needs of its split, and stages that cannot go on.

Every built-in algorithm with `personalization: none` (and `all`) is either refused by `validate`, naming the stage,
the algorithm and the fix, or runs to the end. A stage whose training diverges stops at that round: its runs FAILED,
one error line naming the stage, the round and the last finite loss, exit code 1, no `--resume` offered. An algorithm
that asks the engine for empty work, and a round that does not move the stage on, stop the stage instead of crashing
in torch or looping."""

from __future__ import annotations

import copy
import math
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from fedpilot.algorithms import ALGORITHMS, build_algorithm
from fedpilot.api import Algorithm, Upload
from fedpilot.engine.cohort import Cohort
from fedpilot.engine.config import StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.errors import Diverged, NothingToTrain, StageFailed
from fedpilot.testing import TinyMLP, ToyData, fit, stage_for
from pipeline_fixtures import cli, write_pipeline

QUICKSTART = str(Path(__file__).resolve().parents[1] / "pipelines" / "quickstart.yaml")

TINY = {
    "name": "needs",
    "defaults": [{"dataset": "digits"}, {"model": "mlp"}, "_self_"],
    "dataset": {"partition": {"kind": "iid", "clients": 6}},
    "model": {"hidden": [8]},
    "evaluation": {"every": 1},
    "tracking": {"system_metrics": False, "plots": False},
    "stages": [{"name": "pretrain", "algorithm": "fedavg", "rounds": 1, "clients_per_round": 3}],
}


def with_stage(algorithm: str, split: str) -> dict:
    """TINY with a second stage of `algorithm`, one round of one local step, under the pipeline split `split`."""
    spec = copy.deepcopy(TINY)
    spec["personalization"] = split
    spec["stages"].append({"name": "second", "algorithm": algorithm, "rounds": 1, "clients_per_round": 3,
                           "local": {"steps": 1}})
    return spec


@pytest.mark.parametrize("split", ["none", "all"])
def test_every_builtin_algorithm_with_an_empty_part_is_refused_by_validate_or_runs_to_the_end(workdir, split):
    refused, ran = [], []
    for name in ALGORITHMS.builtins:
        path = write_pipeline(workdir, with_stage(name, split), f"{name}-{split}.yaml")
        code, output = cli("validate", str(path))
        if code == 2:
            errors = [line for line in output.splitlines() if line.startswith("error: ")]
            assert len(errors) == 1 and "Traceback" not in output, output
            assert f"stage 'second' ({name})" in errors[0] and ": set personalization to" in errors[0], output
            refused.append(name)
            continue
        assert code == 0, output
        code, output = cli("run", str(path), "--no-progress")
        assert code == 0, (name, output)
        ran.append(name)
    needs = {n: ALGORITHMS[n]({}).needs for n in ALGORITHMS.builtins}
    empty = "personal" if split == "none" else "shared"
    assert sorted(refused) == sorted(n for n in ALGORITHMS.builtins
                                     if empty in needs[n] and ALGORITHMS[n]({}).personal_part is None)
    assert {"fedalt", "fedsim", "fedrep", "pflego"} <= set(refused)
    assert ("finetune" in refused) == (split == "none") and "fedavg" in ran


def test_the_quickstart_without_personal_parameters_is_refused_at_its_fedalt_stage_with_the_fix(workdir):
    code, output = cli("validate", QUICKSTART, "personalization=none")
    assert code == 2, output
    assert "error: personalization='none': stage 'personalize' (fedalt) trains personal parameters" in output
    assert "use fedavg, or finetune with params.part: all" in output


def test_a_split_that_leaves_nothing_shared_names_the_model(workdir):
    spec = with_stage("fedalt", "output_layer")
    spec["model"] = {"name": "logreg"}  # its body is a parameterless Flatten: the head is the whole model
    code, output = cli("validate", str(write_pipeline(workdir, spec)))
    assert code == 2 and "stage 'second' (fedalt) sends shared parameters" in output and "'logreg'" in output, output
    spec["stages"][1]["personalization"] = ["head.bias"]  # one that works: the weights stay shared
    code, output = cli("validate", str(write_pipeline(workdir, spec)))
    assert code == 0, output


def test_an_algorithms_own_part_that_matches_nothing_names_the_algorithm(workdir):
    spec = with_stage("lg_fedavg", "output_layer")
    spec["model"] = {"name": "logreg"}
    code, output = cli("validate", str(write_pipeline(workdir, spec)))
    assert code == 2 and "error: stages.1.algorithm='lg_fedavg': its own personal part" in output, output


# ---- the engine: empty work and rounds that do not move on ------------------------------------------------------
class TrainsPersonal(Algorithm):
    """A plugin-like algorithm that declares no needs and trains its personal part."""

    name = "trains_personal"

    def local_update(self, cohort) -> Upload:
        cohort.personal = cohort.sgd("personal").personal
        return Upload(shared=cohort.sgd("shared").shared)


def stage(algorithm: Algorithm | str, personal: list[str], rounds: int, name: str) -> FederatedStage:
    """A stage of `algorithm` on ToyData and TinyMLP, 3 clients a round."""
    built = build_algorithm(algorithm) if isinstance(algorithm, str) else algorithm
    return stage_for(TinyMLP(), personal, ToyData(), built, StageConfig(rounds=rounds, clients_per_round=3),
                     name=name)


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """A TimeoutError in this thread after `seconds` (a loop that never ends fails the test instead of hanging)."""
    def expire(*_):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_an_algorithm_asking_to_train_an_empty_part_fails_the_stage_by_name(workdir):
    with time_limit(120), pytest.raises(StageFailed, match=r"stage 'mine' \(trains_personal\), round 1: the "
                                        r"algorithm asked to train the 'personal' part"):
        fit(stage(TrainsPersonal(), [], 2, "mine"))


def test_the_cohort_refuses_empty_work_before_any_executor_runs():
    federated = stage(TrainsPersonal(), [], 1, "empty")
    clients = torch.arange(3)
    cohort = Cohort(federated.round_work(0, clients), clients, slice(0, 3), clients, federated.shared_params(), {}, {})
    with pytest.raises(NothingToTrain, match="'personal' part"):
        cohort.sgd("personal")
    with pytest.raises(NothingToTrain, match="'personal' part"):
        cohort.gradient("personal")
    everything = {n: v.expand(3, *v.shape) for n, v in federated.shared_params().items()}
    cohort = Cohort(federated.round_work(0, clients), clients, slice(0, 3), clients, {}, everything, everything)
    with pytest.raises(NothingToTrain, match="'shared' part"):
        cohort.sgd("shared")


def test_a_round_that_does_not_step_the_server_stops_the_stage_instead_of_looping(workdir, monkeypatch):
    stuck = stage("fedavg", [], 3, "stuck")
    monkeypatch.setattr(stuck, "server_step", lambda pseudo_grad: None)  # the round never moves the step on
    with time_limit(120), pytest.raises(StageFailed, match=r"stage 'stuck' .* round 1 of 3 would run again"):
        fit(stuck)


# ---- divergence -----------------------------------------------------------------------------------------------------
def test_a_diverging_run_fails_at_that_round_in_one_line_without_offering_resume(workdir):
    spec = copy.deepcopy(TINY)
    spec["personalization"] = "output_layer"
    spec["stages"] = [{"name": "pretrain", "algorithm": "fedavg", "rounds": 2, "clients_per_round": 3},
                      {"name": "hot", "algorithm": "fedalt", "rounds": 5, "clients_per_round": 3,
                       "local": {"lr": 1e30}}]
    code, output = cli("run", str(write_pipeline(workdir, spec)), "--no-progress")
    assert code == 1, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output and "--resume" not in output, output
    assert "error: stage 'hot' diverged at round " in errors[0] and "last finite training loss: " in errors[0], output
    client = MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    statuses = {r.data.tags.get("fedpilot.stage", "pipeline"): r.info.status for r in runs}
    assert sorted(statuses.values()) == ["FAILED", "FAILED", "FINISHED"], statuses
    assert not any((workdir / "cache" / "runs").glob("*/*")), "a diverged run leaves no checkpoint to resume"
    parent = next(r.info.run_id for r in runs if "fedpilot.stage" not in r.data.tags)
    code, output = cli("run", "--resume", parent)
    assert code == 2 and f"error: --resume='{parent}': this run cannot be resumed" in output, output
    assert "diverged at round" in output, output


def test_a_non_finite_aggregate_stops_before_the_server_steps_on_it():
    federated = stage("fedavg", [], 2, "agg")
    shared = federated.shared_params()
    with pytest.raises(Diverged, match=r"stage 'agg' diverged at round 1: the aggregated update is not finite "
                                       r"\(last finite training loss: 0\.5\)"):
        federated.guard.check_finite(0, 0.5, {n: torch.full_like(p, math.inf) for n, p in shared.items()})
    with pytest.raises(Diverged, match=r"the training loss is not finite \(last finite training loss: none"):
        federated.guard.check_finite(0, math.nan, {})
    federated.guard.check_finite(0, 0.25, {n: torch.zeros_like(p) for n, p in shared.items()})
    assert federated.guard.last_finite_loss == 0.25


def test_a_search_whose_trials_diverge_counts_them_as_pruned_and_ends(workdir):
    spec = with_stage("fedalt", "output_layer")
    spec["search"] = {"space": {"stages.1.local.lr": {"type": "categorical", "choices": [1e30]}},
                      "objective": {"metric": "val_acc_mean"}, "trials": 2}
    code, output = cli("search", str(write_pipeline(workdir, spec)), "--storage",
                       f"sqlite:///{workdir}/studies.db")
    assert code == 0, output
    assert output.count("-> diverged") == 2 and "2 finished trials (2 pruned)" in output, output
