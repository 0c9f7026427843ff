"""Per-client tensors that live across rounds: the personal bank [n_clients, ...]."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fedpilot.engine.local import Params


class ClientBank(nn.Module):
    """A dict of [n_clients, ...] buffers (so Lightning checkpoints them), gathered and scattered by id."""

    def __init__(self, values: Params):
        super().__init__()
        self.names = list(values)
        for name, value in values.items():
            self.register_buffer(self._key(name), value.contiguous())

    @staticmethod
    def _key(name: str) -> str:
        return name.replace(".", "__")

    def tensor(self, name: str) -> torch.Tensor:
        return getattr(self, self._key(name))

    def get(self, clients: torch.Tensor) -> Params:
        return {n: self.tensor(n)[clients] for n in self.names}

    def put(self, clients: torch.Tensor, values: Params) -> None:
        for n in self.names:
            self.tensor(n)[clients] = values[n].detach().to(self.tensor(n).dtype)

    def share_rows(self, clients: torch.Tensor, mine: slice) -> None:
        """DDP: this process updated the rows `clients[mine]`, the others the rest of `clients`; afterwards every
        process holds all of them (a sum over processes of disjoint rows, exact)."""
        for n in self.names:
            rows = torch.zeros_like(self.tensor(n)[clients])
            rows[mine] = self.tensor(n)[clients[mine]]
            dist.all_reduce(rows)
            self.tensor(n)[clients] = rows

    def nbytes(self) -> int:
        return sum(self.tensor(n).numel() * self.tensor(n).element_size() for n in self.names)
