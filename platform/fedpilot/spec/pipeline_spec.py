"""The pipeline schema: a composed pipeline -> typed, validated PipelineSpec (model, personalization, stages,
evaluation, tracking, search, slurm), every number within the engine's types; a search trial's values set on it.
Components are chosen by registry names; nothing named in a user's file is imported or instantiated.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from fedpilot.data.config import DatasetSpec
from fedpilot.engine.config import StageConfig
from fedpilot.errors import SpecError, check_finite, from_validation
from fedpilot.jobs.slurm_options import SlurmSpec
from fedpilot.metric_names import recorded_metrics
from fedpilot.models.options import PRESETS, validated_options
from fedpilot.names import check_name
from fedpilot.schema import Seed, Strict
from fedpilot.settings import tracking_scheme
from fedpilot.spec.search_spec import Param, SearchSpec

# The types the numbers of a pipeline end up in: the engine computes in float32 (a larger factor, such as an lr or a
# weight decay, fails inside torch), and torch's counts and sizes, numpy's and SQL's integers are 64-bit.
FLOAT32_MAX = 3.4028234663852886e38
INT64 = (-(2**63), 2**63 - 1)


def check_numbers(value: Any, key: str = "") -> None:
    """Every number anywhere in `value` is finite (check_finite) and, outside the dataset (numpy takes its numbers in
    float64, and its keys have their own bounds), fits the engine's types: a float within float32's range, an integer
    within int64's; else a SpecError naming its dotted key path (lists by index)."""
    if isinstance(value, dict | list | tuple):
        for part, item in value.items() if isinstance(value, dict) else enumerate(value):
            check_numbers(item, f"{key}.{part}" if key else str(part))
        return
    check_finite(value, key)
    if key.split(".", 1)[0] == "dataset":
        return
    if isinstance(value, float) and abs(value) > FLOAT32_MAX:
        raise SpecError(key or "value", value, f"past float32's largest number ({FLOAT32_MAX:.6g}), which the engine "
                        "computes in")
    if isinstance(value, int) and not INT64[0] <= value <= INT64[1]:
        raise SpecError(key or "value", value, "past a 64-bit integer, which torch's sizes and counts are")


