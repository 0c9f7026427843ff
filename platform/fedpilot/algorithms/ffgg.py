"""FFGG: Fine-tuning Followed by Global Gradient (Mishchenko et al. 2023, arXiv, "Partially personalized FL:
breaking the curse of data heterogeneity"), with its local-steps, asynchronous and Byzantine-robust variants.

The model is (theta, w_m): shared parameters theta and a personal part w_m. FFGG solves F(theta) = 0 with
F_m(theta) = grad_theta f_m(theta, w*_m(theta)), w*_m(theta) = argmin_w f_m(theta, w). Every variant is
stateless (paper Sec. 1.2, point 3): a client re-initialises w at each participation and the engine keeps
nothing personal; a pipeline measures the personal models with a fine-tuning stage after it (paper App. E.3).

`ffgg` (Algorithm 1 with the local SGD fine-tuner, Algorithm 2), one round:
    client m in C_r:  w <- w0;  tau steps  w <- w - gamma_w grad_w f_m(theta_r, w)     (Algorithm 2)
                      send Delta_m = grad_theta f_m(theta_r, w)
    server:           theta_{r+1} = theta_r - gamma_theta * mean_{m in C_r} Delta_m     (line 7)
`ffgg_local` (Algorithm 4): after the fine-tuner, K alternations of one w step and one theta step on the
    client (theta at gamma_theta), send theta_r - theta_{r,K}; the server subtracts their mean (no step size).
`ffgg_async` (Algorithm 3): a client's update is computed at a stale model theta_{r-d} and applied at round r.
`ffgg_robust` (Algorithm 5): a fixed fraction of clients is Byzantine; the server applies a robust aggregate.

Choices the paper leaves open (each one tested in tests/test_algo_ffgg.py):

* Algorithm 2's budget. `tau` SGD steps on w at rate `lr_w` (gamma_w), each on one fresh minibatch of the
  stage's `local.batch_size`; tau null = the stage's `local` block (epochs or steps), i.e. the "one local epoch"
  of the real-data experiments (Sec. 3.3). A batch size >= every client's train set gives Algorithm 2's full
  gradient steps. The local block's clip_norm, weight_decay and lr schedule apply to these steps.
* Initialisation of w. Algorithm 2 says "randomly", the analysis (Remark 1) uses a fixed w0 = 0; we take the
  stage's starting personal value (the model's random initialisation, or the value carried from the previous
  stage: the FedAvg-pretrained head), the same for every participation, as the engine's stateless mode hands it.
* Delta_m = grad_theta f_m(theta_r, w_m): the mean of the minibatch gradients of `grad_epochs` passes over the
  client's train set (1.0: one pass; exact with a batch >= the client's train set).
* Server. Line 7 is a uniform mean over C_r (not weighted by sample counts); the stage's server optimizer
  (sgd, lr gamma_theta, momentum 0) then takes theta_r - gamma_theta * mean: `server.lr` IS gamma_theta.
  Local FFGG uploads theta_{r,K} and line 11 has no step size: use server lr 1.
* Local FFGG's K (`alt_steps`): null = each client's step count of the stage's local budget (local.steps, or
  ceil(epochs * ceil(n_m / batch)) as the engine's epoch plan counts them); the theta steps use `lr_theta`
  (gamma_theta on the client; null = local.lr). Each step draws a fresh minibatch.
* Asynchrony is simulated in rounds: each sampled client gets a delay d, uniform on {0, .., max_delay}, drawn
  from a generator seeded by (seed, stage, round) for the whole cohort (so it does not depend on chunking);
  it fine-tunes AND takes its gradient at theta_{r-d} (Algorithm 3 lines 6-7: both at the model it received),
  and the server applies the mean of these stale gradients to theta_r. The server keeps the last max_delay + 1
  models in its checkpointed state; a delay reaching before the stage's first round reads theta_0 (the paper's
  initialisation (15): the first clients all start from theta_0). With clients_per_round 1 this is exactly
  Algorithm 3's server step theta_{r+1} = theta_r - gamma_theta Delta^{r-d}_j with i.i.d. delays; with larger
  cohorts it averages several stale updates per step (buffered asynchrony). max_delay 0 is `ffgg`.
* Byzantine clients: floor(byzantine_fraction * n_clients) clients, chosen once per stage by a seeded
  permutation (the paper's fixed set B). They compute the honest update, then send, by `attack`:
  sign_flip: -attack_scale * Delta_m;  gaussian: attack_scale * N(0, I) noise (drawn for the whole cohort from
  a (seed, stage, round) generator). Algorithm 5 lets every client send each round: clients_per_round null.
* Robust aggregator (Algorithm 5's ARAgg): bucketing (Karimireddy, He, Jaggi, ICLR 2022): a seeded random
  permutation of the round's uploads, cut into ceil(M / bucket_size) buckets, averaged per bucket; then a
  coordinate-wise rule over the bucket means: `median`, `trimmed_mean` (drop floor(trim * buckets) on each
  side; it must be at least bucket_size * byzantine_fraction, the share of buckets a Byzantine client can reach)
  or `mean` (the plain mean of the uploads: no defence, for ablations). Against Definition 2: Karimireddy et al.
  (Thm. I) show that bucketing with s <= delta_max / delta turns the coordinate-wise median into a
  (delta_max, c)-agnostic robust aggregator (delta_max < 1/4, c = O(d)); it is agnostic since nothing in it depends on
  sigma. The coordinate-wise median alone is not (the paper, after Definition 2). The defaults, delta = 0.1 and s = 2,
  satisfy s * delta < 1/4. The rule is unweighted (Algorithm 5), so clients cannot inflate their weight.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from fedpilot.api import (
    Aggregator,
    Algorithm,
    AlgorithmParams,
    Cohort,
    LocalConfig,
    RoundInfo,
    Tensors,
    Tunable,
    Upload,
    WeightedMean,
    round_generator,
)

DELAYS, ATTACK_NOISE, BUCKETS, BYZANTINES = 1, 2, 3, 4  # tags of the seeded generators (never a plan's phase key)
CLIENT_LR = Tunable(1e-4, 10.0, fallback="local.lr", source=(
    "Mishchenko et al. 2023 (FFGG), App. E, Table 2: client lr 1e-3 to 1e-1 (Pillutla et al.'s setup); fedpilot: "
    "widened to 1e-4 and 10"))


class FineTunerParams(AlgorithmParams):
    """tau: Algorithm 2's steps on w (null = the stage's local block); lr_w: gamma_w (null = local.lr)."""

    tau: int | None = Field(None, ge=1)
    lr_w: float | None = Field(None, gt=0)


class FfggParams(FineTunerParams):
    """grad_epochs: passes over the client's data averaged into grad_theta f_m (Delta_m)."""

    grad_epochs: float = Field(1.0, gt=0)


