"""FFGG (Mishchenko et al. 2023): Theorems 1-4 on the paper's linear-quadratic problem; the engine's rounds are
Algorithms 1-5 computed by hand; vectorized = sequential; the robust aggregator against Definition 2; bad params."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.ffgg import alternations, byzantine_clients, draw_delays, robust_mean
from fedpilot.engine.batches import epoch_plan, round_generator
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from test_algo_pflego import FULL_BATCH, client_loss
from test_engine_equivalence import HEAD, INPUT, assert_close, run_stage


# ---- the paper's linear-quadratic problem (Sec. 3.1): Theorems 1-4 ----------------------------------------------
class LinearQuadratic:
    """f_m(theta, w) = 1/2 ||H_m theta - b_m||^2 + 1/2 ||A_m theta + B_m w - y_m||^2 (Example 1, Sec. 3.1).

    H, A, B uniform on [0, 1] divided by their second dimension as in the paper, at a tiny size; b_m and y_m are
    made from one theta* and a w*_m per client, so Assumption 2 (overpersonalization) holds: F_m(theta*) = 0.
    """

    def __init__(self, clients: int = 6, n: int = 24, d_theta: int = 5, d_w: int = 3, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        u = lambda *shape: torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
        self.H, self.A = u(clients, n, d_theta) / d_theta, u(clients, n, d_theta) / d_theta
        self.B = u(clients, n, d_w) / d_w
        self.theta_star = torch.randn(d_theta, generator=g, dtype=torch.float64)
        w_star = torch.randn(clients, d_w, generator=g, dtype=torch.float64)
        self.b = _mv(self.H, self.theta_star)
        self.y = _mv(self.A, self.theta_star) + _mv(self.B, w_star)
        projector = torch.eye(n, dtype=torch.float64) - self.B @ torch.linalg.pinv(self.B)
        norm = lambda m: float(torch.linalg.matrix_norm(m, 2).max())  # noqa: E731
        self.L = 2 * max(norm(self.H.mT @ self.H), norm(self.A.mT @ projector @ self.A))  # Example 1
        self.L_w = norm(self.B.mT @ self.B)

    def grad_theta(self, theta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """grad_1 f_m for every client [M, d_theta] (theta [d_theta] or per client [M, d_theta])."""
        residual = _mv(self.A, theta) + _mv(self.B, w) - self.y
        return _mv(self.H.mT, _mv(self.H, theta) - self.b) + _mv(self.A.mT, residual)

    def grad_w(self, theta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _mv(self.B.mT, _mv(self.A, theta) + _mv(self.B, w) - self.y)

    def exact_w(self, theta: torch.Tensor) -> torch.Tensor:
        """w*_m(theta) = B_m^+ (y_m - A_m theta) for every client."""
        return torch.linalg.lstsq(self.B, (self.y - _mv(self.A, theta))[..., None]).solution[..., 0]

    def sgd_fine_tuner(self, tau: int):
        """Algorithm 2 (full gradients, w0 = 0 as in Remark 1, gamma_w = 1/L_w)."""

        def solve(theta: torch.Tensor) -> torch.Tensor:
            w = torch.zeros(self.B.shape[0], self.B.shape[2], dtype=torch.float64)
            for _ in range(tau):
                w = w - self.grad_w(theta, w) / self.L_w
            return w

        return solve

    def F(self, theta: torch.Tensor) -> torch.Tensor:
        return self.grad_theta(theta, self.exact_w(theta)).mean(0)


def _mv(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    return (matrix @ vector[..., None])[..., 0]


def ffgg_iterates(problem: LinearQuadratic, solve, rounds: int, gamma: float, cohort: int | None = None) -> list:
    """Algorithm 1: theta_{r+1} = theta_r - gamma * mean over C_r of grad_1 f_m(theta_r, w_m(theta_r))."""
    theta = torch.zeros_like(problem.theta_star)
    iterates = [theta]
    for r in range(rounds):
        deltas = problem.grad_theta(theta, solve(theta))
        if cohort is not None:
            deltas = deltas[torch.randperm(len(deltas), generator=round_generator(r))[:cohort]]
        theta = theta - gamma * deltas.mean(0)
        iterates.append(theta)
    return iterates


def test_theorem_1_exact_ffgg_drives_F_to_zero_within_the_bound():
    problem = LinearQuadratic()
    gamma, rounds = 1 / problem.L, 400
    iterates = ffgg_iterates(problem, problem.exact_w, rounds, gamma)
    norms = torch.stack([problem.F(t).norm() for t in iterates])
    start = float((iterates[0] - problem.theta_star).norm() ** 2)
    for r in range(1, rounds + 1):
        assert float(norms[:r].min() ** 2) <= problem.L * start / (gamma * r)
    assert norms[-1] < 1e-8 * norms[0]
    torch.testing.assert_close(iterates[-1], problem.theta_star)


def test_overpersonalized_problem_converges_with_partial_participation():
    """Every F_m vanishes at theta*, so sampling clients adds no noise floor (Assumption 2)."""
    problem = LinearQuadratic()
    iterates = ffgg_iterates(problem, problem.exact_w, 600, 1 / problem.L, cohort=2)
    assert problem.F(iterates[-1]).norm() < 1e-8 * problem.F(iterates[0]).norm()


def test_more_local_steps_of_algorithm_2_give_a_smaller_F():
    """Theorem 2 / Fig. 1(a): inexact fine-tuning stalls at a floor that more local work lowers."""
    problem = LinearQuadratic()
    final = [float(problem.F(ffgg_iterates(problem, problem.sgd_fine_tuner(tau), 150, 1 / problem.L)[-1]).norm())
             for tau in (1, 10, 100)]
    start = float(problem.F(torch.zeros_like(problem.theta_star)).norm())
    assert final[0] > final[1] > final[2]
    assert final[0] > 1e-2 * start and final[2] < 1e-3 * start


def test_theorem_3_asynchronous_ffgg_with_the_simulated_delays_converges():
    """Algorithm 3 with the module's seeded delays: gradients at theta_{r-d} applied at theta_r."""
    problem = LinearQuadratic()
    clients, max_delay, rounds = problem.H.shape[0], 4, 1500
    gamma = 1 / (2 * problem.L * math.sqrt(2 * clients * max_delay))  # Theorem 7's step size
    history = [torch.zeros_like(problem.theta_star)]
    for r in range(rounds):
        client = int(torch.randint(clients, (1,), generator=round_generator(r)))
        stale = history[max(r - int(draw_delays((0, 0, r), 1, max_delay)), 0)]
        history.append(history[-1] - gamma * problem.grad_theta(stale, problem.exact_w(stale))[client])
    assert problem.F(history[-1]).norm() < 1e-3 * problem.F(history[0]).norm()


