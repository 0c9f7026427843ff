"""Choices the engine makes by measuring where it runs: the layout of each pooling call, the evaluation's forward
batch. The timings are replaced by given ones where a test checks the choice, so no test depends on the machine."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn
from torch.func import vmap

from fedpilot.engine.accel import evaluate, pooling, timing
from fedpilot.engine.accel.pooling import MeasuredPooling, has_2d_maps
from fedpilot.engine.accel.timing import fastest


def small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3), nn.ReLU(),
                         nn.AvgPool2d(2), nn.AdaptiveMaxPool2d(1), nn.Flatten(), nn.Linear(8, 4))


@pytest.fixture
def channels_last_wins(monkeypatch):
    """Every pooling call measures channels-last faster: the mode's rerouted path runs."""
    calls = []

    def measured(func, args, kwargs):
        calls.append((func, tuple(args[0].shape)))
        return True

    monkeypatch.setattr(pooling, "channels_last_is_faster", measured)
    return calls


def test_rerouted_pooling_gives_the_same_values_and_gradients_in_nchw(channels_last_wins):
    model, x = small_cnn(), torch.randn(5, 3, 12, 12)
    expected = model(x)
    expected_grads = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    seen = []
    model[1].register_full_backward_hook(lambda m, gin, gout: seen.append(gout[0].is_contiguous()))
    with MeasuredPooling():
        got = model(x)
        grads = torch.autograd.grad(got.square().sum(), list(model.parameters()))
    assert {f for f, _ in channels_last_wins} >= {torch.nn.functional.max_pool2d, torch.nn.functional.avg_pool2d}
    torch.testing.assert_close(got, expected)
    for g, e in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(g, e)
    assert seen == [True]  # the gradient reaching the ReLU came back NCHW, not channels-last


def test_vmapped_pooling_passes_through_the_mode(channels_last_wins):
    model, x = small_cnn(), torch.randn(2, 4, 3, 12, 12)
    with MeasuredPooling():
        got = vmap(model)(x)
    torch.testing.assert_close(got, torch.stack([model(xi) for xi in x]))
    assert channels_last_wins == []  # batched tensors are left alone


def test_each_pooling_signature_is_measured_once(monkeypatch):
    timed = []

    def fastest(candidates, run, device, repeats=3):
        timed.append(tuple(candidates))
        for name in candidates:
            run(name)
        return timing.Timed("channels_last", {}, {})

    monkeypatch.setattr(pooling, "fastest", fastest)
    monkeypatch.setattr(pooling, "_channels_last_faster", {})
    model = small_cnn()
    with MeasuredPooling():
        model(torch.randn(2, 3, 12, 12))
        model(torch.randn(2, 3, 12, 12))
        model(torch.randn(3, 3, 12, 12))
    assert timed == [("nchw", "channels_last")] * 3 * 2  # 3 pooling calls, for each of 2 input shapes
    assert all(pooling._channels_last_faster.values())


def test_candidates_take_turns_after_a_warm_up_each_and_a_clear_loser_drops_out(monkeypatch):
    calls, cost = [], {"a": [1.0, 1.2, 0.9], "b": [1.1, 0.95, 1.3], "c": [1.6, 1.0, 1.0]}

    def best_time(run, device, repeats=1, warm=True):  # each candidate's seconds, turn by turn
        run()
        return cost[calls[-1]].pop(0)

    monkeypatch.setattr(timing, "best_time", best_time)
    choice, seconds, _ = fastest(["a", "b", "c"], calls.append, torch.device("cpu"), repeats=3)
    assert calls == ["a", "b", "c"] + ["a", "b", "c"] + ["a", "b"] * 2  # c: 1.6 > 1.2 x 1.0 after the first turn
    assert choice == "a" and seconds == {"a": 0.9, "b": 0.95, "c": 1.6}


def test_the_last_candidate_left_in_the_running_takes_no_further_turn(monkeypatch):
    calls, cost = [], {"a": [1.0, 1.0, 1.0], "b": [1.3, 1.0, 1.0]}

    def best_time(run, device, repeats=1, warm=True):
        run()
        return cost[calls[-1]].pop(0)

    monkeypatch.setattr(timing, "best_time", best_time)
    choice, seconds, _ = fastest(["a", "b"], calls.append, torch.device("cpu"), repeats=3)
    assert calls == ["a", "b", "a", "b"] and choice == "a"  # b out after the first turn: a has no rival left


