"""Self-FL: the closed-form posterior on the paper's scalar synthetic problem, Eqs. 8/10/19 as reconstructed,
the first activation, adaptive step counts, engine paths and resume agree."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from pydantic import ValidationError

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.selffl import (
    initial_point,
    local_steps,
    precision,
    precision_mean,
    trace_variance,
    welford,
)
from fedpilot.engine import FederatedStage, LocalConfig, StageConfig
from test_engine_equivalence import assert_close

ALL = [n for n, _ in TinyMLP().named_parameters()]
LOCAL = LocalConfig(batch_size=4, lr=0.1)


# ---- the paper's scalar synthetic setting (Sec. 4.1, App. G.1) --------------------------------------------------
def synthetic(sigma0_sq: float, max_size: int, seed: int) -> dict[str, torch.Tensor]:
    """M = 20 clients, theta_m ~ N(1.6, sigma0_sq), z_m = mean of N_m ~ U[10, max_size] draws of N(theta_m, 0.1);
    with the closed forms: theta_m^FL and its posterior sd, theta^(G) and its sd."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(10, max_size + 1, (20,), generator=g).double()
    theta = 1.6 + math.sqrt(sigma0_sq) * torch.randn(20, generator=g, dtype=torch.float64)
    s = 0.1 / sizes  # intra-client variance of z_m
    z = theta + s.sqrt() * torch.randn(20, generator=g, dtype=torch.float64)
    w = precision(s, sigma0_sq)
    others = w.sum() - w
    fl = (z / s + (w * z).sum() - w * z) / (1 / s + others)  # posterior mean of theta_m given z_1..z_M
    return {"z": z, "s": s, "fl": fl, "fl_sd": (1 / (1 / s + others)).sqrt(),
            "global": (w * z).sum() / w.sum(), "global_sd": 1 / w.sum().sqrt()}


