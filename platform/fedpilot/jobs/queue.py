"""The job queue: submit, list, cancel, and the worker that claims jobs atomically and runs each in a child."""

from __future__ import annotations

import contextlib
import ctypes
import glob
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Engine, and_, or_, select, update

from fedpilot.db import (
    CANCELLED,
    FAILED,
    LOST,
    QUEUED,
    RUNNING,
    STOPPED,
    SUCCEEDED,
    Job,
    JobAttempt,
    session_factory,
    utcnow,
)
from fedpilot.errors import DataUnavailable, JobEnded, JobError, NoSuchJob, within
from fedpilot.jobs.result_file import read_result
from fedpilot.registry import plugin_distributions
from fedpilot.settings import DEFAULT_TRACKING_URI, tracking_uri

MAX_ATTEMPTS = 3
PARALLEL_KINDS = ("search", "compare")  # jobs whose copies share one piece of work (a study, a comparison)
TAIL_CHARS = 4000
RUN_ID_POLL_SECONDS = 0.25  # until a job's MLflow run is recorded; then the heartbeat's period
PR_SET_PDEATHSIG = 1
log = logging.getLogger(__name__)  # the worker's log: stderr unless the process configures logging


def job_fields(path: Path, overrides: list[str], search: bool, trials: int | None, here: bool = True,
            unreachable: Callable[[DataUnavailable], None] | None = None) -> dict[str, Any]:
    """Validate a pipeline into the fields of a job (kind, pipeline name, resolved spec, trials and study): every
    check `fedpilot run` makes runs now, and local dataset paths become absolute (a worker runs elsewhere). With
    `here` off (a Slurm job) the devices it asks for need not exist on this machine. Data this machine cannot reach
    goes to `unreachable` (the worker or cluster may reach it), else raises."""
    from fedpilot.pipeline.checks import prepare as check
    from fedpilot.settings import SQL_INT_MAX, check_cache
    from fedpilot.spec import load_pipeline

    within("--trials", trials, 1, SQL_INT_MAX)
    root = check_cache()
    spec = load_pipeline(path, overrides)
    try:
        check(spec, root, here)
    except DataUnavailable as err:
        if unreachable is None:
            raise
        unreachable(err)
    resolved = absolute_paths(spec.resolved())
    if not search:
        if trials is not None:
            raise JobError("--trials", trials, "only search jobs have trials; add --search")
        return {"kind": "run", "pipeline": resolved["name"], "spec": json.dumps(resolved)}
    block = resolved.get("search")
    if not block:
        raise JobError("search", None, "--search needs a pipeline with a `search:` block")
    trials = trials if trials is not None else block.get("trials")
    if not trials:
        raise JobError("--trials", None, "required with --search (the pipeline's search block sets no trials)")
    return {"kind": "search", "pipeline": resolved["name"], "spec": json.dumps(resolved), "trials": int(trials),
            "study": block["study"]}


def absolute_paths(resolved: dict[str, Any]) -> dict[str, Any]:
    """The spec with a local dataset path (a file, folder or glob relative to here) made absolute."""
    source = resolved["dataset"]["source"]
    path = source.get("path")
    if path and (Path(path).expanduser().exists() or glob.glob(os.path.expanduser(path))):
        source["path"] = str(Path(os.path.abspath(os.path.expanduser(path))))
    return resolved


def submit(database: Engine, fields: dict[str, Any]) -> int:
    """Queue a job; its id."""
    with session_factory(database).begin() as session:
        job = Job(**fields, status=QUEUED, attempts=0, created_at=utcnow())
        session.add(job)
        session.flush()
        return job.id


def list_jobs(database: Engine) -> list[dict[str, Any]]:
    """Every job as a plain row, oldest first, with its MLflow link."""
    with session_factory(database)() as session:
        jobs = session.scalars(select(Job).order_by(Job.id)).all()
    return [_row(job) for job in jobs]


