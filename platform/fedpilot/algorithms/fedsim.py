"""FedSim: Pillutla et al., ICML 2022 (partial model personalization), Algorithm 1 with LocalSim
(Algorithm 3 / Algorithm 5)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fedpilot.algorithms.fedalt import FedAlt
from fedpilot.api import PERSONAL_AND_SHARED, Algorithm, StatefulParams, Upload

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FedSimParams(StatefulParams):
    """tau: joint local steps (null = the stage's local budget); lr_v / lr_u: gamma_v, gamma_u (null = local.lr).

    stateful: false gives the stateless variant of App. C.4.
    """

    tau: int | None = Field(None, ge=1)
    lr_v: float | None = Field(None, gt=0)
    lr_u: float | None = Field(None, gt=0)


class FedSim(Algorithm):
    """LocalSim: u and v take each step together, both gradients taken at the same point; send u, keep v."""

    name = "fedsim"
    Params = FedSimParams
    tunable = FedAlt.tunable  # the same step sizes in the same paper's pipeline
    needs = PERSONAL_AND_SHARED
    batches_trials = True

    def local_update(self, cohort: Cohort) -> Upload:
        params = cohort.params  # a batch of trials' rows: lr_v and lr_u per row
        local = cohort.sgd("all", lr={"shared": params.lr_u, "personal": params.lr_v}, steps=params.tau)
        cohort.personal = local.personal
        return Upload(shared=local.shared)
