"""FedAvg (McMahan et al. 2017) with a server optimizer: FedAvgM and FedAdam come from the stage's `server`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpilot.api import Algorithm, Tunable, Upload

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FedAvg(Algorithm):
    """Every parameter is shared: local SGD on the whole model, the server averages by sample count."""

    name = "fedavg"
    tunable = {"local.lr": Tunable(1e-4, 10.0, source=(
        "Pillutla et al., ICML 2022, Table 9: client lr 1e-2 to 1 in FedAvg pretraining (step a), 1e-3 to 1e-1 after "
        "(step b); Chen et al., ICML 2023, App. H: grid 0.005-0.5; fedpilot: down to 1e-4 for the diabetes "
        "regression's 3e-4, up to 10 for the Shakespeare LSTM's clipped 2"))}
    batches_trials = True  # its only value is the stage's local lr, which the engine applies per row

    @property
    def personal_part(self) -> str:
        return "none"

    def local_update(self, cohort: Cohort) -> Upload:
        return Upload(shared=cohort.sgd("shared").shared)
