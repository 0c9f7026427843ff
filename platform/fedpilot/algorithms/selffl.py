"""Self-FL: self-aware personalized FL (Chen et al., NeurIPS 2022), Algorithm 1 (`selffl`) and Algorithm 2
(`selffl_aug`).

Two-level Gaussian model: theta_m ~ N(theta_0, s0) across clients, client m's local optimum z_m ~ N(theta_m,
s_m). With precisions w_k = (s0 + s_k)^-1, P = sum_k w_k and W_-m = P - w_m (the other clients'), the FL
posterior mean of theta_m is theta_m^FL = (z_m / s_m + sum_{k!=m} w_k z_k) / (1 / s_m + W_-m) (Eq. 3, proof
Eq. 28). One round for each sampled client m, given the global model theta and the broadcast (s0, P):

  init   theta_m^INIT = theta - (w_m / W_-m) (theta_m - theta)                        (Eq. 10)
  steps  l_m: (1 - eta / s_m)^l_m = W_-m / (1 / s_m + W_-m), rounded, in [1, l_max]   (Eq. 8, App. D Eq. 16)
  train  l_m SGD steps of the personal copy from theta_m^INIT (the stage's local.lr and batch_size)
  server s0 = trace of the empirical variance of every client's latest personal model (Eq. 14);
         theta_hat = sum_m w_m theta_m / sum_m w_m over the round's clients (Eq. 11);
         theta <- (1 - C) theta + C theta_hat, C = clients per round / clients (the smoothing of Sec. 4.1)
  s_m    trace of the empirical variance of client m's own personal models over its activations, updated
         online (App. E, Eq. 19, with the client's own activation counter, Remark E.1).

The text we worked from lost its formulas; the above is reconstructed from the algorithm boxes (Alg. 1, 2),
the proof of Proposition 3.1 (Eqs. 27-31) and App. D-E, and checked against the closed form on the paper's
scalar synthetic problem (tests/test_algo_selffl.py). Choices where the paper is open:

* Eq. 8's scales, re-derived. In the Gaussian model client m minimises its summed negative log-likelihood, whose
  quadratic approximation is (theta - z_m)^2 / (2 s_m) with s_m = v_m^2 / N_m the variance of its local optimum
  (App. D; v_m^2 the per-sample inverse Fisher information). A gradient step eta on that sum contracts the
  distance to z_m by 1 - eta / s_m (Remark 2.2; Eq. 16 writes 1 - N_m v_m^-2 eta), and l steps from Eq. 10's
  start land on theta_m^FL when (1 - eta / s_m)^l = W_-m / (1 / s_m + W_-m). The engine's loss is the mean over
  a minibatch, an unbiased estimate of the summed loss / N_m, so a step of the stage's local.lr (times its
  schedule) is, in expectation, a step lr / N_m on the sum: Eq. 8 uses eta = lr / N_m, i.e. the contraction
  1 - lr / (N_m s_m) = 1 - lr / v_m^2, and the batch size does not enter. The scalar problem through the real
  stage lands on the closed-form posterior with exactly this scale (tests/test_algo_selffl.py). For d
  parameters the paper takes traces (sums of entry-wise variances, Sec. 3.2) for s_m and s0; the right side of
  Eq. 8 and Eqs. 10-11 are ratios of traces and do not depend on that choice, the contraction does: with the
  trace, as the paper writes it, 1 - eta / trace(s_m) is d times weaker than an isotropic per-entry reading
  (trace / d), so the paper's l_m are the larger ones (its experiments cap them at l_max = 40). We keep the
  trace. The stage's local epochs/steps are not used; l_m replaces them.
* When Eq. 8 gives one step. For small W_-m s_m (clients far apart: s0 >> (M - 1) s_m, the paper's regime in
  Sec. 4.2, where l_m hits l_max) l_m ~ (s_m / eta) log(1 / (s_m W_-m)) is large; for large W_-m s_m (s0 <<
  (M - 1) s_m) l_m ~ 1 / (W_-m eta): a client trusts the others and barely trains. Eq. 14 estimates s0 from the
  personal models, which Eq. 10 starts next to the global model and Eq. 8 then keeps there, so under Algorithm 1
  an estimated s0 that starts small stays small. On the digits pipelines (few training samples a client) s0 and
  s_m end small enough that Eq. 8's target W_-m / (1 / s_m + W_-m) is above what one step's contraction
  1 - lr / (N_m s_m) leaves: l_m rounds to 1 for every client with a variance estimate. A client trains l_max
  steps in its first two activations (s_m = 0) and one step after. Algorithm 2's s0 from local optima (Eq. 22) is
  larger, but its s_m is smaller too and l_m is again 1 (the figures: docs/algorithms.md, Self-FL).
* Eq. 8 edge cases. Zero variance (no estimate yet, below) means infinite own precision: the client's target
  is its local optimum, so it trains l_max steps. 0 < s_m <= eta / N_m: the contraction 1 - eta / s_m is not
  in (0, 1); one step already reaches the quadratic's optimum, so l_m = 1 (Eq. 8's limit as s_m -> eta / N_m).
* What the server broadcasts for the other clients' weights: s0 and the total precision P = sum_k w_k over
  ALL clients, each with its last reported s_k (0 before its first report: the paper's initial s = 0). A
  client subtracts its own term, W_-m = P - w_m. The server keeps the reported s_k (one scalar per client,
  `server_state["variance"]`); every chunk computes the whole cohort's l_m (a per-client `steps` tensor is
  the whole cohort's) from that copy as it stood at the round's start, equal to each client's own s_m.
* First activation: the client has no personal model of its own yet (its personal copy is the stage's
  starting model), so it starts from the broadcast (theta_m^INIT = theta) and, with zero variance, trains
  l_max steps. Its aggregation weight is then 1 / s0.
* Eq. 14 over all M clients: every client's latest personal model, a client not yet activated counting with
  its starting model theta^0 (Alg. 2's initialisation theta_m^0 = theta^0; a Self-FL stage starts every
  personal copy at the global model it inherits). The server keeps running sums over these M models (their sum
  and sum of squares, relative to theta^0) instead of the models; to update them it needs the model each
  reporting client replaces, which a deployed server has (it received it); here the client hands it over with
  its upload (`SelfFLUpload.previous`, not counted as communication).
* `known` variances: the paper's synthetic experiments (App. G.1) compute l_m from Eq. 16 with the true s0 and
  v^2 (s_m = v^2 / N_m); `known: {sigma0_sq, sample_variance}` does that instead of estimating s0 and s_m.
* Online variance: after training, the client folds its new personal model into its running mean and
  variance (Eq. 19, population variance 1/t as in Eq. 18, summed over all entries) and reports s_m with its
  model: the server weights this round with it (Eq. 13 read as {theta_m^1..theta_m^t}), and at the next
  activation the same s_m is the variance of its previous personal models (Alg. 2, Eq. 20). A client's first
  two activations have s_m = 0 (zero and one model seen). A precision is capped at 1 / VARIANCE_FLOOR.
* Smoothing under client sampling: C = r / M on every round (1 with full participation); `smoothing: false`
  takes theta_hat as the new global model. The server optimizer must stay sgd, lr 1, momentum 0 (default).
* The server needs s0 before it can weight the round's models, so the aggregator keeps the round's models
  (r of them) until every chunk is in, instead of a streamed sum.

Algorithm 2 (`selffl_aug`): after its l_m steps the client continues training a copy for `optimum_steps`
more steps (the paper's "until convergence", as a fixed budget since the engine draws batches in advance)
and uses these local optima for its variance (Eq. 20) and the server's s0 (Eq. 22: the round's local optima,
re-estimated only from rounds with >= 2 clients); both models are uploaded and the personal models are still
the ones aggregated (Eq. 23).

Recorded per client (engine state bank, per-client table and `{state}_mean/_max` metrics): `steps` (its
last l_m), `variance` (s_m) and `activations`; the running means `mean.NAME` double the per-client memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedpilot.api import (
    Aggregator,
    Algorithm,
    AlgorithmParams,
    Cohort,
    RoundInfo,
    Tensors,
    Tunable,
    Upload,
    per_client,
)

VARIANCE_FLOOR = 1e-12


# ---- the paper's formulas, on [K, ...] tensors ------------------------------------------------------------
def precision(variance: torch.Tensor, sigma0_sq: float) -> torch.Tensor:
    """w = (s0 + s_m)^-1, each client's weight in Eqs. 8, 10 and 11."""
    return 1.0 / (sigma0_sq + variance.double()).clamp_min(VARIANCE_FLOOR)


