"""Where samples come from: synthetic, scikit-learn's bundled sets, LEAF's Shakespeare, any Hugging Face dataset, a
plugin's source."""

from __future__ import annotations

import glob
import math
import os
import socket
from dataclasses import dataclass
from numbers import Real
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from fedpilot.data.config import (
    SOURCES,
    DigitsSource,
    HFSource,
    ShakespeareSource,
    SklearnSource,
    Source,
    SyntheticSource,
)
from fedpilot.errors import DataUnavailable, SpecError, check_memory
from fedpilot.settings import cache_root

DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")  # what `save_to_disk` writes
FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
GLOB_CHARS = "*?["


@dataclass
class RawData:
    """All samples of a source before partitioning.

    x: features (float32), image pixels (uint8 [N, C, H, W], in [0, 1] after `scale`), or text (an object array of
    str); y: the raw target column (None without one); groups: the natural client of each sample, if any;
    feature_shape: the shape of one sample's features (None for text, whose shape the tokenizer decides)."""

    x: np.ndarray
    y: np.ndarray | None
    groups: np.ndarray | None
    feature_shape: tuple[int, ...] | None
    scale: float = 1.0
    class_names: int | None = None  # the number of classes a ClassLabel column declares

    @property
    def is_text(self) -> bool:
        return self.x.dtype == object

    @property
    def is_image(self) -> bool:
        return self.feature_shape is not None and len(self.feature_shape) == 3


BuiltinSource = SyntheticSource | DigitsSource | SklearnSource | ShakespeareSource | HFSource


def load_source(source: BuiltinSource | Source, seed: int, column: str | None = None,
                downloads: Path | None = None) -> RawData:
    """The samples of `source`; `column` (dataset.partition.column) overrides its natural client column;
    `downloads` is where a source fetches what it needs once (the Shakespeare archive)."""
    if isinstance(source, HFSource):
        return hugging_face(source, column)
    natural = {"synthetic": "client", "shakespeare": "role", "shifted_digits": "client"}.get(source.kind)
    if column is not None and column != natural:
        raise SpecError("dataset.partition.column", column, f"no such column in a {source.kind} source",
                        [natural] if natural else [])
    if isinstance(source, Source):
        return plugin_samples(source, seed, downloads or cache_root() / "downloads")
    if isinstance(source, SyntheticSource):
        return synthetic(source, seed if source.seed is None else source.seed)
    if isinstance(source, ShakespeareSource):
        from fedpilot.data.shakespeare import load_shakespeare

        return load_shakespeare(source, downloads)
    if isinstance(source, SklearnSource):
        return bundled(source.name)
    return digits()


def plugin_samples(source: Source, seed: int, downloads: Path) -> RawData:
    """A plugin source's samples; whatever its `load` raises or a result that is not RawData is a SpecError naming
    the plugin and its distribution."""
    def broken(problem: str) -> SpecError:
        return SpecError("dataset.source.kind", source.kind, f"the {SOURCES.origin(source.kind)} {problem}")

    try:
        raw = source.load(seed, downloads)
    except SpecError:
        raise
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise broken(f"failed to load its samples: {type(err).__name__}: {first}") from None
    if not isinstance(raw, RawData):
        raise broken(f"returned {type(raw).__name__} from load, not a fedpilot.api.RawData")
    sizes = {len(a) for a in (raw.x, raw.y, raw.groups) if a is not None}
    if len(sizes) != 1:
        raise broken(f"returned x, y and groups of different lengths {sorted(sizes)}")
    if not (isinstance(raw.scale, Real) and math.isfinite(raw.scale) and raw.scale > 0):
        raise broken(f"returned scale={raw.scale!r}: the inputs are multiplied by it (a finite number > 0)")
    return raw


