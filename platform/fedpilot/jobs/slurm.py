"""Slurm as a backend of the job queue, through submitit: `--to slurm` submits a job's frozen spec to the cluster's
own scheduler instead of waiting for a fedpilot worker.

A Slurm job is a row of the same jobs table (`backend` "slurm") and runs like a queue job: its task (rank 0) marks
the row running, starts `fedpilot run` / `fedpilot search` in a child with heartbeats and records the MLflow run
(jobs.queue.execute); the row holds the Slurm job id and its log. A search with `--parallel N` is N rows submitted
as one Slurm job array, each task a trial worker on the shared study. `devices: N` and `nodes: M` become M nodes of
N tasks (srun), each task one rank of Lightning's SLURM environment.

Time limits and preemption: Slurm sends SIGUSR2 `SIGNAL_DELAY_S` seconds before the time limit (submitit's
`--signal`), SIGTERM on preemption, `scontrol requeue` or `scancel`. The run stops after its current round with a
checkpoint (pipeline.signals); after SIGUSR2 the task requeues the job itself, after SIGTERM Slurm requeues it when
that was the reason. The requeued job resumes its MLflow runs from the checkpoint (`fedpilot run --resume`), the
path every resume takes, so it ends identical to an uninterrupted run. A cancel request ends it cancelled instead.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import Engine, delete, select, update

from fedpilot.db import (
    CANCELLED,
    FAILED,
    LOST,
    QUEUED,
    RUNNING,
    SUCCEEDED,
    Job,
    JobAttempt,
    connect,
    session_factory,
    utcnow,
)
from fedpilot.errors import CancelFailed, JobError, SubmitRefused, UserError
from fedpilot.jobs.queue import (
    PARALLEL_KINDS,
    TAIL_CHARS,
    child_command,
    close_runs,
    execute,
    request_cancel,
    submit,
)
from fedpilot.jobs.slurm_options import SlurmSpec, slurm_minutes
from fedpilot.settings import SERVER_TIMEOUT_S, cache_root, sqlite_file

SLURM = "slurm"
ENV = "FEDPILOT_SLURM"  # defaults for every submission: "partition=gpu gpus=1 time=4:00:00 account=lab"
FLAGS = ("partition", "gpus", "cpus", "mem", "time", "account", "qos")
SIGNAL_DELAY_S = 90  # SIGUSR2 this long before the time limit: time to finish a round and checkpoint
TIME_LIMIT_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
FORWARDED = (signal.SIGTERM, *TIME_LIMIT_SIGNALS)
# Slurm states after which a job never runs again (REQUEUED, PENDING, ... mean it will).
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED", "REVOKED", "SPECIAL_EXIT"}
HEARTBEAT_SECONDS = 10.0
log = logging.getLogger(__name__)  # the Slurm job's log (its stderr file) unless logging is configured


# ---- options ---------------------------------------------------------------------------------------------------
def options(block: dict[str, Any] | None, flags: dict[str, Any]) -> SlurmSpec:
    """The Slurm options of a submission: $FEDPILOT_SLURM, then the pipeline's `slurm:` block, then the flags (each
    later one wins key by key); a bad value is a SpecError naming where it came from."""
    merged: dict[str, Any] = {}
    text = os.environ.get(ENV, "").strip()
    if text:
        env: dict[str, Any] = {}
        for item in shlex.split(text):
            key, sep, value = item.partition("=")
            if not sep or key not in FLAGS:
                raise JobError(ENV, item, "not KEY=VALUE with a known key", allowed=list(FLAGS))
            env[key] = value
        merged.update(_checked(env, lambda key: f"{ENV}.{key}"))
    merged.update({k: v for k, v in (block or {}).items() if v not in (None, [])})
    given = {k: v for k, v in flags.items() if v is not None}
    merged.update(_checked(given, lambda key: f"--{key}"))
    return _checked(merged, lambda key: f"slurm.{key}", model=True)


def _checked(values: dict[str, Any], key_of: Any, model: bool = False) -> Any:
    from pydantic import ValidationError

    from fedpilot.errors import from_validation

    try:
        checked = SlurmSpec.model_validate(values)
    except ValidationError as err:
        found = from_validation(err, SlurmSpec)
        problem = found.problem.removeprefix("Value error, ")
        raise JobError(key_of(found.key), found.value, problem, found.allowed) from None
    return checked if model else checked.model_dump(include=set(values))


def parameters(spec: dict[str, Any], slurm: SlurmSpec, name: str) -> dict[str, Any]:
    """submitit's SlurmExecutor parameters for a pipeline (resolved spec) under the options `slurm`: `nodes` nodes of
    `devices` tasks, GPUs per node (default `devices`, none with `device: cpu`), signal before the time limit."""
    devices, nodes, device = spec.get("devices", 1), spec.get("nodes", 1), spec.get("device", "auto")
    gpus = slurm.gpus if slurm.gpus is not None else (0 if device == "cpu" else devices)
    if device == "cuda" and gpus == 0:
        raise JobError("--gpus", gpus, "the pipeline asks for `device: cuda`; give its job GPUs or set device: cpu")
    if 0 < gpus < devices:
        raise JobError("--gpus", gpus, f"`devices: {devices}` runs {devices} processes per node, one per GPU")
    return {"job_name": name, "nodes": nodes, "ntasks_per_node": devices, "cpus_per_task": slurm.cpus,
            "gpus_per_node": gpus or None, "mem": slurm.mem, "partition": slurm.partition, "account": slurm.account,
            "qos": slurm.qos, "time": slurm_minutes(slurm.time) if slurm.time else None, "setup": slurm.setup or None,
            "signal_delay_s": SIGNAL_DELAY_S, "additional_parameters": {"requeue": True}}


def absolute_db(url: str) -> str:
    """A SQLite URL with its file made absolute (the job may start in another directory); others as they are."""
    path = sqlite_file(url)
    if path is None or path.is_absolute():
        return url
    _, sep, query = url.partition("?")
    return f"sqlite:///{path.resolve()}{sep}{query}"


# ---- submitting ------------------------------------------------------------------------------------------------
def enqueue(database: Engine, db_url: str, fields: dict[str, Any], slurm: SlurmSpec,
            parallel: int = 1) -> list[tuple[int, str]]:
    """Store `parallel` rows of a job (validated fields, see jobs.queue.job_fields) and submit them to Slurm, as one
    job array when more than one; (row id, Slurm job id) of each. Nothing stays queued when sbatch refuses (a
    SubmitRefused says why)."""
    if parallel < 1:
        raise JobError("--parallel", parallel, "must be at least 1")
    if parallel > 1 and fields["kind"] not in PARALLEL_KINDS:
        raise JobError("--parallel", parallel, "only a search or a comparison runs in parallel (workers of one study "
                        "or comparison)")
    spec = json.loads(fields["spec"])
    params = parameters(spec, slurm, f"fedpilot-{fields['pipeline']}")
    reach_slurm()
    ids = [submit(database, {**fields, "backend": SLURM, "slurm": record(slurm, parallel)}) for _ in range(parallel)]
    try:
        slurm_ids = dispatch(database, db_url, ids, params)
    except SubmitRefused:
        with session_factory(database).begin() as session:
            session.execute(delete(Job).where(Job.id.in_(ids)))
        raise
    return list(zip(ids, slurm_ids, strict=True))


def record(slurm: SlurmSpec, parallel: int) -> str:
    """What a row (or a schedule) keeps of its Slurm options and `parallel`: JSON, the options' defaults left out."""
    return json.dumps({**slurm.model_dump(exclude_defaults=True), "parallel": parallel})


