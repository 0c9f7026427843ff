"""Typed settings of one federated stage: local work, learning-rate schedule, server optimizer."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BeforeValidator, ByteSize, Field, TypeAdapter, ValidationError, model_validator

from fedpilot.schema import Strict

_BYTE_SIZE = TypeAdapter(ByteSize)


def _byte_count(value: object) -> int:
    """Bytes from an integer or a number with a unit: 1073741824, "1GiB", "1.5 GB", "512MB" (pydantic's ByteSize)."""
    if isinstance(value, float) and value.is_integer():  # YAML's 1.0e+9
        value = int(value)
    try:
        size = None if isinstance(value, bool) else int(_BYTE_SIZE.validate_python(value))
    except ValidationError:
        size = None
    if size is None or size < 0:
        raise ValueError("expected a size in bytes: an integer >= 0, or a number with a unit such as '2GiB' or '512MB'")
    return size


Bytes = Annotated[int, BeforeValidator(_byte_count)]
AUTO = "auto"  # `execution: auto`: the stage times the candidates on its first round (engine/accel/choice.py)
# The executors a stage may run, by their `execution:` names, in the order a stage times them (engine/accel maps
# each to its class): the one list of them.
EXECUTORS = ("vmap", "vmap_autograd", "loop", "loop_channels_last", "loop_batched_first", "bmm")
Beta = Annotated[float, Field(ge=0, lt=1)]


class LrSchedule(Strict):
    """Client learning rate across rounds (held constant within a round, as in Pillutla et al., ICML 2022,
    App. B.3).

    constant: lr.  exponential: lr * gamma ** (round // every)  (gamma 0.5 = "halve every N rounds").
    linear: warm up linearly over `warmup` rounds (a fraction of the stage if < 1), then decay linearly to 0.
    """

    kind: Literal["constant", "exponential", "linear"] = "constant"
    gamma: float = Field(0.5, gt=0, le=1)
    every: int = Field(100, ge=1)
    warmup: float = Field(0.0, ge=0)

    def factor(self, round_idx: int, rounds: int) -> float:
        """Multiplier of the base client lr at `round_idx` of a stage with `rounds` rounds."""
        if self.kind == "exponential":
            return self.gamma ** (round_idx // self.every)
        if self.kind == "linear":
            warmup = self.warmup * rounds if self.warmup < 1 else self.warmup
            if round_idx < warmup:
                return (round_idx + 1) / math.ceil(warmup)
            return max(0.0, (rounds - round_idx) / max(1.0, rounds - warmup))
        return 1.0


class LocalConfig(Strict):
    """What each sampled client does in a round: SGD for `epochs` epochs or `steps` steps."""

    epochs: float | None = Field(None, gt=0)
    steps: int | None = Field(None, ge=1)
    batch_size: int = Field(10, ge=1)
    lr: float = Field(0.05, gt=0)
    schedule: LrSchedule = LrSchedule()
    clip_norm: float | None = Field(None, gt=0)
    weight_decay: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _one_budget(self) -> LocalConfig:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("give local work as `epochs` or `steps`, not both")
        if self.epochs is None and self.steps is None:
            self.epochs = 1.0
        return self


class ServerConfig(Strict):
    """Server optimizer on the shared parameters, the aggregate being its pseudo-gradient.

    sgd with lr 1 and momentum 0 is FedAvg; momentum > 0 is FedAvgM; adam is FedAdam (Reddi et al. 2021). Adam's
    `betas` are each in [0, 1): torch.optim.Adam refuses others.
    """

    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = Field(1.0, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    betas: tuple[Beta, Beta] = (0.9, 0.99)
    eps: float = Field(1e-3, gt=0)


class StageConfig(Strict):
    """One stage of a pipeline as the engine sees it (the algorithm's own settings live apart)."""

    rounds: int = Field(1, ge=1)
    clients_per_round: int | None = Field(None, ge=1)
    local: LocalConfig = LocalConfig()
    server: ServerConfig = ServerConfig()
    eval_every: int = Field(10, ge=1)
    eval_clients: int | None = Field(None, ge=1)  # evaluated during training (a seeded sample); all at the end
    max_parallel_clients: int = Field(256, ge=1)
    execution: Literal[(AUTO, *EXECUTORS)] = AUTO  # type: ignore[valid-type]
    host_memory_budget: Bytes | None = None  # per-client rows kept in memory; more: a file
    device_data_budget: Bytes | None = None  # client data on the device; more: gathered per round
    precision: Literal["32-true", "bf16-mixed"] = "32-true"  # Lightning's names; bf16-mixed: bf16 forward passes
