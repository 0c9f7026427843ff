"""Choosing between ways of doing the same work by timing them where they run."""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import NamedTuple, TypeVar

import psutil
import torch

from fedpilot.engine.memory import MemoryRise, PeakMemory, process_status, release_freed_memory

T = TypeVar("T")
TIMING_BUDGET_S = 5.0  # past this, `fastest` drops clear losers by their warm-up and starts no further turn
WARM_OUT = 2.0
TRIAL_STEPS = 3  # steps of each local phase in an executor trial: a step's cost shows, the whole round's need not
TRIAL_SHARE = 0.5  # of the memory available, what a timing trial on the CPU may add (the rest: other processes)
SAME_SPEED = 1.2  # a speed difference under 20% is believed only when repeated turns confirm it (house rule)
MATERIAL_MEMORY = 0.1  # memory weighs in where a leaner candidate's peak is lower by a tenth of the fastest's


class Timed(NamedTuple):
    """What `fastest` measured: the candidate kept, each one's seconds and, where memory weighed in, each one's
    peak memory in its warm-up run (bytes: the process's resident set on a CPU, torch's allocation on a GPU)."""

    choice: str
    seconds: dict[str, float]
    peak_bytes: dict[str, int]


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


def fastest(candidates: list[str], run: Callable[[str], None], device: torch.device, repeats: int = 3,
            out_of_the_running: float = SAME_SPEED, weigh_memory: bool = False,
            warm_up: Callable[[str], None] | None = None, known: dict[str, float] | None = None) -> Timed:
    """The candidate whose `run(candidate)` takes least time, and each one's seconds: the best of up to `repeats`
    runs after a warm-up run of each, the candidates taking turns (a b c a b c ...) so that a change in the
    machine's load during the timing falls on all of them alike. A candidate slower than `out_of_the_running`
    times the best after a turn (by default SAME_SPEED: believably slower, so `kept` could not keep it) is not run
    again (its best so far is its seconds), and one left alone takes no further turn; nor, where memory weighs in,
    one that a leaner candidate has been as fast as (`outweighed`). A candidate that runs out of memory in its
    warm-up run is left out with a warning (vmap holds every client's gradients at once, the loop one client's);
    when all of them do, the first one's error is raised. `warm_up(candidate)`, when given, is the warm-up run: a
    shorter run of the same work that pays the first call's costs (tracing, allocation) and reaches the same peak
    memory. With `weigh_memory`, each warm-up's peak memory is measured and a leaner candidate is kept where the
    fastest is not believably faster (`kept`). `known`: candidates' seconds for the warm-up's work measured
    beforehand (as their calls were sized, `clients_per_call`); such a candidate warms up after the others, and not
    at all where its known seconds are over `out_of_the_running` times the quickest of their warm-ups (which a
    warm-up's first-call costs only make slower): it is left out with its known seconds.

    The timing is bounded where the work is large (a federation's first round of a large model): once it has
    taken TIMING_BUDGET_S, a candidate whose warm-up took more than WARM_OUT times the fastest warm-up is out, and
    no turn starts after the budget is spent (at least one timed turn runs)."""
    start, warm, peaks, warm_up, known, left_out = time.perf_counter(), {}, {}, warm_up or run, known or {}, {}
    for name in sorted(candidates, key=lambda name: name in known):
        if name in known and warm and known[name] > out_of_the_running * min(warm.values()):
            left_out[name] = known[name]
            continue
        began = time.perf_counter()
        with PeakMemory(device) if weigh_memory else nullcontext() as memory:
            fits = within_memory(lambda name=name: warm_up(name), device)[0]
        if fits:
            warm[name] = time.perf_counter() - began
            if memory is not None:
                peaks[name] = memory.bytes
        else:
            warnings.warn(f"executor candidate {name!r} ran out of memory on {device.type}; it is left out of the "
                          "timing", stacklevel=2)
    if not warm:
        warm_up(candidates[0])  # raises the genuine out-of-memory error (or succeeds, if memory was freed meanwhile)
        warm = {candidates[0]: 0.0}
    running = list(warm)
    if time.perf_counter() - start > TIMING_BUDGET_S:
        running = [name for name in running if warm[name] <= WARM_OUT * min(warm.values())]
    times: dict[str, list[float]] = {name: [] for name in running}
    for _ in range(repeats):
        for name in running:
            times[name].append(best_time(lambda name=name: run(name), device, repeats=1, warm=False))
        best = min(min(t) for t in times.values())
        running = [name for name in running
                   if min(times[name]) <= out_of_the_running * best and not outweighed(name, times, peaks)]
        if len(running) < 2 or time.perf_counter() - start > TIMING_BUDGET_S:
            break  # one left has nothing to be timed against
    seconds = {name: min(t) for name, t in times.items()}
    untimed = {**left_out, **{n: w for n, w in warm.items() if n not in seconds}}
    return Timed(kept(times, peaks), {**untimed, **seconds}, peaks)


