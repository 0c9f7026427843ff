"""The base of every settings block a user writes (pipeline, stage, dataset, algorithm params): unknown keys and
true/false in place of a number are refused; and the bounds that libraries set on numbers. Torch-free."""

from __future__ import annotations

from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class Strict(BaseModel):
    """A settings block that rejects unknown keys, and true or false where a number is expected (pydantic would take
    them as 1 and 0, and YAML reads yes, no, on and off as booleans)."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(value, bool) and _takes(annotation, (int, float)) and not _takes(annotation, (bool, Any)):
            raise ValueError("a number, not true or false")
        return value


def _takes(annotation: Any, types: tuple[Any, ...]) -> bool:
    """Whether an annotation admits one of `types`: itself, or a member of its union or Annotated."""
    if annotation in types:
        return True
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType, Annotated) else ()
    return any(_takes(member, types) for member in members)


def at_most(limit: float, why: str) -> AfterValidator:
    """An upper bound that a library or a number type sets: its error says the bound and why."""
    def check(value: float) -> float:
        if value > limit:
            raise ValueError(f"must be at most {limit} ({why})")
        return value

    return AfterValidator(check)


# numpy's SeedSequence takes seeds >= 0, numpy's RandomState and scikit-learn (in a source plugin; Optuna's samplers)
# seeds below 2**32, and torch.manual_seed(seed * 1000 + stage) stays below its 2**64 for every such seed.
SEED_MAX = 2**32 - 1
Seed = Annotated[int, Field(ge=0), at_most(SEED_MAX, "numpy's RandomState and scikit-learn take no larger seed")]
