"""The matched budget of the digits-k2 comparisons (README, "How each paper reads"): every pipeline of the shipped
sets starts from the same FedAvg pretraining, then runs the same rounds and cohorts, in which every sampled client
takes the same number of minibatch gradients (4, batch 10) however its method splits them among its phases
(counted through the engine from the batch plans each round draws), and a method that ends with fine-tuning ends
with the baseline's."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedpilot.compare.plan import load_plan
from fedpilot.compare.run import prepare_plan
from fedpilot.engine.cohort import RoundWork
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.spec import PipelineSpec
from fedpilot.testing import fit

ROOT = Path(__file__).resolve().parents[1]
SETS = sorted((ROOT / "pipelines" / "compare").glob("digits-k2*.yaml"))
GRADIENTS = 4  # minibatch gradients per sampled client per round
EXTRA = {"digits-k2-selffl-aug": 20}  # Algorithm 2's local optimum: optimum_steps more, declared in its pipeline


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def comparisons(cache) -> list[tuple[str, dict[str, PipelineSpec]]]:
    """Each set's baseline and its pipelines' specs (seed 0), the dataset built once into `cache`; loading a set
    checks the tracking store, here one of the module's own (an earlier test in this process may have pointed MLflow
    at a server it has stopped since)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{cache}/mlflow.db")
        loaded = [load_plan(path, seeds=1) for path in SETS]
        for plan in loaded:
            prepare_plan(plan, cache)
    return [(plan.baseline, {name: runs[0] for name, runs in plan.specs.items()}) for plan in loaded]


def test_every_pipeline_shares_the_pretraining_rounds_cohorts_and_fine_tuning(comparisons):
    reference = next(specs for _, specs in comparisons if "digits-k2-baselines" in specs)["digits-k2-baselines"]
    pretraining, finetuning = reference.stages[0], reference.stages[-1]
    assert finetuning.algorithm == "finetune" and finetuning.local.epochs == 5
    for baseline, specs in comparisons:
        assert baseline in specs
        for name, spec in specs.items():
            first, method, *rest = spec.stages
            assert first == pretraining, name
            assert (method.rounds, method.clients_per_round, method.local.batch_size) == (50, 10, 10), name
            ends = [s for s in rest if s.algorithm == "finetune" and s.local.epochs]
            assert all(s.local == finetuning.local and s.params == finetuning.params for s in ends), name


def test_every_client_takes_the_same_minibatch_gradients_a_round(comparisons, cache, tmp_path, monkeypatch):
    """One round of each method after the pretraining (a client's first activation): the batch plans of the round
    hold exactly GRADIENTS active minibatches per sampled client, summed over the method's phases."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    works: list[RoundWork] = []
    plan = RoundWork.plan

    def recorded(self: RoundWork, *args, **kwargs):
        works.append(self)
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(RoundWork, "plan", recorded)
    measured = {}
    for _, specs in comparisons:
        for name, spec in specs.items():
            one_round = spec.model_copy(update={"stages": [spec.stages[0], spec.stages[1].model_copy(
                update={"rounds": 1})]})
            stage = PipelineRunner(one_round, cache_dir=cache, progress=False)._stage(1, None)
            stage.executor_choice.pin("vmap")  # pinned: an auto stage also times executors on the round's plans
            works.clear()
            fit(stage)
            round_work = {id(w): w for w in works}.values()
            measured[name] = sum(p.active.sum(1) for w in round_work for p in w.plans.values()).tolist()
    expected = {name: [GRADIENTS + EXTRA.get(name, 0)] * 10 for name in measured}
    assert len(measured) == 20 and measured == expected