def dispatch(database: Engine, db_url: str, ids: list[int], params: dict[str, Any]) -> list[str]:
    """sbatch the stored rows `ids` (an array when several) with submitit; record their Slurm ids and logs."""
    import submitit
    from submitit.core.utils import FailedJobError

    folder = cache_root().resolve() / "slurm" / "%j"
    try:
        executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=0)
        executor.update_parameters(**params, array_parallelism=len(ids))
        tasks = [SlurmTask(job_id, db_url) for job_id in ids]
        jobs = [executor.submit(tasks[0])] if len(tasks) == 1 else executor.submit_array(tasks)
    except (FailedJobError, subprocess.SubprocessError, OSError, ValueError, RuntimeError) as err:
        problem = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip()) or repr(err)
        raise SubmitRefused("--to", SLURM, f"Slurm refused the job: {problem}") from None
    with session_factory(database).begin() as session:
        for job_id, job in zip(ids, jobs, strict=True):
            session.execute(update(Job).where(Job.id == job_id).values(
                slurm_job_id=job.job_id, slurm_log=str(job.paths.stdout)))
    return [job.job_id for job in jobs]


def dispatch_queued(database: Engine, db_url: str, ids: list[int]) -> None:
    """Submit rows a schedule fired (options from the row); a refusal fails them with the reason."""
    with session_factory(database)() as session:
        rows = session.scalars(select(Job).where(Job.id.in_(ids)).order_by(Job.id)).all()
    if not rows:
        return
    stored = json.loads(rows[0].slurm or "{}")
    stored.pop("parallel", None)
    try:
        reach_slurm()
        params = parameters(json.loads(rows[0].spec), SlurmSpec.model_validate(stored), f"fedpilot-{rows[0].pipeline}")
        dispatch(database, db_url, ids, params)
    except UserError as err:
        with session_factory(database).begin() as session:
            session.execute(update(Job).where(Job.id.in_(ids), Job.status == QUEUED).values(
                status=FAILED, finished_at=utcnow(), error=str(err)))


