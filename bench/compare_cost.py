"""What a comparison's time went to (issue 52): a `fedpilot compare` run's wall clock split, from its MLflow records,
into its parts: the studies (every trial's runs), the reruns on the comparison seeds (tuned, and as written under
`--untuned`), and in each the pipelines' first stage (the pretraining of the shipped sets) apart from the stages after
it; what lies outside every trained stage (building data and models, evaluation outside a stage's run, MLflow,
Optuna) is the rest.

    python bench/compare_cost.py [RUN_ID] [--tracking-uri URI] [--json FILE]

RUN_ID: the comparison's run (the `run_id` its command ends with; default: the latest comparison in the store).
`rounds`: the rounds its trained stages ran (each trial's; a batch's counted per trial). A part's wall time is the
union of its trained stage runs' intervals (start to end as MLflow recorded them), so stages that trained together (a
batch of trials) count once; a stage taken from the cache counts as cached, not as time. The comparison's own
interval spans every sitting of a resumed comparison, pauses included.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

sys.path.insert(0, str(Path(__file__).resolve().parent))
from arguments import output_file  # noqa: E402

from fedpilot.settings import store_exists, tracking_uri  # noqa: E402

PARTS = ("studies", "reruns, tuned", "reruns, as written")
VARIANT_PART = {"tuned": "reruns, tuned", "written": "reruns, as written"}


def descendants(client: MlflowClient, parent: Run) -> list[Run]:
    """Every run below `parent` in its experiment (children, grandchildren, ...)."""
    runs = client.search_runs([parent.info.experiment_id], max_results=50_000)
    children = defaultdict(list)
    for run in runs:
        children[run.data.tags.get("mlflow.parentRunId")].append(run)
    found, todo = [], [parent.info.run_id]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += [run.info.run_id for run in below]
    return found


def part_of(run: Run, by_id: dict[str, Run]) -> str | None:
    """The part a stage run belongs to: its nearest ancestor that is a trial (studies) or a comparison rerun."""
    while run is not None:
        tags = run.data.tags
        if "fedpilot.trial" in tags:
            return "studies"
        if "fedpilot.compare_variant" in tags:
            return VARIANT_PART.get(tags["fedpilot.compare_variant"])
        run = by_id.get(tags.get("mlflow.parentRunId"))
    return None


def union_s(intervals: list[tuple[int, int]]) -> float:
    """Seconds covered by some of the `intervals` (milliseconds since the epoch)."""
    covered, end = 0, None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            covered, end = covered + stop - start, stop
        elif stop > end:
            covered, end = covered + stop - end, stop
    return covered / 1000


def cost(client: MlflowClient, run_id: str) -> dict:
    """The comparison's wall seconds, and per part and stage position its trained and cached stages and wall."""
    parent = client.get_run(run_id)
    runs = descendants(client, parent)
    by_id = {run.info.run_id: run for run in runs}
    cells: dict[tuple[str, str], dict] = defaultdict(lambda: {"trained": 0, "cached": 0, "rounds": 0,
                                                              "intervals": []})
    for run in runs:
        tags = run.data.tags
        part = "fedpilot.stage_index" in tags and part_of(by_id.get(tags.get("mlflow.parentRunId")), by_id)
        if not part:
            continue
        cell = cells[part, "first stage" if tags["fedpilot.stage_index"] == "0" else "later stages"]
        if tags.get("fedpilot.cache") == "hit" or run.info.end_time is None:
            cell["cached"] += tags.get("fedpilot.cache") == "hit"
            continue
        cell["trained"] += 1
        cell["rounds"] += len(client.get_metric_history(run.info.run_id, "round_time_s"))
        cell["intervals"].append((run.info.start_time, run.info.end_time))
    end = parent.info.end_time or max(run.info.end_time or 0 for run in runs)
    every = [interval for cell in cells.values() for interval in cell["intervals"]]
    rows = [{"part": part, "stages": stages, "trained": cell["trained"], "cached": cell["cached"],
             "rounds": cell["rounds"], "wall_s": union_s(cell["intervals"])}
            for (part, stages), cell in sorted(cells.items(), key=lambda kv: (PARTS.index(kv[0][0]), kv[0][1]))]
    return {"run_id": run_id, "wall_s": (end - parent.info.start_time) / 1000, "in_stages_s": union_s(every),
            "rows": rows, "pipelines": by_pipeline(run_id, runs, end)}


def by_pipeline(run_id: str, runs: list[Run], end: int) -> list[dict]:
    """Per pipeline, in the order it started: the wall seconds of its study (its search run, every trial with
    Optuna's work between them) and of its reruns (union), from the comparison's own children; a run still open
    counts to `end`."""
    spans: dict[str, dict[str, list]] = defaultdict(lambda: {"study": [], "reruns": []})
    for run in sorted(runs, key=lambda run: run.info.start_time):
        tags = run.data.tags
        if tags.get("mlflow.parentRunId") == run_id and "fedpilot.pipeline" in tags:
            kind = "reruns" if "fedpilot.compare_variant" in tags else "study"
            spans[tags["fedpilot.pipeline"]][kind].append((run.info.start_time, run.info.end_time or end))
    return [{"pipeline": name, "study_s": union_s(span["study"]), "reruns_s": union_s(span["reruns"])}
            for name, span in spans.items()]


def latest_comparison(client: MlflowClient) -> str | None:
    """The run id of the store's most recent comparison (None: the store holds none)."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = client.search_runs(experiments, "tags.`fedpilot.compare_key` != ''", max_results=1,
                               order_by=["attributes.start_time DESC"])
    return found[0].info.run_id if found else None


def print_cost(figures: dict) -> None:
    total = figures["wall_s"]
    print(f"comparison {figures['run_id']}: {total / 60:.1f} min wall, {figures['in_stages_s'] / 60:.1f} of them in "
          f"trained stages")
    print(f"{'part':<20} {'stages':<13} {'trained':>8} {'cached':>7} {'rounds':>7} {'wall min':>9} {'share':>6}")
    for row in figures["rows"]:
        print(f"{row['part']:<20} {row['stages']:<13} {row['trained']:>8} {row['cached']:>7} {row['rounds']:>7} "
              f"{row['wall_s'] / 60:>9.1f} {row['wall_s'] / total:>6.0%}")
    rest = total - figures["in_stages_s"]
    print(f"{'outside stages':<50} {rest / 60:>9.1f} {rest / total:>6.0%}")
    print(f"\n{'pipeline':<28} {'study min':>9} {'reruns min':>10}")
    for row in figures["pipelines"]:
        print(f"{row['pipeline']:<28} {row['study_s'] / 60:>9.1f} {row['reruns_s'] / 60:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_id", nargs="?", help="the comparison's run (default: the store's latest comparison)")
    parser.add_argument("--tracking-uri", default=tracking_uri(),
                        help="the MLflow store (default $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    parser.add_argument("--json", type=output_file, help="write the figures as JSON to this file")
    args = parser.parse_args()
    if not store_exists(args.tracking_uri):  # looking up creates nothing
        parser.error(f"argument --tracking-uri: {args.tracking_uri!r}: no such store")
    client = MlflowClient(args.tracking_uri)
    run_id = args.run_id or latest_comparison(client)
    if run_id is None:
        parser.error(f"no comparison in the store {args.tracking_uri} (a `fedpilot compare` run tags "
                     "fedpilot.compare_key)")
    try:
        figures = cost(client, run_id)
    except MlflowException:
        parser.error(f"argument run_id: {run_id!r}: no such run in the store {args.tracking_uri}")
    print_cost(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
