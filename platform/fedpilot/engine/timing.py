"""Choosing between ways of doing the same work by timing them where they run."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_time(run: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The least seconds of `repeats` runs of `run()` after a warm-up run (the first call of vmap or of a new
    layout pays for tracing and allocation); CUDA work is waited for."""
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def fastest(candidates: list[str], run: Callable[[str], None], device: torch.device,
            repeats: int = 3) -> tuple[str, dict[str, float]]:
    """The candidate whose `run(candidate)` takes least time by `best_time`, and each one's seconds."""
    seconds = {name: best_time(lambda name=name: run(name), device, repeats) for name in candidates}
    return min(seconds, key=seconds.__getitem__), seconds
