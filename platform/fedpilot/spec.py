"""Pipeline YAML -> typed PipelineSpec: Hydra compose of configs/ groups, the user's file and overrides,
then pydantic validation. Components are chosen by registry names; nothing named in a user's file is
imported or instantiated.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf, grammar_parser
from omegaconf.errors import GrammarParseError, OmegaConfBaseException
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
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
from fedpilot.models.options import PRESETS, validated_options
from fedpilot.names import check_name
from fedpilot.schema import Seed, Strict
from fedpilot.settings import SQL_INT_MAX, configs_dir, tracking_scheme

# Limits on what a pipeline file and its overrides may be, checked before Hydra or OmegaConf touch them: a YAML
# alias bomb ("billion laughs") is a few hundred bytes that expands to billions of nodes, and OmegaConf builds
# every one of them (at a few thousand nodes per second). Real pipelines are a few KiB with a few hundred nodes,
# nested a few levels, so these leave ample room while bounding what composing a file can cost to seconds.
MAX_FILE_BYTES = 1 << 20  # 1 MiB: a larger file is refused before it is read
MAX_YAML_NODES = 10_000  # YAML nodes with every re-use of an alias counted (what loading the file builds)
MAX_YAML_DEPTH = 50  # nesting of mappings and lists (every check below walks the tree recursively)
MAX_OVERRIDES = 100  # overrides on one command line
MAX_OVERRIDE_CHARS = 1_000  # characters of one override (key=value)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML has it: the same YAML, faster
# The types the numbers of a pipeline end up in: the engine computes in float32 (a larger factor, such as an lr or a
# weight decay, fails inside torch), and torch's counts and sizes, numpy's and SQL's integers are 64-bit.
FLOAT32_MAX = 3.4028234663852886e38
INT64 = (-(2**63), 2**63 - 1)


def config_groups() -> dict[str, list[str]]:
    """Each config group of configs/ (a folder) and its choices (the stems of its .yaml files)."""
    return {folder.name: sorted(f.stem for f in folder.glob("*.yaml"))
            for folder in sorted(configs_dir().iterdir()) if folder.is_dir()}


def compose_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The pipeline file composed with its `defaults` groups from configs/ and dotted `overrides`.

    Before Hydra composes anything, the file and the overrides are checked (size and expansion limits, a mapping
    at the top, `defaults` naming files of configs/ groups, no resolver calls); after, every number is finite."""
    path = Path(path).resolve()
    if not path.is_file():
        raise SpecError("pipeline", str(path), "no such file")
    if path.suffix not in {".yaml", ".yml"}:
        raise SpecError("pipeline", str(path), "a pipeline is a .yaml file")
    groups = config_groups()
    user = read_user_yaml(path)
    check_user_yaml(user, groups)
    _check_omegaconf_yaml(path)
    check_overrides(overrides, groups)
    search = f"hydra.searchpath=[file://{configs_dir()}]"
    try:
        with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
            cfg = compose(config_name=path.stem,
                          overrides=[search, *(_add_or_override(o, groups) for o in overrides)])
    except (HydraException, OmegaConfBaseException, ValueError, TypeError, KeyError, IndexError) as err:
        # Hydra's own errors, and the plain ones it raises where an override does not fit the config
        raise _compose_error(err, path, overrides) from None
    try:
        composed = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation of a missing key, or a cycle
        raise _interpolation_error(err, cfg, path) from None
    if not isinstance(composed, dict):
        raise SpecError("pipeline", str(path), "a pipeline is a mapping of keys to values")
    check_numbers(composed)
    return _own_model_options(composed, user, overrides)


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


