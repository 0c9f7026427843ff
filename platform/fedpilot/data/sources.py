"""Where samples come from: synthetic, scikit-learn digits, any Hugging Face dataset."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fedpilot.data.config import DigitsSource, HFSource, SyntheticSource
from fedpilot.errors import SpecError


@dataclass
class RawData:
    """All samples of a source before partitioning; `groups` is the natural client of each sample, if any."""

    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray | None
    num_classes: int
    feature_shape: tuple[int, ...]


def load_source(source: SyntheticSource | DigitsSource | HFSource, seed: int) -> RawData:
    if isinstance(source, SyntheticSource):
        return synthetic(source, seed if source.seed is None else source.seed)
    if isinstance(source, DigitsSource):
        return digits()
    return hugging_face(source)


def synthetic(spec: SyntheticSource, seed: int) -> RawData:
    """LEAF/FedProx Synthetic(alpha, beta) (Li et al. 2020, Sec. 5.1)."""
    rng = np.random.default_rng(seed)
    sizes = np.minimum(rng.lognormal(spec.mean_size, spec.sigma, spec.n_clients).astype(int) + 50, spec.max_size)
    cov = np.arange(1, spec.dim + 1, dtype=np.float64) ** -1.2
    xs, ys, groups = [], [], []
    for k, n in enumerate(sizes):
        u, b = rng.normal(0, np.sqrt(spec.alpha)), rng.normal(0, np.sqrt(spec.beta))
        w = rng.normal(u, 1, (spec.dim, spec.classes))
        bias = rng.normal(u, 1, spec.classes)
        v = rng.normal(b, 1, spec.dim)
        x = rng.normal(v, np.sqrt(cov), (n, spec.dim))
        xs.append(x)
        ys.append(np.argmax(x @ w + bias, axis=1))
        groups.append(np.full(n, k))
    return RawData(np.concatenate(xs).astype(np.float32), np.concatenate(ys).astype(np.int64),
                   np.concatenate(groups), spec.classes, (spec.dim,))


def digits() -> RawData:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]
    return RawData(x, bunch.target.astype(np.int64), None, 10, (1, 8, 8))


def hugging_face(spec: HFSource) -> RawData:
    """Load by hub name, `save_to_disk` folder or parquet; images become float [C, H, W] in [0, 1]."""
    table = _load_table(spec)
    columns = list(table.column_names)
    for key, column in (("feature", spec.feature), ("label", spec.label), ("partition_column", spec.partition_column)):
        if column is not None and column not in columns:
            raise SpecError(f"dataset.source.{key}", column, "no such column", allowed=columns)
    if spec.max_samples:
        table = table.select(range(min(spec.max_samples, len(table))))
    x = _features(table, spec.feature)
    labels, num_classes = _labels(table, spec.label)
    groups = np.asarray(table[spec.partition_column]) if spec.partition_column else None
    return RawData(x, labels, groups, num_classes, tuple(x.shape[1:]))


def _load_table(spec: HFSource):
    import datasets

    path = Path(spec.path)
    if path.is_dir() and (path / "dataset_info.json").exists():
        loaded = datasets.load_from_disk(str(path))
        return loaded[spec.split] if isinstance(loaded, datasets.DatasetDict) else loaded
    if spec.path.endswith(".parquet"):
        return datasets.load_dataset("parquet", data_files=spec.path, split="train")
    return datasets.load_dataset(spec.path, spec.name, split=spec.split)


def _features(table, column: str) -> np.ndarray:
    """A column of images (PIL) or numeric arrays as float32 [N, ...]; images get a channel axis."""
    import datasets

    feature = table.features[column]
    if isinstance(feature, datasets.Image):
        images = np.stack([np.asarray(img, dtype=np.float32) / 255.0 for img in table[column]])
        return images[:, None] if images.ndim == 3 else images.transpose(0, 3, 1, 2)
    return np.asarray(table.with_format("numpy")[column], dtype=np.float32)


def _labels(table, column: str) -> tuple[np.ndarray, int]:
    """Labels as 0..K-1: ClassLabel ids as they are, other values mapped in sorted order."""
    import datasets

    feature = table.features[column]
    values = np.asarray(table[column])
    if isinstance(feature, datasets.ClassLabel):
        return values.astype(np.int64), feature.num_classes
    names, ids = np.unique(values, return_inverse=True)
    return ids.astype(np.int64), len(names)
