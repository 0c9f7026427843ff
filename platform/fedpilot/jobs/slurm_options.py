"""The Slurm options of a job (the pipeline's `slurm:` block, `fedpilot submit --to slurm` flags and
$FEDPILOT_SLURM): one typed value, checked before anything is submitted. Torch-free."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator

from fedpilot.schema import Strict

SLURM_TIME = re.compile(r"^(?:(\d+)-(\d+)(?::(\d+)(?::(\d+))?)?|(\d+)(?::(\d+)(?::(\d+))?)?)$")
SLURM_MEM = re.compile(r"^\d+[KMGT]?$")


def slurm_minutes(value: str) -> int:
    """Minutes of a Slurm time limit (`M`, `M:S`, `H:M:S`, `D-H`, `D-H:M`, `D-H:M:S`), seconds rounded up."""
    found = SLURM_TIME.match(value.strip())
    if not found:
        raise ValueError("not a Slurm time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
    days, dh, dm, ds, a, b, c = (int(g) if g else 0 for g in found.groups())
    if found.group(1) is not None:
        seconds = ((days * 24 + dh) * 60 + dm) * 60 + ds
    elif found.group(7) is not None:
        seconds = (a * 60 + b) * 60 + c
    else:
        seconds = a * 60 + b
    if seconds <= 0:
        raise ValueError("a time limit must be positive")
    return -(-seconds // 60)


class SlurmSpec(Strict):
    """Where `fedpilot submit --to slurm` sends a pipeline (the `slurm:` block; flags and $FEDPILOT_SLURM too):
    partition, GPUs per node (default `devices`, 0 with `device: cpu`), CPUs per task, memory per node (`16G`),
    time limit (`4:00:00`), account and QoS; `setup` lines run before the job (e.g. `module load cuda`)."""

    partition: str | None = None
    gpus: int | None = Field(None, ge=0)
    cpus: int | None = Field(None, ge=1)
    mem: str | None = None
    time: str | None = None
    account: str | None = None
    qos: str | None = None
    setup: list[str] = Field(default_factory=list)

    @field_validator("partition", "account", "qos")
    @classmethod
    def _word(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_.,-]{1,128}", value):
            raise ValueError("letters, digits, `_`, `.`, `,` or `-` only")
        return value

    @field_validator("mem")
    @classmethod
    def _memory(cls, value: str | None) -> str | None:
        if value is not None and not SLURM_MEM.match(str(value).strip()):
            raise ValueError("memory per node in Slurm's form: a number of MB, or with K, M, G or T (16G)")
        return None if value is None else str(value).strip()

    @field_validator("time", mode="before")
    @classmethod
    def _time(cls, value: Any) -> str | None:
        if value is None:
            return None
        value = str(value)
        slurm_minutes(value)
        return value.strip()