def _row(job: Job) -> dict[str, Any]:
    stamp = {k: (getattr(job, k).isoformat() if getattr(job, k) else None)
             for k in ("created_at", "started_at", "finished_at")}
    return {"id": job.id, "kind": job.kind, "pipeline": job.pipeline, "status": job.status,
            "backend": job.backend or "queue", "slurm_job_id": job.slurm_job_id,
            "cancel_requested": job.cancel_requested, "attempts": job.attempts, "worker": job.worker,
            **stamp, "trials": job.trials, "study": job.study, "exit_code": job.exit_code, "run_id": job.run_id,
            "tracking_uri": job.tracking_uri, "mlflow": mlflow_link(job.tracking_uri, job.run_id),
            "error": job.error, "reason": short_reason(job.error) if job.status == FAILED else None,
            "plugins": json.loads(job.plugins) if job.plugins else {}}


def short_reason(error: str | None, width: int = 60) -> str | None:
    """The last line of an error, cut to `width` characters (the `reason` column of `fedpilot jobs`)."""
    if not error:
        return None
    line = error.strip().splitlines()[-1]
    return line if len(line) <= width else line[: width - 3] + "..."


def show_job(database: Engine, job_id: int) -> dict[str, Any]:
    """One job with its attempts (oldest first), output tails and error; NoSuchJob if there is none."""
    with session_factory(database)() as session:
        job = session.get(Job, job_id)
        if job is None:
            raise NoSuchJob(job_id)
        attempts = session.scalars(select(JobAttempt).where(JobAttempt.job_id == job_id)
                                   .order_by(JobAttempt.number)).all()
    row = _row(job)
    row["attempts_detail"] = [{"number": a.number, "worker": a.worker, "status": a.status,
                               "plugins": json.loads(a.plugins) if a.plugins else {},
                               "started_at": a.started_at.isoformat() if a.started_at else None,
                               "finished_at": a.finished_at.isoformat() if a.finished_at else None,
                               "exit_code": a.exit_code, "run_id": a.run_id, "error": a.error} for a in attempts]
    row.update(stdout_tail=job.stdout_tail, stderr_tail=job.stderr_tail, slurm=json.loads(job.slurm or "null"),
               slurm_log=job.slurm_log)
    return row


def mlflow_link(uri: str | None, run_id: str | None) -> str | None:
    """The MLflow UI page of a run on a tracking server, else `<store uri> run <id>`."""
    if not run_id:
        return None
    if uri and uri.startswith(("http://", "https://")):
        try:
            from mlflow import MlflowClient

            experiment = MlflowClient(uri).get_run(run_id).info.experiment_id
            return f"{uri.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}"
        except Exception:  # server down or run gone: the run id is still useful
            return f"{uri} run {run_id}"
    return f"{uri or DEFAULT_TRACKING_URI} run {run_id}"


def backend_name(database: Engine, job_id: int) -> str | None:
    """The `backend` column of a job (None: this queue); NoSuchJob if there is no such job."""
    with session_factory(database)() as session:
        found = session.execute(select(Job.backend).where(Job.id == job_id)).first()
    if found is None:
        raise NoSuchJob(job_id)
    return found[0]


def request_cancel(database: Engine, job_id: int) -> str:
    """Mark a queued job cancelled, or a running one as asked to stop; the resulting status (NoSuchJob or JobEnded
    if the job does not exist or already ended)."""
    with session_factory(database).begin() as session:
        done = session.execute(update(Job).where(Job.id == job_id, Job.status == QUEUED)
                               .values(status=CANCELLED, finished_at=utcnow()))
        if done.rowcount:
            return CANCELLED
        asked = session.execute(update(Job).where(Job.id == job_id, Job.status == RUNNING)
                                .values(cancel_requested=True))
        if asked.rowcount:
            return "cancel_requested"
        status = session.scalar(select(Job.status).where(Job.id == job_id))
    if status is None:
        raise NoSuchJob(job_id)
    raise JobEnded(job_id, status)


