"""Choosing between ways of doing the same work by timing them where they run."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_time(run: Callable[[], object], device: torch.device, repeats: int = 3, warm: bool = True) -> float:
    """The least seconds of `repeats` runs of `run()`, after a warm-up run unless `warm` is False (the first call
    of vmap or of a new layout pays for tracing and allocation); CUDA work is waited for."""
    if warm:
        run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def fastest(candidates: list[str], run: Callable[[str], None], device: torch.device,
            repeats: int = 3, out_of_the_running: float = 1.5) -> tuple[str, dict[str, float]]:
    """The candidate whose `run(candidate)` takes least time, and each one's seconds: the best of up to `repeats`
    runs after a warm-up run of each, the candidates taking turns (a b c a b c ...) so that a change in the
    machine's load during the timing falls on all of them alike. A candidate slower than `out_of_the_running`
    times the best after a turn is not run again (its best so far is its seconds): it cannot win."""
    for name in candidates:
        run(name)
    times: dict[str, list[float]] = {name: [] for name in candidates}
    running = list(candidates)
    for _ in range(repeats):
        for name in running:
            times[name].append(best_time(lambda name=name: run(name), device, repeats=1, warm=False))
        best = min(min(t) for t in times.values())
        running = [name for name in running if min(times[name]) <= out_of_the_running * best]
    seconds = {name: min(t) for name, t in times.items()}
    return min(seconds, key=seconds.__getitem__), seconds
