"""Minibatch plans: every local step of a whole cohort drawn at once from a seeded generator.

A plan is made for the whole cohort before it is cut into chunks, so results do not depend on chunking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from fedpilot.engine.data import AugmentParams


def draw_without_replacement(n: int, size: int, *key: int) -> torch.Tensor:
    """`size` of range(n), uniform without replacement, sorted, seeded by `key`; its cost follows `size`, not `n`
    (numpy's Generator.choice: a million-client federation's cohort costs what a thousand-client one's does)."""
    rng = np.random.default_rng(np.random.SeedSequence(list(key)))
    return torch.from_numpy(np.sort(rng.choice(n, size, replace=False))).long()


@dataclass(frozen=True)
class Sampling:
    """Which of `n_clients` a stage's rounds take, seeded by `key` (seed, stage): each round a cohort of `size`
    (None: all) uniform without replacement, or with `one_pass` consecutive slices of the clients in one pass over
    them; and the `evaluated` clients of the evaluations during training (None: all)."""

    n_clients: int
    size: int | None
    key: tuple[int, int]
    one_pass: bool = False
    evaluated_clients: int | None = None

    @property
    def cohort_size(self) -> int:
        return min(self.size or self.n_clients, self.n_clients)

    def rounds(self, rounds: int) -> int:
        """Rounds of a stage of `rounds` rounds: those, or with `one_pass` the slices."""
        return math.ceil(self.n_clients / self.cohort_size) if self.one_pass else rounds

    def cohort(self, round_idx: int) -> torch.Tensor:
        """Round `round_idx`'s clients, seeded by (seed, stage, round)."""
        size, n = self.cohort_size, self.n_clients
        if self.one_pass:
            return torch.arange(round_idx * size, min(n, (round_idx + 1) * size))
        return draw_without_replacement(n, size, *self.key, round_idx, 0)

    def evaluated(self) -> torch.Tensor | None:
        """The clients evaluated during training, the same at every evaluation of the stage (None: every one)."""
        n, size = self.n_clients, self.evaluated_clients
        return None if size is None or size >= n else draw_without_replacement(n, size, *self.key, 0, 1)


def round_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from a tuple of ints (seed, stage, round, phase), stable across machines."""
    seed = int(np.random.SeedSequence(list(key)).generate_state(1, dtype=np.uint64)[0] >> 1)
    return torch.Generator().manual_seed(seed)


@dataclass
class BatchPlan:
    """Sample indices [K, S, B] into the client-major tensors, 0/1 sample weights and active steps [K, S], and the
    random augmentations drawn for each planned sample (if the data has any)."""

    index: torch.Tensor
    weight: torch.Tensor
    active: torch.Tensor
    augment: AugmentParams | None = None

    def rows(self, rows: slice) -> BatchPlan:
        augment = self.augment.rows(rows) if self.augment is not None else None
        return BatchPlan(self.index[rows], self.weight[rows], self.active[rows], augment)

    def to(self, device: torch.device) -> BatchPlan:
        return BatchPlan(self.index.to(device), self.weight.to(device), self.active.to(device), self.augment)

    def first_steps(self, steps: int) -> BatchPlan:
        """Each client's first `steps` steps (drawn before any augmentation)."""
        return BatchPlan(self.index[:, :steps], self.weight[:, :steps], self.active[:, :steps])


def _orderings(sizes: torch.Tensor, repeats: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """`repeats` random orderings of each client's positions 0..n_k-1, padded past n_k: [K, repeats, width]."""
    keys = torch.rand(len(sizes), repeats, width, generator=gen)
    keys = keys.masked_fill(torch.arange(width) >= sizes[:, None, None], 2.0)
    return keys.argsort(dim=-1)


def epoch_plan(offsets: torch.Tensor, sizes: torch.Tensor, epochs: float, batch: int,
               gen: torch.Generator) -> BatchPlan:
    """`epochs` passes over each client's samples in batches of `batch` (the last batch of a pass may be short; a
    batch larger than every client is the whole client: the plan is no wider than the largest client).

    A fractional epoch count keeps the first ceil(fraction * steps per epoch) steps of the last pass.
    """
    n_max = int(sizes.max())
    batch = max(1, min(batch, n_max))
    per_epoch = math.ceil(n_max / batch)
    passes = math.ceil(epochs)
    order = _orderings(sizes, passes, per_epoch * batch, gen)
    pos = order.reshape(len(sizes), passes * per_epoch, batch)
    weight = (pos < sizes[:, None, None]).float()
    client_steps = torch.ceil(sizes / batch)
    step_in_pass = torch.arange(per_epoch).repeat(passes)
    pass_idx = torch.arange(passes).repeat_interleave(per_epoch)
    budget = torch.where(pass_idx[None] < passes - 1, client_steps[:, None],
                         torch.ceil(client_steps * (epochs - (passes - 1)))[:, None])
    active = step_in_pass[None] < budget
    return BatchPlan(offsets[:, None, None] + _clip(pos, sizes), weight, active)


def step_plan(offsets: torch.Tensor, sizes: torch.Tensor, steps: torch.Tensor | int, batch: int,
              gen: torch.Generator) -> BatchPlan:
    """`steps` steps per client (an int or a per-client tensor), each a fresh batch drawn without replacement."""
    steps = torch.as_tensor(steps).expand(len(sizes))
    s_max = int(steps.max())
    order = _orderings(sizes, s_max, int(sizes.max()), gen)[..., :batch]
    weight = (order < sizes[:, None, None]).float()
    active = torch.arange(s_max)[None] < steps[:, None]
    return BatchPlan(offsets[:, None, None] + _clip(order, sizes), weight, active)


def _clip(pos: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Padding positions point at the client's own sample 0 (weight 0), so every index is valid."""
    return torch.where(pos < sizes[:, None, None], pos, torch.zeros_like(pos))
