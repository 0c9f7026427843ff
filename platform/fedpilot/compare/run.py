"""A comparison from its plan to its table: its MLflow run found (the same plan's unfinished one: a rerun continues
it), given (--resume) or made; the work done in this process beside any other; the table assembled once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedpilot.compare.plan import Plan, tuning_error
from fedpilot.compare.record import ComparisonResult, assemble
from fedpilot.compare.work import POLL_SECONDS, Work, find_run, start_run
from fedpilot.errors import SpecError
from fedpilot.leases import NamedLease
from fedpilot.pipeline.checks import prepare
from fedpilot.settings import check_tracking, tracking_uri
from fedpilot.tracking import Tracker, comparison_outcome


def prepare_plan(plan: Plan, cache_dir: Path) -> None:
    """Every check `fedpilot run` makes, of every (pipeline, seed) and every tuning seed (datasets built into the
    cache), before anything is recorded."""
    for by_seed in plan.specs.values():
        for spec in by_seed.values():
            check_tracking(spec.tracking.uri)
            prepare(spec, cache_dir)
    for i, spec in enumerate(plan.tuning.values()):
        for seed in plan.comparison.tuning_seeds():
            try:
                prepare(spec.model_copy(update={"seed": seed}), cache_dir)
            except SpecError as err:  # its objective, say: the set's tune block gave it
                raise tuning_error(plan.comparison, i, err) from None


def comparison_run(plan: Plan, run_id: str | None = None) -> tuple[Tracker, str, bool]:
    """The tracker of the comparison's experiment, its run (`run_id`, else the plan's unfinished one, else a new
    one) and whether that run was made here."""
    tracker = Tracker(tracking_uri(), plan.comparison.name)
    found = run_id or find_run(tracker, plan)
    return (tracker, found, False) if found else (tracker, start_run(tracker, plan), True)


def run_comparison(plan: Plan, storage_url: str, cache_dir: Path | None = None, progress: bool = False,
                   echo: Callable[[str], None] = print, run_id: str | None = None,
                   heartbeat_seconds: int = 10) -> ComparisonResult:
    """Do the comparison's work in this process until every unit is done, then its table (assembled by the first
    process to get there; the others read it). The run is RUNNING meanwhile; a stop or failure here marks it KILLED
    or FAILED, and running the same command (or --resume) goes on from what is done."""
    tracker, run_id, _ = comparison_run(plan, run_id)
    if tracker.client.get_run(run_id).info.status == "FINISHED":  # --resume of a comparison that is done
        return finished_result(tracker, run_id)
    tracker.client.update_run(run_id, status="RUNNING")
    try:
        work = Work(plan, run_id, tracker, storage_url, cache_dir, progress, echo, heartbeat_seconds)
        work.run()
        lease = NamedLease(work.database, f"compare:{run_id}:assemble", 3 * heartbeat_seconds)
        lease.acquire(POLL_SECONDS)
        with lease.kept():
            if tracker.client.get_run(run_id).info.status == "FINISHED":
                return finished_result(tracker, run_id)
            return assemble(plan, run_id, tracker, work)
    except BaseException as err:
        if tracker.client.get_run(run_id).info.status != "FINISHED":
            tracker.fail([run_id], err)
        raise


def finished_result(tracker: Tracker, run_id: str) -> ComparisonResult:
    """The outcome another process assembled, read back from the comparison's run."""
    record, table = comparison_outcome(tracker.client, run_id)
    scores = {p: {int(s): v for s, v in by_seed.items()} for p, by_seed in record["scores"].items()}
    runs = {p: {int(s): v for s, v in by_seed.items()} for p, by_seed in record["runs"].items()}
    return ComparisonResult(run_id, table, scores, runs, record["counts"], tracker.uri, tracker.experiment_id)


