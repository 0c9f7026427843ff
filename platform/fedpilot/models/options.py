"""What a pipeline may say about its model, checked without torch: the model registry, each built-in model's options
as a schema, what inputs each model reads, and the personalization presets.

A built-in model's schema (`SCHEMAS`) is where its options are declared, once: names, types, defaults; its builder
in fedpilot.models.zoo takes them from there (`builder_signature`, `checked`). The schema refuses every option its
builder would refuse and every one that would only fail once training starts: unknown options, types, ranges (sizes of
at least 1, an LSTM of at least one layer) and constraints between options (`d_model` divisible by `n_heads`); its
`fits` checks it against the built dataset (token ids or features, images of rank 3 and at least 4x4 pixels for the CNN,
a `context` as long as the sequences, a `vocab_size` that holds the data's vocabulary). So a built-in model whose
options pass builds without error, and `fedpilot validate` does not build it (nor import torch). A plugin model's
builder (a Net subclass or a function returning a Net, `model_problem`) has no schema: its options are its keyword
parameters typed by their annotations; its builder is code, so a pipeline naming it is checked by building it.
"""

from __future__ import annotations

import inspect
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    NonNegativeInt,
    PositiveInt,
    PydanticSchemaGenerationError,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from fedpilot.errors import SpecError, from_validation
from fedpilot.registry import Registry, first_line

PRESETS = ["none", "input_layer", "output_layer", "adapters", "all"]
IMAGES = "images (channels, height, width)"
TOKENS = "token sequences (length,)"
# the parameter kinds a positional / a keyword argument can set
POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
KEYWORD = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def model_problem(name: str, component: Any) -> str | None:
    """What keeps a plugin's `component` from being a model, or None. A plugin model is built like a built-in one,
    as `component(input_shape, num_classes, **options)`: a Net subclass, or a function that returns a Net. Its
    options are the parameters after those two that a keyword can set, typed by their annotations (a class's in its
    `__init__`)."""
    from fedpilot.models.zoo import Net

    if isinstance(component, type) and not issubclass(component, Net):
        return "is not a subclass of fedpilot.api.Net (a model is head(body(x)))"
    if not callable(component):
        return f"is {_a(component)}, not a fedpilot.api.Net subclass or a function returning a Net"
    try:
        parameters = builder_parameters(component)
    except Exception as err:  # a signature inspect cannot read, an annotation that does not evaluate
        return f"has a signature fedpilot cannot read: {first_line(err)}"
    if sum(p.kind in POSITIONAL for p in parameters) < 2:
        return "does not take (input_shape, num_classes, **options)"
    return None


def _a(value: Any) -> str:
    """`value`'s type with an article: "an int", "a dict"."""
    kind = type(value).__name__
    return f"{'an' if kind[0].lower() in 'aeiou' else 'a'} {kind}"


def builder_parameters(builder: Any) -> list[inspect.Parameter]:
    """The parameters of a model's builder (a class's `__init__`'s without self), annotations evaluated."""
    return list(inspect.signature(builder, eval_str=True).parameters.values())


MODELS = Registry("model", {name: f"fedpilot.models.zoo:{name}" for name in (
    "logreg", "mlp", "cnn", "resnet18", "transformer", "char_lstm", "text_classifier")},
    group="fedpilot.models", check=model_problem, key="model.name")


def check_rank(name: str, input_shape: tuple[int, ...], rank: int, what: str) -> tuple[int, ...]:
    """`input_shape` if it has `rank` dimensions, else a SpecError saying what the model takes."""
    if len(input_shape) != rank:
        raise SpecError("model.name", name, f"takes {what}, but the inputs have shape {tuple(input_shape)}")
    return tuple(input_shape)


def check_groups(width: int, groups: int) -> None:
    """GroupNorm splits the channels evenly over the groups."""
    if groups < 1 or width % groups:
        raise SpecError("model.groups", groups, f"must be a positive divisor of width={width}")


def check_heads(d_model: int, n_heads: int) -> None:
    """Attention splits d_model evenly over the heads."""
    if n_heads < 1 or d_model % n_heads:
        raise SpecError("model.n_heads", n_heads, f"must be a positive divisor of d_model={d_model}")