@pytest.mark.parametrize(("times", "peaks", "expected"), [
    ({"a": [1.0], "b": [1.04]}, {"a": 1500, "b": 1000}, "b"),  # 4% in one turn: noise; b saves a third
    ({"a": [1.0, 1.01, 0.99], "b": [1.04, 1.05, 1.03]}, {"a": 1500, "b": 1000}, "a"),  # faster in every turn
    ({"a": [1.0], "b": [1.3]}, {"a": 1500, "b": 1000}, "a"),  # more than SAME_SPEED faster
    ({"a": [1.0], "b": [1.04]}, {"a": 1500, "b": 1400}, "a"),  # b saves less than MATERIAL_MEMORY
    ({"a": [1.0], "b": [1.04], "c": [1.1]}, {"a": 1500, "b": 1000, "c": 900}, "c"),  # the leanest of the close
    ({"a": [1.0], "b": [1.04]}, {}, "a"),  # memory not measured: the fastest
])
def test_a_leaner_candidate_is_kept_where_the_fastest_is_not_believably_faster(times, peaks, expected):
    assert timing.kept(times, peaks) == expected


def test_memory_weighs_in_the_timing_where_asked(monkeypatch):
    """`big` holds 256 MiB while it runs and is at most 5% faster (one turn): the measured peaks keep `small`."""
    held = {"big": 0.06, "small": 0.063}

    def run(name: str) -> None:
        block = torch.ones(64 * 2**20) if name == "big" else None  # 256 MiB, touched
        time.sleep(held[name])
        del block

    choice, seconds, peaks = fastest(["big", "small"], run, torch.device("cpu"), repeats=1, weigh_memory=True)
    assert peaks["big"] - peaks["small"] > 200 * 2**20 and set(seconds) == {"big", "small"}
    assert choice == "small"
    assert fastest(["big", "small"], run, torch.device("cpu"), repeats=1).peak_bytes == {}


def test_a_hungrier_candidate_no_faster_than_a_leaner_one_takes_no_further_turn(monkeypatch):
    """`big` holds 256 MiB more than the others at its peak and is slower than `small` in the first turn: it could be
    kept only by a later turn believably faster than `small`, so only `small` and `other` take the next turns."""
    calls, cost = [], {"big": [1.0, 0.5, 0.5], "small": [0.95, 0.96, 0.97], "other": [1.1, 1.0, 1.05]}

    def run(name: str) -> None:
        calls.append(name)
        block = torch.ones(64 * 2**20) if name == "big" else None  # 256 MiB, touched
        del block

    def best_time(run, device, repeats=1, warm=True):  # each candidate's seconds, turn by turn
        run()
        return cost[calls[-1]].pop(0)

    monkeypatch.setattr(timing, "best_time", best_time)
    choice, seconds, peaks = fastest(["big", "small", "other"], run, torch.device("cpu"), weigh_memory=True)
    assert peaks["big"] - peaks["small"] > 200 * 2**20
    assert calls == ["big", "small", "other"] * 2 + ["small", "other"] * 2  # warm-ups, then the turns
    assert choice == "small" and seconds == {"big": 1.0, "small": 0.95, "other": 1.0}


OUT_OF_MEMORY = [torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                 RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                              "memory: you tried to allocate 21474836480 bytes.")]


@pytest.mark.parametrize("error", OUT_OF_MEMORY, ids=["cuda", "cpu"])
def test_a_candidate_that_runs_out_of_memory_is_left_out_of_the_timing(error):
    calls = []

    def run(name: str) -> None:
        calls.append(name)
        if name == "vmap":
            raise error

    with pytest.warns(UserWarning, match="executor candidate 'vmap' ran out of memory on cpu"):
        choice, seconds, _ = fastest(["vmap", "loop", "loop_channels_last"], run, torch.device("cpu"), repeats=2)
    assert calls.count("vmap") == 1 and choice in ("loop", "loop_channels_last")
    assert set(seconds) == {"loop", "loop_channels_last"}


