"""Ditto (Li, Hu, Beirami, Smith, ICML 2021), the original joint algorithm, not only Ditto-as-fine-tuning.

Each sampled client k, given the global model w^t:
  1. global update: local SGD on F_k from w^t (the stage's `local` budget), sent to the server (FedAvg);
  2. personal update: `personal_steps` SGD steps on its personal copy v_k of the whole model for
     F_k(v_k) + lambda/2 ||v_k - w^t||^2 (the pull is to the broadcast w^t, as in the paper's Algorithm 1).
Clients are evaluated with v_k. v_k starts, at a client's first participation, from the stage's starting
model (the previous stage's global model: the usual FedAvg warm start).
Choice: the paper solves the personal problem "for s local iterations" with its own step size; we take
`personal_steps` (null = the stage's local budget, i.e. the same work as the global update) and `lr_v`
(null = the stage's local.lr), and run the personal update from v_k after the global update, as the
paper's pseudo-code orders them (the two updates are independent given w^t).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pydantic import Field

from fedpilot.algorithms.ranges import PERSONALIZED_CLIENT_LR
from fedpilot.api import Algorithm, AlgorithmParams, Tunable, Upload

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class DittoParams(AlgorithmParams):
    """lam: lambda of the pull to the global model (Pillutla et al., ICML 2022, App. B.3, tune it over 1e-4 to 1 and
    chose 0.1 for EMNIST and GLDv2, 1e-3 for Stack Overflow; its declared range, 1e-4 to 10, holds that grid);
    personal_steps / lr_v: the personal solver's budget and step (null = the stage's local budget / local.lr)."""

    lam: float = Field(0.1, ge=0)
    personal_steps: int | None = Field(None, ge=1)
    lr_v: float | None = Field(None, gt=0)


class Ditto(Algorithm):
    """FedAvg on a global copy plus an L2-regularised personal copy of the whole model per client."""

    name = "ditto"
    Params = DittoParams
    tunable = {"local.lr": PERSONALIZED_CLIENT_LR, "params.lr_v": replace(PERSONALIZED_CLIENT_LR, fallback="local.lr"),
               "params.lam": Tunable(1e-4, 10.0, source=(
                   "Pillutla et al., ICML 2022, App. B.3: lambda on {1e-4, ..., 1}, chosen 1e-3 and 1e-1; Chen et al., "
                   "ICML 2023, App. H: {0.05, 0.1, 0.5, 0.8}; fedpilot: up to 10, so that the grid's 1 is no edge"))}
    personal_copy = True
    batches_trials = True

    @property
    def personal_part(self) -> str | None:
        return "all"

    def local_update(self, cohort: Cohort) -> Upload:
        params = cohort.params  # a batch of trials' rows: lr_v and lam per row
        global_update = cohort.sgd("shared")
        cohort.personal = cohort.sgd("personal", lr=params.lr_v, steps=params.personal_steps, prox=params.lam,
                                     reference=cohort.shared).personal
        return Upload(shared=global_update.shared)