def local_steps(variance: torch.Tensor, others: torch.Tensor, lr: torch.Tensor, l_max: int) -> torch.Tensor:
    """Eq. 8: l with (1 - lr / s_m)^l = W_-m / (1 / s_m + W_-m), rounded into [1, l_max]; l_max at zero
    variance, 1 where lr >= s_m (see the module docstring). `lr` is the step on the summed loss."""
    variance, others, lr = variance.double(), others.double(), lr.double()
    exact = torch.log1p(1.0 / (variance * others)) / -torch.log1p(-lr / variance)
    steps = exact.nan_to_num(posinf=l_max).round().clamp(1, l_max)
    steps = torch.where(variance <= lr, torch.ones_like(steps), steps)
    return torch.where(variance <= 0, torch.full_like(steps, l_max), steps).long()


def initial_point(personal: Tensors, broadcast: Tensors, coefficient: torch.Tensor) -> Tensors:
    """Eq. 10: theta - c_m (theta_m - theta) with c_m = w_m / W_-m [K]; c_m = 0 starts from the broadcast."""
    return {n: broadcast[n] - per_client(coefficient, v) * (v - broadcast[n]) for n, v in personal.items()}


def trace_variance(models: Tensors) -> float:
    """Eq. 14: the empirical variance (1/K) of K models, summed over all their entries."""
    k = len(next(iter(models.values())))
    return float(sum((v - v.mean(0)).pow(2).sum(dtype=torch.float64) for v in models.values()) / k)