def test_a_candidate_whose_measured_calls_are_believably_slower_takes_no_warm_up_or_turn(monkeypatch):
    """`slow` and `close` were measured as their calls were sized: the candidate without such seconds warms up first,
    `slow` (over 1.2 x its warm-up) is left out untouched with its known seconds, `close` warms up and is timed."""
    calls, cost = [], {"loop": [1.0, 1.0, 1.0], "close": [1.1, 1.05, 0.9]}
    clock = iter(range(1000))
    monkeypatch.setattr(timing.time, "perf_counter", lambda: float(next(clock)))  # each warm-up: 1 s

    def best_time(run, device, repeats=1, warm=True):  # each candidate's seconds, turn by turn
        run()
        return cost[calls[-1]].pop(0)

    monkeypatch.setattr(timing, "best_time", best_time)
    monkeypatch.setattr(timing, "TIMING_BUDGET_S", 1e9)
    choice, seconds, _ = fastest(["slow", "close", "loop"], calls.append, torch.device("cpu"),
                                 known={"slow": 1.3, "close": 1.1})
    assert "slow" not in calls and calls[:2] == ["loop", "close"]  # warm-ups: the unmeasured one first
    assert calls[2:] == ["loop", "close"] * 3 and choice == "close"
    assert seconds == {"slow": 1.3, "loop": 1.0, "close": 0.9}


