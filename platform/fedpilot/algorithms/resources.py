"""Heterogeneous client resources (pFedGate: Chen et al., ICML 2023): each client i has its own level, pFedGate's
sparsity budget s_i or HeteroFL's width rate p_i, drawn once per client and fixed for the stage.

`Levels` gives them as a distribution over a set of values, as in pFedGate's experiments ("the full model for
10% of the clients and 50% of the parameters for the other 90%": values [1.0, 0.5], shares [0.1, 0.9]). Clients
are assigned by a permutation seeded by the pipeline's seed alone, so a client's level does not depend on the
stage, the round or the chunking, and the shares are exact (the first round(share * n) clients of the permutation
take the first value, and so on; rounding goes to the last value).

A level reaches the client's model as a per-client constant (Algorithm.constants): a buffer of the module the
algorithm adds to the model, which the client's own value replaces in training and in evaluation, and which no
local step changes. A client that never took part in a stage keeps the buffer's value (the single level) in that
stage's evaluation.
"""

from __future__ import annotations

import math

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedpilot.api import Cohort, round_generator

LEVELS = 5  # tag of the seeded permutation (never a batch plan's phase key)


class Levels(BaseModel):
    """values: the levels in (0, 1]; shares: the fraction of clients at each (null = equal shares)."""

    model_config = ConfigDict(extra="forbid")

    values: list[float] = Field(min_length=1)
    shares: list[float] | None = None

    @model_validator(mode="after")
    def _valid(self) -> Levels:
        if any(not 0 < v <= 1 for v in self.values):
            raise ValueError(f"values={self.values}: each must be in (0, 1]")
        if self.shares is not None:
            if len(self.shares) != len(self.values) or any(s < 0 for s in self.shares):
                raise ValueError(f"shares={self.shares}: one non-negative share per value")
            if not math.isclose(sum(self.shares), 1.0, abs_tol=1e-6):
                raise ValueError(f"shares={self.shares}: must sum to 1")
        return self

    def of(self, cohort: Cohort) -> torch.Tensor:
        """The levels of the cohort's clients [K] (float32), on their device."""
        return self.per_client(cohort.round_key[0], cohort.n_clients).to(cohort.clients.device)[cohort.clients]

    def per_client(self, seed: int, n_clients: int) -> torch.Tensor:
        """Each client's level [n_clients] (float32)."""
        shares = self.shares or [1.0 / len(self.values)] * len(self.values)
        counts = [round(s * n_clients) for s in shares[:-1]]
        counts.append(n_clients - sum(counts))
        levels = torch.repeat_interleave(torch.tensor(self.values), torch.tensor(counts).clamp_min(0))[:n_clients]
        order = torch.randperm(n_clients, generator=round_generator(seed, LEVELS))
        return torch.empty(n_clients).index_put_((order,), levels)
