"""Pipeline YAML -> typed PipelineSpec: Hydra compose of configs/ groups, the user's file and overrides,
then pydantic validation. Components are chosen by registry names; nothing named in a user's file is
imported or instantiated.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from fedpilot.data import DatasetSpec
from fedpilot.engine.config import StageConfig
from fedpilot.errors import SpecError, from_validation
from fedpilot.models import PRESETS, check_model


def configs_dir() -> Path:
    """The configs/ tree: $FEDPILOT_CONFIGS, the copy inside an installed wheel, or the checkout's."""
    if os.environ.get("FEDPILOT_CONFIGS"):
        return Path(os.environ["FEDPILOT_CONFIGS"]).resolve()
    packaged = Path(str(resources.files("fedpilot"))) / "configs"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[2] / "configs"


def compose_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The pipeline file composed with its `defaults` groups from configs/ and dotted `overrides`."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError("pipeline", str(path), "no such file")
    if path.suffix not in {".yaml", ".yml"}:
        raise SpecError("pipeline", str(path), "a pipeline is a .yaml file")
    _check_yaml(path)
    search = f"hydra.searchpath=[file://{configs_dir()}]"
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
            cfg = compose(config_name=path.stem, overrides=[search, *map(_add_or_override, overrides)])
        composed = OmegaConf.to_container(cfg, resolve=True)
    except (HydraException, OmegaConfBaseException) as err:
        raise _compose_error(err, path, overrides) from None
    if not isinstance(composed, dict):
        raise SpecError("pipeline", str(path), "a pipeline is a mapping of keys to values")
    return composed


def _add_or_override(override: str) -> str:
    """`key=value` sets the key whether or not the file has it (Hydra's `++`): the schema check that follows
    rejects unknown keys with a better message than Hydra's. Group choices (`dataset=femnist`) and overrides
    with Hydra's own prefixes (`+`, `~`) pass unchanged."""
    key = override.split("=", 1)[0]
    if key.startswith(("+", "~")) or "=" not in override or (configs_dir() / key).is_dir():
        return override
    return f"++{override}"


def _check_yaml(path: Path) -> None:
    """A clear error for a YAML syntax error, with the line and column."""
    try:
        OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and OmegaConf's wrappers
        raise SpecError("pipeline", str(path), f"not valid YAML: {_first_line(err)}") from None


def _compose_error(err: Exception, path: Path, overrides: list[str] | tuple[str, ...]) -> SpecError:
    """Hydra's error as a SpecError; an override that cannot be applied names its key and why."""
    text = str(err)
    for override in overrides:
        key, _, value = override.partition("=")
        if f"override ++{override}" in text or f"override '{key}'" in text:
            reason = _first_line(err.__cause__) if err.__cause__ else text
            return SpecError(key.lstrip("+~"), value, f"cannot be set: {reason}")
    return SpecError("pipeline", str(path), _first_line(err))


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(BaseModel):
    """A registered model name (fedpilot.models.MODELS) and its options, e.g. {name: mlp, hidden: [200]}."""

    model_config = ConfigDict(extra="allow")
    name: str

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _registered(self) -> ModelSpec:
        check_model(self.name, self.options)
        return self


class PersonalizationSpec(Strict):
    """Which parameters are personal: a ParamSplit preset or a list of name regexes (a bare value is `split`)."""

    split: str | list[str] = "none"
    adapter_dim: int = Field(16, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, value: Any) -> Any:
        return {"split": value} if isinstance(value, str | list) else value

    @field_validator("split")
    @classmethod
    def _preset(cls, split: str | list[str]) -> str | list[str]:
        if isinstance(split, str) and split not in PRESETS:
            raise SpecError("personalization", split, "unknown preset (or give a list of name regexes)",
                            allowed=PRESETS)
        return split


class StageSpec(StageConfig):
    """One stage: a registered algorithm with its `params`, plus the engine settings of StageConfig.

    `personalization` overrides the pipeline's for this stage; `eval_every` defaults to `evaluation.every`.
    """

    name: str | None = None
    algorithm: str
    params: dict[str, Any] = Field(default_factory=dict)
    personalization: PersonalizationSpec | None = None
    eval_every: int | None = Field(None, ge=1)

    def engine_config(self, eval_every: int) -> StageConfig:
        fields = self.model_dump(include=set(StageConfig.model_fields))
        return StageConfig.model_validate({**fields, "eval_every": self.eval_every or eval_every})


class EvaluationSpec(Strict):
    """Every client is evaluated on its val split every `every` rounds, and on val and test at each stage's end."""

    every: int = Field(10, ge=1)


class TrackingSpec(Strict):
    """MLflow: the experiment (default: the pipeline name) and the store URI ($MLFLOW_TRACKING_URI wins over
    `uri`; default sqlite:///mlflow.db); system metrics (CPU, memory, GPU) sampled during the run; plots."""

    experiment: str | None = None
    uri: str | None = None
    system_metrics: bool = True
    plots: bool = True


OBJECTIVE_METRICS = [
    *(f"val_acc_{stat}" for stat in ("mean", "weighted", "std", "min", "p10", "p25", "p50", "p75", "p90", "max",
                                     "frac_better", "frac_worse")),
    "shared_bytes", "personal_bytes_per_client", "personal_bank_bytes", "comm_bytes_per_round", "peak_memory_bytes",
]


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
        return self


