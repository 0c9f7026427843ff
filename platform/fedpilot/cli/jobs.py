"""The job commands: submit, jobs, cancel, worker, scheduler, and the `schedule` group."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer

from fedpilot.cli.common import (
    MARKUP,
    PARALLEL_MAX,
    PERIOD_MAX_S,
    Account,
    AsJson,
    Command,
    Cpus,
    Db,
    Gpus,
    Group,
    Mem,
    Overrides,
    Parallel,
    Partition,
    Pipeline,
    Qos,
    Time,
    To,
    fail,
    print_json,
    program,
    slurm_flags,
    unreachable,
)
from fedpilot.errors import NoSuchJob, NoSuchSchedule, SpecError, UserError, within
from fedpilot.settings import SQL_INT_MAX

if TYPE_CHECKING:
    from sqlalchemy import Engine

    from fedpilot.jobs.backend import Backend

schedule_app = typer.Typer(cls=Group, rich_markup_mode=MARKUP, no_args_is_help=True,
                           help="Cron schedules that add trials to an Optuna study at each firing.")


def _database(db: str | None, option: str = "--db", missing: UserError | None = None) -> Engine:
    """The platform database (tables created) for `option`'s value, else $FEDPILOT_DB; for a lookup (`missing`:
    what is not found) an SQLite file that does not exist is that error, and stays uncreated."""
    from fedpilot.db import connect
    from fedpilot.settings import platform_db, store_exists

    url, key = platform_db(db, option)
    if missing is not None and not store_exists(url):
        raise missing
    return connect(url, key)


def _print_rows(rows: list[dict], as_json: bool, columns: list[str]) -> None:
    """Rows as a JSON list, or as an aligned text table of `columns`."""
    if as_json:
        print_json(rows)
        return
    if not rows:
        typer.echo("(none)")
        return
    cells = [[("" if row.get(c) is None else str(row[c])) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    for line in [columns, *cells]:
        typer.echo("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip())


def send(fields: dict, to: Backend, flags: dict, parallel: int, db: str | None, option: str = "--db") -> list[int]:
    """Submit a validated job (jobs.queue.job_fields) `parallel` times to the backend `to` (on Slurm an array when
    `parallel` > 1, with the Slurm options `flags`), in the platform database `option` (its value `db`) names; the
    job ids (Slurm's ids are told on stderr)."""
    from fedpilot.jobs.backend import configured
    from fedpilot.jobs.queue import PARALLEL_KINDS
    from fedpilot.settings import platform_db

    url, _ = platform_db(db, option)
    if parallel > 1 and fields["kind"] not in PARALLEL_KINDS:
        raise SpecError("--parallel", parallel, "only a search or a comparison runs in parallel (workers of one "
                        "study or comparison)")
    target = configured(to, json.loads(fields["spec"]), flags)
    sent = target.submit(_database(db, option), url, fields, parallel)
    for job_id, own_id in sent:
        if own_id is not None:
            typer.echo(f"job {job_id}: Slurm job {own_id}", err=True)
    return [job_id for job_id, _ in sent]


def submit(
    pipeline: Pipeline,
    overrides: Overrides = None,
    search: Annotated[bool, typer.Option("--search", help="Queue an Optuna search of the pipeline's `search:` "
                                                          "block instead of one run.")] = False,
    trials: Annotated[int | None, typer.Option(help="Total finished trials the search job reaches "
                                                           "(default: the search block's `trials`).")] = None,
    db: Db = None,
    to: To = None,
    parallel: Parallel = 1,
    partition: Partition = None, gpus: Gpus = None, cpus: Cpus = None, mem: Mem = None, time: Time = None,
    account: Account = None, qos: Qos = None,
) -> None:
    """Check a pipeline and queue it as a job, or submit it to Slurm (`--to slurm`); print the job ids.

    Its resolved spec is frozen now. What was queued and how to follow it goes to stderr, the job ids alone to
    stdout (for scripts)."""
    from fedpilot.data.federated import staging
    from fedpilot.jobs.backend import QUEUE, backend
    from fedpilot.jobs.queue import job_fields
    from fedpilot.settings import platform_db

    try:
        target = backend(to)
        within("--parallel", parallel, 1, PARALLEL_MAX)
        platform_db(db)  # checked before the pipeline's data is built; the job is stored once the pipeline passed
        with staging():  # a new dataset becomes a cache entry once the job is sent
            fields = job_fields(pipeline, overrides or [], search, trials, here=target.here, unreachable=unreachable)
            ids = send(fields, target, slurm_flags(partition, gpus, cpus, mem, time, account, qos), parallel, db)
    except UserError as err:
        fail(err)
    what = (f"a search bringing study {fields['study']} to {fields['trials']} trials" if search else "a run") + \
        f" of pipeline {fields['pipeline']}" + ("" if target.name == QUEUE else " on Slurm")
    worker = f"; a worker runs it: {program()} worker" if target.name == QUEUE else ""
    for job_id in ids:
        typer.echo(f"queued job {job_id}: {what}\nfollow it: {program()} jobs show {job_id}  (status, attempts, "
                   f"MLflow run{worker})", err=True)
    typer.echo(" ".join(map(str, ids)))


jobs_app = typer.Typer(cls=Group, rich_markup_mode=MARKUP, invoke_without_command=True,
                       help="The job queue: `fedpilot jobs` lists it, `fedpilot jobs show ID` tells one job's story.")


@jobs_app.callback()
def jobs(ctx: typer.Context, db: Db = None, as_json: AsJson = False) -> None:
    """List the jobs: status (queued/running/succeeded/failed/cancelled), attempts, worker, times, MLflow run, and
    a short reason for failed ones."""
    if ctx.invoked_subcommand is not None:
        return
    from fedpilot.jobs.backend import backend
    from fedpilot.jobs.queue import list_jobs

    try:
        database = _database(db)
        rows = list_jobs(database)
    except UserError as err:
        fail(err)
    extra: list[str] = []
    for name in sorted({r["backend"] for r in rows}):
        place = backend(name)
        place.refresh(database, rows)
        extra += [c for c in place.columns if c not in extra]
    _print_rows(rows, as_json, ["id", "kind", "pipeline", "status", "attempts", "worker", *extra, "created_at",
                                "started_at", "finished_at", "mlflow", "reason"])


@jobs_app.command("show", cls=Command)
def jobs_show(job_id: Annotated[int, typer.Argument(help="The job id `fedpilot submit` printed.")], db: Db = None,
              as_json: Annotated[bool, typer.Option("--json", help="Print the job as JSON.")] = False) -> None:
    """One job: its fields, every attempt (worker, times, status, exit code, MLflow run, error) and its output."""
    from fedpilot.jobs.backend import backend
    from fedpilot.jobs.queue import show_job

    try:
        within("JOB_ID", job_id, 1, SQL_INT_MAX)
        database = _database(db, missing=NoSuchJob(job_id))
        row = show_job(database, job_id)
    except UserError as err:
        fail(err)
    place = backend(row["backend"])
    place.refresh(database, [row])
    row.update(place.logs(row))
    if as_json:
        print_json(row)
        return
    for key in ("id", "kind", "pipeline", "status", "attempts", "worker", "slurm_job_id", "slurm_state", "node",
                "created_at", "started_at", "finished_at", "trials", "study", "exit_code", "mlflow", "slurm_log"):
        if row.get(key) is not None:
            typer.echo(f"{key + ':':<13}{row[key]}")
    if row["error"]:
        typer.echo(f"{'error:':<13}{row['error']}")
    typer.echo("\nattempts")
    _print_rows(row["attempts_detail"], False, ["number", "worker", "status", "started_at", "finished_at",
                                                 "exit_code", "run_id", "error"])
    streams = ("log", "log_err") if row.get("log") is not None or row.get("log_err") is not None else ()
    for stream in streams or ("stdout_tail", "stderr_tail"):
        if row.get(stream):
            typer.echo(f"\n{stream.replace('_tail', '')} (last {len(row[stream])} characters)\n{row[stream].rstrip()}")


def cancel(job_id: Annotated[int, typer.Argument(help="The job id `fedpilot submit` printed.")], db: Db = None) -> None:
    """Cancel a job: a queued one at once; a running one is killed by its worker and marked cancelled."""
    from fedpilot.jobs.backend import backend
    from fedpilot.jobs.queue import backend_name

    try:
        within("JOB_ID", job_id, 1, SQL_INT_MAX)
        database = _database(db, missing=NoSuchJob(job_id))
        status = backend(backend_name(database, job_id)).cancel(database, job_id)
    except UserError as err:
        fail(err)
    typer.echo(f"job {job_id}: {status}")


def worker(
    db: Db = None,
    exit_when_idle: Annotated[bool, typer.Option("--exit-when-idle", help="Return once no job is queued (or "
                                                                          "waiting to be recovered).")] = False,
    poll_seconds: Annotated[float, typer.Option(help="Wait between looks at an empty queue (0.01 to 86400 "
                                                    "for this and the two below).")] = 5.0,
    heartbeat_seconds: Annotated[float, typer.Option(help="Heartbeat and cancel-check period while a "
                                                                     "job runs.")] = 10.0,
    grace_seconds: Annotated[float, typer.Option(help="A running job whose heartbeat is older than this "
                                                                "belongs to a dead worker and is queued again "
                                                                "(failed after 3 attempts).")] = 60.0,
    name: Annotated[str | None, typer.Option(help="Worker name shown by `fedpilot jobs` (default host:pid).")] = None,
) -> None:
    """Run queued jobs one at a time, each in a child process (`fedpilot run` or `fedpilot search`)."""
    from fedpilot.db import connect
    from fedpilot.jobs.queue import default_worker_name, work
    from fedpilot.settings import check_cache, check_tracking, platform_db

    try:
        for option, seconds in (("--poll-seconds", poll_seconds), ("--heartbeat-seconds", heartbeat_seconds),
                                ("--grace-seconds", grace_seconds)):
            within(option, seconds, 0.01, PERIOD_MAX_S)
        url, key = platform_db(db)
        check_tracking(reach=True)  # what the jobs' runs record to, and their cache
        check_cache()
        database = connect(url, key)
    except UserError as err:
        fail(err)
    ran = work(database, url, name=name or default_worker_name(), poll_seconds=poll_seconds,
               heartbeat_seconds=heartbeat_seconds, grace_seconds=grace_seconds, exit_when_idle=exit_when_idle)
    typer.echo(f"worker idle after {ran} job{'s' if ran != 1 else ''}", err=True)


def scheduler(
    db: Db = None,
    once: Annotated[bool, typer.Option("--once", help="Fire what is due now and return.")] = False,
    poll_seconds: Annotated[float, typer.Option(help="Wait between looks at the schedules (0.01 to 86400).")] = 30.0,
) -> None:
    """Fire due schedules: each firing queues a search job that adds the schedule's trials to its study.

    It logs its start (the schedules it watches) and each firing."""
    from fedpilot.jobs.schedule import serve, watching
    from fedpilot.settings import check_cache

    try:
        within("--poll-seconds", poll_seconds, 0.01, PERIOD_MAX_S)
        check_cache()  # a schedule --to slurm writes its jobs' logs there
        database = _database(db)
    except UserError as err:
        fail(err)
    _log(f"scheduler started: {watching(database)}; looking every {poll_seconds:g} s" + (", once" if once else ""))
    queued = serve(database, once=once, poll_seconds=poll_seconds, log=_log)  # a Slurm schedule's jobs go to Slurm
    typer.echo(f"queued jobs: {', '.join(map(str, queued)) or 'none'}")


@schedule_app.command("add", cls=Command)
def schedule_add(
    pipeline: Pipeline,
    overrides: Overrides = None,
    cron: Annotated[str, typer.Option(help='Crontab expression in UTC, e.g. "0 2 * * *" (02:00 daily).')] = ...,
    trials: Annotated[int, typer.Option(help="Trials each firing adds to the study (at least 1).")] = ...,
    name: Annotated[str | None, typer.Option(help="Schedule name, also its Optuna study (default: the "
                                                  "pipeline's search.study).")] = None,
    db: Db = None,
    to: To = None,
    parallel: Parallel = 1,
    partition: Partition = None, gpus: Gpus = None, cpus: Cpus = None, mem: Mem = None, time: Time = None,
    account: Account = None, qos: Qos = None,
) -> None:
    """Schedule a pipeline's search (it needs a `search:` block): every firing adds --trials trials. With `--to
    slurm` each firing is submitted to Slurm (`--parallel` trial workers as a job array)."""
    from fedpilot.data.federated import staging
    from fedpilot.jobs.backend import QUEUE, SlurmBackend, backend, configured
    from fedpilot.jobs.schedule import first_firings, plan, store
    from fedpilot.jobs.slurm import record
    from fedpilot.pipeline.checks import prepare
    from fedpilot.settings import check_cache, platform_db

    flags = slurm_flags(partition, gpus, cpus, mem, time, account, qos)
    try:
        target = backend(to)
        if target.name == QUEUE and (any(v is not None for v in flags.values()) or parallel > 1):
            raise SpecError("--to", target.name, "Slurm options and --parallel need --to slurm")
        within("--parallel", parallel, 1, PARALLEL_MAX)
        root = check_cache()
        platform_db(db)  # checked before the pipeline's data is built; the schedule is stored once it passed
        schedule, spec = plan(pipeline, overrides or [], cron, trials, name)
        target = configured(target, spec.resolved(), flags)
        if isinstance(target, SlurmBackend):
            schedule.backend, schedule.slurm = target.name, record(target.options, parallel)
        with staging():  # a new dataset becomes a cache entry once the schedule is stored
            prepare(spec, root, here=target.here)  # every check a firing's search makes, before storing
            store(_database(db), schedule)
    except UserError as err:
        fail(err)
    typer.echo(f"schedule {schedule.name}: {schedule.cron} (UTC){' on Slurm' if schedule.backend else ''}; "
               f"firing k brings study {schedule.study} to k x {schedule.trials} trials\n"
               f"{first_firings(_database(db), schedule)}")


def _log(message: str) -> None:
    """A line of a long-running command's log, with its UTC time."""
    from fedpilot.db import utcnow

    typer.echo(f"{utcnow():%Y-%m-%d %H:%M:%S}Z {message}")


@schedule_app.command("list", cls=Command)
def schedule_list(db: Db = None, as_json: AsJson = False) -> None:
    """List schedules with their cron, trials per firing, study, state, firings and next fire time."""
    from fedpilot.jobs.schedule import list_schedules

    try:
        rows = list_schedules(_database(db))
    except UserError as err:
        fail(err)
    _print_rows(rows, as_json, ["name", "pipeline", "cron", "trials", "study", "to", "paused", "firings",
                                "next_fire_time"])


def _change(name: str, db: str | None, action: str) -> None:
    """Pause, resume or remove the schedule `name`."""
    from fedpilot.jobs.schedule import remove, set_paused

    try:
        database = _database(db, missing=NoSuchSchedule(name, []))
        if action == "removed":
            remove(database, name)
        else:
            set_paused(database, name, action == "paused")
    except UserError as err:
        fail(err)
    typer.echo(f"schedule {name}: {action}")


ScheduleName = Annotated[str, typer.Argument(help="The schedule's name (see `fedpilot schedule list`).")]


@schedule_app.command("pause", cls=Command)
def schedule_pause(name: ScheduleName, db: Db = None) -> None:
    """Stop a schedule from firing until it is resumed."""
    _change(name, db, "paused")


@schedule_app.command("resume", cls=Command)
def schedule_resume(name: ScheduleName, db: Db = None) -> None:
    """Let a paused schedule fire again (firings missed while paused are skipped)."""
    _change(name, db, "resumed")


@schedule_app.command("remove", cls=Command)
def schedule_remove(name: ScheduleName, db: Db = None) -> None:
    """Delete a schedule and its firing records; its jobs and Optuna study stay."""
    _change(name, db, "removed")


