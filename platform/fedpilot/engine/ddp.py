"""A stage's rounds split across DDP processes: each trains its slice of the cohort, and what the round ends with is
all-reduced so that every process takes the same server step."""

from __future__ import annotations

import torch
import torch.distributed as dist

from fedpilot.engine.bank import ClientBank
from fedpilot.engine.protocol import Algorithm, ReducibleAggregator, RoundInfo


def distributed() -> bool:
    """Whether this process is one of several DDP processes sharing each round."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def process_rows(n: int) -> slice:
    """The rows of an n-client cohort this process trains: all of them, or under DDP its contiguous share."""
    if not distributed():
        return slice(0, n)
    world, rank = dist.get_world_size(), dist.get_rank()
    return slice(rank * n // world, (rank + 1) * n // world)


def splits_across_processes(algorithm: Algorithm) -> bool:
    """Whether the algorithm's aggregate is made of sums that DDP processes can all-reduce (a cohort split across
    devices); an aggregate that keeps every upload (robust rules, precision weights) runs in one process."""
    return isinstance(algorithm.aggregator(), ReducibleAggregator)


def check_splits_across_processes(algorithm: Algorithm) -> None:
    """Under DDP, refuse an algorithm whose rounds cannot be split across the processes."""
    if distributed() and not splits_across_processes(algorithm):
        raise ValueError(f"{algorithm.name}: its server keeps every client's upload, so a round cannot be split "
                         f"across {dist.get_world_size()} processes; run it with devices: 1")


def share_round(clients: torch.Tensor, mine: slice, aggregate: ReducibleAggregator, info: RoundInfo,
                banks: list[ClientBank], sums: list[float], device: torch.device) -> list[float]:
    """The whole cohort's aggregate and rows of `banks` on every process (each trained its `mine` rows of `clients`);
    the training-stat `sums`, all-reduced."""
    aggregate.all_reduce(info, device)
    for bank in banks:
        bank.share_rows(clients, mine)
    totals = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    return totals.tolist()