class LocalFfggParams(FineTunerParams):
    """alt_steps: K alternations of a w step and a theta step (null = the local budget's step count);
    lr_theta: the clients' gamma_theta (null = local.lr)."""

    alt_steps: int | None = Field(None, ge=1)
    lr_theta: float | None = Field(None, gt=0)


class AsyncFfggParams(FfggParams):
    """max_delay: delays are uniform on {0, .., max_delay} rounds. The paper assumes bounded delays (Assumption 5)
    and gives no value: 4 is our choice; 0 is synchronous FFGG, clients_per_round 1 is Algorithm 3 exactly."""

    max_delay: int = Field(4, ge=0)


class RobustFfggParams(FfggParams):
    """Byzantine clients (a fixed fraction, their attack and its scale) and the robust aggregator. The paper has no
    Byzantine experiment: these defaults are our choices (see the module docstring for the rules)."""

    byzantine_fraction: float = Field(0.1, ge=0, lt=0.5)
    attack: Literal["sign_flip", "gaussian"] = "sign_flip"
    attack_scale: float = Field(10.0, gt=0)
    rule: Literal["median", "trimmed_mean", "mean"] = "median"
    bucket_size: int = Field(2, ge=1)
    trim: float = Field(0.2, ge=0, lt=0.5)


class Stateless(Algorithm):
    """FFGG's clients keep nothing: w restarts from the stage's starting value at every participation. A shared
    part theta is needed; a personal part w is not (without one FFGG is distributed gradient descent)."""

    needs = frozenset({"shared"})

    @property
    def stateful(self) -> bool:
        return False


