"""The job queue: submit, list, cancel, and the worker that claims jobs atomically and runs each in a child."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Engine, and_, or_, select, update

from fedpilot.db import CANCELLED, FAILED, QUEUED, RUNNING, SUCCEEDED, Job, session_factory, utcnow
from fedpilot.errors import SpecError

MAX_ATTEMPTS = 3
TAIL_CHARS = 4000
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"  # fedpilot.tracking.DEFAULT_URI, without importing lightning
PR_SET_PDEATHSIG = 1


def prepare(path: Path, overrides: list[str], search: bool, trials: int | None) -> dict[str, Any]:
    """Validate a pipeline into the fields of a job: kind, pipeline name, resolved spec, trials and study."""
    from fedpilot.spec import load_pipeline

    resolved = load_pipeline(path, overrides).resolved()
    if not search:
        if trials is not None:
            raise SpecError("--trials", trials, "only search jobs have trials; add --search")
        return {"kind": "run", "pipeline": resolved["name"], "spec": json.dumps(resolved)}
    block = resolved.get("search")
    if not block:
        raise SpecError("search", None, "--search needs a pipeline with a `search:` block")
    trials = trials if trials is not None else block.get("trials")
    if not trials:
        raise SpecError("--trials", None, "required with --search (the pipeline's search block sets no trials)")
    return {"kind": "search", "pipeline": resolved["name"], "spec": json.dumps(resolved), "trials": int(trials),
            "study": block["study"]}


def submit(engine: Engine, fields: dict[str, Any]) -> int:
    """Queue a job; its id."""
    with session_factory(engine).begin() as session:
        job = Job(**fields, status=QUEUED, attempts=0, created_at=utcnow())
        session.add(job)
        session.flush()
        return job.id


def list_jobs(engine: Engine) -> list[dict[str, Any]]:
    """Every job as a plain row, oldest first, with its MLflow link."""
    with session_factory(engine)() as session:
        jobs = session.scalars(select(Job).order_by(Job.id)).all()
    return [_row(job) for job in jobs]


def _row(job: Job) -> dict[str, Any]:
    stamp = {k: (getattr(job, k).isoformat() if getattr(job, k) else None)
             for k in ("created_at", "started_at", "finished_at")}
    return {"id": job.id, "kind": job.kind, "pipeline": job.pipeline, "status": job.status,
            "cancel_requested": job.cancel_requested, "attempts": job.attempts, "worker": job.worker,
            **stamp, "trials": job.trials, "study": job.study, "exit_code": job.exit_code, "run_id": job.run_id,
            "tracking_uri": job.tracking_uri, "mlflow": mlflow_link(job.tracking_uri, job.run_id)}


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


def cancel(engine: Engine, job_id: int) -> str:
    """Cancel a queued job at once, or ask the worker of a running job to stop it; the resulting status."""
    with session_factory(engine).begin() as session:
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
        raise SpecError("JOB_ID", job_id, "no such job")
    raise SpecError("JOB_ID", job_id, f"the job already ended ({status})")


def recover(engine: Engine, grace_seconds: float) -> None:
    """Jobs whose worker stopped heartbeating for `grace_seconds`: queued again, or failed after 3 attempts."""
    stale = and_(Job.status == RUNNING, Job.heartbeat_at < utcnow() - timedelta(seconds=grace_seconds))
    lost = "the worker running it stopped sending heartbeats"
    with session_factory(engine).begin() as session:
        session.execute(update(Job).where(stale, Job.cancel_requested)
                        .values(status=CANCELLED, finished_at=utcnow(), stderr_tail=lost))
        session.execute(update(Job).where(stale, Job.attempts >= MAX_ATTEMPTS)
                        .values(status=FAILED, finished_at=utcnow(),
                                stderr_tail=f"{lost}; gave up after {MAX_ATTEMPTS} attempts"))
        session.execute(update(Job).where(stale).values(status=QUEUED, worker=None, heartbeat_at=None))


def claim(engine: Engine, worker: str) -> Job | None:
    """Atomically take the oldest queued job for `worker` (never the same job twice); None if none is queued."""
    lock = engine.dialect.name == "postgresql"
    with session_factory(engine)() as session:
        while True:
            query = select(Job.id).where(Job.status == QUEUED).order_by(Job.created_at, Job.id).limit(1)
            job_id = session.scalar(query.with_for_update(skip_locked=True) if lock else query)
            if job_id is None:
                session.rollback()
                return None
            now = utcnow()
            taken = session.execute(update(Job).where(Job.id == job_id, Job.status == QUEUED).values(
                status=RUNNING, worker=worker, attempts=Job.attempts + 1, started_at=now, heartbeat_at=now,
                finished_at=None, cancel_requested=False))
            session.commit()
            if taken.rowcount == 1:
                return session.get(Job, job_id, populate_existing=True)


def idle(engine: Engine, grace_seconds: float) -> bool:
    """No job is queued and none is running on a worker that stopped heartbeating."""
    cutoff = utcnow() - timedelta(seconds=grace_seconds)
    waiting = or_(Job.status == QUEUED, and_(Job.status == RUNNING, Job.heartbeat_at < cutoff))
    with session_factory(engine)() as session:
        return session.scalar(select(Job.id).where(waiting).limit(1)) is None


def child_command(job: Job, spec_file: Path, db_url: str, heartbeat_seconds: float) -> list[str]:
    """The `fedpilot run` or `fedpilot search` command line that executes a job (trials beat like the worker)."""
    base = [sys.executable, "-m", "fedpilot.cli"]
    if job.kind == "search":
        return [*base, "search", str(spec_file), "--trials", str(job.trials), "--storage", db_url,
                "--study", str(job.study), "--heartbeat-seconds", str(max(1, round(heartbeat_seconds)))]
    return [*base, "run", str(spec_file), "--no-progress"]


def _die_with_parent(parent: int) -> None:
    """In the child before exec: get SIGKILL when the worker dies (Linux), and exit if it already has."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def execute(engine: Engine, job: Job, worker: str, db_url: str, heartbeat_seconds: float) -> str:
    """Run a claimed job in a child process with heartbeats and cancel checks; its final status."""
    spec = json.loads(job.spec)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or (spec.get("tracking") or {}).get("uri") or DEFAULT_TRACKING_URI
    with tempfile.TemporaryDirectory(prefix="fedpilot-job-") as tmp:
        spec_file = Path(tmp) / f"job-{job.id}.yaml"
        spec_file.write_text(yaml.safe_dump(spec, sort_keys=False))
        out_path, err_path = Path(tmp) / "stdout", Path(tmp) / "stderr"
        with out_path.open("w") as out, err_path.open("w") as err:
            parent = os.getpid()
            proc = subprocess.Popen(child_command(job, spec_file, db_url, heartbeat_seconds), stdout=out, stderr=err,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=lambda: _die_with_parent(parent))
            stopped = _watch(engine, job.id, worker, proc, heartbeat_seconds)
        stdout, stderr = out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    status = stopped or (SUCCEEDED if proc.returncode == 0 else FAILED)
    with session_factory(engine).begin() as session:
        session.execute(update(Job).where(Job.id == job.id, Job.worker == worker, Job.status == RUNNING).values(
            status=status, finished_at=utcnow(), exit_code=proc.returncode, run_id=run_id_of(stdout),
            tracking_uri=uri, stdout_tail=stdout[-TAIL_CHARS:], stderr_tail=stderr[-TAIL_CHARS:]))
    return status


