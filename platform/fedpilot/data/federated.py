"""Client-major arrays for the engine, built once and cached on disk by fingerprint (numpy; no torch).

A cache entry is a folder <cache>/data/<fingerprint>/ with x.npy (and y.npy), index.npz (per-split offsets and
sizes), samples.npz (which of the source's samples each client's split holds), meta.json, summary.json and, for
text, tokenizer.json. Loading memory-maps the arrays, so a dataset
costs the memory of the pages the engine touches, and building holds one copy of the stored rows (images as
uint8, never a float copy of the whole set). A new build stays in a temporary folder until the checks of the
command that built it have passed (`staging`): a refused command leaves the cache as it was.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from dataclasses import dataclass, field
from itertools import takewhile
from pathlib import Path
from typing import Any

import numpy as np

from fedpilot.data.config import DatasetSpec, Source
from fedpilot.data.partition import partition, split_client
from fedpilot.data.sources import RawData, load_source
from fedpilot.errors import SpecError, check_memory
from fedpilot.settings import cache_root

FORMAT_VERSION = 4  # bump when the stored layout or the build algorithm changes
SPLITS = ("train", "val", "test")
CHECK_CHUNK = 1 << 20  # values checked for nan and inf at a time
MIN_STD = 1e-6  # a constant feature or channel is centred, not divided by 0
ENCODE_CHUNK = 1 << 16  # texts tokenized at a time (one progress step)
Progress = Callable[[str, int, int], None]  # (what the build is doing, steps done, steps in all)
_progress: ContextVar[Progress | None] = ContextVar("build_progress", default=None)
_staged: ContextVar[dict[Path, Staged] | None] = ContextVar("staged_builds", default=None)


@contextmanager
def reporting(progress: Progress) -> Iterator[None]:
    """Builds started inside report what they are doing to `progress` (the CLI draws it; nothing here prints)."""
    token = _progress.set(progress)
    try:
        yield
    finally:
        _progress.reset(token)


def report(what: str, done: int, total: int) -> None:
    if (progress := _progress.get()) is not None:
        progress(what, done, total)


@dataclass(eq=False)
class FederatedData:
    """All samples in one array, client after client (each client's train, val, test samples in a row), with
    per-split offsets and sizes [n_clients] into it.

    x: the stored rows: float32 features, uint8 image pixels (in [0, 1] after multiplying by `scale`), or int64
       token ids (next_token: windows [n, seq_len + 1] whose inputs are [:, :-1] and targets [:, 1:]).
    y: targets (int64 class ids, float32 regression targets); None for next_token.
    num_classes: the model's outputs: classes, the vocabulary size (next_token) or regression targets.
    mean / std: per-channel normalization of image inputs (the `normalize` augmentation); specials / vocab_size:
    the token ids of pad, unk, bos, eos and the vocabulary's size (text); augment: the training-batch augmentations
    (plain dicts); folder: the cache entry.
    """

    x: np.ndarray
    y: np.ndarray | None
    offsets: dict[str, np.ndarray]
    sizes: dict[str, np.ndarray]
    task: str
    num_classes: int
    feature_shape: tuple[int, ...]
    client_names: list[str]
    fingerprint: str
    scale: float = 1.0
    mean: list[float] | None = None
    std: list[float] | None = None
    specials: dict[str, int] | None = None
    vocab_size: int | None = None
    augment: list[dict[str, Any]] = field(default_factory=list)
    folder: Path | None = None
    cache_hit: bool = False

    @property
    def n_clients(self) -> int:
        return len(self.client_names)

    def rows(self, split: str, client: int) -> np.ndarray:
        """The row indices of one client's split."""
        start = int(self.offsets[split][client])
        return np.arange(start, start + int(self.sizes[split][client]))

    def targets(self) -> np.ndarray:
        """Each row's target: `y`, or the next tokens of a next-token window."""
        return self.x[:, 1:] if self.y is None else self.y

    def samples(self, split: str) -> list[np.ndarray]:
        """Per client, the indices into the source of the samples its `split` holds (a text's windows come from
        these samples): what tells whether two builds share a sample."""
        stored = np.load(self.folder / "samples.npz")
        ids, counts = stored[f"ids_{split}"], stored[f"counts_{split}"]
        return np.split(ids, np.cumsum(counts)[:-1])


def fingerprint(spec: DatasetSpec, seed: int, redraw: int | None = None) -> str:
    """sha256 (16 hex chars) of everything that determines the arrays: spec, effective seed (and with
    `split.redraw` the run seed that re-cuts train / val), FORMAT_VERSION, the data package's code (an edited
    partitioner or source builds anew), a plugin source's code and a tokenizer file's contents."""
    tokenizer = spec.text.tokenizer if spec.text else None
    saved = (hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest() if tokenizer and os.path.isfile(tokenizer)
             else None)
    blob = json.dumps({"spec": spec.model_dump(mode="json"), "seed": seed, "redraw": redraw, "format": FORMAT_VERSION,
                       "code": _data_code(), "source_code": _plugin_code(spec.source), "tokenizer": saved},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _plugin_code(source: object) -> str | None:
    """sha256 of the modules that define a plugin source's class and its bases (None for a built-in source, whose
    code is the data package's)."""
    if not isinstance(source, Source):
        return None
    modules = {sys.modules[cls.__module__] for cls in type(source).__mro__ if cls.__module__ in sys.modules}
    files = sorted(Path(m.__file__) for m in modules if getattr(m, "__file__", None)
                   and m.__name__.split(".")[0] not in ("fedpilot", "pydantic", "abc", "builtins"))
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


@functools.cache
def _data_code() -> str:
    """sha256 of this package's source files."""
    digest = hashlib.sha256()
    for file in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def default_cache_dir() -> Path:
    """Where built federated datasets are cached: <cache root>/data."""
    return cache_root() / "data"


def build_federated_data(spec: DatasetSpec, seed: int, cache_dir: Path | None = None) -> FederatedData:
    """The federated dataset of `spec` (with spec.seed, else `seed`; with `split.redraw`, train / val re-cut by
    `seed`), loaded from the cache when built before; a new build becomes a cache entry when the `staging` block
    around it ends (at once outside one)."""
    redraw = seed if spec.split.redraw else None
    seed = spec.seed if spec.seed is not None else seed
    key = fingerprint(spec, seed, redraw)
    folder = Path(cache_dir or default_cache_dir()) / key
    if (folder / "meta.json").is_file():
        return load(folder, cache_hit=True)
    with staging() as staged:
        if folder not in staged:
            remove_abandoned(folder)
            staged[folder] = Build(spec, seed, key, folder.parent.parent / "downloads", redraw).stage(folder)
        return staged[folder].data


@dataclass(eq=False)
class Staged:
    """A build written into the temporary folder `tmp` beside its cache entry `folder`, loaded from there until it
    is published; `made`: the cache folders created for it (deepest first), removed again when it is discarded."""

    tmp: Path
    folder: Path
    made: list[Path]
    data: FederatedData | None = None

    def publish(self) -> None:
        """`tmp` renamed into place (a concurrent build of the same key wins or loses whole: the same arrays), and
        the data's arrays mapped from there (views taken before keep the files they map)."""
        try:
            os.replace(self.tmp, self.folder)
        except OSError:  # another process built it first
            shutil.rmtree(self.tmp, ignore_errors=True)
        published = load(self.folder)
        self.data.x, self.data.y, self.data.folder = published.x, published.y, self.folder

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)
        for folder in self.made:
            with suppress(OSError):  # not empty: another build's entry is in it now
                folder.rmdir()


@contextmanager
def staging() -> Iterator[dict[Path, Staged]]:
    """Datasets built inside the block (by entry folder) become cache entries when it ends without an error; on an
    error they are deleted with the cache folders made for them, so a command refused after building its data
    leaves the cache as it was. A block inside another one belongs to the outer block."""
    outer = _staged.get()
    if outer is not None:
        yield outer
        return
    staged: dict[Path, Staged] = {}
    token = _staged.set(staged)
    try:
        yield staged
    except BaseException:
        for entry in reversed(staged.values()):  # the newest first: an older one's folders are then empty
            entry.discard()
        raise
    finally:
        _staged.reset(token)
    for entry in staged.values():
        entry.publish()


def remove_abandoned(folder: Path) -> None:
    """Delete what builds of this entry left when they were killed (kill -9, a power cut): their temporary
    folders (.<key>.<pid>.tmp of a process that is gone) and an entry folder without meta.json (never written by
    `Staged.publish`, which renames a complete folder into place; a copy or an older version may leave one)."""
    for tmp in folder.parent.glob(f".{folder.name}.*.tmp"):
        pid = tmp.name.split(".")[-2]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)
    if folder.is_dir() and not (folder / "meta.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    """Whether a process with this id runs (a build of another process may still be writing its folder)."""
    if pid == os.getpid():
        return False  # this process is not writing it now: a folder of an earlier, failed build
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load(folder: Path, cache_hit: bool = False) -> FederatedData:
    """A cache entry, its arrays memory-mapped copy-on-write (shared pages, writable views for torch)."""
    meta = json.loads((folder / "meta.json").read_text())
    index = np.load(folder / "index.npz")
    y = mapped(folder / "y.npy") if (folder / "y.npy").is_file() else None
    return FederatedData(mapped(folder / "x.npy"), y,
                         {s: index[f"offsets_{s}"] for s in SPLITS}, {s: index[f"sizes_{s}"] for s in SPLITS},
                         **{**meta, "feature_shape": tuple(meta["feature_shape"])}, folder=folder, cache_hit=cache_hit)


def mapped(path: Path) -> np.memmap:
    """The array at `path` memory-mapped copy-on-write, advised for random access: a round reads a few clients'
    rows, and the kernel's default read-around brings megabytes around each fault (the figures: bench/README.md)."""
    array = np.load(path, mmap_mode="c")
    if hasattr(mmap, "MADV_RANDOM") and array.size:
        array._mmap.madvise(mmap.MADV_RANDOM)
    return array


class Build:
    """Load a source, check it against the task, partition it, split each client, tokenize text, and lay the
    samples out client-major (`stage` writes the cache entry, `Staged.publish` renames it into place)."""

    def __init__(self, spec: DatasetSpec, seed: int, key: str, downloads: Path, redraw: int | None = None):
        self.spec, self.key, self.tokenizer = spec, key, None
        rng = np.random.default_rng([seed, 1])
        report("loading", 0, 1)
        raw = load_source(spec.source, seed, spec.partition.column, downloads)
        report("loading", 1, 1)
        refuse_bad_values(raw, spec)
        targets, self.num_classes = task_targets(raw, spec)
        strata = targets if spec.task == "classification" else np.zeros(len(raw.x), dtype=np.int64)
        clients = partition(strata, raw.groups, spec.partition, rng)
        parts = [split_client(idx, strata, spec.split, rng, None if redraw is None else (redraw, i))
                 for i, idx in enumerate(clients)]
        self.parts = parts
        natural = spec.partition.kind == "natural"
        self.names = [str(raw.groups[c[0]]) if natural else str(i) for i, c in enumerate(clients)]
        self.meta: dict[str, Any] = {"scale": raw.scale}
        if raw.is_text:
            self.x, self.y, sizes = self._tokenized(raw, targets, parts)
        else:
            order = np.concatenate([p[s] for p in parts for s in SPLITS])
            self.x, self.y = raw.x[order], None if targets is None else targets[order]
            sizes = {s: np.array([len(p[s]) for p in parts], dtype=np.int64) for s in SPLITS}
            self.feature_shape = raw.feature_shape
        if not sizes["test"].any():
            raise SpecError("dataset.split.test", spec.split.test, f"0 of {len(parts)} clients get a test "
                            "sample (a client's share is round(test * its samples)), and every stage records "
                            "each client's test metrics: raise it, or use fewer, larger clients")
        self.sizes = sizes
        totals = sizes["train"] + sizes["val"] + sizes["test"]
        starts = np.cumsum(totals) - totals
        self.offsets = {"train": starts, "val": starts + sizes["train"], "test": starts + sizes["train"] + sizes["val"]}
        self._inputs(raw)

    def _tokenized(self, raw: RawData, targets: np.ndarray | None, parts: list[dict[str, np.ndarray]]):
        """Token ids: next_token windows packed per client and split, or one padded sequence per sample."""
        from fedpilot.data.text import build_tokenizer, encode, pack_windows, pad_to, special_ids

        text = self.spec.text
        if text is None:
            raise SpecError("dataset.source.feature", _feature_name(self.spec), "holds text: give dataset.text "
                            "{tokenizer: char|word|PATH, vocab_size, seq_len} to tokenize it")
        # a packed client split takes at least one window of seq_len + 1 tokens, an unpacked sample one
        packed = self.spec.task == "next_token" and text.pack
        windows = sum(len(p[s]) > 0 for p in parts for s in SPLITS) if packed else len(raw.x)
        check_memory("dataset.text.seq_len", text.seq_len, windows * (text.seq_len + 1) * 8,
                     f"{windows:,} sequences of {text.seq_len:,} tokens")
        train = np.concatenate([p["train"] for p in parts])
        report("building the vocabulary", 0, 1)
        self.tokenizer = build_tokenizer(text, raw.x[train].tolist())
        report("building the vocabulary", 1, 1)
        ids = special_ids(self.tokenizer)
        self.meta.update(specials=ids, vocab_size=self.tokenizer.get_vocab_size())
        self.feature_shape = (text.seq_len,)
        if self.spec.task == "next_token" and text.pack:
            self.num_classes = self.tokenizer.get_vocab_size()
            return self._packed(raw, parts, ids)
        if self.spec.task == "next_token":
            self.num_classes = self.tokenizer.get_vocab_size()
            windows = [[pack_windows(encode(self.tokenizer, raw.x[p[s]]), text.seq_len, ids, text.pack)
                        for s in SPLITS] for p in parts]
            sizes = {s: np.array([len(w[i]) for w in windows], dtype=np.int64) for i, s in enumerate(SPLITS)}
            return np.concatenate([w for client in windows for w in client]), None, sizes
        order = np.concatenate([p[s] for p in parts for s in SPLITS])
        x = pad_to(encode(self.tokenizer, raw.x[order]), text.seq_len, ids["pad"])
        return x, targets[order], {s: np.array([len(p[s]) for p in parts], dtype=np.int64) for s in SPLITS}

    def _packed(self, raw: RawData, parts: list[dict[str, np.ndarray]], ids: dict[str, int]):
        """Next-token windows packed per client and split: the texts tokenized a chunk at a time into one int32
        array (never a Python list per text), then every client's splits cut into windows at once."""
        from fedpilot.data.text import encode_flat, pack_runs, stream_of

        order = [p[s] for p in parts for s in SPLITS]
        texts = raw.x[np.concatenate(order)]
        flats, lengths = [], []
        for start in range(0, len(texts), ENCODE_CHUNK):
            flat, length = encode_flat(self.tokenizer, texts[start : start + ENCODE_CHUNK])
            flats.append(flat)
            lengths.append(length)
            report("tokenizing", min(start + ENCODE_CHUNK, len(texts)), len(texts))
        del texts
        lengths = np.concatenate(lengths) if lengths else np.zeros(0, dtype=np.int64)
        stream = stream_of(np.concatenate(flats) if flats else np.zeros(0, np.int32), lengths, ids)
        del flats
        samples = np.cumsum([0] + [len(o) for o in order])  # each run's first sample, and the end
        edges = np.concatenate([[0], np.cumsum(lengths + 2)])[samples]
        x, counts = pack_runs(stream, edges, self.spec.text.seq_len, ids["pad"],
                              lambda done, total: report("packing", done, total))
        counts = counts.reshape(len(parts), len(SPLITS))
        return x, None, {s: counts[:, i].astype(np.int64) for i, s in enumerate(SPLITS)}

    def _inputs(self, raw: RawData) -> None:
        """Check the augmentations against the inputs; normalization statistics of the training split."""
        spec = self.spec
        if spec.augment and not raw.is_image:
            raise SpecError("dataset.augment", [a.kind for a in spec.augment], "augmentations apply to images "
                            f"[channels, height, width]; these inputs are {_kind(raw)}")
        train = np.concatenate([np.arange(o, o + n) for o, n in zip(self.offsets["train"], self.sizes["train"],
                                                                   strict=True)])
        if spec.normalize:
            if raw.is_text or raw.x.dtype == np.uint8:
                raise SpecError("dataset.normalize", True, f"z-scores numeric features; these inputs are "
                                f"{_kind(raw)} (images: use dataset.augment: [normalize])")
            rows = self.x[train]
            self.x = (self.x - rows.mean(0)) / np.maximum(rows.std(0), MIN_STD)
        self._augmentations(raw, train)

    def _augmentations(self, raw: RawData, train: np.ndarray) -> None:
        """Check each augmentation against the images; the `normalize` statistics of the training split."""
        for i, augment in enumerate(self.spec.augment):
            if augment.kind == "random_crop" and augment.padding >= min(raw.feature_shape[1:]):
                raise SpecError(f"dataset.augment.{i}.padding", augment.padding, f"a crop of images "
                                f"{raw.feature_shape} padded this much could hold none of their pixels")
            if augment.kind == "normalize":
                pixels = self.x[train].astype(np.float64) * raw.scale
                channels = pixels.shape[1]
                mean = augment.mean or pixels.mean((0, 2, 3)).tolist()
                std = augment.std or np.maximum(pixels.std((0, 2, 3)), MIN_STD).tolist()
                if len(mean) != channels or len(std) != channels:
                    raise SpecError("dataset.augment.normalize", {"mean": mean, "std": std},
                                    f"needs one mean and one std per channel ({channels})")
                self.meta.update(mean=[float(m) for m in mean], std=[float(s) for s in std])
        self.meta["augment"] = [a.model_dump() for a in self.spec.augment if a.kind != "normalize"]

    def stage(self, folder: Path) -> Staged:
        """The cache entry `folder`, written into a temporary folder beside it (a killed build leaves only that,
        which `remove_abandoned` deletes) and loaded from there; `staging` publishes it."""
        made = list(takewhile(lambda p: not p.exists(), (folder.parent, *folder.parent.parents)))
        folder.parent.mkdir(parents=True, exist_ok=True)
        staged = Staged(folder.with_name(f".{folder.name}.{os.getpid()}.tmp"), folder, made)
        shutil.rmtree(staged.tmp, ignore_errors=True)
        staged.tmp.mkdir()
        try:
            self._write(staged.tmp)
            staged.data = load(staged.tmp)
        except BaseException:  # Ctrl+C, a full disk: no half-written folder stays behind
            staged.discard()
            raise
        return staged

    def _write(self, tmp: Path) -> None:
        """The entry's files; meta.json, what marks an entry complete, after the arrays."""
        from fedpilot.data.summary import summarize

        report("writing", 0, 3)
        np.save(tmp / "x.npy", np.ascontiguousarray(self.x))
        report("writing", 1, 3)
        if self.y is not None:
            np.save(tmp / "y.npy", np.ascontiguousarray(self.y))
        np.savez(tmp / "index.npz", **{f"offsets_{s}": self.offsets[s] for s in SPLITS},
                 **{f"sizes_{s}": self.sizes[s] for s in SPLITS})
        np.savez(tmp / "samples.npz", **{f"ids_{s}": np.concatenate([p[s] for p in self.parts]) for s in SPLITS},
                 **{f"counts_{s}": np.array([len(p[s]) for p in self.parts], dtype=np.int64) for s in SPLITS})
        meta = {"task": self.spec.task, "num_classes": int(self.num_classes),
                "feature_shape": list(self.feature_shape), "client_names": self.names, "fingerprint": self.key,
                **self.meta}
        if self.tokenizer is not None:
            self.tokenizer.save(str(tmp / "tokenizer.json"))
        report("writing", 2, 3)
        (tmp / "meta.json").write_text(json.dumps(meta))
        (tmp / "summary.json").write_text(json.dumps(summarize(load(tmp))))
        report("writing", 3, 3)


def refuse_bad_values(raw: RawData, spec: DatasetSpec) -> None:
    """Features, and the targets of a task that learns from them, with missing (null) or non-finite (inf, nan)
    values are a SpecError on the source's column (a plugin's: its RawData field): a model would train on
    them."""
    targets = None if spec.task == "next_token" else raw.y
    for part, field_name, values in (("feature", "features (RawData.x)", raw.x),
                                     ("label", "targets (RawData.y)", targets)):
        count, samples = bad_values(values) if values is not None else (0, 0)
        if not count:
            continue
        column = getattr(spec.source, part, None)
        key, value, where = ((f"dataset.source.{part}", column, "") if column is not None
                             else ("dataset.source.kind", spec.source.kind, f"in its {field_name}, "))
        raise SpecError(key, value, f"{where}{count} value(s) are missing or not finite (null, inf or nan) "
                        f"in {samples} sample(s)")


def bad_values(values: np.ndarray) -> tuple[int, int]:
    """(values, samples) of an array that are None or nan (object arrays) or inf or nan (floats), counted a
    chunk of rows at a time: bounded scratch memory, and a memory-mapped array is read once, in order."""
    if values.dtype != object and not np.issubdtype(values.dtype, np.inexact):
        return 0, 0
    width = int(np.prod(values.shape[1:]))
    step = max(1, CHECK_CHUNK // max(1, width))
    count = samples = 0
    for start in range(0, len(values), step):
        rows = values[start : start + step]
        # an object array holds None for a null, and nan among Python numbers (nan != nan)
        bad = (np.equal(rows, None) | np.not_equal(rows, rows)) if values.dtype == object else ~np.isfinite(rows)
        if bad.any():
            bad = bad.reshape(len(rows), -1)
            count, samples = count + int(bad.sum()), samples + int(bad.any(1).sum())
    return count, samples


def task_targets(raw: RawData, spec: DatasetSpec) -> tuple[np.ndarray | None, int]:
    """(targets, model outputs) of the task: class ids 0..K-1, float regression targets, or none for next_token
    (its targets are the text itself). A float label column under classification is an error, not 430 classes."""
    task, label = spec.task, getattr(spec.source, "label", None)
    if task == "next_token":
        if not raw.is_text:
            raise SpecError("dataset.task", task, f"learns from text, but the inputs are {_kind(raw)}")
        return None, 0
    if raw.y is None:
        raise SpecError("dataset.source.label", label, f"task {task} needs a target column")
    values = np.asarray(raw.y)
    numeric = np.issubdtype(values.dtype, np.number) or values.dtype == bool
    if task == "regression":
        if not numeric:
            raise SpecError("dataset.source.label", label, f"task regression needs numbers; this column holds "
                            f"{values.dtype} values")
        return values.astype(np.float32), 1 if values.ndim == 1 else int(np.prod(values.shape[1:]))
    if raw.class_names is not None:
        return values.astype(np.int64), raw.class_names
    if values.ndim > 1:
        raise SpecError("dataset.source.label", label, f"holds arrays of shape {values.shape[1:]}, not class labels "
                        "(for several float targets set dataset.task: regression)")
    if numeric and np.issubdtype(values.dtype, np.floating) and not np.all(np.mod(values, 1) == 0):
        raise SpecError("dataset.task", task, f"the target column holds {len(np.unique(values))} distinct "
                        "non-integer numbers, not class labels: set dataset.task: regression",
                        allowed=["regression"])
    names, ids = np.unique(values, return_inverse=True)
    return ids.astype(np.int64), len(names)


def _kind(raw: RawData) -> str:
    """What a source's inputs are, in words."""
    if raw.is_text:
        return "text"
    return f"images {raw.feature_shape}" if raw.is_image else f"features of shape {raw.feature_shape}"


def _feature_name(spec: DatasetSpec) -> str:
    return getattr(spec.source, "feature", "text")