def kept(times: dict[str, list[float]], peaks: dict[str, int]) -> str:
    """Of the timed candidates (their seconds turn by turn), the fastest, or else the leanest one that needs
    MATERIAL_MEMORY less at its peak and that the fastest is not believably faster than: more than SAME_SPEED
    times, or in each of two or more turns. A few percent of one turn is the machine's noise, not worth the memory
    of an executor that batches every client's work (`loop_batched_first`, the vmaps)."""
    fastest_one = min(times, key=lambda name: min(times[name]))
    leaner = [name for name in times if materially_leaner(name, fastest_one, peaks)
              and not believably_faster(times[fastest_one], times[name])]
    return min(leaner, key=peaks.__getitem__, default=fastest_one)


def outweighed(name: str, times: dict[str, list[float]], peaks: dict[str, int]) -> bool:
    """Whether a candidate MATERIAL_MEMORY leaner than `name` has been at least as fast so far: `name` could then be
    kept only by a later turn more than SAME_SPEED times faster than that one's best (`kept`), which one turn's
    noise does not give; it takes no further turn."""
    return any(materially_leaner(other, name, peaks) and min(times[other]) <= min(times[name]) for other in times)


def materially_leaner(a: str, b: str, peaks: dict[str, int]) -> bool:
    """Whether candidate `a` needed MATERIAL_MEMORY less than `b` at its peak (False where either was not measured)."""
    return a in peaks and b in peaks and peaks[a] < (1 - MATERIAL_MEMORY) * peaks[b]


def believably_faster(a: list[float], b: list[float]) -> bool:
    """Whether turns `a` are faster than turns `b` (seconds of the same turns) beyond doubt: the best more than
    SAME_SPEED times faster, or each of two or more turns faster."""
    turns = list(zip(a, b, strict=False))
    return min(b) > SAME_SPEED * min(a) or (len(turns) >= 2 and all(x < y for x, y in turns))


class CallSize(NamedTuple):
    """How many clients a call takes, and the seconds a client's share of such a call took."""

    clients: int
    seconds_per_client: float | None


def clients_per_call(seconds_at: Callable[[int], float], most: int, device: torch.device) -> CallSize:
    """How many clients one call of an executor that batches them should take: from one, doubled while twice as
    many make each client's share of a call's seconds (`seconds_at(clients)`, one run) believably cheaper
    (SAME_SPEED: twice the clients' memory for a gain under 20% is the trade `kept` refuses), at most `most`. A GPU's
    call costs about the same for one client as for many until the GPU is busy; a CPU's grows with the clients from
    the first: the memory, which grows with them, then follows what the speed gains. One client is measured after a
    first run (which pays what any first call does); a larger call is run again only where its first run was not
    cheaper enough, since a first call at a new size can only look slower. A size that runs out of memory ends the
    doubling; one at a single client leaves the share unknown (None). Where the first call of one client adds so
    little memory that `most` of them would add under MATERIAL_MEMORY of what the process holds (a small model),
    the call takes them all, unmeasured."""
    with MemoryRise(device) as one:  # a first call's own allocations only make the rise look larger
        fits = within_memory(lambda: seconds_at(1), device)[0]  # pays what any first call does
    if fits and one.rise is not None and most * one.rise < MATERIAL_MEMORY * one.start:
        return CallSize(most, None)  # its share of a call of all of them was not measured
    fits, share = within_memory(lambda: seconds_at(1), device) if fits else (False, None)
    size = 1
    while fits and size < most:
        more = min(2 * size, most)
        fits, seconds = within_memory(lambda more=more: seconds_at(more), device)
        if fits and SAME_SPEED * seconds / more >= share:
            fits, seconds = within_memory(lambda more=more: seconds_at(more), device)
        if not fits or SAME_SPEED * seconds / more >= share:
            break
        size, share = more, seconds / more
    return CallSize(size, share)


def within_memory(run: Callable[[], T], device: torch.device) -> tuple[bool, T | None]:
    """(True, run()), or (False, None) when it runs out of memory (then its memory is handed back); other errors
    pass through."""
    try:
        with host_memory_cap(device):
            return True, run()
    except (RuntimeError, MemoryError) as error:  # torch.OutOfMemoryError is a RuntimeError
        if not out_of_memory(error):
            raise
    release_freed_memory(device)
    return False, None


def out_of_memory(error: BaseException) -> bool:
    """A CUDA out-of-memory error, or the CPU allocator's (a plain RuntimeError in torch, MemoryError in Python)."""
    return (isinstance(error, torch.OutOfMemoryError | MemoryError)
            or "DefaultCPUAllocator: can't allocate memory" in str(error))


@contextmanager
def host_memory_cap(device: torch.device) -> Iterator[None]:
    """On a Linux CPU, while it is open: the process's data segment (RLIMIT_DATA: its heap and private mappings)
    may grow by at most TRIAL_SHARE of the memory available. Linux overcommits, so an allocation beyond the
    machine's memory succeeds and the kernel's OOM killer ends the process (or a neighbour) once it is touched;
    under the cap it fails at once, as torch's out-of-memory error, and `within_memory` can tell."""
    used = process_status("VmData") if device.type == "cpu" else None
    if used is None:
        yield
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    cap = used + int(psutil.virtual_memory().available * TRIAL_SHARE)
    cap = min([cap] + [limit for limit in (soft, hard) if limit != resource.RLIM_INFINITY])
    resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
