"""A comparison set file and the plan it stands for: every (pipeline, seed) spec as `fedpilot run` would run it,
and with `tune:` each pipeline's study (its space, objective and tuning seeds), all checked before anything runs.

A tuned comparison is leak-free by construction: every run of a pipeline, tuning and comparison seeds alike, trains
on one federation (`tune.splits: fixed`, dataset.seed fixed where the set left it unset) or on federations whose
test samples are never a tuning seed's train or val samples (`train_val`; `redraw` is checked before any work,
compare/federation.py); each pipeline is tuned over its algorithms' declared spaces (`auto`) unless the set writes
one; and a study is shared only by plans that would run the very same trials (`study_name`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from fedpilot.errors import SpecError, from_validation, within
from fedpilot.metric_names import OBJECTIVE_METRICS, primary
from fedpilot.names import check_name
from fedpilot.schema import SEED_MAX, Seed, Strict
from fedpilot.settings import SQL_INT_MAX
from fedpilot.spec import (
    Param,
    PipelineSpec,
    PrunerSpec,
    SamplerSpec,
    load_pipeline_at_seeds,
    read_user_yaml,
    with_values,
    written_values,
)
from fedpilot.spec.search_spec import check_batch

MAX_SEEDS = 1000  # every seed runs each pipeline of the set, all checked before the first runs: more is a typo
MAX_EDGE_TRIALS = 20  # further trials a study spends beyond one edge of a range: more would be another search
TUNED, WRITTEN = "tuned", "written"  # a pipeline run's variant: at its study's choice, or as its file gives it
FEDERATION_SEED = 0  # the dataset.seed a tuned comparison fixes where the set leaves it unset


class TuneSpec(Strict):
    """A set's `tune:` block (`fedpilot compare --tune N` sets `trials`): each pipeline's study of `trials` finished
    trials (`budget: per_method`; `per_dimension`: `trials` per tuned dimension), on the validation `objective`
    (default: the mean over clients of the task's primary metric) of the tuning `seeds` (default: the one seed after
    the comparison's), with Optuna's `sampler` and `pruner`.

    space: per pipeline name, a written space (spec keys -> ranges) instead of its algorithms' declared ones (`auto`);
    a range that excludes the pipeline's written value is widened to include it (trial 0 is the pipeline as written)
    unless `widen: false`, which refuses it. tune_budget: also search what changes a client's work or model size.
    edge_trials: further trials a study spends beyond an edge of a range its best value lies near. batch: how many
    of a wave's trials one computation spans (its search's `batch`; `auto`, the default: as the executor times).
    splits: `fixed` (one federation for every seed), `train_val` (clients and test samples fixed, train / val re-cut
    per seed) or `redraw` (every seed its own federation, refused when a comparison seed's test samples were a tuning
    seed's train or val samples). untuned: also run each pipeline as written on the comparison's seeds (default vs
    tuned)."""

    trials: int = Field(ge=1, le=SQL_INT_MAX)
    objective: str | None = None
    seeds: list[Seed] | None = Field(None, min_length=1, max_length=MAX_SEEDS)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    space: dict[str, dict[str, Param]] | None = None
    widen: bool = True
    tune_budget: bool = False
    budget: Literal["per_method", "per_dimension"] = "per_method"
    edge_trials: int = Field(2, ge=0, le=MAX_EDGE_TRIALS)
    batch: int | Literal["auto"] = "auto"
    splits: Literal["fixed", "train_val", "redraw"] = "fixed"
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

    @field_validator("batch", mode="before")
    @classmethod
    def _some_trials(cls, batch: Any) -> Any:
        return check_batch(batch)


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

    def noise_seeds(self) -> list[int]:
        """The seeds trial 0 of every study trains on to measure the objective's noise between seeds (what the
        pruner's margin is made of): the tuning seeds, and with only one, the seed after every seed of the set."""
        seeds = self.tuning_seeds()
        return seeds if len(seeds) > 1 else [*seeds, max(seeds + self.seed_list()) + 1]


@dataclass
class Plan:
    """Everything a comparison runs: the set, every (pipeline, seed) spec as written, and with tuning each pipeline's
    tuning spec (its `search` block filled in: space, objective, trials, study) at the first tuning seed."""

    comparison: ComparisonSpec
    specs: dict[str, dict[int, PipelineSpec]]
    tuning: dict[str, PipelineSpec]
    shared: int  # leading stages every pipeline of the set shares (trained once per seed, never tuned)
    fixed: list[str]  # the pipelines whose dataset.seed the comparison fixed (the set left it unset)

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
        return {"set": self.comparison.model_dump(mode="json"), "shared": self.shared, "fixed": self.fixed,
                "specs": {name: {str(seed): spec.resolved() for seed, spec in by_seed.items()}
                          for name, by_seed in self.specs.items()},
                "tuning": {name: spec.resolved() for name, spec in self.tuning.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        return cls(ComparisonSpec.model_validate(data["set"]),
                   {name: {int(seed): PipelineSpec.from_dict(spec) for seed, spec in by_seed.items()}
                    for name, by_seed in data["specs"].items()},
                   {name: PipelineSpec.from_dict(spec) for name, spec in data["tuning"].items()}, data["shared"],
                   data.get("fixed", []))

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
    fixed = _fix_federations(comparison, specs) if comparison.tune else []
    first = comparison.seed_list()[0]
    shared = shared_stages([by_seed[first] for by_seed in specs.values()])
    tuning = _tuning_specs(comparison, specs, shared) if comparison.tune else {}
    return Plan(comparison, specs, tuning, shared, fixed)


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
    if max(comparison.noise_seeds()) > SEED_MAX:
        key, value = ("tune.seeds", comparison.tune.seeds) if comparison.tune.seeds else ("seeds", comparison.seeds)
        raise SpecError(key, value, f"leave no seed after them for the noise run of trial 0 (seeds go up to "
                        f"{SEED_MAX}): use smaller seeds")


def _fix_federations(comparison: ComparisonSpec, specs: dict[str, dict[int, PipelineSpec]]) -> list[str]:
    """The tuned comparison's federation rule applied to every (pipeline, seed) spec in place: `fixed` and
    `train_val` set dataset.seed where the set left it unset (and `train_val` split.redraw); the pipelines fixed."""
    splits, fixed = comparison.tune.splits, []
    for name, by_seed in specs.items():
        unset = next(iter(by_seed.values())).dataset.seed is None
        if splits == "redraw" or (not unset and splits == "fixed"):
            continue
        values = {"dataset.seed": FEDERATION_SEED} if unset else {}
        values |= {"dataset.split.redraw": True} if splits == "train_val" else {}
        for seed, spec in by_seed.items():
            by_seed[seed] = with_values(spec, values)
        fixed += [name] if unset else []
    return fixed


def _pipeline_specs(path: Path, comparison: ComparisonSpec, overrides: list[str]) -> dict[str, dict[int, PipelineSpec]]:
    """Each pipeline file's spec at each seed, by pipeline name (two pipelines with one name are an error)."""
    extra = [*comparison.overrides, *overrides, f"tracking.experiment={comparison.name}"]
    specs: dict[str, dict[int, PipelineSpec]] = {}
    for i, relative in enumerate(comparison.pipelines):
        file = path.parent / relative
        if not file.is_file():
            raise SpecError(f"pipelines.{i}", relative, f"no such file (relative to {path.parent})")
        runs = load_pipeline_at_seeds(file, extra, comparison.seed_list())
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
    """Each pipeline's spec at the first tuning seed with its study's `search` block: the set's written space for
    it (tune.space), else `space: auto` over the stages after the shared ones (a pipeline's own `search:` is for
    `fedpilot search`); the set's objective, trials, sampler and pruner."""
    tune, seed = comparison.tune, comparison.tuning_seeds()[0]
    unknown = sorted(set(tune.space or {}) - set(specs))
    if unknown:
        raise SpecError(f"tune.space.{unknown[0]}", unknown[0], "not the name of a pipeline of the set",
                        allowed=list(specs))
    tuning = {}
    for i, (name, by_seed) in enumerate(specs.items()):
        written = next(iter(by_seed.values()))
        space = (tune.space or {}).get(name)
        stages = list(range(shared, len(written.stages)))
        if space is None and not stages:
            raise SpecError(f"pipelines.{i}", comparison.pipelines[i], f"every stage of {name} is shared with the "
                            "other pipelines: nothing of it to tune")
        search = {"space": "auto", "stages": stages, "tune_budget": tune.tune_budget} if space is None else {
            "space": {k: p.model_dump(exclude_none=True) for k, p in space.items()}}
        search |= {"objective": tune.objective or f"val_{primary(written.dataset.task)}_mean", "trials": 1,
                   "edge_trials": tune.edge_trials, "sampler": tune.sampler.model_dump(),
                   "pruner": tune.pruner.model_dump(), "batch": tune.batch}
        spec = _tuning_spec({**written.resolved(), "seed": seed, "search": search}, comparison, i,
                            "" if space is None else f"tune.space.{name}.")
        if space is not None:
            spec.search.space = _around_written(spec, tune.widen, f"tune.space.{name}")
        dimensions = len(spec.search.space)
        spec.search.trials = tune.trials * (dimensions if tune.budget == "per_dimension" else 1)
        spec.search.study = study_name(name, spec, comparison.tuning_seeds())
        tuning[name] = spec
    return tuning


def _tuning_spec(raw: dict[str, Any], comparison: ComparisonSpec, i: int, prefix: str) -> PipelineSpec:
    """Pipeline i's tuning spec, its errors named by where the set gives what failed (`tuning_error`)."""
    try:
        return PipelineSpec.from_dict(raw)
    except SpecError as err:
        raise tuning_error(comparison, i, err, prefix) from None


def tuning_error(comparison: ComparisonSpec, i: int, err: SpecError, prefix: str = "") -> SpecError:
    """An error of pipeline i's tuning spec on the key the user wrote: a written space's keys are the set's
    `tune.space.<pipeline>.` (`prefix`), what the set's `tune:` block gives the study (its objective, tune_budget) is
    that block's key, anything else the pipeline file's."""
    where = f"pipelines.{i} ({comparison.pipelines[i]})"
    if prefix and err.key.startswith("search.space."):
        return SpecError(err.key.replace("search.space.", prefix, 1), err.value, err.problem, err.allowed)
    if err.key.startswith("search.objective"):
        return SpecError("tune.objective", err.value, f"{where}: {err.problem}", err.allowed)
    if "search.tune_budget" in err.problem:
        return SpecError("tune.tune_budget", comparison.tune.tune_budget, f"{where}: " + err.problem.replace(
            "set search.tune_budget: true, or write the space", "set tune.tune_budget: true in the set"))
    return SpecError(f"{where}: {err.key}", err.value, err.problem, err.allowed)


def _around_written(spec: PipelineSpec, widen: bool, key: str) -> dict[str, Param]:
    """A written space whose every range holds the value the pipeline gives its key (trial 0 is the pipeline as
    written): widened to it, or with `widen` off refused."""
    written, space = written_values(spec, inside=False), dict(spec.search.space)
    for name, param in space.items():
        value = written.get(name)
        if value is None or param.type == "categorical" and value in param.choices or \
                param.type != "categorical" and param.low <= value <= param.high:
            continue
        if not widen:
            raise SpecError(f"{key}.{name}", param.model_dump(exclude_none=True), f"leaves out the pipeline's "
                            f"value {value!r}, which trial 0 runs: include it, or drop tune.widen: false")
        space[name] = param.model_copy(update={"choices": [*param.choices, value]} if param.type == "categorical"
                                       else {"low": min(param.low, value), "high": max(param.high, value)})
    return space


def study_name(pipeline: str, spec: PipelineSpec, seeds: list[int]) -> str:
    """The study of one pipeline's tuning, named by the pipeline and a hash of everything that decides its trials:
    the tuning spec (pipeline, space, objective, budget, sampler, pruner), every tuning seed and the federation's
    fingerprint (its data, partition and split, and the data code). Two sets share a study only when it would
    run the very same trials."""
    from fedpilot.data.federated import fingerprint

    what = {k: v for k, v in spec.resolved().items() if k != "tracking"}
    what["search"] = {k: v for k, v in what["search"].items() if k not in ("study", "batch")}  # batch: how, not what
    redrawn = spec.dataset.split.redraw or spec.dataset.seed is None  # a seed's own train/val, or federation
    what |= {"seeds": seeds, "federations": [fingerprint(spec.dataset, spec.dataset.seed if spec.dataset.seed is not
                                                         None else seed, seed if spec.dataset.split.redraw else None)
                                             for seed in (seeds if redrawn else seeds[:1])]}
    return check_name("study", f"{pipeline[:100]}.tune.{_digest(what, 8)}")
