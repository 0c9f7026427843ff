"""Choosing between ways of doing the same work by timing them where they run."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from fedpilot.engine.accel.memory import release_freed_memory

T = TypeVar("T")


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
    times the best after a turn is not run again (its best so far is its seconds): it cannot win. A candidate that
    runs out of memory in its warm-up run is left out with a warning (vmap holds every client's gradients at once,
    the loop one client's); when all of them do, the first one's error is raised."""
    running = []
    for name in candidates:
        if within_memory(lambda name=name: run(name), device)[0]:
            running.append(name)
        else:
            warnings.warn(f"executor candidate {name!r} ran out of memory on {device.type}; it is left out of the "
                          "timing", stacklevel=2)
    if not running:
        run(candidates[0])  # raises the genuine out-of-memory error (or succeeds, if memory was freed meanwhile)
        running = candidates[:1]
    times: dict[str, list[float]] = {name: [] for name in running}
    for _ in range(repeats):
        for name in running:
            times[name].append(best_time(lambda name=name: run(name), device, repeats=1, warm=False))
        best = min(min(t) for t in times.values())
        running = [name for name in running if min(times[name]) <= out_of_the_running * best]
    seconds = {name: min(t) for name, t in times.items()}
    return min(seconds, key=seconds.__getitem__), seconds


def within_memory(run: Callable[[], T], device: torch.device) -> tuple[bool, T | None]:
    """(True, run()), or (False, None) when it runs out of memory (then its memory is handed back); other errors
    pass through."""
    try:
        return True, run()
    except RuntimeError as error:  # torch.OutOfMemoryError is one
        if not out_of_memory(error):
            raise
    release_freed_memory(device)
    return False, None


def out_of_memory(error: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator's (a plain RuntimeError in torch)."""
    return isinstance(error, torch.OutOfMemoryError) or "DefaultCPUAllocator: can't allocate memory" in str(error)
