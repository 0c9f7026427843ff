"""`fedpilot ARGS` in this process, sending itself a signal at the start of round STOP_ROUND of stage STOP_STAGE:
SIGKILL is a crash (kill -9) at a known point, SIGTERM a cluster or a user asking the run to stop."""

import os
import signal
import sys

from fedpilot.cli import app
from fedpilot.engine import FederatedStage
from fedpilot.tracking import RoundMetrics, Tracker

STAGE, ROUND = int(os.environ["STOP_STAGE"]), int(os.environ["STOP_ROUND"])
SIGNAL = signal.Signals[os.environ["STOP_SIGNAL"]]
original = FederatedStage.run_round


def run_round(self, round_idx, chunk=None):
    if self.stage_index == STAGE and round_idx == ROUND:
        os.kill(os.getpid(), SIGNAL)
    return original(self, round_idx, chunk)


FederatedStage.run_round = run_round
Tracker.system_sampling_seconds = 0.1  # system metrics logged before the signal, to see them continue after it
RoundMetrics.flush_seconds = 0.0  # each round written as it ends: the store holds rounds past the last checkpoint,
# which the resumed run redoes and must not log again
app(sys.argv[1:], prog_name="fedpilot")