def precision_mean(models: Tensors, weights: torch.Tensor) -> Tensors:
    """Eq. 11: sum_m w_m theta_m / sum_m w_m."""
    share = weights / weights.sum()
    return {n: torch.tensordot(share.to(v.device, v.dtype), v, dims=1) for n, v in models.items()}


def welford(count: torch.Tensor, mean: Tensors, variance: torch.Tensor,
            value: Tensors) -> tuple[torch.Tensor, Tensors, torch.Tensor]:
    """Eq. 19: fold one more model into each client's running mean and variance (1/t, summed over entries)."""
    t = count + 1
    delta = {n: value[n] - m for n, m in mean.items()}
    squared = sum(d.reshape(len(d), -1).pow(2).sum(1, dtype=torch.float64) for d in delta.values())
    t64 = t.double()
    variance = (t64 - 1) / t64 * variance.double() + (t64 - 1) / t64.pow(2) * squared
    mean = {n: m + delta[n] / per_client(t, m) for n, m in mean.items()}
    return t, mean, variance


# ---- the algorithm ------------------------------------------------------------------------------------------
@dataclass
class SelfFLUpload(Upload):
    """A client's personal model (`shared`) with who sent it, its variance s_m, (Alg. 2) its local optimum, and
    (Alg. 1) the personal model it replaces in Eq. 14's set."""

    clients: torch.Tensor | None = None
    variance: torch.Tensor | None = None
    optimum: Tensors | None = None
    previous: Tensors | None = None