class Ffgg(Stateless):
    """Algorithm 1: fine-tune w on theta_r (Algorithm 2), send grad_theta f_m(theta_r, w); uniform mean on the
    server."""

    name = "ffgg"
    Params = FfggParams
    tunable = {"params.lr_w": CLIENT_LR,
               "server.lr": Tunable(1e-3, 10.0, source=(  # gamma_theta: the server's sgd steps on a mean gradient
                   "Mishchenko et al. 2023 (FFGG), App. E, Table 2: server lr 1 with FedAvg's sgd server (EMNIST; "
                   "Stack Overflow's and GLDv2's are adam's); fedpilot: 1e-3 to 10")),
               "params.grad_epochs": Tunable(0.1, 2.0, budget=True, source=(
                   "Mishchenko et al. 2023 (FFGG), Algorithm 1, line 5: the full gradient, 1 pass; fedpilot: 0.1 to 2 "
                   "(the matched budget's 0.16-0.5)"))}
    batches_trials = True

    def local_update(self, cohort: Cohort) -> Upload:
        model, params = self.client_model(cohort), cohort.params  # a batch of trials' rows: lr_w per row
        cohort.personal = personal_steps(cohort, params.lr_w, params.tau, model)  # Algorithm 2
        grad = cohort.gradient("shared", epochs=params.grad_epochs, shared=model)
        return Upload(grad=grad, weight=torch.ones_like(cohort.weights))

    def client_model(self, cohort: Cohort) -> Tensors | None:
        """The shared parameters each client works at [K, ...], or None for the broadcast theta_r."""
        return None


def personal_steps(cohort: Cohort, lr: float | torch.Tensor | None, steps: int | torch.Tensor | None,
                   model: Tensors | None = None) -> Tensors:
    """SGD steps on w (null: the local block) with theta fixed, at `model` if given. Without a personal part there
    is nothing to tune: FFGG is then distributed gradient descent and Local FFGG is FedAvg (paper, Sec. 2)."""
    if not cohort.personal:
        return cohort.personal
    return cohort.sgd("personal", lr=lr, steps=steps, shared=model).personal


class LocalFfgg(Stateless):
    """Algorithm 4: fine-tune w, then K alternating steps (w, then theta at the new w); send theta_{r,K}."""

    name = "ffgg_local"
    Params = LocalFfggParams
    tunable = {"params.lr_w": CLIENT_LR, "params.lr_theta": CLIENT_LR}
    batches_trials = True

    def local_update(self, cohort: Cohort) -> Upload:
        params = cohort.params  # a batch of trials' rows: lr_w and lr_theta per row
        cohort.personal = personal_steps(cohort, params.lr_w, params.tau)  # Algorithm 2
        budget = alternations(cohort.local, cohort.train_samples(cohort.cohort_clients).cpu(), params.alt_steps)
        theta = None
        for k in range(int(budget.max())):
            active = (budget > k).long()
            cohort.personal = personal_steps(cohort, params.lr_w, active, theta)
            theta = cohort.sgd("shared", lr=params.lr_theta, steps=active, shared=theta).shared
        return Upload(shared=theta, weight=torch.ones_like(cohort.weights))


def alternations(local: LocalConfig, sizes: torch.Tensor, alt_steps: int | None) -> torch.Tensor:
    """K for clients with `sizes` train samples: `alt_steps`, or each one's step count of the `local` budget."""
    if alt_steps is not None or local.steps is not None:
        return torch.full_like(sizes, alt_steps or local.steps)
    return torch.ceil(local.epochs * torch.ceil(sizes / local.batch_size)).long()


class AsyncFfgg(Ffgg):
    """Algorithm 3 in rounds: each client fine-tunes and takes its gradient at theta_{r-d}, d ~ U{0..max_delay}."""

    name = "ffgg_async"
    Params = AsyncFfggParams
    batches_trials = False  # its clients work at models the server keeps (its state), each trial its own

    def aggregator(self) -> RecentModels:
        return RecentModels(self.params.max_delay)

    def client_model(self, cohort: Cohort) -> Tensors:
        models = {**cohort.server_state.get("models", {}), cohort.round: cohort.shared}
        delays = cohort.chunk_of(draw_delays(cohort.round_key, cohort.cohort_size, self.params.max_delay))
        origin = (cohort.round - delays).clamp_min(min(models))
        return {n: torch.stack([models[int(r)][n] for r in origin]) for n in cohort.shared}


class RecentModels(WeightedMean):
    """FFGG's mean of the round's gradients; the server also keeps the models it broadcast in the last
    `max_delay` rounds (server state `models`, round -> parameters) for the clients that work at stale ones."""

    def __init__(self, max_delay: int):
        super().__init__()
        self.max_delay = max_delay

    def result(self, info: RoundInfo, state: dict) -> tuple[Tensors, dict]:
        kept = {r: m for r, m in state.get("models", {}).items() if r > info.round - self.max_delay}
        if self.max_delay:
            kept[info.round] = {n: v.clone() for n, v in info.broadcast.items()}
        return self.normalized(), {**state, "models": kept}


