"""The batched first step (`loop_batched_first`): the clients reach what the loop gives them, each client's gradient is
its own, and wherever it does not apply the executor is the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine_fixtures import TinyCNN, TinyMLP, ToyData
from fedpilot.engine import LocalConfig, local
from fedpilot.engine.cohort import plain_forward
from fedpilot.engine.local import (
    BatchedFirstStepExecutor,
    Batches,
    LoopExecutor,
    StepRule,
    TrainStats,
    executor_candidates,
    precision_context,
)
from fedpilot.engine.shared_start import batchable, first_step_grads
from fedpilot.engine.task import make_task
from fedpilot.models import build_model
from fedpilot.testing import assert_matches_sequential

CLASSIFICATION = make_task("classification")


@pytest.fixture
def batched(monkeypatch) -> list[bool]:
    """For each first step the executor tried to batch: whether it ran batched (False: it went back to the loop)."""
    ran: list[bool] = []

    def spy(*args, **kwargs):
        result = first_step_grads(*args, **kwargs)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(local, "first_step_grads", spy)
    return ran


class Varied(nn.Module):
    """Strided, grouped, 'same'-padded and bias-free convolutions, and a Linear over the last dim of a 4-d map."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.down = nn.Conv2d(1, 4, 3, stride=2, padding=1, bias=False)
        self.grouped = nn.Conv2d(4, 4, 3, padding="same", groups=2)
        self.mix = nn.Linear(4, 4)
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mix(torch.relu(self.grouped(torch.relu(self.down(x))))).flatten(1))


