"""Partitioners (samples -> clients) and the per-client train/val/test split."""

from __future__ import annotations

import numpy as np
from sklearn.model_selection import train_test_split

from fedpilot.data.config import PartitionSpec, SplitSpec
from fedpilot.errors import SpecError


def partition(labels: np.ndarray, groups: np.ndarray | None, spec: PartitionSpec,
              rng: np.random.Generator) -> list[np.ndarray]:
    """Sample indices of each client."""
    n = len(labels)
    if spec.clients is not None and spec.clients > n:
        raise SpecError("dataset.partition.clients", spec.clients, f"more clients than samples ({n})")
    if spec.kind == "natural":
        clients = natural(groups, spec, rng)
    elif spec.kind == "iid":
        clients = np.array_split(rng.permutation(n), spec.clients)
    elif spec.kind == "dirichlet":
        clients = dirichlet(labels, spec, rng)
    else:
        clients = shards(labels, spec, rng)
    small = [i for i, c in enumerate(clients) if len(c) < spec.min_size]
    if small:
        raise SpecError("dataset.partition.min_size", spec.min_size,
                        f"{len(small)} client(s) have fewer samples (client {small[0]}: {len(clients[small[0]])}); "
                        "use fewer clients or a smaller min_size")
    return [np.sort(c) for c in clients]


def natural(groups: np.ndarray | None, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """One client per distinct group value (sorted); `clients` keeps a seeded choice of that many groups."""
    if groups is None:
        raise SpecError("dataset.partition.kind", "natural", "this source has no natural client column "
                        "(set dataset.source.partition_column)", allowed=["iid", "dirichlet", "shards"])
    values, inverse = np.unique(groups, return_inverse=True)
    keep = np.arange(len(values))
    if spec.clients is not None:
        if spec.clients > len(values):
            raise SpecError("dataset.partition.clients", spec.clients, f"only {len(values)} natural clients")
        keep = np.sort(rng.permutation(len(values))[: spec.clients])
    order = np.argsort(inverse, kind="stable")
    bounds = np.cumsum(np.bincount(inverse, minlength=len(values)))[:-1]
    by_group = np.split(order, bounds)
    return [by_group[g] for g in keep]


def dirichlet(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Hsu et al. 2019: client k draws label proportions q_k ~ Dir(alpha * p) (p: global label frequencies)
    and takes its samples class by class from what is left; clients get equal sizes (+-1), so min_size
    holds whenever n / clients >= min_size. A class that runs out is dropped from q_k and q_k renormalised."""
    classes, counts = np.unique(labels, return_counts=True)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    used = np.zeros(len(classes), dtype=int)
    prior = counts / counts.sum()
    clients = []
    for size in (len(part) for part in np.array_split(np.arange(len(labels)), spec.clients)):
        q = rng.dirichlet(spec.alpha * prior * len(classes))
        taken: list[np.ndarray] = []
        need = size
        while need > 0:
            left = counts - used
            weights = q * (left > 0)
            weights = weights if weights.sum() > 0 else (left > 0).astype(float)
            draw = np.minimum(rng.multinomial(need, weights / weights.sum()), left)
            for c in np.flatnonzero(draw):
                taken.append(pools[c][used[c] : used[c] + draw[c]])
                used[c] += draw[c]
            need -= int(draw.sum())
        clients.append(np.concatenate(taken))
    return clients


def shards(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Sort by label, cut into clients * k shards, give each client k random shards (McMahan et al. 2017)."""
    order = np.lexsort((rng.random(len(labels)), labels))
    pieces = np.array_split(order, spec.clients * spec.classes_per_client)
    assignment = rng.permutation(len(pieces)).reshape(spec.clients, spec.classes_per_client)
    return [np.concatenate([pieces[i] for i in row]) for row in assignment]


def split_client(indices: np.ndarray, labels: np.ndarray, spec: SplitSpec,
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """train/val/test of one client: sizes round(fraction * n) for val and test, train gets the rest (>= 1);
    stratified by label when every class of the client has at least 2 samples per part it must fill."""
    n = len(indices)
    n_val, n_test = round(spec.val * n), round(spec.test * n)
    while n - n_val - n_test < 1:
        n_test, n_val = (n_test - 1, n_val) if n_test >= n_val else (n_test, n_val - 1)
    seed = int(rng.integers(2**31))
    own = labels[indices]
    counts = np.unique(own, return_counts=True)[1]
    stratify = own if counts.min() >= 3 and n_val + n_test >= len(counts) and n - n_val - n_test >= len(counts) else None
    rest, test = _cut(indices, n_test, stratify, seed)
    rest_labels = labels[rest] if stratify is not None else None
    train, val = _cut(rest, n_val, rest_labels, seed + 1)
    return {"train": train, "val": val, "test": test}


def _cut(indices: np.ndarray, size: int, stratify: np.ndarray | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if size == 0:
        return indices, indices[:0]
    try:
        keep, cut = train_test_split(indices, test_size=size, random_state=seed, stratify=stratify)
    except ValueError:  # too few samples of some class to stratify: plain seeded split
        keep, cut = train_test_split(indices, test_size=size, random_state=seed)
    return np.sort(keep), np.sort(cut)