def recover(database: Engine, grace_seconds: float) -> None:
    """Jobs whose worker stopped heartbeating for `grace_seconds`: the attempt is lost and its MLflow runs KILLED
    (the next attempt resumes them); the job is queued again, or failed after 3 attempts."""
    stale = and_(Job.status == RUNNING, Job.backend.is_(None),
                 Job.heartbeat_at < utcnow() - timedelta(seconds=grace_seconds))
    lost = "the worker running it stopped sending heartbeats"
    with session_factory(database).begin() as session:
        jobs = session.scalars(select(Job).where(stale).with_for_update()).all()
        # a comparison's units are claimed through leases, which expire on their own: its run stays open
        orphans = [(job.tracking_uri, job.run_id) for job in jobs if job.run_id and job.kind != "compare"]
        for job in jobs:
            session.execute(update(JobAttempt).where(JobAttempt.job_id == job.id, JobAttempt.number == job.attempts)
                            .values(status=LOST, finished_at=utcnow(), error=lost))
            if job.cancel_requested:
                job.status, job.finished_at, job.error = CANCELLED, utcnow(), lost
            elif job.attempts >= MAX_ATTEMPTS:
                job.status, job.finished_at, job.error = (FAILED, utcnow(),
                                                          f"{lost}; gave up after {MAX_ATTEMPTS} attempts")
            else:
                job.status, job.worker, job.heartbeat_at = QUEUED, None, None
    for uri, run_id in orphans:
        close_runs(uri, run_id, lost)


def close_runs(uri: str | None, run_id: str, reason: str) -> None:
    """Mark a dead attempt's MLflow runs KILLED; an unreachable store is reported, not fatal to the worker."""
    from fedpilot.tracking import close_orphans

    try:
        close_orphans(uri or DEFAULT_TRACKING_URI, run_id, reason)
    except Exception as err:  # the tracking server may be down: the next attempt resumes the runs anyway
        log.warning(f"could not mark the runs of {run_id} KILLED: {type(err).__name__}: {err}")


def claim(database: Engine, worker: str) -> Job | None:
    """Atomically take the oldest queued job for `worker` (never the same job twice); None if none is queued."""
    lock = database.dialect.name == "postgresql"
    with session_factory(database)() as session:
        while True:
            query = (select(Job.id).where(Job.status == QUEUED, Job.backend.is_(None))
                     .order_by(Job.created_at, Job.id).limit(1))
            job_id = session.scalar(query.with_for_update(skip_locked=True) if lock else query)
            if job_id is None:
                session.rollback()
                return None
            now = utcnow()
            taken = session.execute(update(Job).where(Job.id == job_id, Job.status == QUEUED).values(
                status=RUNNING, worker=worker, attempts=Job.attempts + 1, started_at=now, heartbeat_at=now,
                finished_at=None, cancel_requested=False))
            if taken.rowcount != 1:
                session.commit()
                continue
            job = session.get(Job, job_id, populate_existing=True)
            session.add(JobAttempt(job_id=job_id, number=job.attempts, worker=worker, started_at=now,
                                   status=RUNNING, run_id=job.run_id))
            session.commit()
            return job


def idle(database: Engine, grace_seconds: float) -> bool:
    """No job is queued and none is running on a worker that stopped heartbeating."""
    cutoff = utcnow() - timedelta(seconds=grace_seconds)
    waiting = and_(Job.backend.is_(None),
                   or_(Job.status == QUEUED, and_(Job.status == RUNNING, Job.heartbeat_at < cutoff)))
    with session_factory(database)() as session:
        return session.scalar(select(Job.id).where(waiting).limit(1)) is None


