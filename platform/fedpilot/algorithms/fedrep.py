"""FedRep: Collins et al. 2021, "Exploiting Shared Representations for Personalized FL" (a baseline of PFLEGO,
Nikoloutsopoulos et al. 2022).

Algorithm 1 of Collins et al.: each sampled client first trains its head for many local epochs with the
representation (body) frozen, then the body for a few epochs with its new head frozen, keeps the head and
sends the body; the server averages the bodies. This is FedAlt's update order (Pillutla et al., ICML 2022, LocalAlt)
with epoch budgets instead of step counts, so it is its own short module rather than a FedAlt parameterisation.

Choices: head_epochs = 10 and body_epochs = 1 as in the FedRep experiments (the stage's local epochs/steps are
not used; batch size and lr are the stage's); the server averages the bodies weighted by N_i (the FedRep
code and FedAvg's rule; Algorithm 1's text writes a uniform mean); the head phase runs on the frozen body's
features, computed once per round (the engine's head-only path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fedpilot.api import PERSONAL_AND_SHARED, Algorithm, StatefulParams, Tunable, Upload, step_size

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FedRepParams(StatefulParams):
    """head_epochs / body_epochs: local epochs of the head phase (body frozen) and of the body phase (head frozen);
    lr_head / lr_body: their lrs (null = the stage's local.lr); stateful: heads persist across rounds."""

    head_epochs: float = Field(10.0, gt=0)
    body_epochs: float = Field(1.0, gt=0)
    lr_head: float | None = Field(None, gt=0)
    lr_body: float | None = Field(None, gt=0)


class FedRep(Algorithm):
    """Head for head_epochs with the body frozen, then the body for body_epochs with the new head; send the body."""

    name = "fedrep"
    Params = FedRepParams
    tunable = {"params.lr_head": step_size("local.lr"), "params.lr_body": step_size("local.lr"),
               "params.head_epochs": Tunable(1.0, 20.0, budget=True)}
    needs = PERSONAL_AND_SHARED
    batches_trials = True

    def local_update(self, cohort: Cohort) -> Upload:
        params = cohort.params  # a batch of trials' rows: lr_head and lr_body per row
        cohort.personal = cohort.sgd("personal", lr=params.lr_head, epochs=params.head_epochs).personal
        return Upload(shared=cohort.sgd("shared", lr=params.lr_body, epochs=params.body_epochs).shared)
