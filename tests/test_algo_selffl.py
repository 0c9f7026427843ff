"""Self-FL: the closed-form posterior on the paper's scalar synthetic problem through the real stage, Eqs. 8/10/14/19
as reconstructed, the first activation, adaptive step counts, engine paths and resume agree."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from pydantic import ValidationError
from torch import nn

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.algorithms.selffl import (
    initial_point,
    local_steps,
    precision,
    trace_variance,
    welford,
)
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.stage import FederatedStage
from fedpilot.engine.task import Scores, Task
from fedpilot.testing import EXECUTIONS
from test_engine_equivalence import assert_close

ALL = [n for n, _ in TinyMLP().named_parameters()]
LOCAL = LocalConfig(batch_size=4, lr=0.1)


# ---- the paper's scalar synthetic setting (Sec. 4.1, App. G.1), through the real stage ---------------------------
V2 = 0.1  # the per-sample variance v^2 of the paper's synthetic data


class GaussianNLL(Task):
    """y ~ N(theta, v^2): the per-sample negative log-likelihood (theta - y)^2 / (2 v^2), up to a constant; `acc`
    (within one noise sd) only so the stage's evaluation has its metric."""

    name, metrics, distributions, train_metric = "gaussian", ("acc", "loss"), ("acc",), "acc"

    def scores(self, output: torch.Tensor, y: torch.Tensor) -> Scores:
        loss = (output - y).pow(2) / (2 * V2)
        one = torch.ones_like(loss)
        return {"loss": (loss, one), "acc": (((output - y).abs() < V2**0.5).to(loss.dtype), one)}


class Scalar(nn.Module):
    """One parameter theta, predicting theta for every input."""

    def __init__(self):
        super().__init__()
        self.theta = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.theta.expand(x.shape[0])


def posterior(z: torch.Tensor, s: torch.Tensor, sigma0_sq: float) -> dict[str, torch.Tensor]:
    """The closed forms given z_1..z_M: theta_m^FL and its posterior sd (Eq. 3), theta^(G) and its sd (Eq. 2)."""
    w = precision(s, sigma0_sq)
    others = w.sum() - w
    return {"fl": (z / s + (w * z).sum() - w * z) / (1 / s + others), "fl_sd": (1 / (1 / s + others)).sqrt(),
            "global": (w * z).sum() / w.sum(), "global_sd": 1 / w.sum().sqrt()}


class ScalarData(ClientData):
    """M = 20 clients, theta_m ~ N(1.6, sigma0_sq), N_m ~ U[10, max_size] train samples of N(theta_m, v^2) (plus 2
    val and 2 test samples), client-major; z_m is the mean of its train samples, s_m = v^2 / N_m (App. D)."""

    def __init__(self, sigma0_sq: float, max_size: int, seed: int, m: int = 20):
        g = torch.Generator().manual_seed(seed)
        train = torch.randint(10, max_size + 1, (m,), generator=g)
        theta = 1.6 + math.sqrt(sigma0_sq) * torch.randn(m, generator=g)
        sizes = train + 4
        y = torch.cat([theta[i] + math.sqrt(V2) * torch.randn(int(sizes[i]), generator=g) for i in range(m)])
        start = torch.cumsum(sizes, 0) - sizes
        super().__init__(torch.zeros(len(y), 1), y, {"train": start, "val": start + train, "test": start + train + 2},
                         {"train": train, "val": torch.full((m,), 2), "test": torch.full((m,), 2)})
        self.z = torch.stack([self.y[start[i] : start[i] + train[i]].double().mean() for i in range(m)])
        self.s = V2 / train.double()


@pytest.mark.parametrize(("sigma0_sq", "max_size", "per_round", "rounds", "lr"), [
    (0.001, 20, 20, 120, 0.005), (1.0, 200, 20, 15, 0.05), (1.0, 200, 10, 30, 0.05)],
    ids=["homogeneous", "heterogeneous", "heterogeneous-C0.5"])
