"""FedAvg (McMahan et al. 2017) with a server optimizer: FedAvgM and FedAdam come from the stage's `server`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpilot.api import Algorithm, Upload, step_size

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FedAvg(Algorithm):
    """Every parameter is shared: local SGD on the whole model, the server averages by sample count."""

    name = "fedavg"
    tunable = {"local.lr": step_size()}
    batches_trials = True  # its only value is the stage's local lr, which the engine applies per row

    @property
    def personal_part(self) -> str:
        return "none"

    def local_update(self, cohort: Cohort) -> Upload:
        return Upload(shared=cohort.sgd("shared").shared)