def _own_model_options(composed: dict[str, Any], user: dict[str, Any], overrides: list[str] | tuple[str, ...]
                       ) -> dict[str, Any]:
    """A model's options come only from its own config: when the pipeline names another model than the model
    group it composed (`model: {name: transformer}` over `defaults: [{model: mlp}]`), the group's options (mlp's
    `hidden`) are dropped and only the options the user gave stay."""
    model = composed.get("model")
    chosen = (OverridesParser.create().parse_override(o) for o in overrides if o.split("=", 1)[0].lstrip("+") == "model")
    choice = next((override.value() for override in chosen), None)  # parsed: `model='mlp'` chooses mlp
    choice = choice or next((d["model"] for d in user.get("defaults", []) if isinstance(d, dict) and "model" in d),
                            None)
    if not isinstance(model, dict) or choice is None:
        return composed
    group = OmegaConf.to_container(OmegaConf.load(configs_dir() / "model" / f"{choice}.yaml"))
    if model.get("name") == group.get("name"):
        return composed
    given = set(user.get("model") or {}) | {key.split(".", 2)[1] for key in (o.split("=", 1)[0].lstrip("+~")
                                                                            for o in overrides)
                                            if key.startswith("model.")}
    composed["model"] = {k: v for k, v in model.items() if k == "name" or k in given or k not in group}
    return composed


def _add_or_override(override: str, groups: dict[str, list[str]]) -> str:
    """`key=value` sets the key whether or not the file has it (Hydra's `++`): the schema check that follows
    rejects unknown keys with a better message than Hydra's. Group choices (`dataset=femnist`) and overrides
    with Hydra's own prefixes (`+`, `~`) pass unchanged."""
    key = override.split("=", 1)[0]
    if key.startswith(("+", "~")) or "=" not in override or key in groups:
        return override
    return f"++{override}"


def read_user_yaml(path: Path) -> dict[str, Any]:
    """The user's pipeline file as plain YAML data (interpolations as text); refused if it is larger than
    MAX_FILE_BYTES, has more than MAX_YAML_NODES nodes once aliases are expanded or more than MAX_YAML_DEPTH
    levels, is empty, is not YAML, or is not a mapping."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise SpecError("pipeline", str(path), f"the file has {size:,} bytes; a pipeline may have at most "
                        f"{MAX_FILE_BYTES:,}")
    text = path.read_bytes()
    try:
        _check_events(text, str(path))
        node = yaml.compose(text, Loader=YAML_LOADER)  # the node graph: linear time, aliases shared
        if node is None:
            raise SpecError("pipeline", str(path), "the file is empty")
        if not isinstance(node, yaml.MappingNode):
            kind = "a list" if isinstance(node, yaml.SequenceNode) else f"the single value {node.value!r}"
            raise SpecError("pipeline", str(path), f"the top level of a pipeline is a mapping of keys to values, "
                            f"not {kind}")
        _expanded_size(node, {}, set(), str(path))
        return yaml.load(text, Loader=YAML_LOADER)  # bounded now: at most MAX_YAML_NODES values
    except yaml.YAMLError as err:
        raise SpecError("pipeline", str(path), f"not valid YAML: {_yaml_problem(err)}") from None


def _check_events(text: bytes, path: str) -> None:
    """The file's nodes as written (before aliases) and its nesting are within the limits: a single pass over
    the parser's events that stops at the first one past a limit, before anything is built."""
    nodes = depth = 0
    try:
        for event in yaml.parse(text, Loader=YAML_LOADER):
            nodes += isinstance(event, yaml.NodeEvent)
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if nodes > MAX_YAML_NODES:
                raise _too_many_nodes(path)
            if depth > MAX_YAML_DEPTH:
                raise _too_deep(path)
    except yaml.YAMLError as err:
        # libyaml (PyYAML 6.0.4's) has its own limit, hit while scanning ahead through a run of `[[[...`
        if "maximum nesting depth" in str(err):
            raise _too_deep(path) from None
        raise


def _too_deep(path: str) -> SpecError:
    return SpecError("pipeline", path, f"not valid YAML: nested more than {MAX_YAML_DEPTH} levels deep")