def test_scalar_gaussian_through_the_stage_lands_on_the_closed_form_posterior(sigma0_sq, max_size, per_round,
                                                                            rounds, lr):
    """Algorithm 1 as the engine runs it (Eqs. 8, 10, 11, smoothing; full-batch local steps on the mean NLL at the
    stage's lr), with the paper's known variances: each personal model ends within half a posterior sd of
    theta_m^FL and the global model near theta^(G). Eq. 8 at the wrong scale (lr on the sum, not lr / N_m)
    would stop every client after one step far from it."""
    data = ScalarData(sigma0_sq, max_size, seed=0)
    closed = posterior(data.z, data.s, sigma0_sq)
    algorithm = build_algorithm("selffl", {"l_max": 1000, "known": {"sigma0_sq": sigma0_sq, "sample_variance": V2}})
    model = Scalar()
    algorithm.prepare_model(model, (1,))
    cfg = StageConfig(rounds=rounds, clients_per_round=per_round, eval_every=rounds,
                      local=LocalConfig(batch_size=max_size, lr=lr))  # a batch >= N_m: full-batch steps
    stage = stage_for(model, ["theta"], data, algorithm, cfg, task=GaussianNLL())
    fit(stage)
    personal, glob = stage.bank.tensor("theta").double(), model.theta.detach().double()
    assert ((personal - closed["fl"]).abs() / closed["fl_sd"]).max() < 0.5
    assert (personal - closed["fl"]).abs().mean() < 0.25 * (data.z - closed["fl"]).abs().mean()  # vs alone
    assert (glob - closed["global"]).abs() < 0.5 * closed["global_sd"]
    if sigma0_sq == 1.0:  # heterogeneous: one global model (FedAvg's answer) is far from every theta_m^FL
        assert (closed["global"] - closed["fl"]).abs().mean() > 10 * (personal - closed["fl"]).abs().mean()
        assert stage.state_bank.tensor("steps").max() > 1


def test_eq10_from_the_global_mean_is_the_other_clients_precision_mean():
    data = ScalarData(1.0, 200, seed=3)
    w = precision(data.s, 1.0)
    others = w.sum() - w
    glob = posterior(data.z, data.s, 1.0)["global"]
    start = initial_point({"t": data.z}, {"t": glob}, w / others)["t"]
    expected = torch.stack([(w * data.z).sum() - w[m] * data.z[m] for m in range(20)]) / others
    torch.testing.assert_close(start, expected)
    assert torch.equal(initial_point({"t": data.z}, {"t": glob}, torch.zeros(20))["t"],
                       glob.expand(20))  # coefficient 0: the first activation starts from the broadcast


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
    stage.executor_choice.pin(execution)
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
    for execution, chunk in EXECUTIONS:
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
    # the round's spread of the steps over its cohort, logged each round (the report draws it, as Fig. 11)
    cohort = steps[stage.sample_cohort(5)].double()
    logged = stage.round_result.metrics
    assert logged["cohort_steps_min"] == cohort.min() and logged["cohort_steps_max"] == cohort.max()
    assert logged["cohort_steps_p50"] == pytest.approx(float(cohort.quantile(0.5)))
    assert {"cohort_variance_p10", "cohort_activations_p90"} <= set(logged)


def test_eq14_is_the_spread_of_every_clients_latest_personal_model():
    """Eq. 14 over all M clients, a client not yet activated counting with its starting model theta^0; kept by
    running sums, it equals the variance of the personal bank, not of the round's models alone."""
    stage = selffl_stage(rounds=4, per_round=4)
    fit(stage)
    bank = {n: stage.bank.tensor(n) for n in ALL}
    assert int((stage.state_bank.tensor("activations") == 0).sum()) >= 1  # some clients are still at theta^0
    assert math.isclose(stage.server_state["sigma0_sq"], trace_variance(bank), rel_tol=1e-5)
    last = stage.sample_cohort(3)
    assert not math.isclose(stage.server_state["sigma0_sq"], trace_variance({n: v[last] for n, v in bank.items()}),
                            rel_tol=0.05)


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


def test_the_report_draws_the_steps_spread_round_by_round():
    import pandas as pd

    from fedpilot.report.curves import cohort_figure
    from fedpilot.report.runs import PipelineRun, Stage

    rounds = pd.RangeIndex(1, 4)
    curves = {f"cohort_steps_{stat}": pd.Series([v + k for k in range(3)], index=rounds, dtype=float)
              for stat, v in (("min", 1), ("p10", 1), ("p50", 2), ("p90", 4), ("max", 6))}
    stages = [Stage("fedavg", "s0", "miss", {"rounds": 5}, pd.DataFrame(), {}),
              Stage("selffl", "s1", "miss", {"rounds": 3}, pd.DataFrame(), curves)]
    figure = cohort_figure([PipelineRun("r", "run", "1", stages, "run")])
    assert figure.layout.annotations[0].text == "steps"
    median = next(t for t in figure.data if t.line.dash == "solid")
    assert list(median.x) == [6, 7, 8] and list(median.y) == [2, 3, 4]  # after fedavg's 5 rounds
    assert sorted(t.fill for t in figure.data if t.fill) == ["tonexty"] and len(figure.data) == 5
    assert cohort_figure([PipelineRun("r", "run", "1", stages[:1], "run")]) is None