def robust_iterates(problem: LinearQuadratic, rule: str, attack: str, rounds: int = 400) -> torch.Tensor:
    """Algorithm 5 with exact g_m = F_m(theta): 2 Byzantine clients of 20, bucketing s = 2, gamma = 1/(2L)."""
    theta, bad = torch.zeros_like(problem.theta_star), torch.tensor([3, 11])
    for r in range(rounds):
        g = problem.grad_theta(theta, problem.exact_w(theta))
        if attack == "sign_flip":
            g[bad] = -10 * g[bad]
        else:
            g[bad] = 10 * torch.randn(len(bad), g.shape[1], generator=round_generator(r), dtype=g.dtype)
        theta = theta - robust_mean({"g": g}, rule, 2, 0.2, round_generator(r, 1))["g"] / (2 * problem.L)
    return (theta - problem.theta_star).norm() / problem.theta_star.norm()


@pytest.mark.parametrize("attack", ["sign_flip", "gaussian"])
def test_theorem_4_robust_ffgg_converges_under_attack_while_the_mean_does_not(attack):
    problem = LinearQuadratic(clients=20)
    assert robust_iterates(problem, "median", attack) < 1e-3
    assert robust_iterates(problem, "mean", attack) > 0.1


def test_bucketed_median_meets_definition_2_empirically_and_the_mean_does_not():
    """E||x_hat - x_bar||^2 <= c delta sigma^2 with sigma^2 the honest pairwise variance (Definition 2), here
    on Gaussian honest inputs against 2 of 20 inputs at +-1e6: a check on one distribution, not a proof."""
    clients, bad, dim = 20, 2, 5
    sigma2, delta = 2.0 * dim, bad / clients  # E||x_m - x_n||^2 for N(mu, I) inputs
    errors = {"median": [], "trimmed_mean": [], "mean": []}
    for trial in range(200):
        x = torch.randn(clients, dim, generator=round_generator(trial)) + 3.0
        honest = x[bad:].mean(0)
        x[:bad] = 1e6 * (-1) ** trial
        for rule, err in errors.items():
            out = robust_mean({"x": x}, rule, 2, 0.2, round_generator(trial, 1))["x"]
            err.append(float(((out - honest) ** 2).sum()))
    ratio = {rule: sum(err) / len(err) / (delta * sigma2) for rule, err in errors.items()}
    assert ratio["median"] < 2 and ratio["trimmed_mean"] < 2
    assert ratio["mean"] > 1e9


