"""Where samples come from: synthetic, scikit-learn digits, any Hugging Face dataset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpilot.data.config import DigitsSource, HFSource, SyntheticSource
from fedpilot.errors import SpecError

DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what `save_to_disk` writes


@dataclass
class RawData:
    """All samples of a source before partitioning; `groups` is the natural client of each sample, if any."""

    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray | None
    num_classes: int
    feature_shape: tuple[int, ...]


def load_source(source: SyntheticSource | DigitsSource | HFSource, seed: int, column: str | None = None) -> RawData:
    """The samples of `source`; `column` (dataset.partition.column) overrides its natural client column."""
    if isinstance(source, HFSource):
        return hugging_face(source, column)
    if column is not None and not (isinstance(source, SyntheticSource) and column == "client"):
        allowed = ["client"] if isinstance(source, SyntheticSource) else []
        raise SpecError("dataset.partition.column", column, f"no such column in a {source.kind} source", allowed)
    if isinstance(source, SyntheticSource):
        return synthetic(source, seed if source.seed is None else source.seed)
    return digits()


def synthetic(spec: SyntheticSource, seed: int) -> RawData:
    """LEAF/FedProx Synthetic(alpha, beta) (Li et al. 2020, Sec. 5.1); groups are the client indices."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(spec.mean_size, spec.sigma, spec.n_clients).astype(int) + 50, spec.max_size)
    scale = np.arange(1, spec.dim + 1, dtype=np.float64) ** -0.6  # std of diag(j^-1.2)
    xs, ys = [], []
    for n in sizes:
        u, b = rng.normal(0, spec.alpha), rng.normal(0, spec.beta)
        w, bias = rng.normal(u, 1, (spec.dim, spec.classes)), rng.normal(u, 1, spec.classes)
        x = rng.normal(rng.normal(b, 1, spec.dim), scale, (n, spec.dim))
        xs.append(x)
        ys.append(np.argmax(x @ w + bias, axis=1))
    groups = np.repeat(np.arange(spec.n_clients), sizes)
    return RawData(np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int64), groups,
                   spec.classes, (spec.dim,))


def digits() -> RawData:
    """scikit-learn's 8x8 digits, pixels 0..16 scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]
    return RawData(x, bunch.target.astype(np.int64), None, 10, (1, 8, 8))


def hugging_face(spec: HFSource, column: str | None = None) -> RawData:
    """Features, labels and (if named) client groups of a Hugging Face dataset."""
    table = _load_table(spec)
    group_key = "dataset.partition.column" if column else "dataset.source.partition_column"
    column = column or spec.partition_column
    for key, name in (("dataset.source.feature", spec.feature), ("dataset.source.label", spec.label),
                      (group_key, column)):
        if name is not None and name not in table.column_names:
            raise SpecError(key, name, "no such column", allowed=table.column_names)
    if spec.max_samples:
        table = table.select(range(min(spec.max_samples, len(table))))
    x = _features(table, spec.feature)
    labels, num_classes = _labels(table, spec.label)
    groups = np.asarray(table[column]) if column else None
    return RawData(x, labels, groups, num_classes, tuple(x.shape[1:]))


def _load_table(spec: HFSource):
    """A `datasets.Dataset`: from a `save_to_disk` folder, parquet file(s), or the hub."""
    import datasets

    path = Path(spec.path)
    if path.is_dir() and any((path / marker).exists() for marker in DISK_MARKERS):
        loaded = datasets.load_from_disk(str(path))
    elif spec.path.endswith(".parquet") or any(ch in spec.path for ch in "*?["):
        return datasets.load_dataset("parquet", data_files=spec.path, split="train")
    else:
        return datasets.load_dataset(spec.path, spec.name, split=spec.split)
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise SpecError("dataset.source.split", spec.split, "no such split", allowed=list(loaded))
        return loaded[spec.split]
    return loaded


def _features(table, column: str) -> np.ndarray:
    """A column of images or numeric arrays as float32 [N, ...]; images become [C, H, W] in [0, 1]."""
    import datasets

    if isinstance(table.features[column], datasets.Image):
        images = np.stack([np.asarray(_plain_mode(img), dtype=np.float32) / 255.0 for img in table[column]])
        return images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    return np.asarray(table.with_format("numpy")[column], dtype=np.float32)


def _plain_mode(image):
    """A PIL image as grayscale (L) or RGB pixels; palette, alpha and other modes become RGB."""
    return image if image.mode in {"L", "RGB"} else image.convert("RGB")


def _labels(table, column: str) -> tuple[np.ndarray, int]:
    """Labels as 0..K-1: ClassLabel ids as they are, other values mapped in sorted order."""
    import datasets

    feature = table.features[column]
    values = np.asarray(table[column])
    if isinstance(feature, datasets.ClassLabel):
        return values.astype(np.int64), feature.num_classes
    names, ids = np.unique(values, return_inverse=True)
    return ids.astype(np.int64), len(names)
