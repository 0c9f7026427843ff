"""Partitioners (samples -> clients) and the per-client train/val/test split.

A partitioner takes (labels, groups, spec, rng) and returns the sample indices of each client, sorted.
"""

from __future__ import annotations

import numpy as np

from fedpilot.data.config import PartitionSpec, SplitSpec
from fedpilot.errors import SpecError

MAX_TRIES = 100  # per-class Dirichlet draws before giving up on min_size


def partition(labels: np.ndarray, groups: np.ndarray | None, spec: PartitionSpec,
              rng: np.random.Generator) -> list[np.ndarray]:
    """Sample indices of each client; every client holds at least spec.min_size samples."""
    n = len(labels)
    if spec.clients is not None and spec.clients > n:
        raise SpecError("dataset.partition.clients", spec.clients, f"more clients than samples ({n})")
    if spec.kind == "natural":
        return natural(groups, spec, rng)
    if spec.kind == "dirichlet":
        clients = dirichlet(labels, spec, rng) if spec.balanced else dirichlet_per_class(labels, spec, rng)
    else:
        clients = {"iid": iid, "shards": shards}[spec.kind](labels, spec, rng)
    sizes = np.array([len(c) for c in clients])
    if sizes.min() < spec.min_size:
        raise SpecError("dataset.partition.min_size", spec.min_size,
                        f"{int((sizes < spec.min_size).sum())} client(s) would have fewer samples (smallest: "
                        f"{sizes.min()}); use fewer clients or a smaller min_size")
    return [np.sort(c) for c in clients]


def natural(groups: np.ndarray | None, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """One client per distinct group value, in sorted order of the value. Groups smaller than min_size are
    dropped (as LEAF does); `clients` keeps a seeded random choice of that many of the rest, in the same order."""
    if groups is None:
        raise SpecError("dataset.partition.kind", "natural", "this source has no natural client column "
                        "(set dataset.source.partition_column)", allowed=["iid", "dirichlet", "shards"])
    values, owner = np.unique(groups, return_inverse=True)
    kept = [members for members in _members(owner, len(values)) if len(members) >= spec.min_size]
    if not kept:
        raise SpecError("dataset.partition.min_size", spec.min_size, "no natural client has that many samples")
    if spec.clients is not None:
        if spec.clients > len(kept):
            raise SpecError("dataset.partition.clients", spec.clients,
                            f"only {len(kept)} natural clients have >= min_size ({spec.min_size}) samples")
        kept = [kept[i] for i in np.sort(rng.permutation(len(kept))[: spec.clients])]
    return kept


def iid(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation cut into `clients` parts of equal size (+-1)."""
    return np.array_split(rng.permutation(len(labels)), spec.clients)


def dirichlet(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Hsu et al. 2019: client k draws label proportions q_k ~ Dir(alpha * K * p) (p: global label frequencies,
    so alpha is the per-class concentration when classes are balanced) and takes n / clients samples (+-1) class by
    class from what is left. A class that runs out is dropped from q_k, which is renormalised."""
    classes, counts = np.unique(labels, return_counts=True)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in classes]
    used = np.zeros(len(classes), dtype=np.int64)
    clients = []
    for size in (len(part) for part in np.array_split(np.arange(len(labels)), spec.clients)):
        q = rng.dirichlet(spec.alpha * len(classes) * counts / counts.sum())
        taken: list[np.ndarray] = []
        while size > 0:
            left = counts - used
            weights = q * (left > 0)
            weights = weights if weights.sum() > 0 else (left > 0).astype(float)
            draw = np.minimum(rng.multinomial(size, weights / weights.sum()), left)
            for c in np.flatnonzero(draw):
                taken.append(pools[c][used[c] : used[c] + draw[c]])
                used[c] += draw[c]
            size -= int(draw.sum())
        clients.append(np.concatenate(taken))
    return clients


def dirichlet_per_class(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """Yurochkin et al. 2019 / NIID-Bench: each class is split across clients by p ~ Dir(alpha), skipping clients
    that already hold n / clients samples; the whole draw is repeated until every client has min_size samples."""
    n, k = len(labels), spec.clients
    for _ in range(MAX_TRIES):
        owner = np.empty(n, dtype=np.int64)
        sizes = np.zeros(k, dtype=np.int64)
        for c in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == c))
            open_ = sizes < n / k
            p = rng.dirichlet(np.full(k, spec.alpha)) * open_
            p = p if p.sum() > 0 else open_.astype(float)
            cuts = (np.cumsum(p / p.sum()) * len(members)).astype(np.int64)[:-1]
            owner[members] = np.searchsorted(cuts, np.arange(len(members)), side="right")
            sizes += np.bincount(owner[members], minlength=k)
        if sizes.min() >= spec.min_size:
            return _members(owner, k)
    raise SpecError("dataset.partition.min_size", spec.min_size,
                    f"no per-class Dirichlet draw in {MAX_TRIES} tries gave every client that many samples "
                    f"(smallest client in the last: {sizes.min()}); use fewer clients, a larger alpha, a smaller "
                    "min_size or balanced: true")


