"""The process's C allocator on Linux CPUs: keep freed memory for the next round, give it back between stages.

Every round allocates the same large buffers again (a cohort's trained copies, gradients); with glibc's
defaults they are fresh mmap pages that fault on first touch, ~20% of the CNN round's CPU time on 2 cores
(bench/README.md). `keep_freed_memory` makes glibc reuse freed memory instead; `release_freed_memory` hands
what is free back to the system, so a stage's resident memory (its recorded peak) starts from what is in use.
"""

from __future__ import annotations

import ctypes
import functools
import sys

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


def release_freed_memory() -> None:
    """Return the allocator's free memory (in every arena) to the system: resident memory = memory in use."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
