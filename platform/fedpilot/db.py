"""The platform database: jobs and their attempts, schedules and their firings, study leases (`fedpilot_*` tables).
A job runs on this queue's workers, or as a Slurm job (`backend`), which updates its row itself.

Optuna keeps its studies in the same database and owns its `alembic_version` table, so these tables are
created with `metadata.create_all` (no migrations). All timestamps are UTC.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    Boolean,
    DateTime,
    Engine,
    ForeignKey,
    Integer,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    create_engine,
    inspect,
    text,
)
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from fedpilot.errors import StoreUnavailable
from fedpilot.settings import check_database

QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
LOST = "lost"  # an attempt whose worker stopped sending heartbeats
STOPPED = "stopped"  # an attempt stopped by a signal with a checkpoint (a Slurm job preempted or requeued)
STATUSES = (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


SQLITE_BUSY_SECONDS = 30  # how long a connection waits for another process's write lock on an SQLite file


def engine_options(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options for the platform database, shared by Optuna's storage on the same file: on SQLite
    a connection waits up to SQLITE_BUSY_SECONDS for a lock (sqlite3's default 5 s fails busy workers); elsewhere
    connections are pinged before use."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": SQLITE_BUSY_SECONDS}}
    return {"pool_pre_ping": True}


def connect(url: str, key: str = "--db") -> Engine:
    """The platform database (an SQLAlchemy Engine) with the `fedpilot_*` tables created; a bad URL is a SetupError
    and a database that cannot be opened a StoreUnavailable, on `key` (the option or variable that gave the URL)."""
    check_database(key, url)
    database = create_engine(url, **engine_options(url))
    try:
        _create_tables(database)
    except OperationalError as err:
        shown = database.url.render_as_string(hide_password=True)
        raise StoreUnavailable(key, shown,
                               f"cannot open the database: {str(err.orig).strip().splitlines()[0]}") from None
    return database


def _create_tables(database: Engine) -> None:
    """The `fedpilot_*` tables that do not exist yet (a second try if another process raced to create them), and
    the columns a newer fedpilot added to an existing table."""
    try:
        Base.metadata.create_all(database)
    except (IntegrityError, ProgrammingError, OperationalError):
        Base.metadata.create_all(database)
    _add_missing_columns(database)


def _add_missing_columns(database: Engine) -> None:
    """ALTER TABLE ... ADD COLUMN for each nullable column a table of an older database lacks."""
    found = inspect(database)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in found.get_columns(table.name)}
        for column in table.columns:
            if column.name not in have and column.nullable:
                kind = column.type.compile(database.dialect)
                try:
                    with database.begin() as db:
                        db.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))
                except (OperationalError, ProgrammingError):  # another process added it first
                    pass


def session_factory(database: Engine) -> sessionmaker:
    """Sessions whose objects stay readable after commit."""
    return sessionmaker(database, expire_on_commit=False)


class UTCDateTime(TypeDecorator):
    """A timestamp stored as naive UTC (SQLite keeps no zone) and read back as aware UTC."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.astimezone(timezone.utc).replace(tzinfo=None) if value is not None else None

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        return value.replace(tzinfo=timezone.utc) if value is not None else None


class Base(DeclarativeBase):
    pass


class Job(Base):
    """One queued pipeline run or Optuna search, with its resolved spec frozen at submission."""

    __tablename__ = "fedpilot_jobs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))
    pipeline: Mapped[str] = mapped_column(String(200))
    spec: Mapped[str] = mapped_column(Text)
    trials: Mapped[int | None] = mapped_column(Integer)
    study: Mapped[str | None] = mapped_column(String(200))
    schedule_id: Mapped[int | None] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=QUEUED, index=True)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    run_id: Mapped[str | None] = mapped_column(String(64))
    plugins: Mapped[str | None] = mapped_column(Text)  # JSON {distribution: version} the last attempt ran with
    tracking_uri: Mapped[str | None] = mapped_column(Text)
    stdout_tail: Mapped[str | None] = mapped_column(Text)
    stderr_tail: Mapped[str | None] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)  # why the last attempt failed, in a line or a few
    backend: Mapped[str | None] = mapped_column(String(16))  # None: this queue's workers; "slurm": a Slurm job
    slurm: Mapped[str | None] = mapped_column(Text)  # the Slurm options it was submitted with (JSON)
    slurm_job_id: Mapped[str | None] = mapped_column(String(64))  # 1234, or 1234_0 for a task of an array
    slurm_log: Mapped[str | None] = mapped_column(Text)  # the Slurm job's stdout file (stderr: .err beside it)


class JobAttempt(Base):
    """One try of a job by a worker: when, where, how it ended, its MLflow run and its error."""

    __tablename__ = "fedpilot_job_attempts"
    __table_args__ = (UniqueConstraint("job_id", "number", name="fedpilot_job_attempts_once"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[int] = mapped_column(ForeignKey("fedpilot_jobs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    worker: Mapped[str] = mapped_column(String(200))
    started_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    status: Mapped[str] = mapped_column(String(16), default=RUNNING)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    run_id: Mapped[str | None] = mapped_column(String(64))
    error: Mapped[str | None] = mapped_column(Text)
    plugins: Mapped[str | None] = mapped_column(Text)  # JSON {distribution: version} of the plugins it ran with


class Schedule(Base):
    """A cron schedule that adds `trials` trials to its study at each firing."""

    __tablename__ = "fedpilot_schedules"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    pipeline: Mapped[str] = mapped_column(String(200))
    spec: Mapped[str] = mapped_column(Text)
    cron: Mapped[str] = mapped_column(String(200))
    trials: Mapped[int] = mapped_column(Integer)
    study: Mapped[str] = mapped_column(String(200))
    paused: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    active_since: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    backend: Mapped[str | None] = mapped_column(String(16))  # where its firings' jobs run (None: the queue)
    slurm: Mapped[str | None] = mapped_column(Text)  # Slurm options and `parallel` of its firings' jobs (JSON)


class Firing(Base):
    """One recorded firing of a schedule; the unique key makes concurrent schedulers fire it once."""

    __tablename__ = "fedpilot_firings"
    __table_args__ = (UniqueConstraint("schedule_id", "fire_time", name="fedpilot_firings_once"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    schedule_id: Mapped[int] = mapped_column(ForeignKey("fedpilot_schedules.id", ondelete="CASCADE"), index=True)
    fire_time: Mapped[datetime] = mapped_column(UTCDateTime)
    job_id: Mapped[int] = mapped_column(ForeignKey("fedpilot_jobs.id"))
    recorded_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Lease(Base):
    """Who may create the next trial of an Optuna study (a short lease), and the study's MLflow search run."""

    __tablename__ = "fedpilot_study_leases"

    study: Mapped[str] = mapped_column(String(512), primary_key=True)
    owner: Mapped[str | None] = mapped_column(String(128))
    until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    mlflow_run_id: Mapped[str | None] = mapped_column(String(64))
