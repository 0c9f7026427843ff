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

from fedpilot.api import PERSONAL_AND_SHARED, Algorithm, StatefulParams, Tunable, Upload

CLIENT_LR = Tunable(1e-4, 10.0, fallback="local.lr", source=(
    "Chen et al., ICML 2023, App. H: FedRep's personal lr on {0.005, 0.01, 0.05, 0.1, 0.5}; Nikoloutsopoulos et al. "
    "2022 (PFLEGO), Sec. 5.1: FedRep at 0.001; fedpilot: widened to 1e-4 and 10"))

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
    tunable = {"params.lr_head": CLIENT_LR, "params.lr_body": CLIENT_LR,
               "params.head_epochs": Tunable(0.2, 20.0, budget=True, source=(
                   "Collins et al., ICML 2021 (FedRep), its experiments as recalled: 10 head epochs a round; "
                   "fedpilot: down to 0.2 for the matched budget's 0.5"))}
    needs = PERSONAL_AND_SHARED
    batches_trials = True

    def local_update(self, cohort: Cohort) -> Upload:
        params = cohort.params  # a batch of trials' rows: lr_head and lr_body per row
        cohort.personal = cohort.sgd("personal", lr=params.lr_head, epochs=params.head_epochs).personal
        return Upload(shared=cohort.sgd("shared", lr=params.lr_body, epochs=params.body_epochs).shared)
