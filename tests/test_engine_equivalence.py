"""The vectorized engine matches the plain sequential executor on the same sampled batches."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import TinyCNN, TinyMLP, ToyData, fit, stage_for
from fedpilot.api import Algorithm
from fedpilot.engine.accel import choose, executor_candidates, shared_start
from fedpilot.engine.cohort import Cohort
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.protocol import Upload
from fedpilot.testing import (
    HEAD,
    INPUT,
    assert_close,
    assert_matches_sequential,
    device_under_test,
    run_stage,
)

CASES = [
    ("fedavg", [], {}),
    ("fedalt", HEAD, {}),
    ("fedalt", INPUT, {"tau_v": 2, "tau_u": 3, "lr_v": 0.2}),
    ("fedalt", HEAD, {"stateful": False}),
    ("fedsim", HEAD, {"lr_v": 0.3}),
    ("fedsim", INPUT, {"stateful": False}),
    ("finetune", HEAD, {}),
    ("finetune", None, {"part": "all", "prox": 0.5}),
    ("local", None, {}),
]


@pytest.mark.parametrize(("algo", "personal", "params"), CASES)
def test_vmap_and_loop_match_sequential(algo, personal, params):
    assert_matches_sequential(algo, personal, params)


def test_steps_budget_and_lr_schedule_match_sequential():
    local = LocalConfig(steps=3, batch_size=5, lr=0.2, schedule={"kind": "linear", "warmup": 2})
    reference = run_stage("fedsim", HEAD, {}, "sequential", 1, local)
    got = run_stage("fedsim", HEAD, {}, "vmap", 4, local)
    assert_close(got[0], reference[0])
    assert_close(got[1], reference[1])


def test_conv_model_matches_sequential():
    assert_matches_sequential("fedalt", ["body.0.weight", "body.0.bias"], local=LocalConfig(epochs=1, batch_size=4,
                              lr=0.1), model=TinyCNN, data=ToyData(image=True),
                              executions=(("vmap", 4), ("vmap_autograd", 3), ("loop", 4), ("loop_channels_last", 4)))


@pytest.mark.parametrize(("algo", "personal", "params"), [CASES[1], CASES[4], CASES[7]])
def test_executors_batching_fewer_clients_a_call_match_sequential(algo, personal, params):
    """Executors that batch clients, taking at most 3 of a chunk of 7 in a call (3 + 3 + 1; per-client references of
    the pull to the start, clipping, weight decay, a gradient phase), end where the sequential reference does."""
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)
    reference = run_stage(algo, personal, params, "sequential", 1, local)
    for execution in ("vmap", "vmap_autograd", "bmm"):
        got = run_stage(algo, personal, params, execution, 7, local, per_call=3)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


def test_the_batched_first_step_in_groups_matches_sequential(monkeypatch):
    """loop_batched_first taking 3 clients' first step a call: three calls for 7 clients, the reference's numbers."""
    from fedpilot.engine.accel import loop

    calls = []
    monkeypatch.setattr(loop, "first_step_grads", lambda *a: calls.append(a[6].shape[0]) or
                        shared_start.first_step_grads(*a))
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1)
    run = [run_stage("fedavg", [], {}, execution, 7, local, TinyCNN, ToyData(image=True), per_call=3)
           for execution in ("sequential", "loop_batched_first")]
    assert calls[:3] == [3, 3, 1] and len(calls) == 3 * 4  # every round's first step, in three calls
    assert_close(run[1][0], run[0][0])


def has_bf16(device: torch.device) -> bool:
    """bf16 matmul units torch uses: a CUDA GPU with bf16, or oneDNN's AVX-512-BF16/AMX path on a CPU."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@pytest.mark.parametrize(("execution", "chunk"), [("vmap", 7), ("loop", 2), ("bmm", 5)])
