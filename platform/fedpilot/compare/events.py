"""What a comparison's work tells whoever watches it (the command's display): where it stands and each step done.
Plain values, torch-free: `compare.work` emits them, `cli.display` shows them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitsDone:
    """A pass over the comparison's units: how many runs are done (by any process) of how many, and the pipelines
    whose study has its trials."""

    done: int
    total: int
    studied: tuple[str, ...]


@dataclass(frozen=True)
class StudyStarted:
    """This process starts or continues `pipeline`'s study, which has `finished` of its `trials` already, and its
    best objective so far (None before a trial completed)."""

    pipeline: str
    finished: int
    trials: int
    best: float | None


@dataclass(frozen=True)
class TrialDone:
    """A trial of `pipeline`'s study ended: its number and its objective (None: pruned)."""

    pipeline: str
    number: int
    value: float | None


@dataclass(frozen=True)
class RunStarted:
    """This process starts the run of `pipeline` on `seed` (`variant`: tuned or written)."""

    pipeline: str
    seed: int
    variant: str


@dataclass(frozen=True)
class RunDone:
    """The run of `pipeline` on `seed` ended: its test score (None: diverged)."""

    pipeline: str
    seed: int
    variant: str
    score: float | None


Event = UnitsDone | StudyStarted | TrialDone | RunStarted | RunDone
