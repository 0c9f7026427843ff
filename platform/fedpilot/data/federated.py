"""Client-major tensors for the engine, built once and cached on disk by fingerprint."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from fedpilot.data.config import DatasetSpec
from fedpilot.data.partition import partition, split_client
from fedpilot.data.sources import load_source

FORMAT_VERSION = 1
SPLITS = ("train", "val", "test")


@dataclass
class FederatedData:
    """All samples in one tensor, client after client (each client's train, val, test samples in a row),
    with per-split offsets and sizes [n_clients] into it."""

    x: torch.Tensor
    y: torch.Tensor
    offsets: dict[str, torch.Tensor]
    sizes: dict[str, torch.Tensor]
    num_classes: int
    feature_shape: tuple[int, ...]
    client_names: list[str]
    fingerprint: str
    cache_hit: bool = field(default=False, compare=False)

    @property
    def n_clients(self) -> int:
        return len(self.client_names)

    def to(self, device: torch.device | str) -> FederatedData:
        move = {k: v.to(device) for k, v in self.offsets.items()}, {k: v.to(device) for k, v in self.sizes.items()}
        return replace(self, x=self.x.to(device), y=self.y.to(device), offsets=move[0], sizes=move[1])

    def split_indices(self, split: str, client: int) -> torch.Tensor:
        start = int(self.offsets[split][client])
        return torch.arange(start, start + int(self.sizes[split][client]))

    def state(self) -> dict:
        return {"x": self.x, "y": self.y, "offsets": self.offsets, "sizes": self.sizes,
                "num_classes": self.num_classes, "feature_shape": list(self.feature_shape),
                "client_names": self.client_names, "fingerprint": self.fingerprint}


def fingerprint(spec: DatasetSpec, seed: int) -> str:
    """Hash of everything that determines the tensors: spec, effective seed, storage format."""
    blob = json.dumps({"spec": spec.model_dump(mode="json"), "seed": seed, "format": FORMAT_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("FEDPILOT_CACHE", ".fedpilot-cache/data"))


def build_federated_data(spec: DatasetSpec, seed: int, cache_dir: Path | None = None) -> FederatedData:
    """The federated dataset of `spec` (its own seed, else `seed`), from the cache when built before."""
    seed = spec.seed if spec.seed is not None else seed
    key = fingerprint(spec, seed)
    path = Path(cache_dir or default_cache_dir()) / f"{key}.pt"
    if path.exists():
        state = torch.load(path, weights_only=True)
        state["feature_shape"] = tuple(state["feature_shape"])
        return FederatedData(**state, cache_hit=True)
    data = _build(spec, seed, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as tmp:
        torch.save(data.state(), tmp)
    os.replace(tmp.name, path)
    return data


def _build(spec: DatasetSpec, seed: int, key: str) -> FederatedData:
    rng = np.random.default_rng([seed, 1])
    raw = load_source(spec.source, seed)
    clients = partition(raw.y, raw.groups, spec.partition, rng)
    parts = [split_client(idx, raw.y, spec.split, rng) for idx in clients]
    order = np.concatenate([p[s] for p in parts for s in SPLITS])
    sizes = {s: torch.tensor([len(p[s]) for p in parts], dtype=torch.long) for s in SPLITS}
    totals = sizes["train"] + sizes["val"] + sizes["test"]
    starts = torch.cumsum(totals, 0) - totals
    offsets = {"train": starts, "val": starts + sizes["train"], "test": starts + sizes["train"] + sizes["val"]}
    x = torch.from_numpy(raw.x[order])
    if spec.normalize:
        train = torch.cat([x[int(o) : int(o) + int(n)] for o, n in zip(offsets["train"], sizes["train"], strict=True)])
        x = (x - train.mean(0)) / train.std(0).clamp_min(1e-6)
    names = _client_names(raw.groups, clients)
    return FederatedData(x.contiguous(), torch.from_numpy(raw.y[order]), offsets, sizes, raw.num_classes,
                         raw.feature_shape, names, key)


def _client_names(groups: np.ndarray | None, clients: list[np.ndarray]) -> list[str]:
    """The natural group value of each client (e.g. a writer id), else its index."""
    if groups is None:
        return [str(i) for i in range(len(clients))]
    return [str(groups[c[0]]) for c in clients]