def test_robust_mean_buckets_then_takes_coordinatewise_rules():
    values = {"v": torch.tensor([[1.0, -4.0], [2.0, 9.0], [3.0, 0.0], [100.0, 1.0], [5.0, 2.0]])}
    gen = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    assert torch.equal(robust_mean(values, "median", 1, 0.0, gen())["v"], torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(robust_mean(values, "mean", 2, 0.0, gen())["v"], values["v"].mean(0))
    assert torch.equal(robust_mean(values, "trimmed_mean", 1, 0.2, gen())["v"], torch.tensor([10 / 3, 1.0]))
    order = torch.randperm(5, generator=gen())
    buckets = torch.stack([values["v"][order[i : i + 2]].mean(0) for i in (0, 2, 4)])
    assert torch.equal(robust_mean(values, "median", 2, 0.0, gen())["v"], buckets.median(0).values)


# ---- the engine's rounds against Algorithms 1-5 by hand (full-batch steps: batch 64 > every client) ------------
GAMMA = 0.3


def fine_tuned_gradient(theta: dict, head: dict, data: ToyData, m: int, tau: int, lr_w: float) -> tuple[dict, dict]:
    """Algorithm 2 then line 5 for client m: (w after tau GD steps, grad_theta f_m(theta, w))."""
    for _ in range(tau):
        head = {n: v.clone().requires_grad_() for n, v in head.items()}
        grads = torch.autograd.grad(client_loss({**theta, **head}, data, m), list(head.values()))
        head = {n: (v - lr_w * g).detach() for (n, v), g in zip(head.items(), grads, strict=True)}
    leaves = {n: v.clone().requires_grad_() for n, v in theta.items()}
    grads = torch.autograd.grad(client_loss({**leaves, **head}, data, m), list(leaves.values()))
    return head, dict(zip(theta, grads, strict=True))


def stage_of(algo: str, params: dict, rounds: int = 1, clients_per_round: int | None = 5, server_lr: float = GAMMA,
             data: ToyData | None = None, personal: list[str] = HEAD) -> tuple[FederatedStage, dict]:
    """A fitted stage with a personal head (full-batch local steps) and the model's starting parameters."""
    torch.manual_seed(0)
    model = TinyMLP()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = StageConfig(rounds=rounds, clients_per_round=clients_per_round, local=FULL_BATCH, server={"lr": server_lr})
    stage = stage_for(model, personal, data or ToyData(), build_algorithm(algo, params), cfg)
    fit(stage)
    return stage, start


def split(params: dict) -> tuple[dict, dict]:
    return {n: v for n, v in params.items() if n not in HEAD}, {n: v for n, v in params.items() if n in HEAD}


def shared_of(stage: FederatedStage) -> dict:
    return split({n: p.detach() for n, p in stage.model.named_parameters()})[0]


def mean_of(dicts: list[dict]) -> dict:
    return {n: torch.stack([d[n] for d in dicts]).mean(0) for n in dicts[0]}


def test_ffgg_round_is_algorithm_1_with_algorithm_2_and_keeps_nothing_personal():
    stage, start = stage_of("ffgg", {"tau": 3, "lr_w": 0.5})
    theta, head = split(start)
    grads = [fine_tuned_gradient(theta, head, ToyData(), m, 3, 0.5)[1] for m in stage.sample_cohort(0).tolist()]
    step = mean_of(grads)  # uniform over C_r, not weighted by sample counts
    assert_close(shared_of(stage), {n: v - GAMMA * step[n] for n, v in theta.items()})
    assert_close({n: stage.bank.tensor(n) for n in HEAD}, {n: v.expand(12, *v.shape) for n, v in head.items()})


@pytest.mark.parametrize(("algo", "params", "server_lr", "steps", "lr"), [
    ("ffgg", {}, GAMMA, 1, GAMMA),  # theta - gamma * mean grad f_m(theta): distributed gradient descent
    ("ffgg_local", {"alt_steps": 2}, 1.0, 2, FULL_BATCH.lr),  # mean of 2 local GD steps: FedAvg
])
def test_without_a_personal_part_ffgg_is_gradient_descent_and_local_ffgg_is_fedavg(algo, params, server_lr, steps, lr):
    stage, start = stage_of(algo, params, server_lr=server_lr, personal=[])
    finals = []
    for m in stage.sample_cohort(0).tolist():
        theta = dict(start)
        for _ in range(steps):
            grad = fine_tuned_gradient(theta, {}, ToyData(), m, 0, 0.0)[1]
            theta = {n: v - lr * grad[n] for n, v in theta.items()}
        finals.append(theta)
    assert_close({n: p.detach() for n, p in stage.model.named_parameters()}, mean_of(finals))


def test_local_ffgg_round_is_algorithm_4():
    tau, k, lr_w, lr_theta = 2, 3, 0.5, 0.2
    stage, start = stage_of("ffgg_local", {"tau": tau, "alt_steps": k, "lr_w": lr_w, "lr_theta": lr_theta},
                            server_lr=1.0)
    data, finals = ToyData(), []
    for m in stage.sample_cohort(0).tolist():
        theta, head = split(start)
        head = fine_tuned_gradient(theta, head, data, m, tau, lr_w)[0]
        for _ in range(k):
            head, grad = fine_tuned_gradient(theta, head, data, m, 1, lr_w)  # w step, then grad_1 at the new w
            theta = {n: v - lr_theta * grad[n] for n, v in theta.items()}
        finals.append(theta)
    assert_close(shared_of(stage), mean_of(finals))  # theta_r - mean(theta_r - theta_{r,K})


def test_local_ffgg_default_alternations_count_the_local_budget_like_the_epoch_plan():
    local, data = LocalConfig(epochs=1.5, batch_size=4), ToyData()
    plan = epoch_plan(data.offsets["train"], data.sizes["train"], 1.5, 4, torch.Generator())
    assert torch.equal(alternations(local, data.sizes["train"], None), plan.active.sum(1))
    assert torch.equal(alternations(local, data.sizes["train"], 7), torch.full((12,), 7))
    assert torch.equal(alternations(LocalConfig(steps=2), data.sizes["train"], None), torch.full((12,), 2))


def test_async_rounds_use_gradients_at_the_delayed_models():
    rounds, max_delay, cohort = 4, 2, 4
    stage, start = stage_of("ffgg_async", {"tau": 2, "lr_w": 0.5, "max_delay": max_delay}, rounds, cohort)
    theta0, head = split(start)
    models, used_stale = [theta0], False
    for r in range(rounds):
        delays = draw_delays((0, 0, r), cohort, max_delay)
        used_stale |= bool(((delays > 0) & (r - delays >= 0)).any())
        grads = [fine_tuned_gradient(models[max(r - int(d), 0)], head, ToyData(), m, 2, 0.5)[1]
                 for m, d in zip(stage.sample_cohort(r).tolist(), delays, strict=True)]
        step = mean_of(grads)
        models.append({n: v - GAMMA * step[n] for n, v in models[-1].items()})
    assert used_stale
    assert_close(shared_of(stage), models[-1])
    assert sorted(stage.server_state["models"]) == [2, 3]  # the last max_delay models (the next is the broadcast)


def test_async_with_no_delay_is_ffgg():
    params = {"tau": 2, "lr_w": 0.5}
    assert_close(shared_of(stage_of("ffgg_async", {**params, "max_delay": 0}, rounds=3)[0]),
                 shared_of(stage_of("ffgg", params, rounds=3)[0]))


def test_byzantine_clients_are_a_fixed_seeded_fraction():
    chosen = byzantine_clients(0, 1, 50, 0.1)
    assert len(chosen) == 5 and len(set(chosen.tolist())) == 5 and int(chosen.max()) < 50
    assert torch.equal(chosen, byzantine_clients(0, 1, 50, 0.1))
    assert not torch.equal(chosen, byzantine_clients(1, 1, 50, 0.1))
    assert len(byzantine_clients(0, 1, 50, 0.0)) == 0 and len(byzantine_clients(0, 0, 19, 0.1)) == 1


def test_sign_flipping_byzantines_send_minus_scale_times_their_gradient():
    params = {"tau": 2, "lr_w": 0.5, "byzantine_fraction": 0.25, "attack_scale": 3.0, "rule": "mean", "bucket_size": 1}
    stage, start = stage_of("ffgg_robust", params, clients_per_round=None)
    theta, head = split(start)
    bad = set(byzantine_clients(0, 0, 12, 0.25).tolist())
    sent = []
    for m in range(12):
        grad = fine_tuned_gradient(theta, head, ToyData(), m, 2, 0.5)[1]
        sent.append({n: -3.0 * g if m in bad else g for n, g in grad.items()})
    assert len(bad) == 3
    assert_close(shared_of(stage), {n: v - GAMMA * mean_of(sent)[n] for n, v in theta.items()})


def test_robust_without_byzantines_and_a_plain_mean_is_ffgg():
    params = {"tau": 2, "lr_w": 0.5}
    robust = {**params, "byzantine_fraction": 0.0, "rule": "mean", "bucket_size": 1}
    assert_close(shared_of(stage_of("ffgg_robust", robust, rounds=2)[0]),
                 shared_of(stage_of("ffgg", params, rounds=2)[0]))


def test_robust_ffgg_under_noise_attack_keeps_the_honest_progress_while_averaging_is_thrown_off():
    """Objective: the honest clients' mean loss after fine-tuning w (Algorithm 2) at theta."""
    data = ToyData(n_clients=20)
    honest_clients = sorted(set(range(20)) - set(byzantine_clients(0, 0, 20, 0.1).tolist()))

    def run(params: dict) -> tuple[dict, dict, dict]:
        stage, start = stage_of("ffgg_robust", {"tau": 2, "lr_w": 0.5, "attack": "gaussian", **params}, rounds=4,
                                clients_per_round=None, server_lr=0.5, data=data)
        return (*split(start), shared_of(stage))

    def objective(theta: dict, head: dict) -> float:
        tuned = [fine_tuned_gradient(theta, head, data, m, 2, 0.5)[0] for m in honest_clients]
        losses = [float(client_loss({**theta, **w}, data, m)) for m, w in zip(honest_clients, tuned, strict=True)]
        return sum(losses) / len(losses)

    theta0, head, honest = run({"byzantine_fraction": 0.0, "rule": "mean"})
    robust = run({"byzantine_fraction": 0.1, "rule": "median"})[2]
    averaged = run({"byzantine_fraction": 0.1, "rule": "mean"})[2]
    start, honest, robust, averaged = (objective(t, head) for t in (theta0, honest, robust, averaged))
    assert robust - honest < 0.3 * (start - honest)
    assert averaged > start


# ---- every variant: vectorized and looped engines = the sequential executor; bad params -------------------------
@pytest.mark.parametrize(("algo", "personal", "params", "epochs"), [
    ("ffgg", INPUT, {}, 1.0),
    ("ffgg_local", HEAD, {"tau": 1}, 0.5),  # K differs across clients: 1 to 3 steps
    ("ffgg_async", HEAD, {"max_delay": 2}, 1.0),
    ("ffgg_robust", HEAD, {"byzantine_fraction": 0.25, "attack": "gaussian"}, 1.0),
])
def test_vmap_and_loop_match_sequential(algo, personal, params, epochs):
    local = LocalConfig(epochs=epochs, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)
    reference = run_stage(algo, personal, params, "sequential", 1, local)
    for execution, chunk in [("vmap", 3), ("vmap_autograd", 2), ("loop", 2)]:
        got = run_stage(algo, personal, params, execution, chunk, local)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


@pytest.mark.parametrize(("algo", "params", "key"), [
    ("ffgg", {"tau": 0}, "tau"), ("ffgg", {"lr_w": 0.0}, "lr_w"), ("ffgg", {"grad_epochs": 0}, "grad_epochs"),
    ("ffgg", {"max_delay": 2}, "max_delay"), ("ffgg_local", {"alt_steps": 0}, "alt_steps"),
    ("ffgg_local", {"lr_theta": -1.0}, "lr_theta"), ("ffgg_local", {"grad_epochs": 1.0}, "grad_epochs"),
    ("ffgg_async", {"max_delay": -1}, "max_delay"), ("ffgg_robust", {"byzantine_fraction": 0.5}, "byzantine_fraction"),
    ("ffgg_robust", {"attack": "alie"}, "attack"), ("ffgg_robust", {"rule": "krum"}, "rule"),
    ("ffgg_robust", {"bucket_size": 0}, "bucket_size"), ("ffgg_robust", {"trim": 0.5}, "trim"),
])
def test_bad_params_are_refused_by_name(algo, params, key):
    with pytest.raises(ValidationError, match=key):
        build_algorithm(algo, params)