def child_command(job: Job, spec_file: Path, result_file: Path | None = None, db_url: str = "",
                  heartbeat_seconds: float = 10.0) -> list[str]:
    """The `fedpilot run`, `search` or `compare` command line that executes a job (trials and claimed runs beat like
    the worker). A run an earlier attempt started is resumed in its own MLflow runs, from its last checkpoint; a
    comparison goes on from what is done. Without `result_file`
    (a follower rank of a multi-node Slurm job) the child leaves no result file."""
    base = [sys.executable, "-m", "fedpilot.cli"]
    report = ["--result-file", str(result_file)] if result_file is not None else []
    beat = ["--heartbeat-seconds", str(max(1, round(heartbeat_seconds)))]
    if job.kind == "search":
        return [*base, "search", str(spec_file), "--trials", str(job.trials), "--storage", db_url,
                "--study", str(job.study), *beat, *report]
    if job.kind == "compare":  # the comparison's run holds its plan; every copy works on it with the others
        return [*base, "compare", "--resume", str(job.run_id), "--storage", db_url, *beat, *report]
    target = ["--resume", job.run_id] if job.run_id else [str(spec_file)]
    return [*base, "run", *target, "--no-progress", *report]


def _die_with_parent(parent: int) -> None:
    """In the child before exec: get SIGKILL when the worker dies (Linux), and exit if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def execute(database: Engine, job: Job, worker: str, db_url: str, heartbeat_seconds: float, *,
            streams: tuple[Path, Path] | None = None, kill_on_cancel: bool = True,
            started: Callable[[subprocess.Popen], None] = lambda proc: None,
            ended: Callable[[int], tuple[str, str] | None] = lambda code: None) -> str:
    """Run a claimed job in a child process with heartbeats and cancel checks; its final status.

    The child's output goes to temporary files, or is appended to `streams` (stdout, stderr: a Slurm job's log);
    the row keeps its tails either way. With `kill_on_cancel` off a cancel request is left to whoever signals the
    child (scancel). `started(proc)` sees the child; `ended(exit code)` may name the status and error of an exit
    (a Slurm job stopped for a requeue is queued again, not failed)."""
    spec = json.loads(job.spec)
    uri = tracking_uri((spec.get("tracking") or {}).get("uri"))
    _record_plugins(database, job, worker, spec)
    with tempfile.TemporaryDirectory(prefix="fedpilot-job-") as tmp:
        spec_file, result_file = Path(tmp) / f"job-{job.id}.yaml", Path(tmp) / "result.json"
        spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
        out_path, err_path = streams or (Path(tmp) / "stdout", Path(tmp) / "stderr")
        offsets = [_size(out_path), _size(err_path)]
        with out_path.open("a") as out, err_path.open("a") as err:
            parent = os.getpid()
            command = child_command(job, spec_file, result_file, db_url, heartbeat_seconds)
            proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=lambda: _die_with_parent(parent))
            started(proc)
            stopped = _watch(database, job, worker, proc, heartbeat_seconds, result_file, uri, kill_on_cancel)
        stdout, stderr = (_read_from(path, offset) for path, offset in zip((out_path, err_path), offsets, strict=True))
        result = read_result(result_file)
    status = stopped or (SUCCEEDED if proc.returncode == 0 else FAILED)
    error = None if status == SUCCEEDED else (result.get("error") or _last_line(stderr)
                                              or f"exit code {proc.returncode}")
    if stopped is None and proc.returncode != 0 and (special := ended(proc.returncode)) is not None:
        status, error = special
    mine = and_(Job.id == job.id, Job.worker == worker, Job.status == RUNNING)
    with session_factory(database).begin() as session:
        session.execute(update(Job).where(mine).values(
            status=status, finished_at=utcnow(), exit_code=proc.returncode, run_id=result.get("run_id") or job.run_id,
            tracking_uri=uri, stdout_tail=stdout[-TAIL_CHARS:], stderr_tail=stderr[-TAIL_CHARS:], error=error))
        session.execute(update(JobAttempt).where(JobAttempt.job_id == job.id, JobAttempt.number == job.attempts,
                                                 JobAttempt.worker == worker).values(
            status=STOPPED if status == QUEUED else status, finished_at=utcnow(), exit_code=proc.returncode,
            error=error, run_id=result.get("run_id") or job.run_id))
    return status


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _read_from(path: Path, offset: int, most: int = 16 * TAIL_CHARS) -> str:
    """The end (at most `most` bytes) of what was appended to `path` after byte `offset` (a job's share of a log)."""
    with path.open("rb") as f:
        f.seek(max(offset, path.stat().st_size - most))
        return f.read().decode(errors="replace")


def _last_line(text: str) -> str | None:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def _watch(database: Engine, job: Job, worker: str, proc: subprocess.Popen, heartbeat_seconds: float,
           result_file: Path, uri: str, kill_on_cancel: bool = True) -> str | None:
    """Heartbeat until the child exits, recording its MLflow run as soon as it exists (looked for every
    `RUN_ID_POLL_SECONDS` until then: a retry resumes it, `fedpilot jobs` links it); kill it on a cancel request
    (-> CANCELLED) or if the job was taken from this worker (-> the status it has now)."""
    recorded = job.run_id
    next_beat = time.monotonic() + heartbeat_seconds
    while True:
        period = heartbeat_seconds if recorded else RUN_ID_POLL_SECONDS
        try:
            proc.wait(timeout=min(period, next_beat - time.monotonic()))
            return None
        except subprocess.TimeoutExpired:
            pass
        run_id = read_result(result_file).get("run_id")
        news = {"run_id": run_id, "tracking_uri": uri} if run_id and run_id != recorded else {}
        if not news and time.monotonic() < next_beat:
            continue
        next_beat = time.monotonic() + heartbeat_seconds
        with session_factory(database).begin() as session:
            beat = session.execute(update(Job).where(Job.id == job.id, Job.worker == worker, Job.status == RUNNING)
                                   .values(heartbeat_at=utcnow(), **news))
            if news and beat.rowcount:
                session.execute(update(JobAttempt).where(JobAttempt.job_id == job.id,
                                                         JobAttempt.number == job.attempts).values(run_id=run_id))
                recorded = run_id
            cancelled = session.scalar(select(Job.cancel_requested).where(Job.id == job.id))
        if not beat.rowcount or (cancelled and kill_on_cancel):
            _kill(proc)
            return CANCELLED if cancelled else None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def plugin_versions(spec: dict[str, Any]) -> dict[str, str]:
    """{distribution: version} of the installed plugins registering a name a resolved spec uses (its stages'
    algorithms, its model, its dataset source); a spec without one of them (the job's child refuses it) has none."""
    named = {"fedpilot.algorithms": [_at(stage, "algorithm") for stage in _at(spec, "stages") or []],
             "fedpilot.models": [_at(spec, "model", "name")],
             "fedpilot.sources": [_at(spec, "dataset", "source", "kind")]}
    return {dist: version for group, names in named.items()
            for dist, version in plugin_distributions(group, [n for n in names if isinstance(n, str)]).items()}


def _at(value: Any, *keys: str) -> Any:
    """value[keys[0]][keys[1]]..., or None where there is no such key."""
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _record_plugins(database: Engine, job: Job, worker: str, spec: dict[str, Any]) -> None:
    """The plugin distributions and versions this attempt runs with (its child runs in this environment)."""
    plugins = json.dumps(plugin_versions(spec), sort_keys=True)
    with session_factory(database).begin() as session:
        session.execute(update(Job).where(Job.id == job.id, Job.worker == worker).values(plugins=plugins))
        session.execute(update(JobAttempt).where(JobAttempt.job_id == job.id, JobAttempt.number == job.attempts)
                        .values(plugins=plugins))


def default_worker_name() -> str:
    """host:pid, unique among live workers."""
    return f"{socket.gethostname()}:{os.getpid()}"


def work(database: Engine, db_url: str, *, name: str, poll_seconds: float = 5.0, heartbeat_seconds: float = 10.0,
         grace_seconds: float = 60.0, exit_when_idle: bool = False) -> int:
    """The worker loop: recover dead workers' jobs, claim, execute; the number of jobs this worker ran."""
    ran = 0
    while True:
        recover(database, grace_seconds)
        job = claim(database, name)
        if job is not None:
            execute(database, job, name, db_url, heartbeat_seconds)
            ran += 1
        elif exit_when_idle and idle(database, grace_seconds):
            return ran
        else:
            time.sleep(poll_seconds)
