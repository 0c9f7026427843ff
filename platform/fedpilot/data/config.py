"""Typed dataset specs: source, partition, per-client split. Errors name the key path and the bad value."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedpilot.errors import SpecError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SyntheticSource(Strict):
    """LEAF/FedProx Synthetic(alpha, beta) (Li et al. 2020): client-specific logistic models.

    Client k: u_k ~ N(0, alpha), B_k ~ N(0, beta); W_k, b_k ~ N(u_k, 1); v_k ~ N(B_k, 1);
    x ~ N(v_k, diag(j^-1.2)); y = argmax(W_k x + b_k). alpha and beta are the normal scales, as in the
    reference code. Client sizes: int(lognormal(mean_size, sigma)) + 50 (LEAF: lognormal(4, 2) + 50),
    clipped at max_size. The natural client column is `client`.
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
    """A Hugging Face dataset: a hub name, a `save_to_disk` folder, or parquet file(s) (a path or glob)."""

    kind: Literal["hf"] = "hf"
    path: str
    name: str | None = None
    split: str = "train"
    feature: str
    label: str
    partition_column: str | None = None
    max_samples: int | None = Field(None, ge=1)


SOURCES = {"synthetic": SyntheticSource, "digits": DigitsSource, "hf": HFSource}
SourceSpec = Annotated[SyntheticSource | DigitsSource | HFSource, Field(discriminator="kind")]


class PartitionSpec(Strict):
    """How samples become clients: natural (by a column), iid, dirichlet(alpha) over labels, shards.

    dirichlet with balanced=True follows Hsu et al. 2019: every client draws label proportions and gets
    n / clients samples. balanced=False is the per-class allocation of Yurochkin et al. 2019 / NIID-Bench:
    each class is split across clients by Dir(alpha), so client sizes vary too (see partition.py).
    """

    kind: Literal["natural", "iid", "dirichlet", "shards"] = "natural"
    clients: int | None = Field(None, ge=1)
    alpha: float = Field(0.5, gt=0)
    balanced: bool = True
    classes_per_client: int = Field(2, ge=1)
    column: str | None = None
    min_size: int = Field(10, ge=1)

    @model_validator(mode="after")
    def _clients_required(self) -> PartitionSpec:
        if self.kind != "natural" and self.clients is None:
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
            raise SpecError("dataset.split.train", self.train, "must be > 0: every client trains")
        return self


class DatasetSpec(Strict):
    """A federated dataset: where samples come from, how they become clients, how clients split them."""

    source: SourceSpec
    partition: PartitionSpec = Field(default_factory=PartitionSpec)
    split: SplitSpec = Field(default_factory=SplitSpec)
    seed: int | None = None
    normalize: bool = False

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DatasetSpec:
        """Validate a `dataset:` mapping; the first problem (unknown keys first) becomes a SpecError naming its key."""
        try:
            return cls.model_validate(d)
        except ValidationError as err:
            errors = sorted(err.errors(), key=lambda e: e["type"] != "extra_forbidden")  # a typo beats its "missing"
            raise _spec_error(errors[0]) from None


def _spec_error(error: dict[str, Any]) -> SpecError:
    """A pydantic error as a SpecError `dataset.<loc>`, listing allowed keys, kinds and literal values."""
    cause = (error.get("ctx") or {}).get("error")
    if isinstance(cause, SpecError):
        return cause
    owner, loc = _owner([str(p) for p in error["loc"]])
    key, value, kind = ".".join(["dataset", *loc]), error.get("input"), error["type"]
    if kind in {"union_tag_invalid", "union_tag_not_found"}:
        tag = value.get("kind") if isinstance(value, dict) else None
        return SpecError(f"{key}.kind", tag, "unknown source kind", allowed=list(SOURCES))
    if kind == "extra_forbidden":
        return SpecError(key, value, "unknown key", allowed=list(owner.model_fields))
    if kind == "literal_error":
        return SpecError(key, value, "not an allowed value", allowed=get_args(owner.model_fields[loc[-1]].annotation))
    if kind == "missing":
        return SpecError(key, None, "required")
    return SpecError(key, value, error["msg"])


def _owner(loc: list[str]) -> tuple[type[BaseModel], list[str]]:
    """The model that holds the last key of an error location, and the location without pydantic's union tag."""
    if len(loc) > 2 and loc[0] == "source" and loc[1] in SOURCES:
        return SOURCES[loc[1]], ["source", *loc[2:]]
    if len(loc) > 1 and loc[0] in {"partition", "split"}:
        return {"partition": PartitionSpec, "split": SplitSpec}[loc[0]], loc
    return DatasetSpec, loc