def test_bf16_mixed_executors_match_sequential_under_bf16(execution, chunk):
    """Under bf16-mixed each executor stays within bf16's rounding of the sequential reference under bf16-mixed, and
    parameters stay float32 (where the device has bf16 units: CUDA, or a CPU with AVX-512-BF16/AMX)."""
    device = device_under_test()
    if not has_bf16(device):
        pytest.skip(f"no bf16 matmul units on {device}")
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1)
    reference = run_stage("fedalt", HEAD, {}, "sequential", 1, local, precision="bf16-mixed")
    got = run_stage("fedalt", HEAD, {}, execution, chunk, local, precision="bf16-mixed")
    for mine, theirs in zip(got, reference, strict=True):
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert mine[name].dtype == torch.float32, name
            torch.testing.assert_close(mine[name], theirs[name], atol=3e-2, rtol=3e-2, msg=name)


def test_auto_execution_loops_convolutions_on_cpu_and_vmaps_the_rest():
    """The rule of thumb for work no stage has timed; a stage times these candidates on its first round."""
    cnn, cpu = TinyCNN(), torch.device("cpu")
    assert executor_candidates(cnn) == ["vmap", "vmap_autograd", "loop", "loop_channels_last", "loop_batched_first"]
    assert executor_candidates(TinyMLP()) == ["vmap", "vmap_autograd", "loop", "bmm"]
    assert choose("auto", cnn, cpu).name == "loop"
    assert choose("auto", cnn.head, cpu).name == "vmap"  # head-only phases run on trunk features
    assert choose("auto", TinyMLP(), cpu).name == "vmap"
    assert choose("auto", cnn, torch.device("cuda")).name == "vmap"
    assert choose("loop", TinyMLP(), cpu).name == "loop"


class GradientStep(Algorithm):
    """Test algorithm: personal part steps on its own gradient, the shared part is uploaded as a gradient,
    and a per-client counter lives in the engine's client state."""

    name = "gradient-step-test"

    def client_state(self) -> dict[str, torch.Tensor]:
        return {"visits": torch.zeros(())}

    def local_update(self, cohort: Cohort) -> Upload:
        personal = cohort.gradient("personal", steps=2)
        cohort.personal = {n: v - 0.1 * personal[n] for n, v in cohort.personal.items()}
        cohort.state = {"visits": cohort.state["visits"] + 1}
        return Upload(grad=cohort.gradient("shared", steps=3))


def test_gradients_and_client_state_match_sequential():
    assert_matches_sequential(GradientStep(), HEAD, local=LocalConfig(batch_size=4, lr=0.1))


def test_client_state_counts_each_clients_visits():
    stage = stage_for(TinyMLP(), HEAD, ToyData(), GradientStep(),
                           StageConfig(rounds=5, clients_per_round=4, local=LocalConfig(batch_size=4)), seed=1)
    fit(stage)
    visits = stage.state_bank.tensor("visits")
    assert visits.sum() == 5 * 4 and visits.max() <= 5
    sampled = torch.zeros(12)
    for r in range(5):
        sampled[stage.sample_cohort(r)] += 1
    assert torch.equal(visits, sampled)


def test_both_vmaps_give_each_client_its_own_gradient_and_zeros_where_nothing_depends():
    from torch import nn

    from fedpilot.engine.accel.vmap import VmapAutogradExecutor, VmapExecutor
    from fedpilot.engine.task import make_task

    class Unused(TinyMLP):
        def __init__(self):
            super().__init__()
            self.spare = nn.Linear(2, 2)  # trained, but no output depends on it

    torch.manual_seed(0)
    model, task = Unused(), make_task("classification")
    params = {n: p.detach() + 0.1 * torch.randn(3, *p.shape) for n, p in model.named_parameters()}
    x, y, w = torch.randn(3, 5, 16), torch.randint(0, 4, (3, 5)), torch.ones(3, 5)
    vmapped, autograd = (e(None, task).step_grad(model)(params, {}, {}, x, y, w)
                         for e in (VmapExecutor, VmapAutogradExecutor))
    for name in params:
        torch.testing.assert_close(autograd[0][name], vmapped[0][name])
    assert not autograd[0]["spare.weight"].any()
    for k in range(3):  # row k is client k's gradient alone
        one = VmapExecutor(None, task).step_grad(model)({n: p[k : k + 1] for n, p in params.items()}, {}, {},
                                                           x[k : k + 1], y[k : k + 1], w[k : k + 1])
        torch.testing.assert_close(autograd[0]["body.1.weight"][k], one[0]["body.1.weight"][0])
    torch.testing.assert_close(autograd[1][0], vmapped[1][0])  # the clients' losses