def _too_many_nodes(path: str) -> SpecError:
    return SpecError("pipeline", path, f"the YAML expands to more than {MAX_YAML_NODES:,} nodes (counting every use "
                     "of an alias); a pipeline is far smaller")


def _check_omegaconf_yaml(path: Path) -> None:
    """OmegaConf's own checks of the file (a duplicate key, for one), as a clear error."""
    try:
        OmegaConf.load(path)
    except Exception as err:  # yaml.YAMLError and OmegaConf's wrappers
        raise SpecError("pipeline", str(path), f"not valid YAML: {_yaml_problem(err)}") from None


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int], path: str) -> int:
    """Nodes under `node` with every re-use of an alias counted, memoized per node (linear in the file)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise SpecError("pipeline", path, f"not valid YAML: the alias at line {node.start_mark.line + 1} refers to "
                        "a node that contains it")
    open_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1 + sum(_expanded_size(child, sizes, open_nodes, path) for child in children)
    if total > MAX_YAML_NODES:
        raise _too_many_nodes(path)
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def check_user_yaml(data: dict[str, Any], groups: dict[str, list[str]]) -> None:
    """What Hydra would act on in a user's file: no `hydra` key, `defaults` naming configs/ files, no resolvers."""
    if "hydra" in data:
        raise SpecError("hydra", data["hydra"], "unknown key: Hydra's own settings cannot be set by a pipeline",
                        allowed=[*PipelineSpec.model_fields, "defaults"])
    check_defaults(data.get("defaults", []), groups)
    check_no_resolvers(data)


def check_defaults(defaults: Any, groups: dict[str, list[str]]) -> None:
    """`defaults` is a list of `_self_` and one-key mappings {group: choice} naming a configs/ group and one of
    its files."""
    if not isinstance(defaults, list):
        raise SpecError("defaults", defaults, "a list of {group: choice} entries and _self_, e.g. "
                        "[{dataset: digits}, {model: mlp}, _self_]")
    for i, entry in enumerate(defaults):
        if entry == "_self_":
            continue
        if not isinstance(entry, dict) or len(entry) != 1:
            raise SpecError(f"defaults.{i}", entry, "an entry is _self_ or one {group: choice} of configs/",
                            allowed=list(groups))
        ((group, choice),) = entry.items()
        if group not in groups:
            raise SpecError(f"defaults.{i}", group, "not a config group of configs/", allowed=list(groups))
        check_choice(f"defaults.{i}.{group}", group, choice, groups)


def check_choice(key: str, group: str, choice: Any, groups: dict[str, list[str]]) -> None:
    """A group's choice is the plain name of one of its .yaml files (no path)."""
    if not isinstance(choice, str) or choice not in groups[group]:
        raise SpecError(key, choice, f"not a config of configs/{group}", allowed=groups[group])


def check_no_resolvers(value: Any, key: str = "") -> None:
    """No resolver call (`${oc.env:X}`, `${hydra:...}`, nested ones) anywhere in `value`; plain interpolation
    between the pipeline's own keys (`${stages.0.rounds}`) is fine. The error shows the text, never its value."""
    if isinstance(value, dict | list):
        for part, item in value.items() if isinstance(value, dict) else enumerate(value):
            check_no_resolvers(item, f"{key}.{part}" if key else str(part))
    elif isinstance(value, str) and "${" in value:
        try:
            tree = grammar_parser.parse(value, parser_rule="configValue")
        except GrammarParseError as err:
            raise SpecError(key, value, f"not a valid interpolation: {_first_line(err)}") from None
        names = _resolver_names(tree)
        if names:
            raise SpecError(key, value, f"calls the resolver {names[0]!r}: resolvers are not allowed in a "
                            "pipeline (interpolating its own keys, as in ${stages.0.rounds}, is)")


