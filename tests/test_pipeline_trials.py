"""A pipeline's trials run together (pipeline/trials.py): each recorded and cached as a lone run of its pipeline, the
shared stages trained once, the others as batches; a lone rerun finds every stage in the cache; a dropped trial
stops with its records."""

from __future__ import annotations

import gc
import math
import weakref

from mlflow import MlflowClient

from fedpilot.engine.hooks import RoundCallback
from fedpilot.pipeline.runner import PipelineRunner
from fedpilot.pipeline.trials import PipelineTrials
from fedpilot.spec import load_pipeline, with_values
from pipeline_fixtures import runs_of, write_pipeline

VALUES = [{"stages.1.params.lr_v": 0.01, "stages.1.local.lr": 0.05, "stages.2.local.lr": 0.005},
          {"stages.1.params.lr_v": 0.05, "stages.1.local.lr": 0.02, "stages.2.local.lr": 0.01},
          {"stages.1.params.lr_v": 0.002, "stages.1.local.lr": 0.1, "stages.2.local.lr": 0.005}]
CONTINUOUS = ("test_loss_weighted", "val_loss_weighted", "test_acc_weighted")


def test_trials_run_together_are_recorded_and_cached_as_lone_runs(workdir, monkeypatch):
    spec = load_pipeline(write_pipeline(workdir), [])
    batches, together = [], PipelineTrials._together
    monkeypatch.setattr(PipelineTrials, "_together", lambda self, index, members, *rest: batches.append(
        (index, [k for k, _ in members])) or together(self, index, members, *rest))
    outcomes = PipelineTrials(spec, VALUES).run()
    assert batches == [(1, [0, 1, 2]), (2, [0, 1, 2])]  # FedAlt and fine-tuning as batches of the three
    client = MlflowClient()
    assert all(o.stopped is None and o.result is not None for o in outcomes)
    caches = [[s.cache for s in o.result.stages] for o in outcomes]
    assert caches == [["miss", "miss", "miss"], ["hit", "miss", "miss"], ["hit", "miss", "miss"]]  # pretrain once
    for values, outcome in zip(VALUES, outcomes, strict=True):
        runs = runs_of(client, outcome.result.run_id)
        assert [r.info.status for r in runs] == ["FINISHED"] * 4
        assert runs[2].data.params["local.lr"] == str(values["stages.1.local.lr"])
        rerun = PipelineRunner(with_values(spec, values), progress=False).run()  # the same cache: every stage a hit
        assert [s.cache for s in rerun.stages] == ["hit", "hit", "hit"]
        for mine, theirs in zip(runs[1:], runs_of(client, rerun.run_id)[1:], strict=True):
            assert all(mine.data.metrics[k] == theirs.data.metrics[k] for k in CONTINUOUS)
        alone = PipelineRunner(with_values(spec, values), workdir / "alone", progress=False).run()  # trained alone
        assert [s.cache for s in alone.stages][1:] == ["miss", "miss"]
        for mine, theirs in zip(runs[2:], runs_of(client, alone.run_id)[2:], strict=True):  # what a trained stage logs
            reused = {"executor_timing_reused"}  # a lone run may take the choice this process timed for its workload
            assert mine.data.metrics.keys() - reused == theirs.data.metrics.keys() - reused
            assert mine.data.params == theirs.data.params
        for mine, theirs in zip(outcome.result.stages, alone.stages, strict=True):
            assert all(math.isclose(mine.metrics[k], theirs.metrics[k], rel_tol=1e-4, abs_tol=1e-5)
                       for k in CONTINUOUS), (mine.name, {k: (mine.metrics[k], theirs.metrics[k]) for k in CONTINUOUS})
    finals = {round(o.result.stages[2].metrics["test_loss_weighted"], 6) for o in outcomes}
    assert len(finals) == 3  # the trials differ


class DropSecond(RoundCallback):
    """Drops the batch's second trial after its second round (a search's rung)."""

    def on_round_end(self, trainer, stage, result) -> None:
        if result.round == 2 and 1 in stage.active:
            stage.drop([1])


class Watch(RoundCallback):
    """Keeps a weak reference to each trial's stage as its batch starts."""

    def __init__(self, seen: dict[int, list[weakref.ref]]):
        self.seen = seen

    def on_round_start(self, trainer, stage, start) -> None:
        self.seen.setdefault(start.round, [weakref.ref(trial) for trial in stage.trials])


def test_a_trial_dropped_from_its_batch_stops_with_its_records(workdir):
    spec = load_pipeline(write_pipeline(workdir), [])
    stages: dict[int, dict[int, list[weakref.ref]]] = {}  # stage index -> round -> its trials' stages
    fine_tuned = []

    class Alive(RoundCallback):  # as the fine-tuning stage starts: is the dropped trial's stage 1 still held?
        def on_round_start(self, trainer, stage, start) -> None:
            gc.collect()
            fine_tuned.append(stages[1][0][1]() is None)

    def callbacks(index, trials):
        if index == 1 and len(trials) > 1:
            return [DropSecond(), Watch(stages.setdefault(1, {}))]
        return [Alive()] if index == 2 else []

    outcomes = PipelineTrials(spec, VALUES[:2]).run(callbacks=callbacks)
    assert fine_tuned and all(fine_tuned)  # let go of once it stopped, not when the last trial ends
    kept, dropped = outcomes
    assert kept.stopped is None and kept.result is not None
    assert dropped.result is None and dropped.stopped["stage"] == 1 and dropped.stopped["round"] == 2
    assert dropped.stopped["why"] == "dropped" and "dropped from its batch" in dropped.stopped["error"]
    assert [(e["round"], e["split"]) for e in dropped.stopped["history"]] == [(2, "val")]
    client = MlflowClient()
    experiment = client.get_experiment_by_name("small").experiment_id
    failed = client.search_runs([experiment], "attributes.status = 'FAILED'")
    assert len(failed) == 2  # the dropped trial's pipeline run and its stage run
    stage_run = next(r for r in failed if "fedpilot.stage" in r.data.tags)
    assert [m.step for m in client.get_metric_history(stage_run.info.run_id, "val_acc_mean")] == [2]
