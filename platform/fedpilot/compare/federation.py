"""What a tuned comparison's runs train and are judged on: the federation of every (pipeline, seed), tuning and
comparison seeds alike, and the check that no comparison seed's test sample was a tuning seed's train or val
sample. It runs before any work (on the datasets `prepare_plan` builds) and again on a finished comparison's
records (`check_recorded`: each run's dataset fingerprint, the splits rebuilt from the plan)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from mlflow import MlflowClient
from mlflow.entities import Run

from fedpilot.compare.plan import FEDERATION_SEED, Plan
from fedpilot.data.federated import FederatedData, build_federated_data
from fedpilot.errors import RunError, SpecError
from fedpilot.spec import PipelineSpec
from fedpilot.tracking import FINGERPRINT_TAG, PIPELINE_TAG, SEED_TAG, STUDY_TAG

Built = dict[tuple[str, int], FederatedData]  # (pipeline, seed) -> its federation


def seeded_specs(plan: Plan) -> Iterator[tuple[str, int, PipelineSpec]]:
    """Every (pipeline, seed, spec) a tuned comparison trains: each comparison seed's spec, and each tuning spec on
    every seed its studies train (the tuning seeds and trial 0's noise seed)."""
    for pipeline, by_seed in plan.specs.items():
        yield from ((pipeline, seed, spec) for seed, spec in by_seed.items())
        if pipeline in plan.tuning:
            for seed in plan.comparison.noise_seeds():
                yield pipeline, seed, plan.tuning[pipeline].model_copy(update={"seed": seed})


def check_disjoint(plan: Plan, built: Built) -> None:
    """Refuse a plan in which a comparison seed's test samples were train or val samples on a seed its studies
    train (any client's: a tuned configuration has seen them), naming the pipeline, the seeds and how many."""
    if not plan.tuning:
        return
    for pipeline in plan.tuning:
        for seed in plan.seeds:
            test = _ids(built[(pipeline, seed)], "test")
            for tuning_seed in plan.comparison.noise_seeds():
                trained = built[(pipeline, tuning_seed)]
                seen = np.intersect1d(test, np.concatenate([_ids(trained, "train"), _ids(trained, "val")]))
                if len(seen):
                    raise SpecError("tune.splits", plan.comparison.tune.splits, f"{pipeline}: {len(seen):,} of "
                                    f"{len(test):,} test samples of seed {seed} are train or val samples at tuning "
                                    f"seed {tuning_seed} (each seed draws its own federation): use splits: fixed or "
                                    "train_val")


def _ids(data: FederatedData, split: str) -> np.ndarray:
    return np.unique(np.concatenate(data.samples(split)))


def fingerprints(plan: Plan, built: Built) -> dict[str, dict[str, str]]:
    """Per pipeline and seed, the dataset fingerprint of its federation (what comparison.json records)."""
    found: dict[str, dict[str, str]] = {}
    for (pipeline, seed), data in built.items():
        found.setdefault(pipeline, {})[str(seed)] = data.fingerprint
    return {pipeline: dict(sorted(by_seed.items(), key=lambda kv: int(kv[0]))) for pipeline, by_seed in found.items()}


def build_all(plan: Plan, cache_dir: Path, prepare: Callable[[PipelineSpec], FederatedData] | None = None) -> Built:
    """The federation of every (pipeline, seed) the comparison trains, built into the cache (by `prepare`, which
    also runs a pipeline's checks, or built alone)."""
    make = prepare or (lambda spec: build_federated_data(spec.dataset, spec.seed, cache_dir))
    return {(pipeline, seed): make(spec) for pipeline, seed, spec in seeded_specs(plan)}


def check_recorded(plan: Plan, recorded: dict[str, dict[str, str]], cache_dir: Path) -> None:
    """A finished comparison's records checked: every recorded dataset fingerprint is the one its spec builds, and
    the federations rebuilt from the plan keep every comparison seed's test samples out of the tuning seeds'
    train and val."""
    built = build_all(plan, cache_dir)
    rebuilt = fingerprints(plan, built)
    for pipeline, by_seed in recorded.items():
        for seed, fingerprint in by_seed.items():
            if rebuilt.get(pipeline, {}).get(seed) != fingerprint:
                raise RunError("comparison.json", f"{pipeline} seed {seed}", f"recorded federation {fingerprint} is "
                               f"not the one its spec builds ({rebuilt.get(pipeline, {}).get(seed)})")
    check_disjoint(plan, built)


def recorded_fingerprints(client: MlflowClient, experiment_id: str, plan: Plan,
                          runs: list[Run]) -> dict[str, dict[str, str]]:
    """Per pipeline and seed, the dataset fingerprint its runs recorded: the comparison's `runs` and every trial
    run of its studies (what comparison.json keeps, and `check_recorded` rebuilds)."""
    found: dict[str, dict[str, str]] = {}
    for run in runs:
        tags = run.data.tags
        found.setdefault(tags[PIPELINE_TAG], {})[tags[SEED_TAG]] = tags[FINGERPRINT_TAG]
    for pipeline, spec in plan.tuning.items():
        for run in client.search_runs([experiment_id], f"tags.`{STUDY_TAG}` = '{spec.search.study}'",
                                      max_results=10_000):
            if FINGERPRINT_TAG in run.data.tags:
                found.setdefault(pipeline, {})[run.data.tags[SEED_TAG]] = run.data.tags[FINGERPRINT_TAG]
    return {pipeline: dict(sorted(by_seed.items(), key=lambda kv: int(kv[0]))) for pipeline, by_seed in found.items()}


def federation_line(plan: Plan) -> str:
    """What the comparison did to the federation, for its table (empty when it left the set's specs as written)."""
    if not plan.tuning:
        return ""
    splits, fixed = plan.comparison.tune.splits, plan.fixed
    if splits == "redraw":
        return ("tune.splits: redraw: every seed draws its own federation, checked before any work: no comparison "
                "seed's test sample is a train or val sample on a seed the studies train")
    made = (f"the comparison fixed dataset.seed={FEDERATION_SEED} for {', '.join(fixed)} (the set leaves it unset); "
            if fixed else "")
    what = ("every run, tuning and comparison seeds alike, trains on one federation" if splits == "fixed" else
            "every run keeps the same clients and test samples while each seed re-cuts train / val")
    return f"{made}tune.splits: {splits}: {what}"
