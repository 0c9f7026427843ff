"""Named leases in the platform database: one row per name (a study, a unit of a comparison's work) saying which
process holds it until when, taken over from a holder that stopped renewing it, and the MLflow run recorded under the
name (first writer wins)."""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone

from sqlalchemy import Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from fedpilot.db import Lease, connect

LEASE_SECONDS = 30
_leases = Lease.__table__


class NamedLease:
    """A row per name in the platform database: who holds it now (a study's: who may create its next trial; a
    comparison's unit of work: who runs it), until when, and the MLflow run recorded under the name."""

    def __init__(self, database: Engine | str, name: str, seconds: float = LEASE_SECONDS):
        self.database = connect(database) if isinstance(database, str) else database
        self.seconds = seconds  # how long the lease outlives its holder's last renewal
        self.study, self.owner = name, f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        try:
            with self.database.begin() as db:
                db.execute(insert(_leases).values(study=name))
        except IntegrityError:
            pass

    def acquire(self, poll: float = 0.2) -> None:
        """Wait until this process holds the lease (taken over from a holder that stopped renewing it)."""
        while not self.try_acquire():
            time.sleep(poll)

    def try_acquire(self) -> bool:
        """Take the lease if it is free, expired or already this process's (its time renewed); whether it did."""
        now = datetime.now(timezone.utc)
        with self.database.begin() as db:
            return bool(db.execute(update(_leases).where(
                _leases.c.study == self.study,
                (_leases.c.owner.is_(None)) | (_leases.c.until < now) | (_leases.c.owner == self.owner),
            ).values(owner=self.owner, until=now + timedelta(seconds=self.seconds))).rowcount)

    @contextmanager
    def kept(self) -> Iterator[None]:
        """Hold the (acquired) lease while the block runs, renewed from a thread three times within its time: a process
        that dies stops renewing it, and another takes it over once it expires. Released at the end."""
        done = threading.Event()

        def renew() -> None:
            while not done.wait(self.seconds / 3):
                self.try_acquire()

        thread = threading.Thread(target=renew, daemon=True, name=f"lease {self.study}")
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            self.release()

    def release(self) -> None:
        with self.database.begin() as db:
            db.execute(update(_leases).where(_leases.c.study == self.study, _leases.c.owner == self.owner)
                       .values(owner=None, until=None))

    def mlflow_run(self, create: Callable[[], str], discard: Callable[[str], None]) -> str:
        """The MLflow run recorded under the name (a study's search run): the one recorded here, else a new one made
        by `create` (first writer wins; a loser's run is `discard`ed)."""
        with self.database.begin() as db:
            known = db.execute(select(_leases.c.mlflow_run_id).where(_leases.c.study == self.study)).scalar()
        if known:
            return known
        mine = create()
        with self.database.begin() as db:
            db.execute(update(_leases).where(_leases.c.study == self.study, _leases.c.mlflow_run_id.is_(None))
                       .values(mlflow_run_id=mine))
            winner = db.execute(select(_leases.c.mlflow_run_id).where(_leases.c.study == self.study)).scalar()
        if winner != mine:
            discard(mine)
        return winner
