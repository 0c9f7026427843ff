"""A pipeline's `search:` block: the space over spec keys, the objective(s) among the recorded validation metrics
and footprints (fedpilot.metric_names), the budget, Optuna's sampler and pruner."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedpilot.errors import SpecError
from fedpilot.metric_names import OBJECTIVE_METRICS, default_direction
from fedpilot.names import check_name
from fedpilot.schema import Seed, Strict
from fedpilot.settings import SQL_INT_MAX


def check_batch(batch: Any) -> Any:
    """A search's `batch`: a number of trials (1 to an SQL INTEGER's largest), or `auto` (what is neither a string
    nor a whole number is left to its type's check)."""
    wrong = batch != "auto" if isinstance(batch, str) else type(batch) is int and not 1 <= batch <= SQL_INT_MAX
    if wrong:
        raise ValueError(f"a number of trials from 1 to {SQL_INT_MAX}, or `auto`")
    return batch


class Param(Strict):
    """One dimension of a search space: float/int in [low, high] (optionally log-scaled, stepped) or categorical."""

    type: Literal["float", "int", "categorical"]
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = Field(None, gt=0)
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Param:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical parameter needs a non-empty `choices` list")
            return self
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} parameter needs `low` and `high`")
        if self.low > self.high:
            raise ValueError(f"low={self.low:g} > high={self.high:g}")
        if self.log and self.low <= 0:
            raise ValueError(f"log scale needs low > 0 (low={self.low:g})")
        if self.log and self.step is not None:
            raise ValueError("give `log` or `step`, not both")
        if self.type == "int" and not all(float(v).is_integer() for v in (self.low, self.high, self.step or 1)):
            raise ValueError("an int parameter's low, high and step are whole numbers")
        return self


class Objective(Strict):
    """A recorded metric of one stage (default: the last) to optimize; validation or footprint, never test."""

    metric: str
    stage: int | str = -1
    direction: Literal["maximize", "minimize"] | None = None  # default: default_direction(metric)

    @field_validator("metric")
    @classmethod
    def _recorded(cls, metric: str) -> str:
        if metric.startswith("test_"):
            raise ValueError("searches never optimize test metrics; use the validation split (val_...)")
        if metric not in OBJECTIVE_METRICS:
            raise SpecError("search.objective.metric", metric, "not a recorded stage metric", OBJECTIVE_METRICS)
        return metric

    @model_validator(mode="after")
    def _direction(self) -> Objective:
        self.direction = self.direction or default_direction(self.metric)
        return self


class SamplerSpec(Strict):
    """Optuna's sampler and its seed (at most SEED_MAX: Optuna's samplers seed numpy's RandomState)."""

    kind: Literal["tpe", "random", "nsga2"] = "tpe"
    seed: Seed = 0


class PrunerSpec(Strict):
    """Pruning from the engine's intermediate evaluations (single-objective searches only), with defaults a noisy
    early evaluation cannot fool: `auto` startup trials are a third of the study's (at least 2), `auto` warm-up
    rounds reach half of the searched stages' rounds, and an `auto` margin is twice the noise of an evaluation,
    estimated from the finished trials' curves (no pruning until it can be). `median` prunes a trial whose value is
    worse than the other finished trials' median at the same round by more than the margin; `hyperband` is Optuna's
    (its smallest budget the warm-up)."""

    kind: Literal["median", "hyperband", "none"] = "median"
    startup_trials: int | Literal["auto"] = "auto"
    warmup_rounds: int | Literal["auto"] = "auto"
    margin: float | Literal["auto"] = "auto"

    @field_validator("startup_trials", "warmup_rounds", "margin")
    @classmethod
    def _not_negative(cls, value: int | float | str) -> int | float | str:
        if value != "auto" and value < 0:
            raise ValueError("must be >= 0, or `auto`")
        return value


class SearchSpec(Strict):
    """A pipeline's `search:` block: the space over spec keys, the objective(s), the budget, sampler and pruner.

    `space: auto` searches what the algorithms of `stages` (default: every stage) declare tunable, over their
    declared ranges (a relative range around the pipeline's value); the hyperparameters that change what a client
    spends (local steps, model size) only with `tune_budget: true`. The pipeline's spec holds the space it expands to.
    `batch`: how many of a wave's trials one chunk's computation spans (tuning.py: a study's waves train their trials
    together; `auto`, the default: as many as the executor timed fastest batches; 1: each trial's rows on their own); it
    changes how fast the trials run, never which trials a study tries or what it finds.
    """

    study: str | None = None
    space: dict[str, Param] | Literal["auto"]
    stages: list[int | str] | None = Field(None, min_length=1)  # the stages `space: auto` tunes
    tune_budget: bool = False
    auto: bool = False  # set where `space: auto` was expanded (the spec holds the space it stands for)
    objective: list[Objective] = Field(min_length=1)
    trials: int = Field(20, ge=1, le=SQL_INT_MAX)  # a job's trials: an SQL INTEGER
    timeout_s: float | None = Field(None, gt=0)
    edge_trials: int = Field(0, ge=0, le=20)  # further trials beyond an edge the best value lies near (tuning.py)
    batch: int | Literal["auto"] = "auto"  # trials one chunk's computation spans (tuning.py): how, not what
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)

    @model_validator(mode="before")
    @classmethod
    def _one_objective(cls, value: Any) -> Any:
        objective = value.get("objective") if isinstance(value, dict) else None
        if isinstance(objective, str):  # a bare metric name
            objective = {"metric": objective}
        return {**value, "objective": [objective]} if isinstance(objective, dict) else value

    @field_validator("batch", mode="before")
    @classmethod
    def _some_trials(cls, batch: Any) -> Any:
        return check_batch(batch)

    @field_validator("study")
    @classmethod
    def _named(cls, study: str | None) -> str | None:
        return study if study is None else check_name("search.study", study)

    @field_validator("space", mode="before")
    @classmethod
    def _some_space(cls, space: Any) -> Any:
        if not isinstance(space, dict) and space != "auto" or space == {}:
            raise ValueError("give the keys to search with their ranges, or `auto`")
        return space

    @model_validator(mode="after")
    def _auto_options(self) -> SearchSpec:
        if isinstance(self.space, dict) and not self.auto and (self.stages is not None or self.tune_budget):
            given = "stages" if self.stages is not None else "tune_budget"
            raise SpecError(f"search.{given}", getattr(self, given), "applies to `space: auto` only; a written "
                            "space names its keys")
        return self