class PerRowRates(Algorithm):
    """Test algorithm: step sizes (and, with `pull`, the pull's weight) of one value per client, a function of its id
    (any chunking gives a client the same): the personal part at its own rate, then the shared part at another."""

    name = "per-row-rates-test"

    def __init__(self, pull: bool = False):
        super().__init__()
        self.pull = pull

    def local_update(self, cohort: Cohort) -> Upload:
        rate = 0.05 + 0.02 * (cohort.clients % 5).float()
        if cohort.personal:
            cohort.personal = cohort.sgd("personal", lr=rate, steps=2).personal
        pull = {"prox": 3 * rate, "reference": cohort.shared} if self.pull else {}
        return Upload(shared=cohort.sgd("shared", lr={"shared": 2 * rate}, **pull).shared)


@pytest.mark.parametrize(("personal", "pull"), [(HEAD, False), ([], False), (INPUT, True)])
def test_per_row_step_sizes_match_sequential(personal, pull):
    """lr (and the pull's weight) one per client, on every executor: the fused plain SGD of bmm and the loops,
    the gradient step of the vmaps, the head-only steps on features; with a pull, clipping and weight decay."""
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1, **({"clip_norm": 1.0, "weight_decay": 0.01} if pull else {}))
    assert_matches_sequential(PerRowRates(pull), personal, local=local)


def test_per_row_step_sizes_of_convolutions_match_sequential():
    """The loops and the batched first step (each client's first step from the broadcast, then its own rate)."""
    assert_matches_sequential(PerRowRates(), [], local=LocalConfig(epochs=1, batch_size=4, lr=0.1), model=TinyCNN,
                              data=ToyData(image=True), executions=(("vmap", 4), ("loop", 3), ("loop_channels_last", 4),
                                                                     ("loop_batched_first", 7)))


@pytest.mark.parametrize("execution", ["sequential", "vmap", "vmap_autograd", "loop", "bmm"])
def test_a_rule_of_per_row_values_is_each_rows_own_rule(execution):
    """Per-row lr, weight decay and pull in one call give each row what a call of that row alone with its values as
    numbers gives (the sequential reference takes them as numbers, client by client)."""
    from fedpilot.engine.accel.executors import EXECUTORS
    from fedpilot.engine.executor import Batches, StepRule, TrainStats
    from fedpilot.engine.task import make_task

    torch.manual_seed(0)
    model, k = TinyMLP(), 4
    params = {n: p.detach() + 0.1 * torch.randn(k, *p.shape) for n, p in model.named_parameters()}
    start = {n: p.clone() for n, p in params.items()}
    x, y = torch.randn(40, 16), torch.randint(0, 4, (40,))
    batches = Batches(x, torch.randint(0, 40, (k, 3, 5)), None, torch.ones(k, 3, 5), torch.ones(k, 3, dtype=torch.bool))
    batches.labels = y[batches.index]
    values = {"lr": torch.tensor([0.05, 0.1, 0.2, 0.3]), "wd": torch.tensor([0.0, 0.01, 0.1, 0.02]),
              "prox": torch.tensor([0.5, 0.0, 1.0, 2.0])}
    executor = EXECUTORS[execution](None, make_task("classification"))
    rule = StepRule(dict.fromkeys(params, values["lr"]), 1.0, values["wd"], values["prox"], start)
    together = executor.train(model, params, {}, {}, batches, rule, TrainStats.zeros(k, x.device))
    for row in range(k):
        alone = Batches(x, batches.index[row : row + 1], batches.labels[row : row + 1], batches.weight[row : row + 1],
                        batches.active[row : row + 1])
        own = StepRule(dict.fromkeys(params, float(values["lr"][row])), 1.0, float(values["wd"][row]),
                       float(values["prox"][row]), {n: v[row : row + 1] for n, v in start.items()})
        mine = executor.train(model, {n: p[row : row + 1] for n, p in params.items()}, {}, {}, alone, own,
                              TrainStats.zeros(1, x.device))
        for name in params:
            torch.testing.assert_close(together[name][row], mine[name][0], atol=2e-6, rtol=1e-5, msg=name)
