"""FedAlt: Pillutla et al., ICML 2022 (partial model personalization), Algorithm 1 with LocalAlt
(Algorithm 2 / Algorithm 4)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import Field

from fedpilot.algorithms.ranges import PERSONALIZED_CLIENT_LR
from fedpilot.api import PERSONAL_AND_SHARED, Algorithm, StatefulParams, Upload

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FedAltParams(StatefulParams):
    """tau_v / tau_u: personal / shared local steps; null = the stage's local budget (e.g. 1 epoch) each.

    The paper trains "1 local epoch" per round (App. B.2) without saying how it splits between the two
    phases; we choose one full pass of the stage's local budget for each phase (as in the authors'
    code, which runs the personal then the shared update for the same number of epochs).
    lr_v / lr_u (gamma_v, gamma_u): null = the stage's `local.lr`.
    stateful: false gives the stateless variant of App. C.4 (v re-initialised at every participation
    from the stage's starting value, and not kept).
    """

    tau_v: int | None = Field(None, ge=1)
    tau_u: int | None = Field(None, ge=1)
    lr_v: float | None = Field(None, gt=0)
    lr_u: float | None = Field(None, gt=0)


class FedAlt(Algorithm):
    """LocalAlt: tau_v steps on v with u fixed, then tau_u steps on u with the new v; send u, keep v.

    The server averages the clients' u weighted by alpha_i = N_i (Algorithm 4, line 16).
    """

    name = "fedalt"
    Params = FedAltParams
    tunable = {"params.lr_u": replace(PERSONALIZED_CLIENT_LR, fallback="local.lr"),
               "params.lr_v": replace(PERSONALIZED_CLIENT_LR, fallback="local.lr")}
    needs = PERSONAL_AND_SHARED
    batches_trials = True

    def local_update(self, cohort: Cohort) -> Upload:
        params = cohort.params  # a batch of trials' rows: lr_v and lr_u per row
        cohort.personal = cohort.sgd("personal", lr=params.lr_v, steps=params.tau_v).personal
        return Upload(shared=cohort.sgd("shared", lr=params.lr_u, steps=params.tau_u).shared)
