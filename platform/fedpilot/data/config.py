"""Typed dataset specs: source, partition, per-client split. Errors name the key path and the bad value."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedpilot.errors import SpecError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SyntheticSource(Strict):
    """LEAF/FedProx Synthetic(alpha, beta): client-specific logistic models, lognormal client sizes.

    Client k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k, b_k ~ N(u_k, 1); v_k ~ N(B_k, 1);
    x ~ N(v_k, diag(j^-1.2)); y = argmax(softmax(W_k x + b_k)). Sizes: lognormal(mean_size, sigma) + 50
    (LEAF uses lognormal(4, 2) + 50), clipped at max_size.
    """

    kind: Literal["synthetic"] = "synthetic"
    n_clients: int = Field(100, ge=1)
    dim: int = Field(60, ge=1)
    classes: int = Field(10, ge=2)
    alpha: float = Field(1.0, ge=0)
    beta: float = Field(1.0, ge=0)
    mean_size: float = 4.0
    sigma: float = Field(2.0, ge=0)
    max_size: int = Field(2000, ge=1)
    seed: int | None = None


class DigitsSource(Strict):
    """scikit-learn's bundled handwritten digits: 1797 images 1x8x8 in [0, 1], 10 classes (offline)."""

    kind: Literal["digits"] = "digits"


class HFSource(Strict):
    """A Hugging Face dataset: hub name, a `save_to_disk` folder, or parquet file(s)."""

    kind: Literal["hf"] = "hf"
    path: str
    name: str | None = None
    split: str = "train"
    feature: str
    label: str
    partition_column: str | None = None
    max_samples: int | None = Field(None, ge=1)


Source = Annotated[SyntheticSource | DigitsSource | HFSource, Field(discriminator="kind")]


class PartitionSpec(Strict):
    """How samples become clients: natural (by a column), iid, dirichlet(alpha) over labels, shards."""

    kind: Literal["natural", "iid", "dirichlet", "shards"] = "natural"
    clients: int | None = Field(None, ge=1)
    alpha: float = 0.5
    classes_per_client: int = Field(2, ge=1)
    column: str | None = None
    min_size: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _check(self) -> PartitionSpec:
        if self.kind == "dirichlet" and self.alpha <= 0:
            raise SpecError("dataset.partition.alpha", self.alpha, "must be > 0")
        if self.kind in {"iid", "dirichlet", "shards"} and self.clients is None:
            raise SpecError("dataset.partition.clients", None, f"required for partition kind {self.kind!r}")
        return self


class SplitSpec(Strict):
    """Fractions of each client's samples for train / val / test."""

    train: float = Field(0.6, ge=0, le=1)
    val: float = Field(0.2, ge=0, le=1)
    test: float = Field(0.2, ge=0, le=1)

    @model_validator(mode="after")
    def _sums_to_one(self) -> SplitSpec:
        total = self.train + self.val + self.test
        if abs(total - 1) > 1e-6:
            raise SpecError("dataset.split", self.model_dump(), f"fractions must sum to 1, not {total:g}")
        if self.train <= 0:
            raise SpecError("dataset.split.train", self.train, "must be > 0")
        return self


class DatasetSpec(Strict):
    source: Source
    partition: PartitionSpec = Field(default_factory=PartitionSpec)
    split: SplitSpec = Field(default_factory=SplitSpec)
    seed: int | None = None
    normalize: bool = False

    @classmethod
    def from_dict(cls, raw: dict[str, Any], prefix: str = "dataset") -> DatasetSpec:
        """Validate a dataset mapping; the first problem becomes a SpecError naming its key path."""
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            raise _spec_error(err, raw, prefix) from None


def _spec_error(err: ValidationError, raw: dict[str, Any], prefix: str) -> SpecError:
    """Translate pydantic's first error into a SpecError, with allowed names for unknown keys and kinds."""
    first = err.errors()[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, SpecError):
        return cause
    loc = [str(p) for p in first["loc"] if not (isinstance(p, str) and p in {"synthetic", "digits", "hf"})]
    key = ".".join([prefix, *loc])
    value = first.get("input")
    if first["type"] == "extra_forbidden":
        return SpecError(key, value, "unknown key", allowed=_fields_at(loc[:-1], raw))
    if first["type"] == "union_tag_invalid":
        return SpecError(f"{key}.kind", (value or {}).get("kind"), "unknown source kind",
                         allowed=["synthetic", "digits", "hf"])
    return SpecError(key, value, first["msg"])


def _fields_at(loc: list[str], raw: dict[str, Any]) -> list[str]:
    """The keys allowed at a location of a DatasetSpec."""
    model: type[BaseModel] = DatasetSpec
    for part in loc:
        if part == "source":
            kind = (raw.get("source") or {}).get("kind")
            return list({"synthetic": SyntheticSource, "digits": DigitsSource, "hf": HFSource}.get(
                kind, DigitsSource).model_fields)
        model = {"partition": PartitionSpec, "split": SplitSpec}.get(part, model)
    return list(model.model_fields)
