"""The batched first step (`loop_batched_first`): the clients reach what the loop gives them, each client's gradient is
its own, and wherever it does not apply the executor is the loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from engine_fixtures import TinyCNN, TinyMLP, ToyData
from fedpilot.api import Algorithm
from fedpilot.engine.accel import executor_candidates
from fedpilot.engine.accel import loop as local
from fedpilot.engine.accel.loop import BatchedFirstStepExecutor, LoopExecutor
from fedpilot.engine.accel.shared_start import batchable, first_step_grads
from fedpilot.engine.cohort import Cohort, plain_forward
from fedpilot.engine.config import LocalConfig
from fedpilot.engine.executor import Batches, StepRule, TrainStats, precision_context
from fedpilot.engine.protocol import Upload
from fedpilot.engine.task import make_task
from fedpilot.models.zoo import build_model
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


def _own_gradients(model: nn.Module, params: dict[str, torch.Tensor], trainable: list[str], x: torch.Tensor,
                   y: torch.Tensor, w: torch.Tensor) -> tuple[list[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Client by client, plain autograd: each client's gradient of `trainable` at its row of `params`, and its loss."""
    grads, losses = [], []
    for k in range(x.shape[0]):
        leaves = {n: p[k].clone().requires_grad_(n in trainable) for n, p in params.items()}
        loss, _ = CLASSIFICATION.loss(plain_forward(model, leaves, x[k]), y[k], w[k])
        grads.append(dict(zip(trainable, torch.autograd.grad(loss, [leaves[n] for n in trainable]), strict=True)))
        losses.append(loss.detach())
    return grads, losses


HEAD_OF_VARIED = ["head.weight", "head.bias"]
CLIENT_PARTS = {  # (parameters with a row of their own per client, the trained ones: None = all)
    "all shared (FedAvg)": ([], None),
    "personal head, trained with the rest (FedSim)": (HEAD_OF_VARIED, None),
    "personal head, frozen (FedAlt's shared phase)": (HEAD_OF_VARIED, ["down.weight", "grouped.weight",
                                                                        "grouped.bias", "mix.weight", "mix.bias"]),
    "personal weight, shared bias": (["head.weight"], None),
    "a personal Linear inside the body": (["mix.weight", "mix.bias"], None),
}


@pytest.mark.parametrize(("apart", "trained"), CLIENT_PARTS.values(), ids=CLIENT_PARTS.keys())
def test_each_clients_gradient_is_its_own_on_its_own_samples(apart, trained):
    torch.manual_seed(0)
    model, clients, batch = Varied(), 3, 5
    params = {n: p.detach().expand(clients, *p.shape) for n, p in model.named_parameters()}
    params |= {n: params[n] + 0.3 * torch.randn_like(params[n]) for n in apart}  # rows of their own
    trainable = trained or list(params)
    x, y = torch.randn(clients, batch, 1, 8, 8), torch.randint(0, 4, (clients, batch))
    w = torch.ones(clients, batch)
    w[1, 3:] = 0  # client 1 has 3 samples: the rest of its batch is padding
    grads, loss, _ = first_step_grads(model, plain_forward, CLASSIFICATION, params, {}, trainable, x, y, w)
    assert sorted(grads) == sorted(trainable)
    own, own_loss = _own_gradients(model, params, trainable, x, y, w)
    for k in range(clients):
        for name in trainable:
            torch.testing.assert_close(grads[name][k], own[k][name], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(loss[k], own_loss[k])


def test_a_personal_convolution_is_left_to_the_loop():
    model = Varied()
    params = {n: p.detach().expand(2, *p.shape) for n, p in model.named_parameters()}
    params["down.weight"] = params["down.weight"] + 0.1  # rows of their own, [2, ...] contiguous
    x, y, w = torch.randn(2, 3, 1, 8, 8), torch.randint(0, 4, (2, 3)), torch.ones(2, 3)
    assert first_step_grads(model, plain_forward, CLASSIFICATION, params, {}, list(params), x, y, w) is None


PERSONALIZED = {  # algorithm, its params: each trains the shared body while the clients' heads differ
    "fedalt": {"tau_v": 1, "tau_u": 2},
    "fedrep": {},
    "fedsim": {"lr_v": 0.3},
    "fedper": {},
}


@pytest.mark.parametrize("algorithm", PERSONALIZED, ids=PERSONALIZED.keys())
def test_clients_with_personal_heads_reach_the_sequential_references_weights(batched, algorithm):
    assert_matches_sequential(algorithm, ["head.weight", "head.bias"], PERSONALIZED[algorithm], model=TinyCNN,
                              data=ToyData(image=True), executions=(("loop_batched_first", 5),))
    assert True in batched  # the phases with a trained body and personal heads went batched


class GatedHead(Algorithm):
    """FedSim with a forward of its own (it scales the head's output): the per-client head cannot be batched."""

    name = "gated_head"

    def forward(self, model: nn.Module, params: dict, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * functional_call(model, params, (x,))

    def local_update(self, cohort: Cohort) -> Upload:
        return Upload(shared=cohort.sgd("all").shared)


def test_an_algorithms_own_forward_keeps_personal_heads_on_the_loop(batched):
    assert_matches_sequential(GatedHead(), ["head.weight", "head.bias"], model=TinyCNN, data=ToyData(image=True),
                              executions=(("loop_batched_first", 5),))
    assert batched == [] and "loop_batched_first" in executor_candidates(TinyCNN())


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
        trained = executor(None, CLASSIFICATION).train(model, start, {}, {}, batches,
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


def test_clients_whose_convolutions_start_apart_are_stepped_by_the_loop(batched):
    torch.manual_seed(0)
    model = TinyCNN()
    apart = {n: p + 0.1 * torch.randn_like(p) for n, p in _broadcast(model).items()}
    got, _ = _first_steps(model, BatchedFirstStepExecutor, apart)
    want, _ = _first_steps(model, LoopExecutor, apart)
    for name in want:
        assert torch.equal(got[name], want[name])
    assert batched == [False]  # refused: only Linear layers may hold weights of their own


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
