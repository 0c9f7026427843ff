"""Where one round of the shared workload (bench/workload.py) spends its time: the round under torch.profiler, after
warm-up rounds, as `fedpilot run` runs it (a FederatedStage under a Lightning Trainer).

Prints the round's wall time, the time the device was busy with kernels (on a GPU: how much of the round is host
work the GPU waits for), the kernels launched, the operators taking the most host and device time, and the round
against its bound (bench/contenders/bound.py: one model trained over the round's samples in the largest batch that
fits, the same FLOPs).

    python bench/gpu/profile_round.py [--device cuda] [--model cnn] [--clients-per-round 1000] [--warmup 2]
"""

from __future__ import annotations  # noqa: I001  (fedpilot first: see below)

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import get_args

import fedpilot  # noqa: F401  first, as in `fedpilot run`: its OpenMP wait policy is set before torch loads
import lightning as L
import torch
from torch.profiler import ProfilerActivity, profile

BENCH = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(BENCH), str(BENCH / "contenders")]
from arguments import COUNT, WARMUP, device_name  # noqa: E402
from bound import bound_times  # noqa: E402
from fedpilot_engine import quiet_trainer, stage_for  # noqa: E402
from workload import WORKLOADS, flops_per_round, write_data  # noqa: E402

from fedpilot.engine.accel import AUTO, EXECUTORS  # noqa: E402
from fedpilot.engine.config import StageConfig  # noqa: E402


class ProfileRound(L.Callback):
    """Profiles round `at` (0-based) from its start to its end, the device's queue drained at both ends."""

    def __init__(self, at: int, device: torch.device):
        self.at, self.device = at, device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities)
        self.began = self.seconds = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if batch_idx == self.at:
            self._sync()
            self.profiler.start()
            self.began = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.at:
            self._sync()
            self.seconds = time.perf_counter() - self.began
            self.profiler.stop()


def device_seconds(events) -> tuple[float, int]:
    """Seconds of device kernels (summed over kernels; they run one at a time on one stream) and their number."""
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.time_range.elapsed_us() for e in kernels) / 1e6, len(kernels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", type=device_name, default="cuda")
    parser.add_argument("--model", choices=sorted(WORKLOADS), default="cnn")
    parser.add_argument("--clients-per-round", type=COUNT, default=1000)
    parser.add_argument("--warmup", type=WARMUP, default=2, help="rounds run before the profiled one")
    parser.add_argument("--execution", default="auto", choices=[AUTO, *EXECUTORS])
    parser.add_argument("--precision", default="32-true",
                        choices=get_args(StageConfig.model_fields["precision"].annotation))
    parser.add_argument("--rows", type=COUNT, default=20)
    args = parser.parse_args()
    clients = WORKLOADS[args.model].clients
    if args.clients_per_round > clients:
        parser.error(f"argument --clients-per-round: {args.clients_per_round} is more than the workload's {clients} "
                     "clients")
    device = torch.device(args.device)
    work = dataclasses.replace(WORKLOADS[args.model], clients_per_round=args.clients_per_round)
    write_data(work)
    stage = stage_for(work, args.warmup + 1, args.execution, args.precision)
    probe = ProfileRound(args.warmup, device)
    quiet_trainer(args.warmup + 1, args.device, [probe]).fit(stage)
    events = probe.profiler.key_averages()
    busy, kernels = device_seconds(probe.profiler.events())
    print(f"{work.describe()}; executor {stage.execution}, precision {args.precision}, {device}")
    print(f"round {args.warmup}: {probe.seconds:.4f} s wall; device kernels {busy:.4f} s "
          f"({100 * busy / probe.seconds:.1f}% of the round), {kernels} kernel launches")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if device.type == "cuda":
        print(events.table(sort_by="self_device_time_total", row_limit=args.rows))
    print_bound(work, probe.seconds, args)


def print_bound(work, seconds: float, args: argparse.Namespace) -> None:
    """The round's bound under the same precision (the median of as many rounds as were profiled and warmed up) and
    how far the profiled round is from it."""
    times, batch, layout = bound_times(work, args.warmup + 1, args.device, args.precision)
    bound, flops = statistics.median(times), flops_per_round(work)
    print(f"bound: {bound:.4f} s a round ({work.clients_per_round * work.samples * work.epochs} samples in batches of "
          f"{batch}, {layout}; {flops / bound / 1e12:.3f} TFLOP/s); the profiled round {seconds:.4f} s "
          f"({flops / seconds / 1e12:.3f} TFLOP/s): {seconds / bound:.2f}x its bound")


if __name__ == "__main__":
    main()