def synthetic(spec: SyntheticSource, seed: int) -> RawData:
    """LEAF/FedProx Synthetic(alpha, beta) (Li et al. 2020, Sec. 5.1); groups are the client indices."""
    rng = np.random.default_rng(seed)
    smallest = min(50, spec.max_size)
    _synthetic_fits(spec, spec.n_clients * smallest, smallest)  # before drawing n_clients sizes
    # clipped while float: a draw past int64's range (a large mean_size or sigma) would wrap negative
    sizes = np.minimum(np.floor(rng.lognormal(spec.mean_size, spec.sigma, spec.n_clients)) + 50,
                       spec.max_size).astype(np.int64)
    _synthetic_fits(spec, int(sizes.sum()), int(sizes.max()))
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
                   (spec.dim,), class_names=spec.classes)


def _synthetic_fits(spec: SyntheticSource, rows: int, largest: int) -> None:
    """Synthetic samples fit in memory: `rows` samples (a client of at most `largest`), each feature held as
    its float64 draw, in their concatenation and in the float32 copy; a client's weights and logits as
    float64."""
    options = spec.model_dump(include={"n_clients", "dim", "classes", "mean_size", "sigma", "max_size"})
    nbytes = rows * spec.dim * (8 + 8 + 4) + (spec.dim + largest) * spec.classes * 8
    check_memory("dataset.source", options, nbytes,
                 f"{rows:,} samples of {spec.dim:,} features and {spec.classes:,} classes")