def _resolver_names(tree: Any) -> list[str]:
    """The names of the resolvers called in an OmegaConf grammar parse tree, outermost first."""
    names = []
    if isinstance(tree, OmegaConfGrammarParser.InterpolationResolverContext):
        names.append(tree.resolverName().getText())
    for child in getattr(tree, "children", None) or []:
        names += _resolver_names(child)
    return names


def check_overrides(overrides: list[str] | tuple[str, ...], groups: dict[str, list[str]]) -> None:
    """Each override is one `key=value` in Hydra's grammar, setting a pipeline key or choosing a configs/ group's
    file, within the limits and without resolver calls; Hydra's settings, packages and sweeps are refused."""
    if len(overrides) > MAX_OVERRIDES:
        raise SpecError("overrides", len(overrides), f"at most {MAX_OVERRIDES} overrides may be given")
    parser = OverridesParser.create()
    for text in overrides:
        if len(text) > MAX_OVERRIDE_CHARS:
            raise SpecError("override", f"{text[:40]}...", f"{len(text):,} characters; an override may have at "
                            f"most {MAX_OVERRIDE_CHARS:,}")
        try:
            parsed = parser.parse_override(text)
        except (HydraException, RecursionError) as err:  # Hydra's OverrideParseException and lexer errors
            raise SpecError("override", text, f"not key=value: {_first_line(err)}") from None
        key = parsed.key_or_group
        if not key:
            raise SpecError("override", text, "not key=value: the key is missing")
        if parsed.package is not None or "/" in key or key.split(".")[0] == "hydra":
            raise SpecError("override", text, "only the pipeline's keys and configs/ group choices can be set",
                            allowed=list(dict.fromkeys([*PipelineSpec.model_fields, *groups])))
        if parsed.is_sweep_override():
            raise SpecError("override", text, "a sweep is not one value (quote a value with commas; tune with a "
                            "search: block)")
        if parsed.is_delete():
            check_deletion(text, key, parsed.value(), groups)
        elif key in groups:
            check_choice(key, key, parsed.value(), groups)
        else:
            check_no_resolvers(parsed.value(), key)


def check_deletion(text: str, key: str, value: Any, groups: dict[str, list[str]]) -> None:
    """`~key` deletes a mapping's key (`~key=value` only if it holds that value); `~group` or `~group=choice`
    deletes a configs/ group. A list's entry cannot be deleted (Hydra fails on it): the whole list is set instead."""
    if any(part.isdigit() for part in key.split(".")):
        raise SpecError("override", text, "an entry of a list cannot be deleted; set the whole list instead, e.g. "
                        f"{key.rsplit('.', 1)[0]}=[...]")
    if key in groups and value is not None:
        check_choice(key, key, value, groups)
    elif value is not None:
        check_no_resolvers(value, key)


def _compose_error(err: Exception, path: Path, overrides: list[str] | tuple[str, ...]) -> SpecError:
    """Hydra's error as a SpecError; an override that cannot be applied names its key and why."""
    text = str(err)
    for override in overrides:
        key, _, value = override.partition("=")
        if f"override ++{override}" in text or f"override '{key}'" in text or f"'{key.lstrip('+~')}'" in text:
            reason = _first_line(err.__cause__) if err.__cause__ else text
            return SpecError(key.lstrip("+~"), value, f"cannot be set: {reason}")
    return SpecError("pipeline", str(path), _first_line(err))


def _interpolation_error(err: OmegaConfBaseException, cfg: Any, path: Path) -> SpecError:
    """An interpolation that cannot be resolved, as a SpecError on its key with its text."""
    key = re.sub(r"\[(\d+)\]", r".\1", getattr(err, "full_key", None) or "")
    if not key:
        return SpecError("pipeline", str(path), _first_line(err))
    value: Any = OmegaConf.to_container(cfg, resolve=False)
    try:
        for part in key.split("."):
            value = value[int(part)] if isinstance(value, list) else value[part]
    except (KeyError, IndexError, TypeError, ValueError):
        value = None
    return SpecError(key, value, f"cannot be resolved: {_first_line(err)}")