class GivenRise:
    """timing.MemoryRise with a given rise over a given start (None: unknown)."""

    rise: int | None = None
    start: int = 2**30

    def __init__(self, device: torch.device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def call_sizes(seconds: dict[int, float | list[float]], most: int, rise: int | None = None) -> tuple[int, list[int]]:
    """timing.clients_per_call on given seconds per size (a list: run after run; a size missing from `seconds` runs
    out of memory) and memory one client's call adds (None: unknown), and the sizes run in order."""
    tried, runs = [], {n: v if isinstance(v, list) else [v] * 2 for n, v in seconds.items()}
    GivenRise.rise = rise

    def seconds_at(clients: int) -> float:
        tried.append(clients)
        if clients not in runs:
            raise torch.OutOfMemoryError(f"{clients} clients")
        return runs[clients].pop(0)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(timing, "MemoryRise", GivenRise)
        size = timing.clients_per_call(seconds_at, most, torch.device("cpu"))
    call_sizes.share = size.seconds_per_client
    return size.clients, tried


def test_a_call_batches_more_clients_only_while_each_client_gets_believably_cheaper():
    gpu = {n: max(0.05, 0.004 * n) for n in (1, 2, 4, 8, 10, 16, 32, 50)}  # the same cost until the device is busy
    assert call_sizes(gpu, 50) == (16, [1, 1, 2, 4, 8, 16, 32, 32])  # 32: 4 ms a client, as at 16 (twice)
    assert call_sizes(gpu, 10) == (10, [1, 1, 2, 4, 8, 10])  # one run of a size that is cheaper enough
    cpu = {1: 0.10, 2: 0.19, 4: 0.37}  # the work from the first client on
    assert call_sizes(cpu, 50) == (1, [1, 1, 2, 2])
    assert call_sizes({1: 0.10, 2: 0.15, 4: 0.26}, 50) == (2, [1, 1, 2, 4, 4])  # 4: 14% cheaper a client, not 20%
    assert call_sizes({1: [0.2, 0.1], 2: [0.19, 0.12]}, 8) == (2, [1, 1, 2, 2, 4])  # first calls slower; 4: no memory
    assert call_sizes({1: 0.1, 2: 0.12, 4: 0.13}, 3) == (2, [1, 1, 2, 3])  # at most the chunk; 3 out of memory
    assert call_sizes({1: 0.1}, 1) == (1, [1, 1])  # a chunk of one client: its seconds
    assert call_sizes({}, 8) == (1, [1]) and call_sizes.share is None  # out of memory with one client
    assert call_sizes(cpu, 50) == (1, [1, 1, 2, 2]) and call_sizes.share == 0.10
    # one client's call adds 1 MiB to the process's 1 GiB: all 50 add under a tenth; taken, its share unmeasured
    assert call_sizes(cpu, 50, rise=2**20) == (50, [1]) and call_sizes.share is None
    assert call_sizes(cpu, 50, rise=2**22) == (1, [1, 1, 2, 2])  # 50 x 4 MiB: measured


def test_the_memory_a_block_adds_is_measured_from_its_start():
    with timing.MemoryRise(torch.device("cpu")) as rise:
        block = torch.ones(64 * 2**20)  # 256 MiB, touched
        del block
    if rise.rise is None:
        pytest.skip("no /proc/self/status and clear_refs: not Linux")
    assert 250 * 2**20 < rise.rise < 300 * 2**20 and rise.start > 0


def test_when_every_candidate_runs_out_of_memory_the_error_is_raised_and_other_errors_are_not_caught():
    def oom(name: str) -> None:
        raise torch.OutOfMemoryError(f"CUDA out of memory ({name})")

    with pytest.warns(UserWarning), pytest.raises(torch.OutOfMemoryError, match=r"\(vmap\)"):
        fastest(["vmap", "loop"], oom, torch.device("cpu"))

    def broken(name: str) -> None:
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        fastest(["vmap", "loop"], broken, torch.device("cpu"))


def test_the_mode_is_entered_only_for_models_with_feature_maps():
    assert has_2d_maps(small_cnn()) and not has_2d_maps(nn.Sequential(nn.Linear(3, 3), nn.LSTM(3, 3)))


def measured(monkeypatch, rates: dict[int, float], n: int) -> int:
    """The batch `in_batches` settles on for n inputs when a batch of b takes rates[b] seconds per sample (or
    raises rates[b], an error)."""
    calls = []

    def apply(x: torch.Tensor) -> torch.Tensor:
        calls.append(len(x))
        if isinstance(rates.get(len(x)), Exception):
            raise rates[len(x)]
        return x * 2

    def best_time(run, device, repeats=3):
        calls.clear()
        run()
        return rates[calls[0]] * sum(calls)

    monkeypatch.setattr(evaluate, "best_time", best_time)
    inputs = torch.arange(float(n)).view(n, 1)
    torch.testing.assert_close(evaluate.in_batches(nn.Linear(1, 1), apply, inputs), inputs * 2)  # only batching
    return evaluate._forward_batch[next(iter(evaluate._forward_batch))][0]


def test_the_evaluation_batch_is_the_fastest_per_sample_and_the_search_stops_past_the_minimum(monkeypatch):
    monkeypatch.setattr(evaluate, "_forward_batch", {})
    rates = {16: 5.0, 32: 3.0, 64: 2.0, 128: 2.1, 256: 2.6, 512: 0.1}  # 512 would win, but 256 is 30% past 64
    assert measured(monkeypatch, rates, 1000) == 64
    assert evaluate._forward_batch[next(iter(evaluate._forward_batch))][1] == float("inf")  # settled


@pytest.mark.parametrize("error", OUT_OF_MEMORY, ids=["cuda", "cpu"])
def test_the_evaluation_batch_search_stops_at_the_first_batch_out_of_memory(monkeypatch, error):
    monkeypatch.setattr(evaluate, "_forward_batch", {})
    rates = {16: 5.0, 32: 3.0, 64: 2.0, 128: 1.5, 256: error, 512: 0.1}  # 256 and up do not fit the device
    assert measured(monkeypatch, rates, 1000) == 128
    assert evaluate._forward_batch[next(iter(evaluate._forward_batch))][1] == float("inf")  # never tried again
    assert measured(monkeypatch, rates, 5000) == 128


def test_an_unfinished_search_resumes_when_larger_inputs_come(monkeypatch):
    monkeypatch.setattr(evaluate, "_forward_batch", {})
    rates = {16: 4.0, 32: 3.0, 64: 2.0, 128: 1.0, 256: 0.5, 512: 0.4, 1024: 0.9}
    assert measured(monkeypatch, rates, 100) == 64  # 100 samples: batches up to 64 could be tried
    assert measured(monkeypatch, rates, 600) == 512  # up to 512 now, still unfinished (1024 not tried)
    assert measured(monkeypatch, rates, 100) == 512  # smaller inputs reuse it (as one batch)