class ModelOptions(BaseModel):
    """The options of a built-in model (its builder's keyword arguments after input_shape and num_classes).

    `reads`: `features` (any shape, flattened), `images` (channels, height, width) or `tokens` (token ids of shape
    (length,)); `fits` checks the options against the data; `adapter_places` says whether the `adapters` preset has
    somewhere to insert adapters (fedpilot.models.split.insert_adapters)."""

    model_config = ConfigDict(extra="forbid")
    reads: ClassVar[Literal["features", "images", "tokens"]] = "features"

    def fits(self, name: str, input_shape: tuple[int, ...], vocab_size: int | None) -> None:
        """A SpecError unless the model reads inputs of `input_shape` (with a vocabulary of `vocab_size` tokens)."""
        if self.reads == "images":
            check_rank(name, input_shape, 3, IMAGES)

    def adapter_places(self) -> bool:
        return True

    def body_has_parameters(self) -> bool:
        """Whether the body has parameters (else the layer presets make the whole model personal)."""
        return True


class LogregOptions(ModelOptions):
    def adapter_places(self) -> bool:
        return False  # the body is a parameterless Flatten

    def body_has_parameters(self) -> bool:
        return False


class MlpOptions(ModelOptions):
    hidden: list[PositiveInt] = [200]

    def adapter_places(self) -> bool:
        return bool(self.hidden)  # after each hidden Linear+ReLU

    def body_has_parameters(self) -> bool:
        return bool(self.hidden)


class CnnOptions(ModelOptions):
    reads: ClassVar = "images"
    hidden: PositiveInt = 512

    def fits(self, name: str, input_shape: tuple[int, ...], vocab_size: int | None) -> None:
        super().fits(name, input_shape, vocab_size)
        if min(input_shape[1:]) < 4:
            raise SpecError("model.name", name, f"takes images of at least 4x4 pixels (two 2x2 max-pools), but the "
                            f"inputs have shape {tuple(input_shape)}")


class Resnet18Options(ModelOptions):
    reads: ClassVar = "images"
    width: PositiveInt = 64
    groups: PositiveInt = 2

    @model_validator(mode="after")
    def _groups_divide_width(self) -> Resnet18Options:
        check_groups(self.width, self.groups)
        return self


class TokenOptions(ModelOptions):
    """A model of token ids: its vocabulary defaults to the data's and must hold it."""

    reads: ClassVar = "tokens"
    vocab_size: PositiveInt | None = None

    def fits(self, name: str, input_shape: tuple[int, ...], vocab_size: int | None) -> None:
        check_rank(name, input_shape, 1, TOKENS)
        if self.vocab_size is not None and vocab_size is not None and self.vocab_size < vocab_size:
            raise SpecError("model.vocab_size", self.vocab_size, f"the data's vocabulary has {vocab_size} tokens")


class TransformerOptions(TokenOptions):
    context: PositiveInt | None = None
    d_model: PositiveInt = 128
    n_layers: NonNegativeInt = 2
    n_heads: PositiveInt = 4

    @model_validator(mode="after")
    def _heads_divide_d_model(self) -> TransformerOptions:
        check_heads(self.d_model, self.n_heads)
        return self

    def fits(self, name: str, input_shape: tuple[int, ...], vocab_size: int | None) -> None:
        super().fits(name, input_shape, vocab_size)
        if self.context is not None and self.context < input_shape[0]:
            raise SpecError("model.context", self.context, f"the sequences have {input_shape[0]} tokens: the "
                            "context must hold them")

    def adapter_places(self) -> bool:
        return self.n_layers > 0  # in each transformer block


class CharLstmOptions(TokenOptions):
    embed_dim: PositiveInt = 8
    hidden: PositiveInt = 256
    layers: PositiveInt = 2

    def adapter_places(self) -> bool:
        return True  # after the LSTM's last layer


