"""pFedMe: Dinh, Tran, Nguyen, "Personalized Federated Learning with Moreau Envelopes", NeurIPS 2020 (a baseline of
Pillutla et al., ICML 2022 and of Self-FL, Chen et al., NeurIPS 2022; Pillutla et al. train it in step (b) of
their pipeline, App. B.2 (iii)).

The personal model theta_i of client i is the proximal point of its loss at the client's copy w of the global
model, theta_i(w) = argmin_theta f_i(theta) + lam/2 ||theta - w||^2 (a Moreau envelope). One round (Algorithm 1):

  server: send w^t to the sampled clients
  client i:  w_{i,0} = w^t, theta_i = w^t
             for r = 0 .. R-1:
                 K SGD steps on f_i(theta_i) + lam/2 ||theta_i - w_{i,r}||^2   (the personal lr)
                 w_{i,r+1} = w_{i,r} - eta lam (w_{i,r} - theta_i)             (eta: the stage's local.lr)
             send w_{i,R}
  server:   w^{t+1} = (1 - beta) w^t + beta mean_i w_{i,R}

Choices: beta is the stage's server lr (server: sgd, lr beta; beta = 1 takes the clients' mean), and the mean is
uniform over the sampled clients, as in Algorithm 1; theta_i starts each participation from w^t (the authors'
code) and carries over the R local rounds; each of the K inner steps draws its own minibatch of the stage's
batch size (the paper solves each inner problem on one sampled batch; a batch size >= every client's train set
makes both the full local loss); the clients are evaluated with their theta_i from their last participation.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedpilot.api import Algorithm, AlgorithmParams, Cohort, Tunable, Upload


class PFedMeParams(AlgorithmParams):
    """lam: weight of the Moreau envelope's pull (pFedMe: 15 on MNIST; Pillutla et al., ICML 2022 tuned 0.1 on EMNIST);
    local_rounds: R; inner_steps: K; lr_personal: the inner steps' lr (null = the stage's local.lr)."""

    lam: float = Field(15.0, gt=0)
    local_rounds: int = Field(20, ge=1)
    inner_steps: int = Field(5, ge=1)
    lr_personal: float | None = Field(None, gt=0)


class PFedMe(Algorithm):
    """A personal copy theta_i solving the proximal problem at the client's w, which steps towards it; w averaged."""

    name = "pfedme"
    Params = PFedMeParams
    tunable = {"local.lr": Tunable(1e-3, 10.0, source=(
                   "Dinh et al., NeurIPS 2020: eta 0.005 (their code's MNIST runs); Pillutla et al., ICML 2022, Table "
                   "9: client lr 1e-3 to 1e-1 (step b); fedpilot: up to 10 (eta times lam is the step of w)")),
               "params.lr_personal": Tunable(1e-3, 10.0, fallback="local.lr", source=(
                   "Dinh et al., NeurIPS 2020: personal lr 0.1 and 0.09 (their code's MNIST runs); fedpilot: 1e-3 to "
                   "10, holding our pipelines' 0.05 and 1 and the former studies' 0.0056 and 0.11 inside")),
               "params.lam": Tunable(1e-4, 100.0, source=(
                   "Dinh et al., NeurIPS 2020: 15 (MNIST); Pillutla et al., ICML 2022, App. B.3: {1e-4, ..., 1}, "
                   "chosen 1e-4 and 1e-1; Chen et al., ICML 2023, App. H: {1e-4, ..., 10}; fedpilot: up to 100, so "
                   "that 15 is no edge"))}
    personal_copy = True
    batches_trials = True

    @property
    def personal_part(self) -> str:
        return "all"

    def local_update(self, cohort: Cohort) -> Upload:
        w = {n: v.clone() for n, v in cohort.broadcast.items()}
        cohort.personal = {n: v.clone() for n, v in w.items()}
        params = cohort.params  # a number each, or one per row in a batch of trials (per_client shapes it)
        eta = cohort.value("local.lr") * cohort.lr_factor
        for _ in range(params.local_rounds):
            cohort.personal = cohort.sgd("personal", lr=params.lr_personal, steps=params.inner_steps,
                                         prox=params.lam, reference=w).personal
            w = {n: v - cohort.per_client(eta * params.lam, v) * (v - cohort.personal[n]) for n, v in w.items()}
        return Upload(shared=w, weight=torch.ones(len(cohort), device=cohort.weights.device))
