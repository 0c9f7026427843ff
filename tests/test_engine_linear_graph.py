"""The `bmm` executor: models of Linear layers stepped as batched matrix products in their traced graph, with plain
SGD fused into the weight gradients (engine/linear_graph.py). It must reach the sequential reference's weights, run
its own path where it applies, and hand everything else to vmap with the same results. The per-client loop fuses the
same update into its Linear layers' gradients, client by client."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_fixtures import TinyCNN, TinyMLP, ToyData
from fedpilot.engine.accel import executor_candidates
from fedpilot.engine.accel import loop as engine_local
from fedpilot.engine.accel.bmm import BmmExecutor
from fedpilot.engine.accel.linear_graph import Tape, linear_graph
from fedpilot.engine.accel.vmap import VmapAutogradExecutor
from fedpilot.engine.config import LocalConfig
from fedpilot.engine.executor import StepRule
from fedpilot.engine.task import CLASSIFICATION, NextToken, Regression, Task, make_task
from fedpilot.testing import HEAD, INPUT, assert_matches_sequential, run_stage

PLAIN_SGD = LocalConfig(epochs=2, batch_size=4, lr=0.1)  # the fused path: no clipping, weight decay or prox


@pytest.mark.parametrize(("algo", "personal", "params"), [
    ("fedavg", [], {}),
    ("fedalt", HEAD, {}),
    ("fedalt", INPUT, {"tau_v": 2, "tau_u": 3, "lr_v": 0.2}),
    ("fedsim", HEAD, {"lr_v": 0.3}),
    ("finetune", HEAD, {}),
    ("local", None, {}),
])
def test_fused_sgd_matches_sequential(algo, personal, params):
    """ToyData's clients have uneven sizes, so some clients sit out the last steps of an epoch."""
    assert_matches_sequential(algo, personal, params, local=PLAIN_SGD, executions=(("bmm", 5), ("bmm", 12)))


def test_the_graph_path_runs_where_it_applies(monkeypatch):
    """With vmap out of reach, a stage of a Linear model still trains on `bmm` (clipped and plain SGD alike)."""
    locals_ = (PLAIN_SGD, LocalConfig(batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01))
    reference = [run_stage("fedsim", HEAD, {}, "sequential", 1, local) for local in locals_]

    def unreachable(*args, **kwargs):
        raise AssertionError("bmm fell back to vmap")

    monkeypatch.setattr(VmapAutogradExecutor, "step_grad", unreachable)
    for local, (shared, personal) in zip(locals_, reference, strict=True):
        got_shared, got_personal = run_stage("fedsim", HEAD, {}, "bmm", 5, local)
        for want, got in ((shared, got_shared), (personal, got_personal)):
            for name in want:
                torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4)