def draw_delays(round_key: tuple[int, ...], cohort_size: int, max_delay: int) -> torch.Tensor:
    """The delays of a whole cohort [cohort_size], uniform on {0, .., max_delay}, from its (seed, stage, round)."""
    gen = round_generator(*round_key, 0, DELAYS)
    return torch.randint(0, max_delay + 1, (cohort_size,), generator=gen)


class RobustFfgg(Ffgg):
    """Algorithm 5: honest clients send FFGG's Delta_m, Byzantine ones an attack; bucketing + a robust rule."""

    name = "ffgg_robust"
    Params = RobustFfggParams

    def aggregator(self) -> RobustAggregate:
        return RobustAggregate(self.params.rule, self.params.bucket_size, self.params.trim)

    def local_update(self, cohort: Cohort) -> Upload:
        upload = super().local_update(cohort)
        seed, stage = cohort.round_key[:2]
        byzantine = byzantine_clients(seed, stage, cohort.n_clients, self.params.byzantine_fraction)
        bad = torch.isin(cohort.clients.cpu(), byzantine).to(cohort.weights.device)
        sent = self.attack(cohort, upload.grad)
        upload.grad = {n: torch.where(cohort.per_client(bad, g), sent[n], g) for n, g in upload.grad.items()}
        return upload

    def attack(self, cohort: Cohort, grads: Tensors) -> Tensors:
        """What Byzantine clients send instead of their honest `grads` [K, ...]."""
        scale = self.params.attack_scale
        if self.params.attack == "sign_flip":
            return {n: -scale * g for n, g in grads.items()}
        gen = round_generator(*cohort.round_key, 0, ATTACK_NOISE)
        return {n: scale * cohort.chunk_of(torch.randn((cohort.cohort_size, *g.shape[1:]), generator=gen)).to(g)
                for n, g in grads.items()}


def byzantine_clients(seed: int, stage: int, n_clients: int, fraction: float) -> torch.Tensor:
    """The stage's fixed Byzantine clients: floor(fraction * n_clients) ids from a (seed, stage) permutation."""
    count = math.floor(fraction * n_clients)
    return torch.randperm(n_clients, generator=round_generator(seed, stage, 0, 0, BYZANTINES))[:count]


class RobustAggregate(Aggregator):
    """Collects every gradient upload of the round, then bucketing + a coordinate-wise rule (`robust_mean`)."""

    def __init__(self, rule: str, bucket_size: int, trim: float) -> None:
        self.rule, self.bucket_size, self.trim = rule, bucket_size, trim
        self.uploads: list[Tensors] = []
        self.upload_bytes = 0

    def add(self, upload: Upload, info: RoundInfo) -> None:
        self.uploads.append(upload.grad)
        self.upload_bytes += sum(g.numel() * g.element_size() for g in upload.grad.values())

    def result(self, info: RoundInfo, state: dict) -> tuple[Tensors, dict]:
        stacked = {n: torch.cat([u[n] for u in self.uploads]) for n in self.uploads[0]}
        gen = round_generator(*info.key, 0, BUCKETS)
        return robust_mean(stacked, self.rule, self.bucket_size, self.trim, gen), state


def robust_mean(values: Tensors, rule: str, bucket_size: int, trim: float, gen: torch.Generator) -> Tensors:
    """Bucketing then a coordinate-wise trimmed mean of the bucket means, for M inputs [M, ...] per name.

    The same random permutation of the M inputs cuts every tensor into ceil(M / bucket_size) buckets (the last
    one may be smaller); `median` keeps the middle one or two bucket means per coordinate, `trimmed_mean` drops
    floor(trim * buckets) at each end; `mean` is the plain mean of the M inputs (no defence).
    """
    if rule == "mean":
        return {name: v.mean(0) for name, v in values.items()}
    m = len(next(iter(values.values())))
    order = torch.randperm(m, generator=gen)
    buckets = math.ceil(m / bucket_size)
    drop = (buckets - 1) // 2 if rule == "median" else math.floor(trim * buckets)
    out = {}
    for name, v in values.items():
        shuffled = v[order.to(v.device)]
        means = torch.stack([shuffled[i : i + bucket_size].mean(0) for i in range(0, m, bucket_size)])
        out[name] = means.sort(dim=0).values[drop : buckets - drop].mean(0)
    return out