class PrecisionMean(Aggregator):
    """Server side (Eqs. 14, 11 and the smoothing): keeps the round's uploads, then weights them by precision.
    Server state: `variance` (the last s_k each client reported, [n_clients]), `sigma0_sq` (s0) and, for Eq. 14
    over every client's latest model, `origin` (theta^0), `offset_sum` (sum_m theta_m - theta^0) and
    `offset_sq` (sum_m ||theta_m - theta^0||^2)."""

    def __init__(self, smoothing: bool, known_sigma0_sq: float | None = None):
        self.smoothing, self.known_sigma0_sq = smoothing, known_sigma0_sq
        self.uploads: list[SelfFLUpload] = []
        self.upload_bytes = 0

    def add(self, upload: SelfFLUpload, info: RoundInfo) -> None:
        self.uploads.append(upload)
        for models in (upload.shared, upload.optimum or {}):
            self.upload_bytes += sum(v.numel() * v.element_size() for v in models.values())
        self.upload_bytes += upload.variance.numel() * upload.variance.element_size()

    def result(self, info: RoundInfo, state: dict[str, Any]) -> tuple[Tensors, dict[str, Any]]:
        broadcast = info.broadcast
        models = {n: torch.cat([u.shared[n] for u in self.uploads]) for n in broadcast}
        variance = torch.cat([u.variance for u in self.uploads]).cpu()
        state = {**state, **self.spread(info, state)}
        target = precision_mean(models, precision(variance, state["sigma0_sq"]))
        reported = state["variance"].clone()
        reported[torch.cat([u.clients for u in self.uploads]).cpu()] = variance.double()
        activity = len(variance) / info.n_clients if self.smoothing else 1.0
        step = {n: activity * (broadcast[n] - target[n]) for n in broadcast}
        return step, {**state, "variance": reported}

    def spread(self, info: RoundInfo, state: dict[str, Any]) -> dict[str, Any]:
        """s0 and what it is kept from: given (`known`), Eq. 22 on the round's local optima (Alg. 2), or Eq. 14 on
        every client's latest personal model (Alg. 1), through the running sums."""
        if self.known_sigma0_sq is not None:
            return {"sigma0_sq": self.known_sigma0_sq}
        if self.uploads[0].optimum is not None:
            optima = {n: torch.cat([u.optimum[n] for u in self.uploads]) for n in info.broadcast}
            return {"sigma0_sq": trace_variance(optima)} if len(next(iter(optima.values()))) >= 2 else {}
        origin = state.get("origin") or {n: v.detach().clone() for n, v in info.broadcast.items()}
        total = dict(state.get("offset_sum")
                     or {n: torch.zeros_like(v, dtype=torch.float64) for n, v in origin.items()})
        squares = float(state.get("offset_sq", 0.0))
        for u in self.uploads:
            for n, start in origin.items():
                new, old = u.shared[n].double() - start.double(), u.previous[n].double() - start.double()
                total[n] = total[n] + (new - old).sum(0)
                squares += float(new.pow(2).sum() - old.pow(2).sum())
        m = info.n_clients
        sigma0_sq = squares / m - sum(float(t.pow(2).sum()) for t in total.values()) / m**2
        return {"sigma0_sq": max(sigma0_sq, 0.0), "origin": origin, "offset_sum": total, "offset_sq": squares}


class KnownVariances(BaseModel):
    """The paper's synthetic setting (App. G.1): s0 and the per-sample variance v^2 given, s_m = v^2 / N_m."""

    model_config = ConfigDict(extra="forbid")

    sigma0_sq: float = Field(ge=0)
    sample_variance: float = Field(gt=0)


class SelfFLParams(AlgorithmParams):
    """l_max: cap on the local steps of Eq. 8 (paper: 40); smoothing: theta <- (1 - C) theta + C theta_hat;
    known: use given variances (the paper's synthetic runs) instead of estimating them."""

    l_max: int = Field(40, ge=1)
    smoothing: bool = True
    known: KnownVariances | None = None