class ModelSpec(BaseModel):
    """A registered model name (fedpilot.models.MODELS) and its options, e.g. {name: mlp, hidden: [200]}: a built-in's
    checked by its schema (fedpilot.models.options, no torch), a plugin's by its builder's annotations."""

    model_config = ConfigDict(extra="allow")
    name: str

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.model_extra or {})

    @model_validator(mode="after")
    def _registered(self) -> ModelSpec:
        for key, value in validated_options(self.name, self.options).items():
            setattr(self, key, value)
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

    `personalization` overrides the pipeline's for this stage; `eval_every` and `eval_clients` default to
    `evaluation.every` and `evaluation.clients`.
    """

    name: str | None = None
    algorithm: str
    params: dict[str, Any] = Field(default_factory=dict)
    personalization: PersonalizationSpec | None = None
    eval_every: int | None = Field(None, ge=1)

    def engine_config(self, evaluation: EvaluationSpec) -> StageConfig:
        fields = self.model_dump(include=set(StageConfig.model_fields))
        return StageConfig.model_validate({**fields, "eval_every": self.eval_every or evaluation.every,
                                           "eval_clients": self.eval_clients or evaluation.clients})


class EvaluationSpec(Strict):
    """Clients are evaluated on their val split every `every` rounds (all of them, or with `clients` a sample of
    that many drawn with the pipeline's seed, the same sample at each evaluation of a stage), and every client on
    val and test at each stage's end.

    `novel_clients` (a count, or a fraction of the federation in (0, 1)) holds that many clients, drawn with the
    pipeline's seed, out of every round of every stage; each stage's end evaluates them with the global model and
    after a newcomer's adaptation (Chen et al., ICML 2023, novel clients). `select: val` lets each client keep, at the
    pipeline's end, whichever of the global and its personalized model scores better on its val split (Pillutla et
    al., ICML 2022, Sec. C.3: decide per device)."""

    every: int = Field(10, ge=1)
    clients: int | None = Field(None, ge=1)
    novel_clients: int | float | None = None
    select: Literal["val"] | None = None

    @field_validator("novel_clients", mode="before")
    @classmethod
    def _a_count_or_a_fraction(cls, value: Any) -> int | float | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ValueError("a number of clients, or a fraction of the federation in (0, 1)")
        if isinstance(value, float) and not 0 < value < 1:
            raise ValueError("a fraction of the federation in (0, 1), or a number of clients")
        if isinstance(value, int) and value < 1:
            raise ValueError("at least 1 client (or a fraction of the federation in (0, 1))")
        return value

    def novel_count(self, n_clients: int) -> int:
        """How many of `n_clients` are held out (0 without `novel_clients`; a fraction rounds, to at least 1)."""
        value = self.novel_clients
        if value is None:
            return 0
        return value if isinstance(value, int) else max(1, round(value * n_clients))


class TrackingSpec(Strict):
    """MLflow: the experiment (default: the pipeline name) and the store URI ($MLFLOW_TRACKING_URI wins over
    `uri`; default sqlite:///mlflow.db); system metrics (CPU, memory, GPU) sampled during the run; plots."""

    experiment: str | None = None
    uri: str | None = None
    system_metrics: bool = True
    plots: bool = True

    @field_validator("experiment")
    @classmethod
    def _named(cls, experiment: str | None) -> str | None:
        return experiment if experiment is None else check_name("tracking.experiment", experiment)

    @field_validator("uri")
    @classmethod
    def _openable(cls, uri: str | None) -> str | None:
        if uri is not None:
            tracking_scheme("tracking.uri", uri)  # the rest (its folder, driver, server) is checked where it is used
        return uri


class PipelineSpec(Strict):
    """A whole pipeline: data, model, personalization, ordered stages, seed (0 to SEED_MAX: what numpy, scikit-learn
    and torch take), evaluation, tracking."""

    name: str
    seed: Seed = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # > 1: Lightning DDP, each round's cohort split across that many GPUs (or CPU processes)
    devices: int = Field(1, ge=1)
    nodes: int = Field(1, ge=1)  # > 1: that many Slurm nodes with `devices` processes each (fedpilot submit --to slurm)
    dataset: DatasetSpec
    model: ModelSpec
    personalization: PersonalizationSpec = Field(default_factory=PersonalizationSpec)
    stages: list[StageSpec] = Field(min_length=1)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    search: SearchSpec | None = None
    slurm: SlurmSpec | None = None

    @field_validator("name")
    @classmethod
    def _named(cls, name: str) -> str:
        return check_name("name", name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PipelineSpec:
        """Validate a composed pipeline; algorithm params are checked and completed by the algorithm's Params.
        Stage names follow the one name pattern, personalization regexes compile, every number is finite and fits
        the engine's types (check_numbers)."""
        check_numbers(raw)
        try:
            spec = cls.model_validate(raw)
        except ValidationError as err:
            raise from_validation(err, cls) from None
        check_numbers(spec.model_dump())  # also values pydantic parsed from strings such as "inf"
        _check_regexes(spec.personalization, "personalization")
        for i, stage in enumerate(spec.stages):
            stage.params = _algorithm_params(stage.algorithm, stage.params, f"stages.{i}")
            stage.name = check_name(f"stages.{i}.name", stage.name or stage.algorithm)
            if stage.name in [s.name for s in spec.stages[:i]]:
                raise SpecError(f"stages.{i}.name", stage.name, "two stages have this name; give each a unique name")
            if stage.personalization is not None:
                _check_regexes(stage.personalization, f"stages.{i}.personalization")
        if spec.search is not None:
            spec.search.study = spec.search.study or spec.name
            if spec.search.space == "auto":
                spec.search.space, spec.search.auto = auto_space(spec), True
            _check_search(spec)
        return spec

    def resolved(self) -> dict[str, Any]:
        """The spec as plain data, every default filled in (what `fedpilot validate` prints and runs record)."""
        data = self.model_dump(mode="json")
        first = ("name", "algorithm", "params")
        data["stages"] = [{**{k: s[k] for k in first}, **{k: v for k, v in s.items() if k not in first}}
                          for s in data["stages"]]
        return data


class SeedSpec(Strict):
    """A pipeline's `seed` alone (`fedpilot data describe` builds the dataset without validating the rest)."""

    seed: Seed = 0


def pipeline_seed(composed: dict[str, Any]) -> int:
    """The `seed` of a composed pipeline, validated as PipelineSpec validates it."""
    try:
        return SeedSpec.model_validate({"seed": composed.get("seed", 0)}).seed
    except ValidationError as err:
        raise from_validation(err, SeedSpec) from None


def _check_regexes(personalization: PersonalizationSpec, key: str) -> None:
    """Every name regex of a personalization list compiles."""
    for pattern in personalization.split if isinstance(personalization.split, list) else []:
        try:
            re.compile(pattern)
        except re.error as err:
            raise SpecError(key, pattern, f"not a valid regular expression: {err}") from None


def _algorithm_params(name: str, params: dict[str, Any], key: str) -> dict[str, Any]:
    """`params` validated by the algorithm's Params (whose fields hold the defaults), every default filled in."""
    from fedpilot.algorithms import ALGORITHMS

    params_cls = ALGORITHMS.get_checked(name, f"{key}.algorithm").Params
    try:
        validated = params_cls.model_validate(params)
    except ValidationError as err:
        raise from_validation(err, params_cls, f"{key}.params") from None
    check_numbers(validated.model_dump(), f"{key}.params")
    return validated.model_dump(mode="json")


def with_values(spec: PipelineSpec, values: dict[str, Any]) -> PipelineSpec:
    """The pipeline with dotted `values` set (a search trial), validated like the original; its `search` block is the
    original's, checked with it (a search's trials set the keys it searches, so checking it again per trial would
    only repeat that work)."""
    raw = spec.resolved()
    raw.pop("search", None)
    for key, value in values.items():
        set_dotted(raw, key, value)
    changed = PipelineSpec.from_dict(raw)
    changed.search = None if spec.search is None else spec.search.model_copy(deep=True)
    return changed


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """Set `value` at the dotted `key` of plain data, as OmegaConf.update(merge=True) would: list items by index, a
    missing or null mapping created on the way, a mapping value merged into the mapping there."""
    node: Any = data
    *path, leaf = key.split(".")
    for part in path:
        if isinstance(node, list):
            node = node[int(part)]
            continue
        if not isinstance(node.get(part), dict | list):
            node[part] = {}
        node = node[part]
    if isinstance(value, dict) and isinstance(node, dict) and isinstance(node.get(leaf), dict):
        for inner, item in value.items():
            set_dotted(node[leaf], inner, item)
    elif isinstance(node, list):
        node[int(leaf)] = value
    else:
        node[leaf] = value


def stage_index(spec: PipelineSpec, stage: int | str, key: str) -> int:
    """The index of a stage named by index (negative from the end) or by name, else a SpecError on `key`."""
    names = [s.name for s in spec.stages]
    if isinstance(stage, int) and -len(names) <= stage < len(names):
        return stage % len(names)
    if isinstance(stage, str) and stage in names:
        return names.index(stage)
    raise SpecError(key, stage, "no such stage", allowed=names)


def auto_space(spec: PipelineSpec) -> dict[str, Param]:
    """What `search.space: auto` stands for: the hyperparameters the algorithms of `search.stages` (default: every
    stage) declare tunable, each over its declared range around the pipeline's value; budgets only with
    `search.tune_budget`."""
    from fedpilot.algorithms import ALGORITHMS

    search, config = spec.search, OmegaConf.create(spec.resolved())
    chosen = range(len(spec.stages)) if search.stages is None else sorted(
        {stage_index(spec, stage, f"search.stages.{i}") for i, stage in enumerate(search.stages)})
    space: dict[str, Param] = {}
    for i in chosen:
        stage = spec.stages[i]
        declared = ALGORITHMS.get_checked(stage.algorithm, f"stages.{i}.algorithm").tunable
        if not declared:
            raise SpecError(f"stages.{i}.algorithm", stage.algorithm, "declares nothing tunable (its `tunable`), so "
                            "`search.space: auto` cannot search this stage: write the space, or leave the stage out "
                            "of search.stages")
        for key, tunable in declared.items():
            if tunable.budget and not search.tune_budget:
                continue
            value = OmegaConf.select(config, f"stages.{i}.{key}")
            if value is None and tunable.fallback:
                value = OmegaConf.select(config, f"stages.{i}.{tunable.fallback}")
            if value is None and tunable.around:
                raise SpecError(f"stages.{i}.{key}", None, f"is null, and {stage.algorithm}'s declared range is "
                                "around the pipeline's value: give it a value, or write the space")
            space[f"stages.{i}.{key}"] = Param.model_validate(tunable.dimension(value))
    if not space:
        raise SpecError("search.space", "auto", "the searched stages declare only budgets (local steps, model size) "
                        "as tunable: set search.tune_budget: true, or write the space")
    return space


def written_values(spec: PipelineSpec, inside: bool = True) -> dict[str, Any]:
    """The value the pipeline gives each key of its search space (a null one: the value its algorithm's declared
    fallback gives, as the stage uses it), where it lies in the space (`inside`; else every one found): what trial 0
    of a comparison's study runs."""
    from fedpilot.algorithms import ALGORITHMS

    config, values = OmegaConf.create(spec.resolved()), {}
    for key, param in spec.search.space.items():
        value = OmegaConf.select(config, key)
        parts = key.split(".")
        if value is None and parts[0] == "stages" and len(parts) == 4 and parts[1].isdigit():
            declared = ALGORITHMS[spec.stages[int(parts[1])].algorithm].tunable.get(".".join(parts[2:]))
            if declared is not None and declared.fallback:
                value = OmegaConf.select(config, f"stages.{parts[1]}.{declared.fallback}")
        within = value in param.choices if param.type == "categorical" else (
            isinstance(value, int | float) and not isinstance(value, bool) and param.low <= value <= param.high)
        if value is not None and (within or not inside):
            values[key] = value
    return values


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
    for i, objective in enumerate(search.objective):
        stage_index(spec, objective.stage, f"search.objective.{i}.stage")
        recorded = recorded_metrics(spec.dataset.task, novel=spec.evaluation.novel_clients is not None)
        if objective.metric not in recorded:
            held_out = "" if spec.evaluation.novel_clients is not None else " (novel_* needs evaluation.novel_clients)"
            raise SpecError(f"search.objective.{i}.metric", objective.metric, f"not recorded by task "
                            f"{spec.dataset.task}{held_out}", allowed=recorded)