def shards(labels: np.ndarray, spec: PartitionSpec, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al. 2017 with single-class shards: each class is cut into shards (as many as its share of
    clients * classes_per_client, at least one) and each client gets classes_per_client random shards."""
    classes, counts = np.unique(labels, return_counts=True)
    total = spec.clients * spec.classes_per_client
    if total < len(classes):
        raise SpecError("dataset.partition.classes_per_client", spec.classes_per_client,
                        f"clients * classes_per_client = {total} shards cannot cover {len(classes)} classes")
    if total > len(labels):
        raise SpecError("dataset.partition.classes_per_client", spec.classes_per_client,
                        f"clients * classes_per_client = {total} shards, more than the {len(labels)} samples")
    pieces = [piece for c, m in zip(classes, _apportion(counts, total), strict=True)
              for piece in np.array_split(rng.permutation(np.flatnonzero(labels == c)), m)]
    assignment = rng.permutation(total).reshape(spec.clients, spec.classes_per_client)
    return [np.concatenate([pieces[i] for i in row]) for row in assignment]


def _apportion(counts: np.ndarray, total: int) -> np.ndarray:
    """`total` split in proportion to `counts`, at least one each, by largest remainders."""
    share = counts * (total - len(counts)) / counts.sum()
    out = 1 + np.floor(share).astype(np.int64)
    out[np.argsort(-(share % 1), kind="stable")[: total - out.sum()]] += 1
    return out


def _members(owner: np.ndarray, k: int) -> list[np.ndarray]:
    """Sorted sample indices of each of k owners."""
    order = np.argsort(owner, kind="stable")
    return np.split(order, np.cumsum(np.bincount(owner, minlength=k))[:-1])


def split_client(indices: np.ndarray, labels: np.ndarray, spec: SplitSpec, rng: np.random.Generator,
                 redraw: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """train/val/test of one client. Sizes: val = round(val * n) and test = round(test * n) (half to even), train
    the rest; when that leaves no train sample, the larger of test/val gives one up. Test is cut off first (by
    `rng`), then val: by `rng` too, or with `redraw` = (the run's seed, the client's index) by a generator of its
    own, so that the test cut is the same for every run seed."""
    n = len(indices)
    n_val, n_test = round(spec.val * n), round(spec.test * n)
    while n - n_val - n_test < 1:
        n_test, n_val = (n_test - 1, n_val) if n_test >= n_val else (n_test, n_val - 1)
    seed = int(rng.integers(2**31))
    rest, test = _cut(indices, n_test, labels, seed)
    val_seed = seed + 1 if redraw is None else int(np.random.default_rng([*redraw, 2]).integers(2**31))
    train, val = _cut(rest, n_val, labels, val_seed)
    return {"train": train, "val": val, "test": test}


def _cut(indices: np.ndarray, size: int, labels: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(rest, `size` samples) of `indices`: stratified by label when every class has >= 2 samples and both
    parts can hold every class, else a plain seeded shuffle split."""
    from sklearn.model_selection import train_test_split  # scikit-learn only when a dataset is built

    if size == 0:
        return indices, indices[:0]
    own = labels[indices]
    classes, counts = np.unique(own, return_counts=True)
    stratify = own if counts.min() >= 2 and min(size, len(indices) - size) >= len(classes) else None
    keep, cut = train_test_split(indices, test_size=size, random_state=seed, stratify=stratify)
    return np.sort(keep), np.sort(cut)
