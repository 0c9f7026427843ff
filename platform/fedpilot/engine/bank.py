"""Per-client tensors that live across rounds: the personal bank [n_clients, ...]."""

from __future__ import annotations

import torch
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

    def nbytes(self) -> int:
        return sum(self.tensor(n).numel() * self.tensor(n).element_size() for n in self.names)
