"""What the suite measures about the machine: CPU, load, large-GEMM GFLOP/s, and the memory (and GPU use) of a
process tree while a contender runs. Standard library and torch only."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def describe(device: str) -> dict:
    """Machine, thread count, instruction set torch uses, memory, load; the GPU's name on CUDA."""
    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "torch": torch.__version__, "load": os.getloadavg()}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def gemm_gflops(dtype: torch.dtype, device: str = "cpu", budget_s: float = 3.0) -> tuple[float, int]:
    """Best GFLOP/s of an n x n matmul, n doubled from 256 up to 4096 while one product takes < 0.25 s."""
    n, best = 256, 0.0
    while True:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        start = time.perf_counter()
        seconds = _timed_matmul(a, b, device)
        while time.perf_counter() - start < budget_s / 4:
            seconds = min(seconds, _timed_matmul(a, b, device))
        best = max(best, 2 * n**3 / seconds / 1e9)
        if n >= 4096 or seconds > 0.25:
            return best, n
        n *= 2


def _timed_matmul(a: torch.Tensor, b: torch.Tensor, device: str) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    sync()
    start = time.perf_counter()
    a @ b
    sync()
    return time.perf_counter() - start


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages (Ray's object store, libraries) split among the processes mapping them."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_memory(pid: int) -> int:
    """Summed PSS of a process and all its descendants (a simulator's worker processes included)."""
    tree, todo, total = _children(), [pid], 0
    while todo:
        p = todo.pop()
        total += _pss_bytes(p)
        todo.extend(tree.get(p, []))
    return total


class Watch:
    """Samples a process tree's memory (and, on CUDA, nvidia-smi's utilization and memory) while it runs."""

    def __init__(self, pid: int, gpu: bool, interval: float = 0.25):
        self.pid, self.interval, self.peak = pid, interval, 0
        self.gpu_util: list[float] = []
        self.gpu_peak_mib = 0.0
        self._stop = threading.Event()
        self._smi = None
        if gpu and shutil.which("nvidia-smi"):
            self._smi = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                          "--format=csv,noheader,nounits", "-lms", "200"],
                                         stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read_smi, daemon=True).start()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, tree_memory(self.pid))

    def _read_smi(self) -> None:
        for line in self._smi.stdout:
            util, used = (float(v) for v in line.split(",")[:2])
            self.gpu_util.append(util)
            self.gpu_peak_mib = max(self.gpu_peak_mib, used)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        if self._smi is not None:
            self._smi.terminate()
        result = {"peak_memory_bytes": self.peak}
        if self.gpu_util:
            result |= {"gpu_util_mean": sum(self.gpu_util) / len(self.gpu_util), "gpu_peak_mib": self.gpu_peak_mib}
        return result