def need_slurm() -> None:
    """A SubmitRefused unless Slurm's client commands are on this machine's PATH."""
    for command in ("sbatch", "squeue", "scancel", "sinfo"):
        if shutil.which(command) is None:
            raise SubmitRefused("--to", SLURM, f"Slurm's `{command}` is not on PATH: submit from a machine of the "
                            "cluster (a login node)")


def reach_slurm() -> None:
    """A SubmitRefused unless Slurm's controller answers (`sinfo` within SERVER_TIMEOUT_S): a command sending work to
    Slurm finds out before it creates anything (a comparison's run, the jobs' rows), not when sbatch fails."""
    need_slurm()
    try:
        answer = subprocess.run(["sinfo", "--noheader", "--format=%P"], capture_output=True, text=True,
                                timeout=SERVER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SubmitRefused("--to", SLURM, f"Slurm's controller did not answer within {SERVER_TIMEOUT_S} s "
                            "(sinfo)") from None
    if answer.returncode != 0:
        said = [line.strip() for line in answer.stderr.splitlines() if line.strip()] or [
            f"sinfo exited with {answer.returncode}"]
        raise SubmitRefused("--to", SLURM, f"Slurm's controller does not answer: {said[-1]}")


# ---- the job on the cluster ------------------------------------------------------------------------------------
class SlurmTask:
    """What a task of the Slurm job runs (pickled by submitit): rank 0 runs the job's row like a worker would,
    other ranks (DDP over srun) run the same command as followers."""

    def __init__(self, job_id: int, db_url: str):
        self.job_id, self.db_url = job_id, db_url

    def __call__(self) -> str:
        import submitit

        env = submitit.JobEnvironment()
        database = connect(self.db_url)
        relay = _Relay()
        with relay:
            if env.global_rank != 0:
                return self._follow(database, env, relay)
            worker = f"{socket.gethostname()} (slurm {env.job_id})"
            job = start(database, self.job_id, worker, env.job_id)
            if job is None:
                return "not run: the job was cancelled or had ended"
            status = execute(database, job, worker, self.db_url, HEARTBEAT_SECONDS,
                             streams=(env.paths.stdout, env.paths.stderr), kill_on_cancel=False,
                             started=relay.attach, ended=lambda code: _stopped(database, self.job_id, code, relay))
        if status == QUEUED and relay.received & set(TIME_LIMIT_SIGNALS):
            log.warning(f"fedpilot: requeueing Slurm job {env.job_id} before its time limit")
            subprocess.run(["scontrol", "requeue", env.job_id], check=False, timeout=60)
        return status

    def _follow(self, database: Engine, env: Any, relay: _Relay) -> str:
        """A rank > 0: the same `fedpilot run` (resuming what rank 0 resumes); it trains its slice, records nothing."""
        with session_factory(database)() as session:
            job = session.get(Job, self.job_id)
        with tempfile.TemporaryDirectory(prefix="fedpilot-job-") as tmp:
            spec_file = Path(tmp) / f"job-{job.id}.yaml"
            spec_file.write_text(yaml.safe_dump(json.loads(job.spec), sort_keys=False))
            with open(env.paths.stdout, "a") as out, open(env.paths.stderr, "a") as err:
                proc = subprocess.Popen(child_command(job, spec_file), stdout=out, stderr=err, stdin=subprocess.DEVNULL)
                relay.attach(proc)
                proc.wait()
        return f"rank {env.global_rank}: exit {proc.returncode}"


class _Relay:
    """While the task runs: SIGTERM, SIGUSR1 and SIGUSR2 are remembered and passed on to the child (which stops
    after its round with a checkpoint) instead of submitit's handlers (which would requeue without one)."""

    def __init__(self) -> None:
        self.received: set[int] = set()
        self.proc: subprocess.Popen | None = None
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> _Relay:
        self.previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.received.add(signum)
        log.warning(f"fedpilot: {signal.Signals(signum).name} received, passed on to the run")
        self._forward(signum)

    def attach(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        for signum in sorted(self.received):  # a signal that came before the child
            self._forward(signum)

    def _forward(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)


def start(database: Engine, job_id: int, worker: str, slurm_id: str) -> Job | None:
    """Mark the row running for a new attempt by this Slurm task (a previous attempt still marked running died with
    its node or was killed: lost); None when the row was cancelled or has ended."""
    with session_factory(database).begin() as session:
        job = session.get(Job, job_id, with_for_update=True)
        if job is None or job.status in (SUCCEEDED, FAILED, CANCELLED):
            return None
        now = utcnow()
        if job.cancel_requested:
            job.status, job.finished_at, job.error = CANCELLED, now, "cancelled before it ran again"
            return None
        session.execute(update(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.status == RUNNING)
                        .values(status=LOST, finished_at=now, error="the Slurm job stopped without reporting"))
        job.status, job.worker, job.attempts, job.slurm_job_id = RUNNING, worker, job.attempts + 1, slurm_id
        job.started_at, job.heartbeat_at, job.finished_at = now, now, None
        session.add(JobAttempt(job_id=job_id, number=job.attempts, worker=worker, started_at=now, status=RUNNING,
                               run_id=job.run_id))
        session.flush()
        session.expunge(job)
        return job


def _stopped(database: Engine, job_id: int, code: int, relay: _Relay) -> tuple[str, str] | None:
    """The status of a child that exited non-zero: cancelled on request; queued again when a signal stopped it
    (Slurm runs it again: preemption, requeue, time limit); else None (failed)."""
    with session_factory(database)() as session:
        cancelled = session.scalar(select(Job.cancel_requested).where(Job.id == job_id))
    if cancelled:
        return CANCELLED, "cancelled (fedpilot cancel)"
    if relay.received or code - 128 in FORWARDED:
        names = ", ".join(signal.Signals(s).name for s in sorted(relay.received)) or f"exit {code}"
        return QUEUED, (f"stopped after a round with a checkpoint ({names}: preempted, requeued or at its time "
                        "limit); it resumes when Slurm runs it again")
    return None


def cancel(database: Engine, job_id: int) -> str:
    """Cancel a Slurm job: its row (cancelled if it waits, asked to stop if it runs) and the Slurm job (scancel:
    a running one stops after its round with a checkpoint, its runs KILLED)."""
    status = request_cancel(database, job_id)
    with session_factory(database)() as session:
        slurm_id = session.scalar(select(Job.slurm_job_id).where(Job.id == job_id))
    if slurm_id:
        done = subprocess.run(["scancel", slurm_id], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise CancelFailed("JOB_ID", job_id, f"scancel {slurm_id} failed: {(done.stderr or done.stdout).strip()}")
    return f"{status} (scancel {slurm_id})" if slurm_id else status


# ---- what Slurm says -------------------------------------------------------------------------------------------
def states(slurm_ids: list[str]) -> dict[str, tuple[str, str]]:
    """(state, node list) of each Slurm job id the controller knows (squeue, also recently ended jobs), else from
    accounting (sacct) where it is configured; ids neither knows are missing."""
    found: dict[str, tuple[str, str]] = {}
    if not slurm_ids:
        return found
    queries = [["squeue", "-h", "-r", "-t", "all", "-o", "%i|%T|%N", "-j"],
               ["sacct", "-n", "-P", "-X", "-o", "JobID,State,NodeList", "-j"]]
    for query in queries:
        missing = [i for i in slurm_ids if i not in found]
        if not missing or shutil.which(query[0]) is None:
            continue
        try:
            done = subprocess.run([*query, ",".join(missing)], capture_output=True, text=True, timeout=30)
        except (subprocess.SubprocessError, OSError):
            continue
        for line in done.stdout.splitlines() if done.returncode == 0 else []:
            parts = line.strip().split("|")
            if len(parts) >= 3 and parts[0] in missing:
                found[parts[0]] = (parts[1].split()[0] if parts[1] else "UNKNOWN", parts[2])
    return found


def refresh(database: Engine, rows: list[dict[str, Any]]) -> None:
    """Add Slurm's state and node to the rows of Slurm jobs that have not ended, and end the rows of jobs Slurm says
    ended without their task recording it (killed, out of memory, cancelled outside fedpilot): their attempt is
    lost and their MLflow runs KILLED."""
    live = [r for r in rows if r["backend"] == SLURM and r["slurm_job_id"] and r["status"] in (QUEUED, RUNNING)]
    known = states([r["slurm_job_id"] for r in live])
    for row in rows:
        if row["backend"] == SLURM:
            row.setdefault("slurm_state", None)
            row.setdefault("node", _node_of(row.get("worker")))
    for row in live:
        state, node = known.get(row["slurm_job_id"], (None, None))
        row["slurm_state"] = state
        row["node"] = node or row["node"]
        if state in ENDED:
            ended = _end(database, row["id"], state)
            if ended is not None:
                row.update(status=ended, reason=f"Slurm: {state}" if ended == FAILED else None)


def _node_of(worker: str | None) -> str | None:
    return worker.split(" (slurm", 1)[0] if worker else None


def _end(database: Engine, job_id: int, state: str) -> str | None:
    """Mark a row whose Slurm job ended in `state` (cancelled, or failed); None if its task had recorded it."""
    status = CANCELLED if state == "CANCELLED" else FAILED
    error = f"the Slurm job ended ({state}) before fedpilot recorded an outcome"
    with session_factory(database).begin() as session:
        job = session.get(Job, job_id, with_for_update=True)
        if job is None or job.status not in (QUEUED, RUNNING):
            return None
        job.status, job.finished_at, job.error = status, utcnow(), error
        session.execute(update(JobAttempt).where(JobAttempt.job_id == job_id, JobAttempt.status == RUNNING)
                        .values(status=LOST, finished_at=utcnow(), error=error))
        orphan = (job.tracking_uri, job.run_id) if job.run_id and job.kind == "run" else None
    if orphan:
        close_runs(*orphan, error)
    return status


def log_tails(path: str | None) -> dict[str, str]:
    """The end of a Slurm job's stdout log and of its stderr log (the .err beside it), as far as they exist."""
    tails: dict[str, str] = {}
    if not path:
        return tails
    for name, file in (("log", Path(path)), ("log_err", Path(path).with_suffix(".err"))):
        try:
            with file.open("rb") as f:
                f.seek(max(0, file.stat().st_size - TAIL_CHARS))
                tails[name] = f.read().decode(errors="replace")
        except OSError:
            continue
    return tails
