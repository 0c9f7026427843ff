"""The one interface every algorithm implements: local update order, what a client returns, the server rule."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from fedpilot.engine import Cohort, Upload, WeightedMean


class AlgorithmParams(BaseModel):
    """Hyperparameters of an algorithm (defaults mirror configs/algorithm/NAME.yaml)."""

    model_config = ConfigDict(extra="forbid")


class Algorithm(ABC):
    """An algorithm says only what is specific to it; sampling, batching, chunking and evaluation are the engine's.

    Class attributes the engine and pipeline read:
      stateful                 personal parameters persist across rounds in the personal bank
      visits_each_client_once  the stage is one pass over all clients (fine-tuning) instead of sampled rounds
      personal_part            a split preset that overrides the pipeline's ("none" for FedAvg, "all" for
                               whole-model fine-tuning), or None to use the pipeline's personalization
      personal_copy            with personal_part "all": the server also keeps a global copy of every parameter
                               (`cohort.shared`), trained and aggregated alongside the clients' personal copies
                               (Ditto); clients are evaluated with their personal copy
    """

    name: ClassVar[str]
    Params: ClassVar[type[AlgorithmParams]] = AlgorithmParams
    visits_each_client_once: ClassVar[bool] = False
    personal_copy: ClassVar[bool] = False

    def __init__(self, params: AlgorithmParams | dict[str, Any] | None = None):
        self.p = params if isinstance(params, self.Params) else self.Params.model_validate(params or {})
        self.server_state: dict[str, Any] = {}  # the server's own state across rounds; checkpointed by the stage

    @property
    def stateful(self) -> bool:
        return bool(getattr(self.p, "stateful", True))

    @property
    def personal_part(self) -> str | None:
        return None

    aggregator = WeightedMean

    def prepare_model(self, model: torch.nn.Module, input_shape: tuple[int, ...]) -> None:
        """Add what the algorithm needs to the model before the stage's split is applied (pFedGate's gate)."""
        return None

    def client_state(self) -> dict[str, torch.Tensor]:
        """Initial per-client state beyond parameters (e.g. Self-FL's variances), without the client dimension;
        the engine keeps a [n_clients, ...] bank of it, checkpointed, and hands a cohort its rows as `cohort.state`."""
        return {}

    @abstractmethod
    def local_update(self, cohort: Cohort) -> Upload:
        """Train the cohort locally (set `cohort.personal` to keep new personal parameters) and say what to send."""