class SelfFL(Algorithm):
    """Uncertainty-driven local steps and initialisation of a personal copy per client, precision-weighted server."""

    name = "selffl"
    Params = SelfFLParams
    tunable = {"local.lr": Tunable(1e-3, 10.0, source=(  # the scale of Eq. 8's eta = lr / N_m
                   "Chen et al., NeurIPS 2022 (Self-FL), Sec. 4.2 and App. G.3: lr 0.01 (FEMNIST, CIFAR-10), 0.03 "
                   "(MNIST), 0.3 (Sent140); fedpilot: widened to 1e-3 and 10 (Shakespeare's 1)")),
               "params.l_max": Tunable(1, 40, integer=True, budget=True, source=(
                   "Chen et al., NeurIPS 2022 (Self-FL), Sec. 4.2: l_max = 40; fedpilot: down to 1"))}
    personal_copy = True

    def __init__(self, params: AlgorithmParams | dict[str, Any] | None = None):
        super().__init__(params)
        self.shapes: dict[str, torch.Size] = {}

    @property
    def personal_part(self) -> str | None:
        return "all"

    def aggregator(self) -> PrecisionMean:
        return PrecisionMean(self.params.smoothing, self.params.known.sigma0_sq if self.params.known else None)

    def server_state(self, n_clients: int) -> dict[str, Any]:
        """Each client's last reported variance (0 before its first report: the paper's initial s) and s0."""
        return {"variance": torch.zeros(n_clients, dtype=torch.float64), "sigma0_sq": 0.0}

    def prepare_model(self, model: torch.nn.Module, input_shape: tuple[int, ...]) -> None:
        """Nothing is added to the model; the parameter shapes size the running means of the client state."""
        self.shapes = {n: p.shape for n, p in model.named_parameters()}

    def client_state(self) -> dict[str, torch.Tensor]:
        if not self.shapes:
            raise RuntimeError("Self-FL: call prepare_model(model, input_shape) before building the stage")
        zero = torch.zeros(())
        return {"activations": zero, "variance": zero.double(), "steps": zero,
                **{f"mean.{n}": torch.zeros(shape) for n, shape in self.shapes.items()}}

    def local_update(self, cohort: Cohort) -> Upload:
        variances, sigma0_sq = self.variances(cohort)
        steps, coefficient = self.client_plan(cohort, variances, sigma0_sq)
        previous = dict(cohort.personal)
        cohort.personal = initial_point(cohort.personal, cohort.shared, coefficient)
        trained = cohort.sgd("personal", steps=steps).personal
        optimum = self.local_optimum(cohort, trained)
        means = {n: cohort.state[f"mean.{n}"] for n in trained}
        count, means, variance = welford(cohort.state["activations"], means, cohort.state["variance"],
                                         optimum if optimum is not None else trained)
        cohort.personal = trained
        cohort.state = {"activations": count, "variance": variance, "steps": cohort.chunk_of(steps).float(),
                        **{f"mean.{n}": m for n, m in means.items()}}
        reported = variance if self.params.known is None else variances[cohort.clients.cpu()].to(variance)
        return SelfFLUpload(shared=trained, clients=cohort.clients, variance=reported, optimum=optimum,
                            previous=previous if optimum is None else None)

    def variances(self, cohort: Cohort) -> tuple[torch.Tensor, float]:
        """Every client's s_k [n_clients] and s0 as the round starts: the server's (its clients' last reports and
        its estimate), or the known ones."""
        if self.params.known is None:
            return cohort.server_state["variance"], cohort.server_state["sigma0_sq"]
        sizes = cohort.train_samples(torch.arange(cohort.n_clients)).cpu().double()
        return self.params.known.sample_variance / sizes, self.params.known.sigma0_sq

    def client_plan(self, cohort: Cohort, variances: torch.Tensor,
                    sigma0_sq: float) -> tuple[torch.Tensor, torch.Tensor]:
        """From s0 and every client's variance: l_m of the whole cohort (Eq. 8; `sgd` takes a per-client `steps`
        tensor of the whole cohort) and this chunk's Eq. 10 coefficients w_m / W_-m (0 at a first activation)."""
        variance = variances[cohort.cohort_clients.cpu()]
        own = precision(variance, sigma0_sq)
        others = precision(variances, sigma0_sq).sum() - own  # W_-m = P - w_m
        lr = cohort.local.lr * cohort.lr_factor / cohort.train_samples(cohort.cohort_clients).cpu().double()
        steps = local_steps(variance, others, lr, self.params.l_max)  # lr: the step on the summed loss
        first = cohort.state["activations"].cpu() == 0
        return steps, cohort.chunk_of(own / others).masked_fill(first, 0.0)

    def local_optimum(self, cohort: Cohort, trained: Tensors) -> Tensors | None:
        """Algorithm 1 uses the personal model itself as the surrogate of the local optimum."""
        return None


class SelfFLAugParams(SelfFLParams):
    """optimum_steps: the extra local steps standing for Algorithm 2's "train until convergence"."""

    optimum_steps: int = Field(100, ge=1)


class SelfFLAug(SelfFL):
    """Algorithm 2 (Augmented Self-FL): variances from a further-trained local optimum per client."""

    name = "selffl_aug"
    Params = SelfFLAugParams

    def local_optimum(self, cohort: Cohort, trained: Tensors) -> Tensors | None:
        cohort.personal = trained
        return cohort.sgd("personal", steps=self.params.optimum_steps).personal
