"""Client-major tensors for the engine, built once and cached on disk by fingerprint."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from fedpilot.data.config import DatasetSpec
from fedpilot.data.partition import partition, split_client
from fedpilot.data.sources import load_source
from fedpilot.settings import cache_root

FORMAT_VERSION = 2  # bump when the stored layout or the build algorithm changes
SPLITS = ("train", "val", "test")


@dataclass(eq=False)
class FederatedData:
    """All samples in one tensor, client after client (each client's train, val, test samples in a row),
    with per-split offsets and sizes [n_clients] into it. `cache_hit` says whether it came from the disk cache."""

    x: torch.Tensor
    y: torch.Tensor
    offsets: dict[str, torch.Tensor]
    sizes: dict[str, torch.Tensor]
    num_classes: int
    feature_shape: tuple[int, ...]
    client_names: list[str]
    fingerprint: str
    cache_hit: bool = False

    @property
    def n_clients(self) -> int:
        return len(self.client_names)

    def to(self, device: torch.device | str) -> FederatedData:
        """A copy with every tensor on `device`."""
        offsets = {k: v.to(device) for k, v in self.offsets.items()}
        sizes = {k: v.to(device) for k, v in self.sizes.items()}
        return replace(self, x=self.x.to(device), y=self.y.to(device), offsets=offsets, sizes=sizes)

    def state(self) -> dict:
        """What the cache stores: tensors and plain Python values only (loadable with weights_only=True)."""
        return {"x": self.x, "y": self.y, "offsets": self.offsets, "sizes": self.sizes,
                "num_classes": self.num_classes, "feature_shape": list(self.feature_shape),
                "client_names": self.client_names, "fingerprint": self.fingerprint}


def fingerprint(spec: DatasetSpec, seed: int) -> str:
    """sha256 (16 hex chars) of everything that determines the tensors: spec, effective seed, FORMAT_VERSION and
    the data package's code (an edited partitioner or source builds anew)."""
    blob = json.dumps({"spec": spec.model_dump(mode="json"), "seed": seed, "format": FORMAT_VERSION,
                       "code": _data_code()}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    """The federated dataset of `spec` (with spec.seed, else `seed`), loaded from the cache when built before."""
    seed = spec.seed if spec.seed is not None else seed
    key = fingerprint(spec, seed)
    path = Path(cache_dir or default_cache_dir()) / f"{key}.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)
        return FederatedData(**{**state, "feature_shape": tuple(state["feature_shape"])}, cache_hit=True)
    data = _build(spec, seed, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save(data.state(), tmp)
    os.replace(tmp, path)
    return data


def _build(spec: DatasetSpec, seed: int, key: str) -> FederatedData:
    """Load, partition, split each client, and lay the samples out client-major."""
    rng = np.random.default_rng([seed, 1])
    raw = load_source(spec.source, seed, spec.partition.column)
    clients = partition(raw.y, raw.groups, spec.partition, rng)
    parts = [split_client(idx, raw.y, spec.split, rng) for idx in clients]
    order = np.concatenate([p[s] for p in parts for s in SPLITS])
    sizes = {s: torch.tensor([len(p[s]) for p in parts], dtype=torch.int64) for s in SPLITS}
    totals = sizes["train"] + sizes["val"] + sizes["test"]
    starts = torch.cumsum(totals, 0) - totals
    offsets = {"train": starts, "val": starts + sizes["train"], "test": starts + sizes["train"] + sizes["val"]}
    x = torch.from_numpy(raw.x[order])
    if spec.normalize:
        train = torch.from_numpy(raw.x[np.concatenate([p["train"] for p in parts])])
        x = (x - train.mean(0)) / train.std(0).clamp_min(1e-6)
    natural = spec.partition.kind == "natural"
    names = [str(raw.groups[c[0]]) if natural else str(i) for i, c in enumerate(clients)]
    return FederatedData(x.contiguous(), torch.from_numpy(raw.y[order]), offsets, sizes, raw.num_classes,
                         raw.feature_shape, names, key)
