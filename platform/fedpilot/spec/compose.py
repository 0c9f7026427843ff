"""A pipeline file -> its composed config: the user's YAML read within limits (size, alias expansion, nesting),
its `defaults` and overrides checked (configs/ groups only, no resolvers, no Hydra settings), then Hydra's compose.
Nothing named in a user's file is imported or instantiated; `load_pipeline` validates the result as a PipelineSpec.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import OmegaConf, grammar_parser
from omegaconf.errors import GrammarParseError, OmegaConfBaseException
from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser

from fedpilot.errors import SpecError
from fedpilot.settings import configs_dir
from fedpilot.spec.pipeline_spec import PipelineSpec, check_numbers

# Limits on what a pipeline file and its overrides may be, checked before Hydra or OmegaConf touch them: a YAML
# alias bomb ("billion laughs") is a few hundred bytes that expands to billions of nodes, and OmegaConf builds
# every one of them. Real pipelines are a few KiB with a few hundred nodes, nested a few levels, so these leave
# ample room while bounding what composing a file can cost.
MAX_FILE_BYTES = 1 << 20  # 1 MiB: a larger file is refused before it is read
MAX_YAML_NODES = 10_000  # YAML nodes with every re-use of an alias counted (what loading the file builds)
MAX_YAML_DEPTH = 50  # nesting of mappings and lists (every check below walks the tree recursively)
MAX_OVERRIDES = 100  # overrides on one command line
MAX_OVERRIDE_CHARS = 1_000  # characters of one override (key=value)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where PyYAML has it: the same YAML, faster


def config_groups() -> dict[str, list[str]]:
    """Each config group of configs/ (a folder) and its choices (the stems of its .yaml files)."""
    return {folder.name: sorted(f.stem for f in folder.glob("*.yaml"))
            for folder in sorted(configs_dir().iterdir()) if folder.is_dir()}


def compose_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """The pipeline file composed with its `defaults` groups from configs/ and dotted `overrides`.

    Before Hydra composes anything, the file and the overrides are checked (size and expansion limits, a mapping
    at the top, `defaults` naming files of configs/ groups, no resolver calls); after, every number is finite."""
    path, user, cfg = _hydra_config(path, overrides)
    return _resolved(cfg, path, user, overrides)


def compose_at_seeds(path: str | Path, overrides: list[str] | tuple[str, ...], seeds: list[int]
                     ) -> dict[int, dict[str, Any]]:
    """compose_pipeline(path, [*overrides, f"seed={s}"]) for each of `seeds`, from one Hydra composition (the
    expensive part): the seed is set (as `++seed=s` would) before interpolations are resolved, so `${seed}`
    anywhere in the file follows it."""
    path, user, cfg = _hydra_config(path, overrides)
    composed = {}
    for seed in seeds:
        OmegaConf.update(cfg, "seed", seed, force_add=True)
        composed[seed] = _resolved(cfg, path, user, [*overrides, f"seed={seed}"])
    return composed


def _hydra_config(path: str | Path, overrides: list[str] | tuple[str, ...]) -> tuple[Path, dict[str, Any], Any]:
    """The checked file (resolved path, its plain YAML) and Hydra's composition of it with `overrides`."""
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
    return path, user, cfg


def _resolved(cfg: Any, path: Path, user: dict[str, Any], overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """Hydra's composition as plain data, interpolations resolved, every number finite."""
    try:
        composed = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # an interpolation of a missing key, or a cycle
        raise _interpolation_error(err, cfg, path) from None
    if not isinstance(composed, dict):
        raise SpecError("pipeline", str(path), "a pipeline is a mapping of keys to values")
    check_numbers(composed)
    return _own_model_options(composed, user, overrides)


def _own_model_options(composed: dict[str, Any], user: dict[str, Any], overrides: list[str] | tuple[str, ...]
                       ) -> dict[str, Any]:
    """A model's options come only from its own config: when the pipeline names another model than the model
    group it composed (`model: {name: transformer}` over `defaults: [{model: mlp}]`), the group's options (mlp's
    `hidden`) are dropped and only the options the user gave stay."""
    model = composed.get("model")
    chosen = (OverridesParser.create().parse_override(o) for o in overrides
              if o.split("=", 1)[0].lstrip("+") == "model")
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


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PipelineSpec:
    """Compose and validate a pipeline file: the one entry point of `fedpilot validate/run/search`."""
    return PipelineSpec.from_dict(compose_pipeline(path, overrides))


def load_pipeline_at_seeds(path: str | Path, overrides: list[str] | tuple[str, ...], seeds: list[int]
                           ) -> dict[int, PipelineSpec]:
    """load_pipeline(path, [*overrides, f"seed={s}"]) for each of `seeds` (a comparison's runs of one file)."""
    return {seed: PipelineSpec.from_dict(raw) for seed, raw in compose_at_seeds(path, overrides, seeds).items()}
