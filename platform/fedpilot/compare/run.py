"""A comparison from its plan to its table: its MLflow run found (the same plan's unfinished one: a rerun continues
it), given (--resume) or made; the work done in this process beside any other; the table assembled once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from fedpilot.compare.events import Event
from fedpilot.compare.federation import build_all, check_disjoint, fingerprints
from fedpilot.compare.plan import Plan, tuning_error
from fedpilot.compare.record import ComparisonResult, assemble
from fedpilot.compare.work import POLL_SECONDS, Work, find_run, start_run
from fedpilot.data.federated import FederatedData, staging
from fedpilot.errors import SpecError
from fedpilot.leases import NamedLease
from fedpilot.pipeline.checks import prepare
from fedpilot.settings import check_tracking, tracking_uri
from fedpilot.spec import PipelineSpec
from fedpilot.tracking import Tracker, comparison_outcome


def prepare_plan(plan: Plan, cache_dir: Path) -> dict[str, dict[str, str]]:
    """Every check `fedpilot run` makes, of every (pipeline, seed) and every seed a study trains (datasets built into
    the cache), and with tuning that no comparison seed's test samples were a tuning seed's train or val samples,
    before anything is recorded; the federations' fingerprints by pipeline and seed."""
    def checked(spec: PipelineSpec) -> FederatedData:
        check_tracking(spec.tracking.uri)
        try:
            return prepare(spec, cache_dir).data
        except SpecError as err:  # a tuning spec's objective, say: the set's tune block gave it
            if spec.search is None or spec.name not in plan.tuning:
                raise
            raise tuning_error(plan.comparison, list(plan.specs).index(spec.name), err) from None

    with staging():  # new datasets become cache entries only once every check, the federations' too, passed
        built = build_all(plan, cache_dir, checked)
        check_disjoint(plan, built)
        return fingerprints(plan, built)


def comparison_run(plan: Plan, run_id: str | None = None) -> tuple[Tracker, str, bool]:
    """The tracker of the comparison's experiment, its run (`run_id`, else the plan's unfinished one, else a new
    one) and whether that run was made here."""
    tracker = Tracker(tracking_uri(), plan.comparison.name)
    found = run_id or find_run(tracker, plan)
    return (tracker, found, False) if found else (tracker, start_run(tracker, plan), True)


def run_comparison(plan: Plan, storage_url: str, cache_dir: Path | None = None, progress: bool = False,
                   echo: Callable[[str], None] = print, run_id: str | None = None,
                   heartbeat_seconds: int = 10, events: Callable[[Event], None] = lambda event: None
                   ) -> ComparisonResult:
    """Do the comparison's work in this process until every unit is done, then its table (assembled by the first
    process to get there; the others read it). The run is RUNNING meanwhile; a stop or failure here marks it KILLED
    or FAILED, and running the same command (or --resume) goes on from what is done. `events` hears where the
    work stands (compare.events)."""
    tracker, run_id, _ = comparison_run(plan, run_id)
    if tracker.client.get_run(run_id).info.status == "FINISHED":  # --resume of a comparison that is done
        return finished_result(tracker, run_id)
    tracker.client.update_run(run_id, status="RUNNING")
    try:
        work = Work(plan, run_id, tracker, storage_url, cache_dir, progress, echo, heartbeat_seconds, events)
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