def _yaml_problem(err: Exception) -> str:
    """A YAML error in one line: the problem and where it is."""
    if isinstance(err, yaml.MarkedYAMLError) and err.problem and err.problem_mark:
        return f"{err.problem} (line {err.problem_mark.line + 1}, column {err.problem_mark.column + 1})"
    return _first_line(err)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
    val and test at each stage's end."""

    every: int = Field(10, ge=1)
    clients: int | None = Field(None, ge=1)


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


STATS = ("mean", "weighted", "std", "min", "p10", "p25", "p50", "p75", "p90", "max")
FOOTPRINTS = ("shared_bytes", "personal_bytes_per_client", "personal_bank_bytes", "comm_bytes_per_round",
              "peak_memory_bytes")
# What each task records per client (fedpilot.engine.task, kept torch-free here; a test checks they agree):
# metric -> recorded with its whole distribution (else its weighted mean only); the first is the primary one.
TASK_METRICS = {"classification": {"acc": True, "loss": False}, "next_token": {"acc": True, "loss": True},
                "regression": {"mse": True, "mae": True}}


def recorded_metrics(task: str) -> list[str]:
    """The validation metrics of a stage of `task` a search can optimize, and the footprints."""
    metrics = TASK_METRICS[task]
    primary = next(iter(metrics))
    names = [f"val_{m}_{stat}" for m, whole in metrics.items() for stat in (STATS if whole else ("weighted",))]
    return [*names, f"val_{primary}_frac_better", f"val_{primary}_frac_worse", *FOOTPRINTS]


OBJECTIVE_METRICS = sorted({m for task in TASK_METRICS for m in recorded_metrics(task)})


def default_direction(metric: str) -> str:
    """maximize accuracy and the fraction of clients better off; minimize losses, errors, the fraction worse off
    and footprints."""
    return "maximize" if metric.startswith("val_acc_") and not metric.endswith("frac_worse") or \
        metric.endswith("frac_better") else "minimize"


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
    """Pruning from the engine's intermediate evaluations (single-objective searches only)."""

    kind: Literal["median", "hyperband", "none"] = "median"
    startup_trials: int = Field(2, ge=0)
    warmup_rounds: int = Field(0, ge=0)


class SearchSpec(Strict):
    """A pipeline's `search:` block: the space over spec keys, the objective(s), the budget, sampler and pruner."""

    study: str | None = None
    space: dict[str, Param] = Field(min_length=1)
    objective: list[Objective] = Field(min_length=1)
    trials: int = Field(20, ge=1, le=SQL_INT_MAX)  # a job's trials: an SQL INTEGER
    timeout_s: float | None = Field(None, gt=0)
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)

    @model_validator(mode="before")
    @classmethod
    def _one_objective(cls, value: Any) -> Any:
        if isinstance(value, dict) and isinstance(value.get("objective"), dict):
            return {**value, "objective": [value["objective"]]}
        return value

    @field_validator("study")
    @classmethod
    def _named(cls, study: str | None) -> str | None:
        return study if study is None else check_name("search.study", study)


class PipelineSpec(Strict):
    """A whole pipeline: data, model, personalization, ordered stages, seed (0 to SEED_MAX: what numpy, scikit-learn
    and torch take), evaluation, tracking."""

    name: str
    seed: Seed = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int = Field(1, ge=1)  # > 1: Lightning DDP, each round's cohort split across that many GPUs (or CPU processes)
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
        if objective.metric not in recorded_metrics(spec.dataset.task):
            raise SpecError(f"search.objective.{i}.metric", objective.metric, f"not recorded by task "
                            f"{spec.dataset.task}", allowed=recorded_metrics(spec.dataset.task))


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineSpec:
    """Compose and validate a pipeline file: the one entry point of `fedpilot validate/run/search`."""
    return PipelineSpec.from_dict(compose_pipeline(path, overrides))
