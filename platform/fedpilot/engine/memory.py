"""Memory of a running stage: the process's C allocator on Linux CPUs (keep freed memory for the next round, give
it back between stages) and the peak a stage reaches.

Every round allocates the same large buffers again (a cohort's trained copies, gradients); with glibc's
defaults they are fresh mmap pages that fault on first touch, a large part of a CNN round's CPU time
(bench/README.md). `keep_freed_memory` makes glibc reuse freed memory instead; `release_freed_memory` hands
what is free back to the system, so a stage's resident memory (its recorded peak) starts from what is in use.
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import psutil
import torch

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


@functools.cache
def keep_freed_memory(device: torch.device) -> None:
    """Once per process, for CPU work: no automatic trimming and no mmap for large blocks."""
    libc = _glibc()
    if device.type == "cpu" and libc is not None:
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
        libc.mallopt(M_MMAP_MAX, 0)


def release_freed_memory(device: torch.device | None = None) -> None:
    """Return the allocator's free memory (in every arena; on a GPU also torch's cached blocks) to the system:
    resident memory = memory in use."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
    if device is not None and device.type == "cuda":
        torch.cuda.empty_cache()


class PeakMemory:
    """Peak memory while a block runs: torch's peak CUDA allocation on a GPU, else the process's resident set
    size sampled every 20 ms, from a start where the allocator has given back what is free (so each stage gets
    its own peak, not the process's lifetime maximum, also when the engine keeps freed memory between rounds)."""

    def __init__(self, device: torch.device, interval: float = 0.02):
        self.device, self.interval = device, interval
        self.bytes = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        process = psutil.Process()
        while True:
            self.bytes = max(self.bytes, process.memory_info().rss)
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            release_freed_memory()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        else:
            self.bytes = int(torch.cuda.max_memory_allocated(self.device))


class MemoryRise:
    """How far a block raised the memory in use above its start (`rise`), and that start (`start`), in bytes: on a
    GPU torch's allocation; on a Linux CPU the resident set, its high-water mark reset at the start
    (/proc/self/clear_refs) after the allocator's free memory is handed back; None where neither is known."""

    def __init__(self, device: torch.device):
        self.device = device
        self.start: int | None = None
        self.rise: int | None = None

    def __enter__(self) -> MemoryRise:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif process_status("VmRSS") is not None:
            release_freed_memory()
            try:
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
            except OSError:
                return self
        self.start = memory_in_use(self.device, release=False)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.start is None:
            return
        peak = (int(torch.cuda.max_memory_allocated(self.device)) if self.device.type == "cuda"
                else process_status("VmHWM"))
        self.rise = None if peak is None else max(peak - self.start, 0)


def memory_in_use(device: torch.device, release: bool = True) -> int:
    """The memory in use (bytes): torch's allocation on a GPU, else the process's resident set, after the C
    allocator's free memory is handed back (`release`)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    if release:
        release_freed_memory()
    return psutil.Process().memory_info().rss


def memory_available(device: torch.device) -> int:
    """The memory that more work could take (bytes): the GPU's free memory, else the machine's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def process_status(field: str) -> int | None:
    """A memory field of /proc/self/status in bytes (None off Linux)."""
    status = Path("/proc/self/status")
    if not status.is_file():
        return None
    line = next((line for line in status.read_text().splitlines() if line.startswith(f"{field}:")), None)
    return None if line is None else int(line.split()[1]) * 1024


def data_fits(nbytes: Callable[[], int], device: torch.device, budget: int | None) -> bool:
    """Whether a federation's data (of `nbytes()`) moves to the device whole: within `budget` when one is given,
    else on a GPU within half of its free memory (on the CPU it is there already); otherwise each round gathers
    its cohort's samples."""
    if budget is not None:
        return nbytes() <= budget
    if device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes() <= free // 2
