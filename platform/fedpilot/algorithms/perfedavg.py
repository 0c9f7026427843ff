"""Per-FedAvg: Fallah, Mokhtari, Ozdaglar, "Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach", NeurIPS 2020 (a baseline of Pillutla et al., ICML 2022 and Self-FL,
Chen et al., NeurIPS 2022), first-order version.

The global model w is trained so that one step of local gradient descent from it is a good personal model:
F(w) = mean_i f_i(w - alpha grad f_i(w)). Each sampled client takes tau local meta-steps (Algorithm 1):

    temp = w - alpha grad f_i(w; D)          (a fresh minibatch D)
    w    = w - beta grad f_i(temp; D')        (another fresh minibatch D')

and sends w; the server takes the mean of the clients' models.

Choices: the first-order version (Per-FedAvg (FO): the Hessian term of the meta-gradient is dropped, as Self-FL
(Chen et al., NeurIPS 2022) does for its audio experiments); beta is the stage's local.lr (times its schedule); the
server mean is uniform over the sampled clients (Algorithm 1). A client's personal model is one step of local SGD from
the final global model: a `finetune` stage with `params: {part: all}` and `local: {steps: 1, lr: alpha}` after this one
gives it (the paper's evaluation); this stage's own evaluation is of the global model.
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedpilot.api import Algorithm, AlgorithmParams, Cohort, Tunable, Upload


class PerFedAvgParams(AlgorithmParams):
    """alpha: the inner (adaptation) step size; tau: local meta-steps per round (each takes two minibatch
    gradients)."""

    alpha: float = Field(0.01, gt=0)
    tau: int = Field(10, ge=1)


class PerFedAvg(Algorithm):
    """First-order MAML steps on each client from the broadcast; the server averages the models."""

    name = "perfedavg"
    Params = PerFedAvgParams
    tunable = {"local.lr": Tunable(1e-4, 1.0, source=(  # beta, the meta-step
                   "Dinh et al., NeurIPS 2020: their code runs Per-FedAvg at beta 0.001 (MNIST); Chen et al., NeurIPS "
                   "2022 (Self-FL), Sec. 4.2: its baselines at lr 0.01-0.03; fedpilot: 1e-4 to 1")),
               "params.alpha": Tunable(1e-4, 1.0, source=(
                   "Dinh et al., NeurIPS 2020: their code runs Per-FedAvg at alpha 0.005 (MNIST); fedpilot: 1e-4 to 1, "
                   "holding our pipelines' 0.05"))}
    batches_trials = True

    @property
    def personal_part(self) -> str:
        return "none"

    def local_update(self, cohort: Cohort) -> Upload:
        w = {n: v.clone() for n, v in cohort.broadcast.items()}
        # a number, or one per row in a batch of trials (per_client shapes it against [K, ...])
        alpha, beta = cohort.params.alpha, cohort.value("local.lr") * cohort.lr_factor
        for _ in range(cohort.params.tau):
            first = cohort.gradient("shared", steps=1, shared=w)
            temp = {n: v - cohort.per_client(alpha, v) * first[n] for n, v in w.items()}
            meta = cohort.gradient("shared", steps=1, shared=temp)
            w = {n: v - cohort.per_client(beta, v) * meta[n] for n, v in w.items()}
        return Upload(shared=w, weight=torch.ones(len(cohort), device=cohort.weights.device))