def digits() -> RawData:
    """scikit-learn's 8x8 digits, pixels 0..16 scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    x = (bunch.images / 16.0).astype(np.float32)[:, None]
    return RawData(x, bunch.target.astype(np.int64), None, (1, 8, 8), class_names=10)


def bundled(name: str) -> RawData:
    """A tabular dataset scikit-learn ships (no download): float32 features and its target column."""
    from sklearn import datasets as sk

    bunch = getattr(sk, f"load_{name}")()
    return RawData(bunch.data.astype(np.float32), bunch.target, None, (bunch.data.shape[1],))


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
    x, scale = _features(table, spec.feature)
    y = _labels(table, spec.label) if spec.label else None
    groups = np.asarray(table[column]) if column else None
    shape = None if x.dtype == object else tuple(x.shape[1:])
    return RawData(x, y, groups, shape, scale, _declared_classes(table, spec.label))


def _load_table(spec: HFSource):
    """A `datasets.Dataset`: from a `save_to_disk` folder, data file(s) (a path or glob), a data folder, or the
    hub. A local-looking path that is not there, and anything `datasets` raises, is a SpecError."""
    import datasets

    path = os.path.expanduser(spec.path)
    if looks_local(spec.path):
        _check_local(spec.path, path)
    try:
        if Path(path).is_dir() and any((Path(path) / marker).exists() for marker in DISK_MARKERS):
            loaded = datasets.load_from_disk(path)
        elif builder := _file_builder(path):
            return datasets.load_dataset(builder, data_files=path, split="train")
        elif Path(path).is_dir() or hub_reachable():
            return datasets.load_dataset(path, spec.name, split=spec.split)
        else:
            return _from_hub_cache(spec)
    except DataUnavailable:
        raise
    except Exception as err:  # a loading script, a bad config name or split, a broken file
        raise _load_error(spec, err) from None
    if isinstance(loaded, datasets.DatasetDict):
        if spec.split not in loaded:
            raise SpecError("dataset.source.split", spec.split, "no such split", allowed=list(loaded))
        return loaded[spec.split]
    return loaded


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection (not in offline mode), with a short timeout rather
    than the library's long retries."""
    import huggingface_hub.constants as hub

    if hub.HF_HUB_OFFLINE:
        return False
    host = urlparse(hub.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _from_hub_cache(spec: HFSource):
    """A hub dataset from the local Hugging Face cache (downloaded earlier), or DataUnavailable."""
    import datasets
    import huggingface_hub.constants as hub

    saved = datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(spec.path, spec.name, split=spec.split)
    except Exception:  # not in the cache
        raise DataUnavailable("dataset.source.path", spec.path, "the Hugging Face hub cannot be reached from here "
                              "and the dataset is not in the local cache") from None
    finally:
        datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE = saved


def looks_local(path: str) -> bool:
    """Whether `path` names local files rather than a hub dataset (`owner/name`): absolute, starting with `.` or
    `~`, with more than one `/`, a data file suffix or glob characters."""
    return (path.startswith(("/", ".", "~")) or path.count("/") > 1 or Path(path).suffix in FILE_BUILDERS
            or any(ch in path for ch in GLOB_CHARS))


def _check_local(given: str, path: str) -> None:
    """A local path exists, a glob matches a file."""
    if any(ch in path for ch in GLOB_CHARS):
        if not glob.glob(path):
            raise SpecError("dataset.source.path", given, "no file matches this pattern")
    elif not os.path.exists(path):
        raise SpecError("dataset.source.path", given, "no such file or folder (hub datasets are named owner/name)")


def _file_builder(path: str) -> str | None:
    """The `datasets` builder of data file(s): by suffix; a glob without a known suffix is parquet."""
    builder = FILE_BUILDERS.get(Path(path).suffix)
    return builder or ("parquet" if any(ch in path for ch in GLOB_CHARS) else None)


def _load_error(spec: HFSource, err: Exception) -> SpecError:
    """What `datasets` raised, as a SpecError on the key it is about (config name, split, else path)."""
    message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if spec.name is not None and repr(spec.name) in message:
        return SpecError("dataset.source.name", spec.name, f"cannot load: {message}")
    if "split" in message.lower() and f'"{spec.split}"' in message:
        return SpecError("dataset.source.split", spec.split, f"cannot load: {message}")
    return SpecError("dataset.source.path", spec.path, f"cannot load: {message}")


def _is_text(table, column: str) -> bool:
    """Whether a column holds strings."""
    return getattr(table.features[column], "dtype", None) in {"string", "large_string"}


def _features(table, column: str) -> tuple[np.ndarray, float]:
    """A column as (values, scale): text as an object array of str; images as uint8 [N, C, H, W] with scale
    1/255 (filled one image at a time, never a float copy of the set); numeric arrays as float32."""
    import datasets

    if _is_text(table, column):
        return np.asarray(table[column], dtype=object), 1.0
    try:
        if isinstance(table.features[column], datasets.Image):
            return _images(table[column]), 1 / 255
        values = np.asarray(table.with_format("numpy")[column])
        if values.dtype == object or not np.issubdtype(values.dtype, np.number):
            raise ValueError(f"values of type {values.dtype} are not numbers")
        return values.astype(np.float32), 1.0
    except (ValueError, TypeError) as err:  # ragged arrays, nested records, images of different sizes
        raise _not_one_array("dataset.source.feature", column, err) from None


def _labels(table, column: str) -> np.ndarray:
    """A target column as one array: class names or numbers, or arrays of numbers of one shape."""
    try:
        return np.asarray(table[column])
    except (ValueError, TypeError) as err:  # ragged arrays, or arrays among nulls
        raise _not_one_array("dataset.source.label", column, err) from None


def _not_one_array(key: str, column: str, err: Exception) -> SpecError:
    return SpecError(key, column, f"cannot be made one array of numbers: {str(err).strip().splitlines()[0]}")


def _images(column) -> np.ndarray:
    """PIL images of one size as uint8 [N, C, H, W]."""
    first = np.asarray(_plain_mode(column[0]))
    out = np.empty((len(column), *(first.shape[2:] or (1,)), *first.shape[:2]), dtype=np.uint8)
    for i, image in enumerate(column):
        pixels = np.asarray(_plain_mode(image))
        if pixels.shape != first.shape:
            raise ValueError(f"image {i} has shape {pixels.shape}, image 0 {first.shape}")
        out[i] = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    return out


def _plain_mode(image):
    """A PIL image as grayscale (L) or RGB pixels; palette, alpha and other modes become RGB."""
    return image if image.mode in {"L", "RGB"} else image.convert("RGB")


def _declared_classes(table, column: str | None) -> int | None:
    """The number of classes a ClassLabel column declares."""
    import datasets

    feature = table.features[column] if column else None
    return feature.num_classes if isinstance(feature, datasets.ClassLabel) else None
