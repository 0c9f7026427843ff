"""Typed dataset specs: source, partition, per-client split. Errors name the key path and the bad value."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fedpilot.errors import SpecError, check_finite, from_validation


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
    """A Hugging Face dataset: a hub name (`owner/name`), a `save_to_disk` folder, a data folder, or data file(s)
    (.parquet, .csv, .json, .jsonl, .arrow; a path or a glob). A path that looks local must exist."""

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
        """Validate a `dataset:` mapping; the first problem (an inf or nan too) becomes a SpecError naming its key
        path."""
        check_finite(d, "dataset")
        try:
            spec = cls.model_validate(d)
        except ValidationError as err:
            raise from_validation(err, cls, "dataset") from None
        check_finite(spec.model_dump(), "dataset")  # also values parsed from strings such as "inf"
        return spec