class Objective(Strict):
    """A recorded metric of one stage (default: the last) to optimize; validation or footprint, never test."""

    metric: str
    stage: int | str = -1
    direction: Literal["maximize", "minimize"] = "maximize"

    @field_validator("metric")
    @classmethod
    def _recorded(cls, metric: str) -> str:
        if metric.startswith("test_"):
            raise ValueError("searches never optimize test metrics; use the validation split (val_...)")
        if metric not in OBJECTIVE_METRICS:
            raise SpecError("search.objective.metric", metric, "not a recorded stage metric", OBJECTIVE_METRICS)
        return metric


class SamplerSpec(Strict):
    kind: Literal["tpe", "random", "nsga2"] = "tpe"
    seed: int = 0


class PrunerSpec(Strict):
    """Pruning from the engine's intermediate evaluations (single-objective searches only)."""

    kind: Literal["median", "hyperband", "none"] = "median"
    startup_trials: int = Field(2, ge=0)
    warmup_rounds: int = Field(0, ge=0)


class SearchSpec(Strict):
    """A pipeline's `search:` block: the space over spec keys, the objective(s), the budget, sampler and pruner."""

    study: str | None = None
    space: dict[str, Param] = Field(min_length=1)
    objective: list[Objective] = Field(min_length=1)
    trials: int = Field(20, ge=1)
    timeout_s: float | None = Field(None, gt=0)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)

    @model_validator(mode="before")
    @classmethod
    def _one_objective(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("objective"), dict):
            return {**value, "objective": [value["objective"]]}
        return value


class PipelineSpec(Strict):
    """A whole pipeline: data, model, personalization, ordered stages, seed, evaluation, tracking."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int = Field(1, ge=1)  # > 1: Lightning DDP, each round's cohort split across that many GPUs (or CPU processes)
    dataset: DatasetSpec
    model: ModelSpec
    personalization: PersonalizationSpec = Field(default_factory=PersonalizationSpec)
    stages: list[StageSpec] = Field(min_length=1)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    search: SearchSpec | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PipelineSpec:
        """Validate a composed pipeline; algorithm params are merged over configs/algorithm/NAME.yaml and checked."""
        try:
            spec = cls.model_validate(raw)
        except ValidationError as err:
            raise from_validation(err, cls) from None
        names = [stage.name or stage.algorithm for stage in spec.stages]
        for i, stage in enumerate(spec.stages):
            stage.name = names[i]
            if names.index(names[i]) != i:
                raise SpecError(f"stages.{i}.name", names[i], "two stages have this name; give each a unique name")
            stage.params = _algorithm_params(stage.algorithm, stage.params, f"stages.{i}")
        if spec.search is not None:
            spec.search.study = spec.search.study or spec.name
            _check_search(spec)
        return spec

    def resolved(self) -> dict[str, Any]:
        """The spec as plain data, every default filled in (what `fedpilot validate` prints and runs record)."""
        data = self.model_dump(mode="json")
        first = ("name", "algorithm", "params")
        data["stages"] = [{**{k: s[k] for k in first}, **{k: v for k, v in s.items() if k not in first}}
                          for s in data["stages"]]
        return data


def _algorithm_params(name: str, params: dict[str, Any], key: str) -> dict[str, Any]:
    """The algorithm's defaults from configs/algorithm/NAME.yaml overlaid with `params`, validated."""
    from fedpilot.algorithms import ALGORITHMS

    if name not in ALGORITHMS:
        raise SpecError(f"{key}.algorithm", name, "unknown algorithm", allowed=sorted(ALGORITHMS))
    defaults_file = configs_dir() / "algorithm" / f"{name}.yaml"
    defaults = OmegaConf.to_container(OmegaConf.load(defaults_file)) if defaults_file.is_file() else {}
    params_cls = ALGORITHMS[name].Params
    try:
        return params_cls.model_validate({**(defaults or {}), **params}).model_dump(mode="json")
    except ValidationError as err:
        raise from_validation(err, params_cls, f"{key}.params") from None


def with_values(spec: PipelineSpec, values: dict[str, Any]) -> PipelineSpec:
    """The pipeline with dotted `values` set (a search trial), validated like the original."""
    config = OmegaConf.create(spec.resolved())
    for key, value in values.items():
        OmegaConf.update(config, key, value, merge=True)
    return PipelineSpec.from_dict(OmegaConf.to_container(config))


def _check_search(spec: PipelineSpec) -> None:
    """Every space key names an existing spec key and both ends / every choice give a valid pipeline; objectives
    name existing stages."""
    search = spec.search
    config = OmegaConf.create(spec.resolved())
    for key, param in search.space.items():
        if key.startswith("search") or OmegaConf.select(config, key, default="<missing>") == "<missing>":
            parent, _, leaf = key.rpartition(".")
            here = OmegaConf.select(config, parent) if parent else config
            allowed = list(here.keys()) if OmegaConf.is_dict(here) else None
            raise SpecError(f"search.space.{key}", leaf, "not a key of the pipeline", allowed)
        for value in param.choices if param.type == "categorical" else [param.low, param.high]:
            value = int(value) if param.type == "int" else value
            try:
                with_values(spec.model_copy(update={"search": None}), {key: value})
            except SpecError as err:
                raise SpecError(f"search.space.{key}", value, f"gives an invalid pipeline: {err}") from None
    names = [s.name for s in spec.stages]
    for i, objective in enumerate(search.objective):
        stage = objective.stage
        if (isinstance(stage, int) and not -len(names) <= stage < len(names)) or (
                isinstance(stage, str) and stage not in names):
            raise SpecError(f"search.objective.{i}.stage", stage, "no such stage", allowed=names)


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineSpec:
    """Compose and validate a pipeline file: the one entry point of `fedpilot validate/run/search`."""
    return PipelineSpec.from_dict(compose_pipeline(path, overrides))
