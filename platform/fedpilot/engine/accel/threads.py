"""Clients on the CPU's cores: one client per intra-op thread, each single-threaded."""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import nn


def client_threads(device: torch.device) -> int:
    """How many clients `for_each_client` runs at once on `device`: one per intra-op thread on the CPU, else one."""
    return torch.get_num_threads() if device.type == "cpu" else 1


def for_each_client(module: nn.Module, run: Callable[[int, nn.Module], None], clients: int,
                    device: torch.device) -> None:
    """run(k, module) for k in range(clients); on CPU one client per intra-op thread, each client single-threaded.

    A client's step at batch 10 is too small to split over cores, and OpenMP's barriers wait on descheduled
    threads when the machine is shared (bench/README.md has the measurements).
    Each client is computed by one thread alone, so the results are the same for any number of threads.
    Each worker thread gets its own copy of `module` (functional_call swaps a module's parameters in place), its
    buffers included, sharing the parameters' memory (every caller passes the parameters to functional_call: the
    copy's own are never read, so copying them would only cost a model's bytes per thread and call), and the
    caller's grad mode and autocast state (both thread-local).
    """
    threads = client_threads(device)
    if threads == 1:
        for k in range(clients):
            run(k, module)
        return
    grad = torch.is_grad_enabled()
    cast = torch.is_autocast_enabled(device.type), torch.get_autocast_dtype(device.type)
    mine = threading.local()

    def job(k: int) -> None:
        if not hasattr(mine, "module"):
            mine.module = copy.deepcopy(module, {id(p): p for p in module.parameters()})
        with torch.set_grad_enabled(grad), torch.autocast(device.type, dtype=cast[1], enabled=cast[0]):
            run(k, mine.module)

    jobs = [_pool(threads, os.getpid()).submit(job, k) for k in range(clients)]
    wait(jobs)  # all of them, also after one failed: none is left running on the next call's rows
    for done in jobs:
        done.result()


@functools.cache
def _pool(threads: int, pid: int) -> ThreadPoolExecutor:
    """The process's `threads` single-threaded workers, started once: a round's chunks each start no threads of their
    own (`pid`: a forked child starts its own, its parent's threads are not in it)."""
    return ThreadPoolExecutor(threads, initializer=torch.set_num_threads, initargs=(1,))
