"""A comparison set file and the plan it stands for: every (pipeline, seed) spec as `fedpilot run` would run it,
and with `tune:` each pipeline's study (its space, objective and tuning seeds), all checked before anything runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from fedpilot.errors import SpecError, from_validation, within
from fedpilot.metric_names import OBJECTIVE_METRICS, primary
from fedpilot.names import check_name
from fedpilot.schema import SEED_MAX, Seed, Strict
from fedpilot.settings import SQL_INT_MAX
from fedpilot.spec import PipelineSpec, PrunerSpec, SamplerSpec, load_pipeline, read_user_yaml, written_values

MAX_SEEDS = 1000  # every seed runs each pipeline of the set, all checked before the first runs: more is a typo
TUNED, WRITTEN = "tuned", "written"  # a pipeline run's variant: at its study's choice, or as its file gives it


class TuneSpec(Strict):
    """A set's `tune:` block (`fedpilot compare --tune N` sets `trials`): each pipeline's study of `trials` finished
    trials, on the validation `objective` (default: the mean over clients of the task's primary metric) of the tuning
    `seeds` (default: the one seed after the comparison's), with Optuna's `sampler` and `pruner`; `tune_budget`
    also searches what changes a client's work or model size; `untuned` also runs each pipeline as written on the
    comparison's seeds (default vs tuned)."""

    trials: int = Field(ge=1, le=SQL_INT_MAX)
    objective: str | None = None
    seeds: list[Seed] | None = Field(None, min_length=1, max_length=MAX_SEEDS)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    tune_budget: bool = False
    untuned: bool = False

    @field_validator("objective")
    @classmethod
    def _validation_only(cls, objective: str | None) -> str | None:
        if objective is not None and "test_" in objective:
            raise ValueError("tuning reads the validation split only: a test metric would choose the configuration "
                             "that is then judged on it (use val_...)")
        if objective is not None and objective not in OBJECTIVE_METRICS:
            raise ValueError(f"not a recorded validation metric or footprint (e.g. val_acc_mean, val_acc_p10, "
                             f"val_mse_mean; all: {', '.join(OBJECTIVE_METRICS[:6])}, ...)")
        return objective


class ComparisonSpec(Strict):
    """A set file: its name, baseline (default: the first pipeline), seeds (a count or a list of 1 to MAX_SEEDS),
    pipeline files, overrides for all of them, and how to tune them."""

    name: str
    baseline: str | None = None
    seeds: int | list[int] = Field(3)  # each checked as a pipeline's seed
    pipelines: list[str] = Field(min_length=1)
    overrides: list[str] = Field(default_factory=list)
    tune: TuneSpec | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        return check_name("name", name)

    @field_validator("seeds")
    @classmethod
    def _some_seeds(cls, seeds: int | list[int]) -> int | list[int]:
        if not 1 <= (seeds if isinstance(seeds, int) else len(seeds)) <= MAX_SEEDS:
            raise ValueError(f"at least one seed, and at most {MAX_SEEDS:,}")
        if isinstance(seeds, list) and len(set(seeds)) < len(seeds):
            raise ValueError("a seed is listed twice")
        return seeds

    @model_validator(mode="after")
    def _default_tuning_seed_fits(self) -> ComparisonSpec:
        if self.tune is not None and not self.tune.seeds and max(self.seed_list()) >= SEED_MAX:
            raise SpecError("seeds", self.seeds, f"the studies tune on the seed after the largest by default, "
                            f"{max(self.seed_list()) + 1}, past the largest seed ({SEED_MAX}): give tune.seeds, or "
                            "smaller seeds")
        return self

    def seed_list(self) -> list[int]:
        return list(range(self.seeds)) if isinstance(self.seeds, int) else list(self.seeds)

    def tuning_seeds(self) -> list[int]:
        """The seeds the studies train on: the `tune:` block's, else the one after the comparison's."""
        return self.tune.seeds if self.tune and self.tune.seeds else [max(self.seed_list()) + 1]


@dataclass
class Plan:
    """Everything a comparison runs: the set, every (pipeline, seed) spec as written, and with tuning each pipeline's
    tuning spec (its `search` block filled in: space, objective, trials, study) at the first tuning seed."""

    comparison: ComparisonSpec
    specs: dict[str, dict[int, PipelineSpec]]
    tuning: dict[str, PipelineSpec]
    shared: int  # leading stages every pipeline of the set shares (trained once per seed, never tuned)

    @property
    def baseline(self) -> str:
        return self.comparison.baseline or next(iter(self.specs))

    @property
    def seeds(self) -> list[int]:
        return self.comparison.seed_list()

    @property
    def variants(self) -> tuple[str, ...]:
        """What runs on the comparison's seeds: the tuned configuration and, asked for, the written one."""
        tune = self.comparison.tune
        return (WRITTEN,) if tune is None else (TUNED, WRITTEN) if tune.untuned else (TUNED,)

    @property
    def metric(self) -> str:
        """The task's primary per-client metric, which the table scores."""
        return primary(next(iter(self.specs.values()))[self.seeds[0]].dataset.task)

    def spec(self, pipeline: str, seed: int, values: dict[str, Any] | None = None) -> PipelineSpec:
        """The spec a (pipeline, seed) run trains: as written, or with a study's chosen `values`."""
        from fedpilot.spec import with_values

        written = self.specs[pipeline][seed]
        return with_values(written, values) if values else written

    def first_trial(self, pipeline: str) -> dict[str, Any]:
        """Trial 0 of the pipeline's study: the values its file gives the searched keys."""
        return written_values(self.tuning[pipeline])

    def to_json(self) -> dict[str, Any]:
        return {"set": self.comparison.model_dump(mode="json"), "shared": self.shared,
                "specs": {name: {str(seed): spec.resolved() for seed, spec in by_seed.items()}
                          for name, by_seed in self.specs.items()},
                "tuning": {name: spec.resolved() for name, spec in self.tuning.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(ComparisonSpec.model_validate(data["set"]),
                   {name: {int(seed): PipelineSpec.from_dict(spec) for seed, spec in by_seed.items()}
                    for name, by_seed in data["specs"].items()},
                   {name: PipelineSpec.from_dict(spec) for name, spec in data["tuning"].items()}, data["shared"])

    @property
    def key(self) -> str:
        """What identifies this comparison: a hash of the plan (a rerun of the same command continues its run)."""
        return _digest(self.to_json())


def _digest(value: Any, length: int = 16) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:length]


def load_plan(path: Path, seeds: int | None = None, overrides: list[str] | None = None, tune: int | None = None,
              untuned: bool = False) -> Plan:
    """The set file's plan, every spec validated (no data built: `prepare_plan` does): `seeds` (a count) and
    `overrides` replace / extend the file's, `tune` sets the `tune:` block's trials (creating it), `untuned` its
    `untuned`."""
    if not path.is_file():
        raise SpecError("set", str(path), "no such file")
    raw = read_user_yaml(path)
    block = _tune_block(raw)
    if tune is not None:
        within("--tune", tune, 1, SQL_INT_MAX)
        raw = {**raw, "tune": {**(block or {}), "trials": tune}}
    if untuned:
        if not block and tune is None:
            raise SpecError("--untuned", True, "runs the pipelines as written beside their tuned configuration: "
                            "add --tune N (or a tune: block)")
        raw = {**raw, "tune": {**raw["tune"], "untuned": True}}
    try:
        comparison = ComparisonSpec.model_validate(raw)
    except ValidationError as err:
        raise from_validation(err, ComparisonSpec) from None
    if seeds is not None:
        comparison.seeds = within("--seeds", seeds, 1, MAX_SEEDS)
    _disjoint(comparison)
    specs = _pipeline_specs(path, comparison, overrides or [])
    if comparison.baseline is not None and comparison.baseline not in specs:
        raise SpecError("baseline", comparison.baseline, "not the name of a pipeline of the set", allowed=list(specs))
    first = comparison.seed_list()[0]
    shared = shared_stages([by_seed[first] for by_seed in specs.values()])
    tuning = _tuning_specs(comparison, specs, shared) if comparison.tune else {}
    return Plan(comparison, specs, tuning, shared)


def _tune_block(raw: Any) -> dict[str, Any] | None:
    """The set file's `tune:` block (None without one); a scalar or a list in its place is a SpecError on `tune`."""
    block = raw.get("tune") if isinstance(raw, dict) else None
    if block is not None and not isinstance(block, dict):
        raise SpecError("tune", block, "a mapping of the tuning settings (trials, objective, seeds, sampler, pruner, "
                        "tune_budget, untuned), e.g. tune: {trials: 8}; or give --tune 8")
    return block


def _disjoint(comparison: ComparisonSpec) -> None:
    """The tuning seeds are not among the comparison's: a configuration chosen on a seed is judged on others."""
    if comparison.tune is None:
        return
    both = sorted(set(comparison.tuning_seeds()) & set(comparison.seed_list()))
    if both:
        raise SpecError("tune.seeds", comparison.tuning_seeds(), f"overlap the comparison's seeds ({both}): a "
                        "configuration is judged on seeds it was not chosen on")


def _pipeline_specs(path: Path, comparison: ComparisonSpec, overrides: list[str]) -> dict[str, dict[int, PipelineSpec]]:
    """Each pipeline file's spec at each seed, by pipeline name (two pipelines with one name are an error)."""
    extra = [*comparison.overrides, *overrides, f"tracking.experiment={comparison.name}"]
    specs: dict[str, dict[int, PipelineSpec]] = {}
    for i, relative in enumerate(comparison.pipelines):
        file = path.parent / relative
        if not file.is_file():
            raise SpecError(f"pipelines.{i}", relative, f"no such file (relative to {path.parent})")
        runs = {seed: load_pipeline(file, [*extra, f"seed={seed}"]) for seed in comparison.seed_list()}
        name = runs[comparison.seed_list()[0]].name
        if name in specs:
            raise SpecError(f"pipelines.{i}", relative, f"a second pipeline named {name!r}")
        specs[name] = runs
    return specs


def shared_stages(specs: list[PipelineSpec]) -> int:
    """How many leading stages every one of `specs` trains the same way (0 for a single pipeline): the comparison
    trains them once per seed and never tunes them. The same stages are those with the same stage cache key
    (pipeline.cache.stage_keys: the keys of the stages the runner trains)."""
    from fedpilot.pipeline.cache import data_fingerprint, stage_keys

    if len(specs) < 2:
        return 0
    keys = [stage_keys(spec, data_fingerprint(spec), spec.device) for spec in specs]
    return sum(1 for _ in takewhile(lambda same: len(set(same)) == 1, zip(*keys, strict=False)))  # up to the shortest


def _tuning_specs(comparison: ComparisonSpec, specs: dict[str, dict[int, PipelineSpec]],
                  shared: int) -> dict[str, PipelineSpec]:
    """Each pipeline's spec at the first tuning seed with its study's `search` block: its own written space, else
    `space: auto` over the stages after the shared ones; the set's objective, trials, sampler and pruner."""
    tune, seed = comparison.tune, comparison.tuning_seeds()[0]
    tuning = {}
    for i, (name, by_seed) in enumerate(specs.items()):
        written = next(iter(by_seed.values()))
        own = written.search.space if written.search is not None and not written.search.auto else None
        stages = list(range(shared, len(written.stages)))
        if own is None and not stages:
            raise SpecError(f"pipelines.{i}", comparison.pipelines[i], f"every stage of {name} is shared with the "
                            "other pipelines: nothing of it to tune")
        search = {"space": {k: p.model_dump(exclude_none=True) for k, p in own.items()} if own else "auto",
                  **({} if own else {"stages": stages, "tune_budget": tune.tune_budget}),
                  "objective": tune.objective or f"val_{primary(written.dataset.task)}_mean", "trials": tune.trials,
                  "sampler": tune.sampler.model_dump(), "pruner": tune.pruner.model_dump()}
        raw = {**written.resolved(), "seed": seed, "search": search}
        try:
            spec = PipelineSpec.from_dict(raw)
        except SpecError as err:
            raise tuning_error(comparison, i, err) from None
        spec.search.study = study_name(name, spec)
        tuning[name] = spec
    return tuning




def tuning_error(comparison: ComparisonSpec, i: int, err: SpecError) -> SpecError:
    """An error of pipeline i's tuning spec on the key the user wrote: the set's `tune:` block for what it gives the
    study (its objective, tune_budget), else the pipeline file's key."""
    where = f"pipelines.{i} ({comparison.pipelines[i]})"
    if err.key.startswith("search.objective"):
        return SpecError("tune.objective", err.value, f"{where}: {err.problem}", err.allowed)
    if "search.tune_budget" in err.problem:
        return SpecError("tune.tune_budget", comparison.tune.tune_budget, f"{where}: " + err.problem.replace(
            "set search.tune_budget: true, or write the space", "set tune.tune_budget: true in the set"))
    return SpecError(f"{where}: {err.key}", err.value, err.problem, err.allowed)


def study_name(pipeline: str, spec: PipelineSpec) -> str:
    """The study of one pipeline's tuning, named by the pipeline and a hash of what it searches on what (a changed
    space, objective, pipeline or tuning seed is another study; more trials continue it). Sets that tune the same
    pipeline the same way share its study."""
    what = {k: v for k, v in spec.resolved().items() if k != "tracking"}
    what["search"] = {k: v for k, v in what["search"].items() if k not in ("trials", "study")}
    return check_name("study", f"{pipeline[:100]}.tune.{_digest(what, 8)}")