class Twice(TinyCNN):
    """Applies its convolution twice: one weight, two per-client gradient contributions the hooks cannot separate."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.ReLU())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.body(x)).flatten(1))


class Normed(TinyCNN):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.Flatten())


LOCAL = {
    "clipped, weight decay": None,  # assert_matches_sequential's default: clip_norm 1.0, weight_decay 0.01
    "plain SGD, two epochs": LocalConfig(epochs=2, batch_size=4, lr=0.1),
}


@pytest.mark.parametrize("local_config", LOCAL.values(), ids=LOCAL.keys())
def test_fedavg_clients_reach_the_sequential_references_weights(batched, local_config):
    assert_matches_sequential("fedavg", [], local=local_config, model=TinyCNN, data=ToyData(image=True),
                              executions=(("loop_batched_first", 4), ("loop_batched_first", 12)))
    assert batched and all(batched)


def test_fedprox_pull_toward_the_broadcast_matches_sequential(batched):
    assert_matches_sequential("fedprox", [], {"mu": 0.5}, model=TinyCNN, data=ToyData(image=True),
                              executions=(("loop_batched_first", 5),))
    assert batched and all(batched)


def test_a_model_of_linear_layers_alone_pinned_to_it_matches_sequential(batched):
    assert_matches_sequential("fedavg", [], local=LocalConfig(epochs=1, batch_size=4, lr=0.1), model=TinyMLP,
                              executions=(("loop_batched_first", 4),))
    assert batched and all(batched)


def test_each_clients_gradient_is_its_own_on_its_own_samples():
    torch.manual_seed(0)
    model, clients, batch = Varied(), 3, 5
    weights = {n: p.detach() for n, p in model.named_parameters()}
    x, y = torch.randn(clients, batch, 1, 8, 8), torch.randint(0, 4, (clients, batch))
    w = torch.ones(clients, batch)
    w[1, 3:] = 0  # client 1 has 3 samples: the rest of its batch is padding
    grads, loss, _ = first_step_grads(model, plain_forward, CLASSIFICATION, weights, list(weights), x, y, w)
    for k in range(clients):
        leaves = {n: p.clone().requires_grad_() for n, p in weights.items()}
        own_loss, _ = CLASSIFICATION.loss(plain_forward(model, leaves, x[k]), y[k], w[k])
        own = torch.autograd.grad(own_loss, list(leaves.values()))
        for name, g in zip(leaves, own, strict=True):
            torch.testing.assert_close(grads[name][k], g, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(loss[k], own_loss.detach())


def test_which_models_it_applies_to():
    assert batchable(TinyCNN()) and batchable(Varied()) and batchable(TinyMLP())
    assert batchable(build_model("cnn", (1, 28, 28), 62))
    assert not batchable(Normed())  # batch statistics would mix clients
    tied = TinyCNN()
    tied.extra = nn.Linear(48, 4)
    tied.extra.weight = tied.head.weight
    assert not batchable(tied)
    assert not batchable(nn.Sequential(nn.Conv2d(1, 2, 3, padding=1, padding_mode="reflect")))
    assert not batchable(nn.Sequential(nn.Conv2d(1, 2, 4, padding="same")))  # torch pads it unevenly
    assert not batchable(nn.Sequential(nn.Conv2d(1, 2, 3), nn.Flatten(), nn.LayerNorm(2)))
    assert executor_candidates(TinyCNN())[-1] == "loop_batched_first"
    assert "loop_batched_first" not in executor_candidates(Normed())
    assert "loop_batched_first" not in executor_candidates(TinyMLP())  # no convolution: the vmaps win there


def _first_steps(model: nn.Module, executor: type, start: dict[str, torch.Tensor], steps: int = 2,
                 precision: str = "32-true") -> tuple[dict[str, torch.Tensor], TrainStats]:
    """`steps` local steps of each client at batch 4 on 4x4 images from its row of `start` [K, ...]."""
    clients, batch = next(iter(start.values())).shape[0], 4
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(clients * steps * batch, 1, 4, 4, generator=generator)
    index = torch.arange(len(x)).view(clients, steps, batch)
    y = torch.randint(0, 4, (len(x),), generator=generator)[index]
    batches = Batches(x, index, y, torch.ones(clients, steps, batch), torch.ones(clients, steps, dtype=torch.bool))
    stats = TrainStats.zeros(clients, x.device)
    with precision_context(precision, x.device):
        trained = executor(plain_forward, CLASSIFICATION).train(model, start, {}, {}, batches,
                                                                StepRule(dict.fromkeys(start, 0.1)), stats)
    return trained, stats


def _broadcast(model: nn.Module, clients: int = 3) -> dict[str, torch.Tensor]:
    return {n: p.detach().expand(clients, *p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("model", [Twice(), Normed()], ids=["a layer applied twice", "batch norm"])
def test_models_it_does_not_apply_to_are_stepped_by_the_loop(batched, model):
    torch.manual_seed(0)
    got, got_stats = _first_steps(model, BatchedFirstStepExecutor, _broadcast(model))
    want, want_stats = _first_steps(model, LoopExecutor, _broadcast(model))
    for name in want:
        assert torch.equal(got[name], want[name])
    assert torch.equal(got_stats.loss, want_stats.loss)
    assert batched == ([False] if isinstance(model, Twice) else [])


def test_clients_that_start_apart_are_stepped_by_the_loop(batched):
    torch.manual_seed(0)
    model = TinyCNN()
    apart = {n: p + 0.1 * torch.randn_like(p) for n, p in _broadcast(model).items()}
    got, _ = _first_steps(model, BatchedFirstStepExecutor, apart)
    want, _ = _first_steps(model, LoopExecutor, apart)
    for name in want:
        assert torch.equal(got[name], want[name])
    assert batched == []


def test_one_client_alone_leaves_the_broadcast_weights_untouched():
    model = TinyCNN()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    got, _ = _first_steps(model, BatchedFirstStepExecutor, _broadcast(model, 1))
    want, _ = _first_steps(model, LoopExecutor, _broadcast(model, 1))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name])
        torch.testing.assert_close(got[name], want[name])


def test_bf16_mixed_steps_agree_with_the_loops(batched):
    torch.manual_seed(0)
    model = TinyCNN()
    got, got_stats = _first_steps(model, BatchedFirstStepExecutor, _broadcast(model), precision="bf16-mixed")
    want, want_stats = _first_steps(model, LoopExecutor, _broadcast(model), precision="bf16-mixed")
    for name in want:
        assert got[name].dtype == torch.float32
        torch.testing.assert_close(got[name], want[name], rtol=0.02, atol=2e-3)
    torch.testing.assert_close(got_stats.loss, want_stats.loss, rtol=0.02, atol=1e-2)
    assert batched == [True]