class TextClassifierOptions(TokenOptions):
    pad_id: NonNegativeInt | None = None
    encoder: Literal["transformer", "lstm"] = "transformer"
    d_model: PositiveInt = 64
    n_layers: NonNegativeInt = 2
    n_heads: PositiveInt = 4

    @model_validator(mode="after")
    def _encoder_shape(self) -> TextClassifierOptions:
        if self.encoder == "transformer":
            check_heads(self.d_model, self.n_heads)
        elif self.n_layers < 1:
            raise SpecError("model.n_layers", self.n_layers, "an LSTM encoder has at least one layer")
        return self

    def adapter_places(self) -> bool:
        return self.n_layers > 0  # in each transformer block, or after the LSTM's last layer


SCHEMAS: dict[str, type[ModelOptions]] = {
    "logreg": LogregOptions, "mlp": MlpOptions, "cnn": CnnOptions, "resnet18": Resnet18Options,
    "transformer": TransformerOptions, "char_lstm": CharLstmOptions, "text_classifier": TextClassifierOptions}


def _plugin_options(name: str) -> dict[str, inspect.Parameter]:
    """The options of plugin model `name` (loaded): its builder's parameters after (input_shape, num_classes) that
    a keyword can set."""
    parameters = builder_parameters(MODELS[name])
    shape_and_classes = [p.name for p in parameters if p.kind in POSITIONAL][:2]
    return {p.name: p for p in parameters if p.kind in KEYWORD and p.name not in shape_and_classes}


def _checker(annotation: Any) -> TypeAdapter:
    """What checks the values of a plugin's option annotated `annotation` (any value when it has none); a class
    pydantic has no schema for (a torch type) by isinstance."""
    if annotation is inspect.Parameter.empty:
        return TypeAdapter(Any)
    try:
        return TypeAdapter(annotation)
    except PydanticSchemaGenerationError:
        return TypeAdapter(annotation, config=ConfigDict(arbitrary_types_allowed=True))


def checked(schema: type[ModelOptions], options: dict[str, Any]) -> ModelOptions:
    """`options` of a built-in model validated by its `schema`, defaults filled in; a SpecError on `model.<option>`."""
    try:
        return schema.model_validate(options)
    except ValidationError as err:
        raise from_validation(err, schema, "model") from None


def builder_signature(schema: type[ModelOptions]) -> inspect.Signature:
    """The signature of a built-in builder, (input_shape, num_classes, *, <schema's fields with their defaults>)."""
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    head = [inspect.Parameter("input_shape", kind, annotation=tuple[int, ...]),
            inspect.Parameter("num_classes", kind, annotation=int)]
    return inspect.Signature([*head, *(
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=f.get_default(call_default_factory=True),
                          annotation=f.annotation) for n, f in schema.model_fields.items())])


def option_names(name: str) -> list[str]:
    """The options model `name` takes (a plugin is loaded to find out)."""
    return list(SCHEMAS[name].model_fields) if name in SCHEMAS else list(_plugin_options(name))


def validated_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` of the registered model `name`, each as the model types it; a SpecError on `model.<option>` for an
    unknown option, a wrong type, a value out of range or options that contradict each other."""
    if name not in MODELS:
        raise SpecError("model.name", name, "unknown model", allowed=list(MODELS))
    allowed = option_names(name)
    for key, value in options.items():
        if key not in allowed:
            raise SpecError(f"model.{key}", value, f"not an option of model {name!r}", allowed=allowed)
    if name in SCHEMAS:
        valid = checked(SCHEMAS[name], options)
        return {key: getattr(valid, key) for key in options}
    parameters = _plugin_options(name)
    typed = {}
    for key, value in options.items():  # each option as its builder's signature types it
        try:
            typed[key] = _checker(parameters[key].annotation).validate_python(value)
        except ValidationError as err:
            raise SpecError(f"model.{key}", value, err.errors()[0]["msg"]) from None
    return typed


def reads_tokens(name: str) -> bool:
    """Whether model `name` reads token ids (a plugin's does when it takes a `vocab_size`)."""
    return SCHEMAS[name].reads == "tokens" if name in SCHEMAS else "vocab_size" in _plugin_options(name)


def token_readers(tokens: bool) -> list[str]:
    """The models that read token ids (`tokens`) or features, plugins that cannot be loaded left out."""
    names = []
    for name in MODELS:
        try:
            if reads_tokens(name) == tokens:
                names.append(name)
        except SpecError:
            continue
    return names
