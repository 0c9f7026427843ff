"""Cron schedules of Optuna searches: each firing queues a search job that adds N trials to the study.

Firing k of a schedule (k counted by its recorded firings) queues a search for k * N trials in total. A firing
is recorded once, whatever the number of schedulers, by the unique (schedule_id, fire_time) key of
`fedpilot_firings`; the job is queued in the same transaction. Missed firings coalesce into the latest one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from apscheduler.triggers.cron import CronTrigger
from sqlalchemy import Engine, delete, func, inspect, select
from sqlalchemy.exc import IntegrityError

from fedpilot.db import QUEUED, Firing, Job, Schedule, engine_options, session_factory, utcnow
from fedpilot.errors import JobError, NoSuchSchedule, ScheduleExists, within
from fedpilot.jobs.backend import backend
from fedpilot.names import check_name
from fedpilot.settings import SQL_INT_MAX

if TYPE_CHECKING:
    from fedpilot.spec import PipelineSpec


def trigger(cron: str) -> CronTrigger:
    """The UTC cron trigger of a crontab expression; a bad one is a SpecError on `--cron`."""
    try:
        return CronTrigger.from_crontab(cron, timezone="UTC")
    except ValueError as err:
        raise JobError("--cron", cron, f"not a valid cron expression: {err}") from None


def check_cron(cron: str, now: datetime | None = None) -> CronTrigger:
    """The trigger of a crontab expression that fires at some time after `now`; else a SpecError on `--cron`."""
    cron_trigger = trigger(cron)
    if cron_trigger.get_next_fire_time(None, now or utcnow()) is None:
        raise JobError("--cron", cron, "never fires: no date matches it (such as February 30)")
    return cron_trigger


def plan(path: Path, overrides: list[str], cron: str, trials: int, name: str | None = None,
         now: datetime | None = None) -> tuple[Schedule, PipelineSpec]:
    """A schedule checked but not stored (study = its name, default the search block's study), and its pipeline."""
    from fedpilot.spec import load_pipeline

    check_cron(cron, now)
    within("--trials", trials, 1, SQL_INT_MAX)
    if name is not None:
        check_name("--name", name)
    spec = load_pipeline(path, overrides)
    resolved = spec.resolved()
    block = resolved.get("search")
    if not block:
        raise JobError("search", None, "a schedule runs searches: the pipeline needs a `search:` block")
    name = name or block["study"]
    resolved["search"] = {**block, "study": name}
    since = now or utcnow()
    schedule = Schedule(name=name, pipeline=resolved["name"], spec=json.dumps(resolved), cron=cron, trials=trials,
                        study=name, paused=False, created_at=since, active_since=since)
    return schedule, spec


def store(database: Engine, schedule: Schedule) -> Schedule:
    """Save a planned schedule; its name must be new."""
    try:
        with session_factory(database).begin() as session:
            session.add(schedule)
    except IntegrityError:
        raise ScheduleExists("--name", schedule.name, "a schedule with this name exists (remove it or pick another "
                        "--name)") from None
    return schedule


def add(database: Engine, path: Path, overrides: list[str], cron: str, trials: int, name: str | None = None,
        now: datetime | None = None) -> Schedule:
    """Validate a pipeline with a search block and store a schedule (study = its name, default the study)."""
    return store(database, plan(path, overrides, cron, trials, name, now)[0])


def list_schedules(database: Engine, now: datetime | None = None) -> list[dict[str, Any]]:
    """Every schedule as a plain row with its firing count and next fire time."""
    with session_factory(database)() as session:
        schedules = session.scalars(select(Schedule).order_by(Schedule.name)).all()
        counts = dict(session.execute(select(Firing.schedule_id, func.count()).group_by(Firing.schedule_id)).all())
    moment = now or utcnow()
    rows = []
    for s in schedules:
        upcoming = None if s.paused else trigger(s.cron).get_next_fire_time(None, moment)
        rows.append({"name": s.name, "pipeline": s.pipeline, "cron": s.cron, "trials": s.trials, "study": s.study,
                     "to": s.backend or "queue",
                     "paused": s.paused, "firings": counts.get(s.id, 0),
                     "next_fire_time": upcoming.isoformat() if upcoming else None,
                     "created_at": s.created_at.isoformat()})
    return rows


def set_paused(database: Engine, name: str, paused: bool, now: datetime | None = None) -> None:
    """Pause or resume a schedule; a resumed schedule does not fire for the time it was paused."""
    with session_factory(database).begin() as session:
        schedule = _named(session, name)
        if schedule.paused and not paused:
            schedule.active_since = now or utcnow()
        schedule.paused = paused


def remove(database: Engine, name: str) -> None:
    """Delete a schedule and its firing records (its jobs and study stay)."""
    with session_factory(database).begin() as session:
        schedule = _named(session, name)
        session.execute(delete(Firing).where(Firing.schedule_id == schedule.id))
        session.delete(schedule)


def _named(session: Any, name: str) -> Schedule:
    schedule = session.scalar(select(Schedule).where(Schedule.name == name))
    if schedule is None:
        raise NoSuchSchedule(name, list(session.scalars(select(Schedule.name)).all()))
    return schedule


def latest_due(cron: CronTrigger, after: datetime, now: datetime) -> datetime | None:
    """The latest fire time in (after, now], found by bisection (a long outage costs no more than a short one)."""
    first = cron.get_next_fire_time(after, after)
    if first is None or first > now:
        return None
    at_now = cron.get_next_fire_time(None, now)
    if at_now is not None and at_now <= now:
        return at_now
    lo, hi = first, now  # invariant: the first fire time at or after lo is <= now, the one after hi is not
    while hi - lo > timedelta(seconds=1):
        mid = lo + (hi - lo) / 2
        fire = cron.get_next_fire_time(None, mid)
        lo, hi = (mid, hi) if fire is not None and fire <= now else (lo, mid)
    return cron.get_next_fire_time(None, lo)


def tick(database: Engine, now: datetime) -> list[int]:
    """Fire every active schedule that is due at `now` (once, coalescing missed firings); the queued job ids. The
    jobs of a schedule `--to slurm` are submitted to Slurm at once (a refusal fails them with the reason)."""
    with session_factory(database)() as session:
        schedules = session.scalars(select(Schedule).where(Schedule.paused.is_(False))).all()
    queued = []
    for s in schedules:
        ids = fire(database, s, now) or []
        if ids:
            backend(s.backend).start(database, database.url.render_as_string(hide_password=False), ids)
        queued += ids
    return queued


def fire(database: Engine, schedule: Schedule, now: datetime) -> list[int] | None:
    """Record the schedule's latest due firing and queue its search job (`parallel` of them for a Slurm schedule)
    in one transaction; the job ids, or None when nothing is due or another scheduler recorded this firing first."""
    with session_factory(database)() as session:
        last, count = session.execute(select(func.max(Firing.fire_time), func.count())
                                      .where(Firing.schedule_id == schedule.id)).one()
        after = max(schedule.active_since, last) if last is not None else schedule.active_since
        due = latest_due(trigger(schedule.cron), after, now)
        if due is None:
            return None
        parallel = json.loads(schedule.slurm or "{}").get("parallel", 1)
        jobs = [Job(kind="search", pipeline=schedule.pipeline, spec=schedule.spec, trials=(count + 1) * schedule.trials,
                    study=schedule.study, schedule_id=schedule.id, status=QUEUED, attempts=0, created_at=now,
                    backend=schedule.backend, slurm=schedule.slurm) for _ in range(parallel)]
        session.add_all(jobs)
        try:
            session.flush()
            session.add(Firing(schedule_id=schedule.id, fire_time=due, job_id=jobs[0].id, recorded_at=now))
            session.commit()
        except IntegrityError:
            session.rollback()
            return None
        return [job.id for job in jobs]


def serve(database: Engine, *, now: Callable[[], datetime] = utcnow, once: bool = False,
          poll_seconds: float = 30.0, log: Callable[[str], None] = lambda line: None) -> list[int]:
    """The scheduler loop: tick every `poll_seconds` (one tick with `once`), `log` each firing; the job ids queued."""
    queued: list[int] = []
    while True:
        fired = tick(database, now())
        for job_id in fired:
            log(firing(database, job_id))
        queued += fired
        if once:
            return queued
        time.sleep(poll_seconds)


def firing(database: Engine, job_id: int) -> str:
    """What a firing queued, in a line."""
    with session_factory(database)() as session:
        job = session.get(Job, job_id)
        schedule = session.get(Schedule, job.schedule_id)
    return (f"schedule {schedule.name if schedule else job.schedule_id} fired: job {job.id}, a search bringing study "
            f"{job.study} to {job.trials} trials")


def watching(database: Engine, now: datetime | None = None) -> str:
    """The schedules a scheduler watches and the next firing, in a line."""
    rows = list_schedules(database, now)
    paused = sum(r["paused"] for r in rows)
    upcoming = min((r for r in rows if r["next_fire_time"]), key=lambda r: r["next_fire_time"], default=None)
    return (f"{len(rows)} schedule{'s' if len(rows) != 1 else ''} ({paused} paused)"
            + (f", next firing: {upcoming['name']} at {upcoming['next_fire_time']}" if upcoming else ""))


def study_trials(database: Engine, study: str) -> int:
    """The trials of an Optuna study in the platform database that count towards a firing's total (finished,
    running or waiting); 0 for a study that does not exist yet."""
    from optuna.storages import RDBStorage
    from optuna.trial import TrialState  # not fedpilot.tuning's STARTED: importing tuning imports torch

    if not inspect(database).has_table("studies"):
        return 0
    url = database.url.render_as_string(hide_password=False)
    storage = RDBStorage(url, engine_kwargs=engine_options(url), skip_table_creation=True)
    try:
        study_id = storage.get_study_id_from_name(study)
    except KeyError:
        return 0
    return sum(trial.state != TrialState.FAIL for trial in storage.get_all_trials(study_id, deepcopy=False))


def first_firings(database: Engine, schedule: Schedule, now: datetime | None = None) -> str:
    """What a new schedule's firings add, given the trials its study has: firing k brings it to k x trials in all,
    so a study that has them already gains nothing at its first firings."""
    have, per = study_trials(database, schedule.study), schedule.trials
    adding = have // per + 1  # the first firing that adds trials
    upcoming = trigger(schedule.cron).get_next_fire_time(None, now or utcnow())
    first = f"first firing {upcoming:%Y-%m-%d %H:%M} UTC"
    if adding == 1:
        return f"{first}: adds {per - have} trial{'s' if per - have != 1 else ''} (the study has {have})"
    return (f"{first}: adds none, the study has {have} trials already; firing {adding} is the first to add "
            f"({adding * per - have})")
