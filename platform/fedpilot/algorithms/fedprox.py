"""FedProx (Li, Sahu, Zaheer, Sanjabi, Talwalkar, Smith, MLSys 2020), a baseline of PFLEGO
(Nikoloutsopoulos et al. 2022).

Each sampled client k, given the global model w^t, approximately minimises its proximal local objective

    h_k(w; w^t) = F_k(w) + mu/2 ||w - w^t||^2

by local SGD from w^t (the stage's `local` budget: FedProx's E epochs, or steps), and sends w; the server averages
the clients' models (FedAvg's rule). mu = 0 is FedAvg exactly.

Choices: the inexact local solver is the engine's minibatch SGD with the pull added to every step's gradient
(FedProx's "gamma-inexact" solution is whatever the budget reaches); the server weights the clients by their
train sample counts (FedAvg's aggregation; FedProx samples clients with probability proportional to N_k and
averages uniformly, the same in expectation).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fedpilot.api import Algorithm, AlgorithmParams, Tunable, Upload

if TYPE_CHECKING:
    from fedpilot.api import Cohort


class FedProxParams(AlgorithmParams):
    """mu: weight of the proximal term mu/2 ||w - w^t||^2 (FedProx tunes it in {0.001, 0.01, 0.1, 0.5, 1}; its
    declared range is 1e-4 to 10)."""

    mu: float = Field(0.01, ge=0)


class FedProx(Algorithm):
    """Local SGD on the whole model pulled towards the broadcast; the server averages."""

    name = "fedprox"
    Params = FedProxParams
    tunable = {"local.lr": Tunable(1e-3, 10.0, source=(
                   "Li et al., MLSys 2020 (FedProx), its appendix as recalled, not checked here: lr 0.003 (FEMNIST) to "
                   "0.8 (Shakespeare); fedpilot: widened to 1e-3 and 10")),
               "params.mu": Tunable(1e-4, 10.0, source=(
                   "Li et al., MLSys 2020 (FedProx): their code's README tunes mu on {0.001, 0.01, 0.1, 0.5, 1}; "
                   "fedpilot: a decade beyond each end, so that no end of the grid is an edge"))}
    batches_trials = True

    @property
    def personal_part(self) -> str:
        return "none"

    def local_update(self, cohort: Cohort) -> Upload:
        return Upload(shared=cohort.sgd("shared", prox=cohort.params.mu, reference=cohort.shared).shared)
