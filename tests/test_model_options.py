"""The built-in models' option schemas (fedpilot.models.options) stand in for building the model in `fedpilot validate`,
so they must agree with the builders: the same options and defaults, every option set a schema accepts (at the edges
of its ranges) builds and runs a forward pass on data it `fits`, what it refuses the builder refuses or training
would fail on, and `adapter_places` says whether the `adapters` preset finds a place. A plugin's builder, a Net
subclass or a function returning a Net, has no schema: its signature types its options."""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import re
from typing import Annotated, Any, Literal, get_args, get_origin

import annotated_types
import pytest
import torch
from pydantic import Field
from torch import nn

import fedpilot.models.options as model_options
from fedpilot.api import Net
from fedpilot.errors import SpecError
from fedpilot.models.options import (
    MODELS,
    SCHEMAS,
    ModelOptions,
    model_problem,
    option_names,
    validated_options,
)
from fedpilot.models.split import apply_split
from fedpilot.models.zoo import build_model

VOCAB, LENGTH = 7, 6
SMALL = {"resnet18": {"width": 4}}  # under every variant: a full-width ResNet-18 takes seconds to build
SHAPES = {"features": [(5,), (1, 8, 8)], "images": [(1, 4, 4), (2, 5, 9)], "tokens": [(LENGTH,)]}


def edges(schema: type[ModelOptions], field: str) -> list[Any]:
    """Values at the edges of a field's range: its minimum, 0 / None / [] where allowed, every literal."""
    info = schema.model_fields[field]
    annotation, values = info.annotation, [info.default]
    members = get_args(annotation) if get_origin(annotation) is not list else ()
    if type(None) in members:
        values.append(None)
    if get_origin(annotation) is Literal:
        values += list(get_args(annotation))
    bounds = [m for a in (annotation, *members) for m in getattr(a, "__metadata__", ())]
    bounds += [m for m in info.metadata]
    for bound in bounds:
        if isinstance(bound, annotated_types.Ge):
            values.append(bound.ge)
        if isinstance(bound, annotated_types.Gt):
            values.append(bound.gt + 1)
    if get_origin(annotation) is list:
        values += [[], [1]]
    if field == "context":
        values.append(LENGTH)
    return values


def variants(schema: type[ModelOptions]) -> list[dict[str, Any]]:
    """The defaults, and option sets that move one field, or two, to the edges of their ranges."""
    fields = list(schema.model_fields)
    single = [{}, *({f: v} for f in fields for v in edges(schema, f)[1:])]
    pairs = [{f: v, g: w} for f, g in itertools.combinations(fields, 2) for v in edges(schema, f)[1:]
             for w in edges(schema, g)[1:]]
    return single + pairs


def accepted(schema: type[ModelOptions], options: dict[str, Any]) -> ModelOptions | None:
    try:
        return schema.model_validate(options)
    except (SpecError, ValueError):
        return None


@pytest.mark.parametrize("name", SCHEMAS)
def test_a_schema_has_its_builders_options_and_defaults(name):
    builder = inspect.signature(MODELS[name]).parameters
    options = dict(list(builder.items())[2:])
    assert list(SCHEMAS[name].model_fields) == list(options)
    defaults = SCHEMAS[name]().model_dump()
    assert {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items()} == \
        {k: list(p.default) if isinstance(p.default, tuple) else p.default for k, p in options.items()}


@pytest.mark.parametrize("name", SCHEMAS)
def test_what_a_schema_accepts_builds_and_runs_on_data_it_fits(name):
    schema, seen = SCHEMAS[name], []
    for variant, shape in itertools.product(variants(schema), SHAPES[schema.reads]):
        options = {**SMALL.get(name, {}), **variant}
        valid = accepted(schema, options)
        if valid is None or not _fits(name, valid, shape) or (valid, shape) in seen:
            continue
        seen.append((valid, shape))
        tokens = {"vocab_size": VOCAB, "pad_id": 0} if schema.reads == "tokens" else None
        model = build_model(name, shape, 3, tokens, **options)
        x = torch.randint(0, VOCAB, (2, *shape)) if schema.reads == "tokens" else torch.rand(2, *shape)
        assert torch.isfinite(model(x)).all(), (options, shape)
        assert valid.adapter_places() == _adapters_fit(model), (options, shape)
    assert len(seen) >= 2