def self_fl_scalar(z: torch.Tensor, s: torch.Tensor, sigma0_sq: float, per_round: int, eta: float = 1e-4,
                   rounds: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 with the module's Eqs. 8, 10, 11 and smoothing; local training is gradient descent on
    (theta - z_m)^2 / (2 s_m) (its l steps in closed form). Known variances, as the paper's synthetic runs
    (Eq. 16 with N_m, v^2 and sigma_0^2)."""
    m = len(z)
    glob, personal = torch.zeros((), dtype=torch.float64), torch.zeros(m, dtype=torch.float64)
    seen = torch.zeros(m, dtype=torch.bool)
    g = torch.Generator().manual_seed(1)
    for _ in range(rounds):
        c = torch.randperm(m, generator=g)[:per_round]
        own = precision(s[c], sigma0_sq)
        others = precision(s, sigma0_sq).sum() - own
        steps = local_steps(s[c], others, torch.tensor(eta), l_max=10**6)
        coefficient = torch.where(seen[c], own / others, torch.zeros_like(own))
        start = initial_point({"t": personal[c]}, {"t": glob}, coefficient)["t"]
        trained = z[c] + (1 - eta / s[c]) ** steps * (start - z[c])
        target = precision_mean({"t": trained}, own)["t"]
        glob = glob - per_round / m * (glob - target)
        personal[c], seen[c] = trained, True
    return personal, glob


@pytest.mark.parametrize(("sigma0_sq", "max_size", "per_round"), [
    (0.001, 20, 20), (1.0, 200, 20), (1.0, 200, 10)], ids=["homogeneous", "heterogeneous", "heterogeneous-C0.5"])
def test_scalar_gaussian_lands_on_the_closed_form_posterior(sigma0_sq, max_size, per_round):
    p = synthetic(sigma0_sq, max_size, seed=0)
    personal, glob = self_fl_scalar(p["z"], p["s"], sigma0_sq, per_round)
    local_error = (p["z"] - p["fl"]).abs().mean()  # learning alone
    full = per_round == 20
    assert (personal - p["fl"]).abs().mean() < (0.15 if full else 0.3) * local_error
    assert ((personal - p["fl"]).abs() / p["fl_sd"]).max() < (1.0 if full else 0.5 * math.sqrt(max_size))
    assert (glob - p["global"]).abs() < (0.5 if full else 1.5) * p["global_sd"]
    if sigma0_sq == 1.0:  # heterogeneous: one global model (FedAvg's answer) is far from every theta_m^FL
        assert (p["global"] - p["fl"]).abs().mean() > 10 * (personal - p["fl"]).abs().mean()


def test_eq10_from_the_global_mean_is_the_other_clients_precision_mean():
    p = synthetic(1.0, 200, seed=3)
    w = precision(p["s"], 1.0)
    others = w.sum() - w
    start = initial_point({"t": p["z"]}, {"t": p["global"]}, w / others)["t"]
    expected = torch.stack([(w * p["z"]).sum() - w[m] * p["z"][m] for m in range(20)]) / others
    torch.testing.assert_close(start, expected)
    assert torch.equal(initial_point({"t": p["z"]}, {"t": p["global"]}, torch.zeros(20))["t"],
                       p["global"].expand(20))  # coefficient 0: the first activation starts from the broadcast


def test_eq8_steps_match_the_contraction_and_its_edge_cases():
    variance = torch.tensor([0.5, 0.05, 2.0, 0.0, 0.001, 0.5], dtype=torch.float64)
    others = torch.tensor([10.0, 10.0, 3.0, 10.0, 10.0, 0.0], dtype=torch.float64)
    lr = torch.full((6,), 0.002, dtype=torch.float64)
    steps = local_steps(variance, others, lr, l_max=500)
    ratio = others / (1 / variance + others)  # Eq. 8's right-hand side
    for k in range(3):
        c = 1 - lr[k] / variance[k]
        assert c ** (steps[k] + 0.5) <= ratio[k] <= c ** (steps[k] - 0.5)  # the nearest integer l
    assert steps[3] == 500 and steps[4] == 1 and steps[5] == 500  # zero variance; lr >= s_m; no other client
    assert steps[2] > steps[0] > steps[1]  # fewer steps for a sharper local optimum, more with fewer others
    assert local_steps(variance[:1], others[:1], lr[:1], l_max=5)[0] == 5


def test_online_variance_is_the_summed_empirical_variance_over_activations():
    g = torch.Generator().manual_seed(0)
    history = [{"a": torch.randn(3, 4, 2, generator=g), "b": torch.randn(3, 5, generator=g)} for _ in range(6)]
    count, mean, variance = torch.zeros(3), {"a": torch.zeros(3, 4, 2), "b": torch.zeros(3, 5)}, torch.zeros(3)
    for t, models in enumerate(history, 1):
        count, mean, variance = welford(count, mean, variance, models)
        stacked = {n: torch.stack([h[n] for h in history[:t]]) for n in models}
        expected = sum(v.var(0, unbiased=False).flatten(1).sum(1) for v in stacked.values())
        torch.testing.assert_close(variance, expected.double(), atol=1e-9, rtol=1e-5)
        assert t > 1 or torch.equal(variance, torch.zeros(3, dtype=torch.float64))  # first activation: zero
    assert math.isclose(trace_variance({n: history[0][n] for n in "ab"}),
                        float(sum(history[0][n].var(0, unbiased=False).sum() for n in "ab")), rel_tol=1e-5)


# ---- the engine path ----------------------------------------------------------------------------------------------
def selffl_stage(execution: str = "vmap", chunk: int = 7, rounds: int = 3, algorithm: str = "selffl",
                 params: dict | None = None, per_round: int = 7) -> FederatedStage:
    torch.manual_seed(0)
    model = TinyMLP()
    algo = build_algorithm(algorithm, {"l_max": 6, **(params or {})})
    algo.prepare_model(model, (16,))
    cfg = StageConfig(rounds=rounds, clients_per_round=per_round, local=LOCAL, max_parallel_clients=chunk,
                      eval_every=rounds)
    stage = stage_for(model, ALL, ToyData(), algo, cfg, seed=3)
    stage.execution = execution
    return stage


def everything(stage: FederatedStage) -> dict[str, torch.Tensor]:
    """Global model, personal copies, client state and the server's copy of the variances."""
    return {**{f"global.{n}": p.detach() for n, p in stage.model.named_parameters()},
            **{f"bank.{n}": stage.bank.tensor(n) for n in ALL},
            **{f"state.{n}": stage.state_bank.tensor(n).double() for n in stage.state_bank.names},
            "server.variance": stage.server_state["variance"]}


@pytest.mark.parametrize("algorithm", ["selffl", "selffl_aug"])
def test_vmap_and_loop_match_sequential(algorithm):
    params = {"optimum_steps": 2} if algorithm == "selffl_aug" else {}
    reference = selffl_stage("sequential", 1, algorithm=algorithm, params=params)
    fit(reference)
    assert len(set(reference.state_bank.tensor("steps").tolist())) >= 3  # the cohort's plan has per-client steps
    for execution, chunk in [("vmap", 7), ("vmap", 3), ("loop", 2)]:
        got = selffl_stage(execution, chunk, algorithm=algorithm, params=params)
        fit(got)
        assert_close(everything(got), everything(reference))


def test_first_activation_trains_l_max_from_the_broadcast_and_weights_equally():
    stage = selffl_stage(rounds=1, params={"l_max": 5})
    start = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    fit(stage)
    cohort = stage.sample_cohort(0)
    state = stage.state_bank
    assert torch.equal(state.tensor("steps")[cohort], torch.full((7,), 5.0))
    assert torch.equal(state.tensor("activations"), torch.zeros(12).index_fill(0, cohort, 1.0))
    assert float(state.tensor("variance").abs().max()) == 0.0  # one personal model seen: zero variance
    assert float(stage.server_state["sigma0_sq"]) > 0
    # all variances 0: equal weights, and the new global model is (1 - C) old + C mean with C = 7 / 12
    for name, value in stage.model.named_parameters():
        mean = stage.bank.tensor(name)[cohort].mean(0)
        torch.testing.assert_close(value.detach(), start[name] + 7 / 12 * (mean - start[name]))
        assert torch.equal(stage.bank.tensor(name)[cohort], state.tensor(f"mean.{name}")[cohort])


def test_step_counts_adapt_per_client_and_follow_the_reported_variances():
    stage = selffl_stage(rounds=6, params={"l_max": 20}, per_round=10)
    fit(stage)
    steps, activations = stage.state_bank.tensor("steps"), stage.state_bank.tensor("activations")
    variance = stage.state_bank.tensor("variance")
    assert torch.equal(variance, stage.server_state["variance"])  # the server's copy is the client's
    settled = activations >= 3  # two models seen before its last activation: a real variance estimate
    assert int(settled.sum()) >= 6
    assert len(set(steps[settled].tolist())) >= 3 and float(steps[settled].max()) < 20
    assert (variance[settled] > 0).all()


def test_resume_mid_stage_restores_the_server_variances(tmp_path):
    full = selffl_stage(rounds=5)
    fit(full)
    interrupted = selffl_stage(rounds=5)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=True)
    L.Trainer(max_steps=3, logger=False, callbacks=[ckpt], enable_progress_bar=False,
              enable_model_summary=False).fit(interrupted)
    resumed = selffl_stage(rounds=5)
    L.Trainer(max_steps=5, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    assert_close(everything(resumed), everything(full))


def test_bad_params_and_a_stage_without_prepare_model_are_refused():
    with pytest.raises(ValidationError, match="l_max"):
        build_algorithm("selffl", {"l_max": 0})
    with pytest.raises(ValidationError, match="optimum_steps"):
        build_algorithm("selffl_aug", {"optimum_steps": 0})
    with pytest.raises(RuntimeError, match="prepare_model"):
        stage_for(TinyMLP(), ALL, ToyData(), build_algorithm("selffl"), StageConfig())
