"""RoundMetrics: the Lightning callback that writes each round's metrics to the stage's MLflow run (apart from
tracking.py, so that what only reads or closes runs, a job worker reaping a dead job, imports no Lightning)."""

from __future__ import annotations

import json
import time
from typing import Any

from mlflow.entities import Metric

from fedpilot.engine.hooks import RoundCallback, RoundResult
from fedpilot.tracking import EXECUTION_TAG, EXECUTOR_TAG, Tracker


class RoundMetrics(RoundCallback):
    """Logs each round's metrics (training stats, and validation when due) to a stage run; step = rounds done, time =
    when the round ended. The test split, evaluated once at the stage's end, is logged with the stage's other
    once-per-stage values.

    Rounds reach the store together, at most `flush_seconds` apart (a write per round was a large part of a small
    model's round on SQLite), and always before a checkpoint is saved and when training ends or fails: a run
    resumed from a checkpoint holds every round before it."""

    flush_seconds = 1.0

    def __init__(self, tracker: Tracker, run_id: str, trial: int | None = None):
        """`trial`: in a batch of trials, which one's rounds go to the run (RoundResult.trials)."""
        self.tracker, self.run_id, self.trial = tracker, run_id, trial
        self.pending: list[Metric] = []
        self.flushed_at = time.monotonic()
        self.executor = ""  # the executor tagged on the run

    def on_round_end(self, trainer: Any, stage: Any, result: RoundResult) -> None:
        if self.trial is not None:
            if self.trial not in result.trials:  # stopped: its run holds what it logged before
                return
            result = result.trials[self.trial]
        if result.executor != self.executor:  # chosen on the first round: recorded at once, for a rerun to pin
            self.tracker.set_tags(self.run_id, execution_tags(stage))
            self.executor = result.executor
        metrics = {k: v for k, v in result.metrics.items() if not k.startswith("test_")}
        self.pending += self.tracker.new_metrics(self.run_id, metrics, step=result.round)
        if time.monotonic() - self.flushed_at >= self.flush_seconds:
            self.flush()

    def on_save_checkpoint(self, *args: Any) -> None:
        self.flush()

    def on_train_end(self, *args: Any) -> None:
        self.flush()

    def on_exception(self, *args: Any) -> None:
        self.flush()

    def flush(self) -> None:
        """Write the rounds logged since the last flush."""
        self.tracker.write_metrics(self.run_id, self.pending)
        self.pending, self.flushed_at = [], time.monotonic()


def execution_tags(stage: Any) -> dict[str, str]:
    """The tags of how a stage runs: its executor's name, and what a rerun needs to compute the same numbers (the
    executor with its clients per call and per chunk, which `PipelineRunner(executions=...)` pins)."""
    choice = stage.executor_choice.state_dict()
    pin = {key: choice[key] for key in ("execution", "clients_per_call", "clients_per_chunk")}
    return {EXECUTOR_TAG: stage.execution, EXECUTION_TAG: json.dumps(pin, sort_keys=True)}