def _fits(name: str, options: ModelOptions, shape: tuple[int, ...]) -> bool:
    try:
        options.fits(name, shape, VOCAB if options.reads == "tokens" else None)
    except SpecError:
        return False
    return True


def _adapters_fit(model: torch.nn.Module) -> bool:
    try:
        apply_split(model, "adapters", 2)
    except SpecError:
        return False
    return True


@pytest.mark.parametrize(("name", "options", "key"), [
    ("mlp", {"hidden": [0]}, "model.hidden.0"),
    ("cnn", {"hidden": 0}, "model.hidden"),
    ("resnet18", {"width": 8, "groups": 3}, "model.groups"),
    ("transformer", {"d_model": 10, "n_heads": 4}, "model.n_heads"),
    ("transformer", {"n_layers": -1}, "model.n_layers"),
    ("char_lstm", {"layers": 0}, "model.layers"),
    ("text_classifier", {"encoder": "lstm", "n_layers": 0}, "model.n_layers"),
    ("text_classifier", {"encoder": "gru"}, "model.encoder"),
    ("mlp", {"width": 3}, "model.width"),
])
def test_a_schema_refuses_what_cannot_be_built_naming_the_option(name, options, key):
    with pytest.raises(SpecError) as refused:
        validated_options(name, options)
    assert refused.value.key == key


@pytest.mark.parametrize(("name", "options", "shape", "vocab", "problem"), [
    ("cnn", {}, (1, 3, 3), None, "at least 4x4 pixels"),
    ("cnn", {}, (64,), None, "takes images"),
    ("transformer", {"context": 5}, (6,), 7, "the sequences have 6 tokens"),
    ("char_lstm", {"vocab_size": 5}, (6,), 7, "vocabulary has 7 tokens"),
])
def test_fits_refuses_data_the_model_cannot_read(name, options, shape, vocab, problem):
    with pytest.raises(SpecError, match=problem):
        SCHEMAS[name].model_validate(options).fits(name, shape, vocab)


def builder(input_shape: tuple[int, ...], num_classes: int, /, width: Annotated[int, Field(gt=0)] = 4, *layers: int,
            act: nn.Module | None = None, **rest: Any) -> Net:
    """A plugin's builder function: its options are `width` and `act` (a keyword sets neither *layers nor **rest)."""
    return Net(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def unreadable(input_shape: tuple[int, ...], num_classes: int, width: int = 4) -> Net:
    return builder(input_shape, num_classes)


unreadable.__annotations__["width"] = "Missing"  # as if imported only under TYPE_CHECKING


class Narrow(Net):
    def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 4):
        super().__init__(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


class Anything:
    pass


@pytest.mark.parametrize(("component", "problem"), [
    (builder, None),
    (functools.partial(builder, width=2), None),
    (MODELS["mlp"], None),
    (Narrow, None),
    (Anything, "is not a subclass of fedpilot.api.Net"),
    (12, "is an int, not a fedpilot.api.Net subclass or a function returning a Net"),
    (lambda input_shape: None, r"does not take \(input_shape, num_classes, \*\*options\)"),
    (unreadable, "has a signature fedpilot cannot read: NameError: name 'Missing' is not defined"),
])
def test_a_plugin_model_is_a_net_subclass_or_a_function_returning_one(component, problem):
    found = model_problem("mine", component)
    assert found is None if problem is None else re.search(problem, found), found


@pytest.mark.parametrize(("options", "checked"), [
    ({"width": "3"}, {"width": 3}),
    ({"width": 0}, "model.width"),
    ({"act": "relu"}, "model.act"),
    ({"layers": [2]}, "model.layers"),
    ({"rest": 1}, "model.rest"),
])
def test_a_builder_functions_options_are_typed_by_its_signature(options, checked, monkeypatch):
    monkeypatch.setattr(model_options, "MODELS", {"mine": builder})
    assert option_names("mine") == ["width", "act"]
    relu = nn.ReLU()
    assert validated_options("mine", {"act": relu}) == {"act": relu}  # a torch class: by isinstance
    if isinstance(checked, dict):
        assert validated_options("mine", options) == checked
        return
    with pytest.raises(SpecError) as refused:
        validated_options("mine", options)
    assert refused.value.key == checked
