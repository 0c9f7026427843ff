"""The round's bound: ONE model trained over all of the round's samples (its clients' samples, times the local
epochs) in the largest batch that fits, forward, backward and an SGD step per batch: the FLOPs of the round in the
best shapes the device has, with none of federated learning's own work (no per-client models, small batches,
aggregation). A federated round can approach it, not beat it; "x bound" in bench/compare.py is how far each contender
is from it.

The largest batch that fits: all of the round's samples, halved while a step runs out of memory (on a CPU under a
cap of half the memory available, so that Linux's overcommit cannot hand the step to the OOM killer). Images run in
the memory layout (NCHW or channels-last) a round measured faster, and freed memory is kept for the next step as
fedpilot keeps it (no page faults on each step's fresh buffers). The round's samples are on the device before the
clock starts: the bound is the arithmetic alone. Round time: the whole round.
"""

from __future__ import annotations  # noqa: I001  (fedpilot first: its OpenMP wait policy is set before torch loads)

import math
import sys
from pathlib import Path

import fedpilot  # noqa: F401
import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workload import RoundClock, Workload, build_model, contender_args, load_data, report, sample_cohort  # noqa: E402

from fedpilot.engine.accel.timing import within_memory  # noqa: E402
from fedpilot.engine.memory import keep_freed_memory  # noqa: E402


class Bound:
    """The workload's model and SGD on all of a round's samples, in batches of `batch` (`fit` finds the largest)."""

    def __init__(self, work: Workload, device: torch.device, precision: str = "32-true"):
        self.work, self.device = work, device
        self.model = build_model(work).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=work.lr)
        self.cast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
        self.x_all, self.y_all = load_data(work)
        self.batch = work.clients_per_round * work.samples
        self.layout = torch.contiguous_format

    def samples(self, round_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Round `round_idx`'s samples (its cohort's, as the contenders sample it) on the device, flat."""
        cohort = sample_cohort(self.work, round_idx)
        x = torch.from_numpy(np.ascontiguousarray(self.x_all[cohort])).flatten(0, 1).to(self.device)
        y = torch.from_numpy(np.ascontiguousarray(self.y_all[cohort])).flatten().to(self.device)
        return x, y

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        with self.cast:
            loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.optimizer.step()

    def round(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Every sample, `epochs` times, in batches of `batch`."""
        for _ in range(self.work.epochs):
            for lo in range(0, len(x), self.batch):
                self.step(x[lo : lo + self.batch], y[lo : lo + self.batch])

    def fit(self, x: torch.Tensor, y: torch.Tensor) -> int:
        """The largest batch of the round's samples a step fits in (halved from all of them), then the faster layout
        of a round; the model is put back as it was."""
        state = {n: v.clone() for n, v in self.model.state_dict().items()}
        while not within_memory(lambda: self.step(x[: self.batch], y[: self.batch]), self.device)[0]:
            if self.batch == 1:
                raise MemoryError("one sample's step does not fit")
            self.batch = math.ceil(self.batch / 2)
        if x.dim() == 4:
            self.layout = min((torch.contiguous_format, torch.channels_last), key=lambda f: self.seconds(x, y, f))
            self.model.to(memory_format=self.layout)
        self.model.load_state_dict(state)
        return self.batch

    def seconds(self, x: torch.Tensor, y: torch.Tensor, layout: torch.memory_format) -> float:
        """A round's seconds in `layout` (after a step in it)."""
        self.layout = layout
        self.model.to(memory_format=layout)
        x = x.contiguous(memory_format=layout)
        self.step(x[: self.batch], y[: self.batch])
        clock = RoundClock(self.device.type)
        clock.start()
        self.round(x, y)
        clock.stop()
        return clock.times[0]


def bound_times(work: Workload, rounds: int, device: str, precision: str = "32-true") -> tuple[list[float], int, str]:
    """Seconds of each of `rounds` bound rounds, the batch and the memory layout they ran in."""
    bound, clock = Bound(work, torch.device(device), precision), RoundClock(device)
    keep_freed_memory(bound.device)
    batch = bound.fit(*bound.samples(0))
    for r in range(rounds):
        x, y = bound.samples(r)
        x = x.contiguous(memory_format=bound.layout) if x.dim() == 4 else x
        clock.start()
        bound.round(x, y)
        clock.stop()
    return clock.times, batch, str(bound.layout).removeprefix("torch.").removesuffix("_format")


def main() -> None:
    args = contender_args(__doc__, {"--precision": {"default": "32-true", "choices": ["32-true", "bf16-mixed"]}})
    times, batch, layout = bound_times(args.workload, args.rounds, args.device, args.precision)
    report(args.out, "bound", args.workload, times, args.warmup, batch=batch, layout=layout, precision=args.precision)


if __name__ == "__main__":
    main()
