"""`fedpilot ARGS` in this process, sending itself a signal at the start of round STOP_ROUND of stage STOP_STAGE:
SIGKILL is a crash (kill -9) at a known point, SIGTERM a cluster or a user asking the run to stop. With
STOP_WHEN=round_end the signal comes at the end of the round before, after the stop callback has looked at it (the
moment Lightning's own SIGTERM handling used to end the run with exit code 0). With STOP_RANK, only that DDP process
sends it (LOCAL_RANK, which Lightning sets for the processes it starts)."""

import os
import signal
import sys

from fedpilot.cli import app
from fedpilot.engine.stage import FederatedStage
from fedpilot.pipeline.round_metrics import RoundMetrics
from fedpilot.pipeline.signals import CheckpointOnStop
from fedpilot.tracking import Tracker

STAGE, ROUND = int(os.environ["STOP_STAGE"]), int(os.environ["STOP_ROUND"])
SIGNAL = signal.Signals[os.environ["STOP_SIGNAL"]]
SIGNALLED = os.environ.get("STOP_RANK", os.environ.get("LOCAL_RANK", "0")) == os.environ.get("LOCAL_RANK", "0")
original_round, original_round_end = FederatedStage.run_round, CheckpointOnStop.on_train_batch_end


def run_round(self, round_idx, chunk=None):
    if SIGNALLED and self.stage_index == STAGE and round_idx == ROUND:
        os.kill(os.getpid(), SIGNAL)
    return original_round(self, round_idx, chunk)


def on_round_end(self, trainer, stage, *args):
    original_round_end(self, trainer, stage, *args)
    if SIGNALLED and stage.stage_index == STAGE and trainer.global_step == ROUND:
        os.kill(os.getpid(), SIGNAL)


if os.environ.get("STOP_WHEN") == "round_end":
    CheckpointOnStop.on_train_batch_end = on_round_end
else:
    FederatedStage.run_round = run_round
Tracker.system_sampling_seconds = 0.1  # system metrics logged before the signal, to see them continue after it
RoundMetrics.flush_seconds = 0.0  # each round written as it ends: the store holds rounds past the last checkpoint,
# which the resumed run redoes and must not log again
app(sys.argv[1:], prog_name="fedpilot")