def _watch(engine: Engine, job_id: int, worker: str, proc: subprocess.Popen, heartbeat_seconds: float) -> str | None:
    """Heartbeat until the child exits; kill it on a cancel request (-> CANCELLED) or if the job was taken
    from this worker (-> the status it has now)."""
    while True:
        try:
            proc.wait(timeout=heartbeat_seconds)
            return None
        except subprocess.TimeoutExpired:
            pass
        with session_factory(engine).begin() as session:
            beat = session.execute(update(Job).where(Job.id == job_id, Job.worker == worker, Job.status == RUNNING)
                                   .values(heartbeat_at=utcnow()))
            cancelled = session.scalar(select(Job.cancel_requested).where(Job.id == job_id))
        if cancelled or not beat.rowcount:
            _kill(proc)
            return CANCELLED if cancelled else None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child and everything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_id_of(stdout: str) -> str | None:
    """The id in the last `run_id: <id>` line of a child's stdout."""
    lines = [line for line in stdout.splitlines() if line.startswith("run_id: ")]
    return lines[-1].split(": ", 1)[1].strip() if lines else None


def default_worker_name() -> str:
    """host:pid, unique among live workers."""
    return f"{socket.gethostname()}:{os.getpid()}"


def work(engine: Engine, db_url: str, *, name: str, poll_seconds: float = 5.0, heartbeat_seconds: float = 10.0,
         grace_seconds: float = 60.0, exit_when_idle: bool = False) -> int:
    """The worker loop: recover dead workers' jobs, claim, execute; the number of jobs this worker ran."""
    ran = 0
    while True:
        recover(engine, grace_seconds)
        job = claim(engine, name)
        if job is not None:
            execute(engine, job, name, db_url, heartbeat_seconds)
            ran += 1
        elif exit_when_idle and idle(engine, grace_seconds):
            return ran
        else:
            time.sleep(poll_seconds)
