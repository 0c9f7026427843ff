"""Where a job runs: a Backend submits a job, starts the rows a schedule fired, cancels a job and refreshes what
`fedpilot jobs` shows of it. The platform database's queue (fedpilot workers) and Slurm (through submitit) are the
two backends; a job row names its own (`backend`: None is the queue), `--to` names a new job's."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from sqlalchemy import Engine

from fedpilot.errors import JobError
from fedpilot.jobs import queue, slurm
from fedpilot.jobs.slurm_options import SlurmSpec

QUEUE, SLURM = "queue", slurm.SLURM


class Backend(ABC):
    """Submits, starts, cancels and refreshes the jobs that run in one place."""

    name: ClassVar[str]
    here: ClassVar[bool] = True  # its jobs run on machines like this one: the devices a pipeline asks for are checked
    columns: ClassVar[tuple[str, ...]] = ()  # what `fedpilot jobs` shows of its jobs beyond the queue's columns

    @abstractmethod
    def submit(self, database: Engine, db_url: str, fields: dict[str, Any],
               parallel: int) -> list[tuple[int, str | None]]:
        """Store `parallel` rows of a validated job (jobs.queue.job_fields) and start them; (row id, the backend's own
        job id or None) of each. Nothing stays stored when the backend refuses the job."""

    @abstractmethod
    def start(self, database: Engine, db_url: str, ids: list[int]) -> None:
        """Start rows a schedule fired (stored queued); a refusal fails them with the reason."""

    @abstractmethod
    def cancel(self, database: Engine, job_id: int) -> str:
        """Cancel a job (a queued one at once, a running one asked to stop); the resulting status."""

    @abstractmethod
    def refresh(self, database: Engine, rows: list[dict[str, Any]]) -> None:
        """Bring the rows of its jobs up to date with what the backend knows (and add its `columns`)."""

    def logs(self, row: dict[str, Any]) -> dict[str, str]:
        """The end of a job's own logs where the backend keeps them (the queue keeps tails in the row)."""
        return {}


class QueueBackend(Backend):
    """The platform database's queue: stored rows wait for a fedpilot worker (`fedpilot worker`) to claim them."""

    name = QUEUE

    def submit(self, database: Engine, db_url: str, fields: dict[str, Any],
               parallel: int) -> list[tuple[int, str | None]]:
        return [(queue.submit(database, fields), None) for _ in range(parallel)]

    def start(self, database: Engine, db_url: str, ids: list[int]) -> None:
        """Nothing to do: a worker claims the queued rows."""

    def cancel(self, database: Engine, job_id: int) -> str:
        return queue.request_cancel(database, job_id)

    def refresh(self, database: Engine, rows: list[dict[str, Any]]) -> None:
        """Nothing to add: workers keep the queue's rows up to date."""


class SlurmBackend(Backend):
    """A Slurm cluster: each row is a Slurm job (an array for a parallel search) that runs the row itself."""

    name = SLURM
    here = False
    columns = ("slurm_job_id", "slurm_state", "node")

    def __init__(self, options: SlurmSpec | None = None):
        self.options = options or SlurmSpec()

    def submit(self, database: Engine, db_url: str, fields: dict[str, Any],
               parallel: int) -> list[tuple[int, str | None]]:
        return list(slurm.enqueue(database, slurm.absolute_db(db_url), fields, self.options, parallel))

    def start(self, database: Engine, db_url: str, ids: list[int]) -> None:
        slurm.dispatch_queued(database, db_url, ids)

    def cancel(self, database: Engine, job_id: int) -> str:
        return slurm.cancel(database, job_id)

    def refresh(self, database: Engine, rows: list[dict[str, Any]]) -> None:
        slurm.refresh(database, rows)

    def logs(self, row: dict[str, Any]) -> dict[str, str]:
        return slurm.log_tails(row.get("slurm_log"))


BACKENDS: dict[str, type[Backend]] = {QUEUE: QueueBackend, SLURM: SlurmBackend}


def backend(name: str | None) -> Backend:
    """The backend a job row's `backend` column (None: the queue) or `--to` names; a SpecError on `--to` for an
    unknown one."""
    chosen = name or QUEUE
    if chosen not in BACKENDS:
        raise JobError("--to", chosen, "not a place jobs run", allowed=list(BACKENDS))
    return BACKENDS[chosen]()


def configured(target: Backend, spec: dict[str, Any], flags: dict[str, Any]) -> Backend:
    """`target` set up for a job of the resolved pipeline `spec` with the Slurm flags `flags` (None: not given):
    for Slurm, its options ($FEDPILOT_SLURM, the `slurm:` block, the flags) checked against the pipeline's devices;
    for the queue, a Slurm flag is a SpecError."""
    if not isinstance(target, SlurmBackend):
        given = [key for key, value in flags.items() if value is not None]
        if given:
            raise JobError(f"--{given[0]}", flags[given[0]], "a Slurm option: add --to slurm")
        return target
    chosen = slurm.options(spec.get("slurm"), flags)
    slurm.parameters(spec, chosen, spec.get("name", "fedpilot"))  # GPUs against devices, before anything is stored
    return SlurmBackend(chosen)