class BatchSecond(nn.Module):
    """A Linear layer applied to [B, K, ...]-laid-out samples: not what `bmm` can batch (it must find out)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x.unsqueeze(0)).squeeze(0))


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) if x.sum() > 0 else -self.head(x)


class Normed(TinyMLP):
    def __init__(self):
        super().__init__()
        self.body.append(nn.LayerNorm(24))


class Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(torch.relu(self.inner(x)))


class Tied(nn.Module):
    """One Linear layer applied twice (in the body; the head as the zoo's models have it)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = Twice(), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("model", [TinyMLP, TinyCNN, Tied], ids=["mlp", "cnn", "layer-twice"])
def test_the_loops_fused_linear_steps_match_sequential(model, monkeypatch):
    """The loop's plain SGD steps each trained Linear layer from its output gradient (W -= lr G^T A); a layer that
    runs twice takes its weight gradient the usual way."""
    fused: list[str] = []
    real = engine_local.sgd_

    def recorded(outputs, *args):
        fused.extend(outputs)
        return real(outputs, *args)

    monkeypatch.setattr(engine_local, "sgd_", recorded)
    data = ToyData(image=True) if model is TinyCNN else ToyData()
    personal = ["body.0.weight", "body.0.bias"] if model is TinyCNN else HEAD
    executions = (("loop", 3), ("loop_channels_last", 4), ("loop_batched_first", 5)) if model is TinyCNN else (
        ("loop", 3),)
    assert_matches_sequential("fedalt", personal, local=PLAIN_SGD, model=model, data=data, executions=executions)
    assert fused and "body.inner" not in fused  # a head alone (its layer ""), the body's Linear layers


def test_which_models_bmm_applies_to():
    assert linear_graph(TinyMLP()) is not None and "bmm" in executor_candidates(TinyMLP())
    assert linear_graph(nn.Linear(3, 2)) is not None  # a head alone (head-only phases)
    for model in (TinyCNN(), Normed(), Branches()):  # convolution, LayerNorm, control flow on values
        assert linear_graph(model) is None and "bmm" not in executor_candidates(model)


def test_the_graph_follows_modules_added_to_the_model():
    """An algorithm may add modules to the model between stages (adapters): the graph is traced again."""
    torch.manual_seed(0)
    model, x = TinyMLP(), torch.randn(3, 5, 16)
    before = linear_graph(model)
    model.body.append(nn.Linear(24, 24))
    after = linear_graph(model)
    assert after is not before
    params = {n: p.detach().expand(3, *p.shape) for n, p in model.named_parameters()}
    tape = Tape(3, 15, set())
    with torch.no_grad():
        torch.testing.assert_close(after(x.flatten(0, 1), params, tape), model(x.flatten(0, 1)))
    model.body.append(nn.LayerNorm(24))
    assert linear_graph(model) is None


@pytest.mark.parametrize("model", [BatchSecond, Tied], ids=["samples-not-first", "layer-twice"])
def test_a_model_it_cannot_batch_is_stepped_like_vmap(model):
    torch.manual_seed(0)
    net, task = model(), make_task("classification")
    assert linear_graph(net) is not None  # traced: only a pass shows the layout
    params = {n: p.detach() + 0.1 * torch.randn(3, *p.shape) for n, p in net.named_parameters()}
    x, y, w = torch.randn(3, 5, 16), torch.randint(0, 4, (3, 5)), torch.ones(3, 5)
    want = VmapAutogradExecutor(None, task).step_grad(net)(params, {}, {}, x, y, w)
    got = BmmExecutor(None, task).step_grad(net)(params, {}, {}, x, y, w)
    for name in params:
        torch.testing.assert_close(got[0][name], want[0][name])
    stepped = {n: p.clone() for n, p in params.items()}
    BmmExecutor(None, task).stepper(net, StepRule(dict.fromkeys(params, 0.1)))(
        stepped, {}, {}, x, y, w, torch.ones(3, dtype=torch.bool))
    for name in params:
        torch.testing.assert_close(stepped[name], params[name] - 0.1 * want[0][name])


def test_per_client_frozen_and_shared_layers_and_an_unused_one():
    """Trained input layer, each client's own frozen head, a shared frozen layer, a trained layer nothing uses."""

    class Model(TinyMLP):
        def __init__(self):
            super().__init__()
            self.spare = nn.Linear(2, 2)

    torch.manual_seed(0)
    model, task = Model(), make_task("classification")
    per_client = {n: p.detach() + 0.1 * torch.randn(3, *p.shape) for n, p in model.named_parameters()}
    trainable = {n: per_client[n] for n in ("body.1.weight", "body.1.bias", "spare.weight", "spare.bias")}
    frozen = {n: per_client[n] for n in HEAD}
    x, y, w = torch.randn(3, 5, 16), torch.randint(0, 4, (3, 5)), torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2,
                                                                                  [0.0] * 5])
    for fixed in ({}, {"head.bias": per_client["head.bias"][0]}):
        mine = {n: v for n, v in frozen.items() if n not in fixed}
        want = VmapAutogradExecutor(None, task).step_grad(model)(trainable, mine, fixed, x, y, w)
        got = BmmExecutor(None, task).step_grad(model)(trainable, mine, fixed, x, y, w)
        for name in trainable:
            torch.testing.assert_close(got[0][name], want[0][name])
        torch.testing.assert_close(got[1][0], want[1][0])
        assert not got[0]["spare.weight"].any() and not got[0]["body.1.weight"][2].any()  # unused; no samples


class Halved(Task):
    """A task with a loss of its own (half the cross-entropy)."""

    name, metrics, distributions, train_metric = "halved", ("acc", "loss"), ("acc",), "acc"

    def scores(self, output, y):
        return CLASSIFICATION.scores(output, y)

    def loss(self, output, y, w):
        value, metric = super().loss(output, y, w)
        return value / 2, metric


@pytest.mark.parametrize("task", [CLASSIFICATION, Regression(), NextToken(pad=0, unk=1, bos=2, eos=3), Halved()],
                         ids=["classification", "regression", "next_token", "own_loss"])
def test_client_losses_are_each_clients_loss(task):
    torch.manual_seed(0)
    if isinstance(task, Regression):
        output, y = torch.randn(4, 6, 3), torch.randn(4, 6, 3)
    elif isinstance(task, NextToken):
        output, y = torch.randn(4, 6, 5, 9), torch.randint(0, 9, (4, 6, 5))
    else:
        output, y = torch.randn(4, 6, 9), torch.randint(0, 9, (4, 6))
    w = (torch.rand(4, 6) > 0.3).float()
    w[3] = 0.0  # a client with no sample in this step
    loss, metric = task.client_losses(output, y, w)
    for k in range(4):
        want = task.loss(output[k], y[k], w[k])
        torch.testing.assert_close(loss[k], want[0])
        torch.testing.assert_close(metric[k], want[1])
