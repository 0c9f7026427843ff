"""Partitioners and the per-client split, called directly on digits' labels."""

from __future__ import annotations

import numpy as np
import pytest

from fedpilot.data.config import PartitionSpec, SplitSpec
from fedpilot.data.partition import partition, split_client
from fedpilot.data.sources import digits
from fedpilot.data.summary import label_skew

LABELS = digits().y


def cut(labels=LABELS, groups=None, seed: int = 0, **spec) -> list[np.ndarray]:
    return partition(labels, groups, PartitionSpec(**spec), np.random.default_rng(seed))


def skew(clients: list[np.ndarray]) -> float:
    return label_skew(np.stack([np.bincount(LABELS[c], minlength=10) for c in clients]))


@pytest.mark.parametrize("spec", [{"kind": "iid", "clients": 40}, {"kind": "shards", "clients": 40},
                                  {"kind": "dirichlet", "clients": 40, "alpha": 0.3},
                                  {"kind": "dirichlet", "clients": 40, "alpha": 0.3, "balanced": False}])
def test_partitions_are_disjoint_complete_and_min_size(spec):
    clients = cut(min_size=15, **spec)
    everything = np.concatenate(clients)
    assert len(clients) == 40 and len(everything) == len(LABELS)
    assert np.array_equal(np.sort(everything), np.arange(len(LABELS)))
    assert min(len(c) for c in clients) >= 15
    assert all(np.array_equal(c, np.sort(c)) for c in clients)


def test_balanced_dirichlet_gives_equal_sizes_per_class_varies():
    balanced = [len(c) for c in cut(kind="dirichlet", clients=40, alpha=0.3)]
    per_class = [len(c) for c in cut(kind="dirichlet", clients=40, alpha=0.3, balanced=False)]
    assert max(balanced) - min(balanced) <= 1 and max(per_class) - min(per_class) > 10


@pytest.mark.parametrize("balanced", [True, False])
def test_label_skew_grows_as_alpha_falls(balanced):
    skews = [skew(cut(kind="dirichlet", clients=20, alpha=a, balanced=balanced, min_size=5)) for a in (100, 1, 0.1)]
    assert skews[0] < skews[1] < skews[2] and skews[0] < 0.2 and skews[2] > 0.5
    assert skew(cut(kind="iid", clients=20)) < 0.2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_shards_give_at_most_k_classes(k):
    clients = cut(kind="shards", clients=30, classes_per_client=k)
    assert max(len(np.unique(LABELS[c])) for c in clients) <= k
    assert skew(clients) > 0.6


def test_same_seed_same_clients_other_seed_differs():
    a, b, c = (cut(kind="dirichlet", clients=30, alpha=0.3, seed=s) for s in (0, 0, 1))
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_natural_sorted_groups_drops_small_and_subsets():
    groups = np.array(["b"] * 12 + ["a"] * 10 + ["c"] * 3 + ["d"] * 11)
    labels = np.zeros(len(groups), dtype=np.int64)
    clients = cut(labels, groups, kind="natural")
    assert [groups[c[0]] for c in clients] == ["a", "b", "d"]  # "c" (3 < min_size 10) dropped
    assert [len(c) for c in clients] == [10, 12, 11] and all(len(set(groups[c])) == 1 for c in clients)
    picked = [[groups[c[0]] for c in cut(labels, groups, seed=s, kind="natural", clients=2)] for s in range(8)]
    assert all(p == sorted(p) for p in picked) and len({tuple(p) for p in picked}) > 1


def test_split_fractions_and_stratification():
    rng = np.random.default_rng(0)
    for client in cut(kind="iid", clients=5):
        parts = split_client(client, LABELS, SplitSpec(), rng)
        assert np.array_equal(np.sort(np.concatenate(list(parts.values()))), client)
        n = len(client)
        assert [len(parts[s]) for s in ("val", "test")] == [round(0.2 * n)] * 2
        train, test = (np.bincount(LABELS[parts[s]], minlength=10) for s in ("train", "test"))
        assert np.abs(test / (train + test) - 0.2).max() < 0.1  # stratified: each class ~20% in test


@pytest.mark.parametrize(("n", "fractions", "sizes"), [
    (1, (0.6, 0.2, 0.2), (1, 0, 0)), (2, (0.6, 0.2, 0.2), (2, 0, 0)), (3, (0.6, 0.2, 0.2), (1, 1, 1)),
    (18, (0.6, 0.2, 0.2), (10, 4, 4)), (2, (0.1, 0.45, 0.45), (1, 1, 0)), (3, (0.0001, 0.5, 0.4999), (1, 1, 1)),
])
def test_split_rounding_keeps_a_train_sample(n, fractions, sizes):
    spec = SplitSpec(**dict(zip(("train", "val", "test"), fractions, strict=True)))
    parts = split_client(np.arange(n), np.arange(n) % 3, spec, np.random.default_rng(0))
    assert tuple(len(parts[s]) for s in ("train", "val", "test")) == sizes
