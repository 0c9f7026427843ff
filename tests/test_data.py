"""The federated data layer: sources, partitioners, splits, determinism, cache, errors."""

from __future__ import annotations

import subprocess
import sys

import datasets
import numpy as np
import pytest
import torch
from PIL import Image

from fedpilot.data import DatasetSpec, build_federated_data, describe, label_skew
from fedpilot.data.summary import label_histograms
from fedpilot.errors import SpecError


def build(tmp_path, seed: int = 0, **dataset):
    return build_federated_data(DatasetSpec.from_dict(dataset), seed=seed, cache_dir=tmp_path)


def digits(tmp_path, seed: int = 0, split=None, **partition):
    return build(tmp_path, seed, source={"kind": "digits"}, partition=partition,
                 **({"split": split} if split else {}))


def check_layout(data) -> None:
    """Client-major: each client's train, val, test blocks are contiguous and cover every sample once."""
    covered = torch.zeros(len(data.y), dtype=torch.long)
    for split in ("train", "val", "test"):
        for c in range(data.n_clients):
            covered[data.split_indices(split, c)] += 1
    assert torch.all(covered == 1)
    torch.testing.assert_close(data.offsets["val"], data.offsets["train"] + data.sizes["train"])


def femnist_like(n_writers: int = 6, per_writer: int = 20) -> datasets.Dataset:
    """A tiny dataset with FEMNIST's schema: PIL 28x28 `image`, ClassLabel `character`, string `writer_id`."""
    rng = np.random.default_rng(0)
    n = n_writers * per_writer
    images = [Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8), mode="L") for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "writer_id": datasets.Value("string"),
                                  "character": datasets.ClassLabel(num_classes=62)})
    return datasets.Dataset.from_dict({"image": images, "writer_id": [f"f{i // per_writer:04d}" for i in range(n)],
                                       "character": rng.integers(0, 62, n).tolist()}, features=features)


def test_digits_source(tmp_path):
    data = digits(tmp_path, kind="iid", clients=20)
    assert len(data.y) == 1797 and data.feature_shape == (1, 8, 8) and data.num_classes == 10
    assert float(data.x.min()) >= 0 and float(data.x.max()) <= 1
    check_layout(data)


def test_synthetic_source(tmp_path):
    data = build(tmp_path, source={"kind": "synthetic", "n_clients": 30, "dim": 20, "classes": 5})
    assert data.n_clients == 30 and data.feature_shape == (20,)
    totals = data.sizes["train"] + data.sizes["val"] + data.sizes["test"]
    assert int(totals.min()) >= 50 and float(totals.float().std()) > 0
    assert int(data.y.min()) >= 0 and int(data.y.max()) < 5
    check_layout(data)


@pytest.mark.parametrize("store", ["disk", "parquet"])
def test_hf_source_natural_partition_by_writer(tmp_path, store):
    table = femnist_like()
    if store == "disk":
        path = tmp_path / "femnist"
        table.save_to_disk(str(path))
    else:
        path = tmp_path / "femnist.parquet"
        table.to_parquet(str(path))
    source = {"kind": "hf", "path": str(path), "feature": "image", "label": "character",
              "partition_column": "writer_id"}
    data = build(tmp_path / "cache", source=source, partition={"kind": "natural", "min_size": 5})
    assert data.n_clients == 6 and data.client_names == [f"f{i:04d}" for i in range(6)]
    assert data.feature_shape == (1, 28, 28) and data.num_classes == 62
    assert int((data.sizes["train"] + data.sizes["val"] + data.sizes["test"]).sum()) == 120
    check_layout(data)


def test_hf_unknown_column_names_the_key(tmp_path):
    path = tmp_path / "femnist"
    femnist_like().save_to_disk(str(path))
    with pytest.raises(SpecError, match=r"dataset.source.label='char'.*did you mean 'character'"):
        build(tmp_path, source={"kind": "hf", "path": str(path), "feature": "image", "label": "char"},
              partition={"kind": "iid", "clients": 2})


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
def test_partitions_are_disjoint_and_complete(tmp_path, kind):
    data = digits(tmp_path, kind=kind, clients=40, alpha=0.5, classes_per_client=2, min_size=5)
    totals = data.sizes["train"] + data.sizes["val"] + data.sizes["test"]
    assert int(totals.sum()) == 1797 and int(totals.min()) >= 5
    check_layout(data)


def test_shards_give_at_most_k_classes(tmp_path):
    data = digits(tmp_path, kind="shards", clients=50, classes_per_client=2, min_size=5)
    for c in range(data.n_clients):
        start = int(data.offsets["train"][c])
        total = int(data.sizes["train"][c] + data.sizes["val"][c] + data.sizes["test"][c])
        assert len(torch.unique(data.y[start : start + total])) <= 3  # k shards may straddle one label boundary


def test_label_skew_grows_as_alpha_falls(tmp_path):
    skews = [label_skew(label_histograms(digits(tmp_path, kind="dirichlet", clients=50, alpha=a, min_size=5)))
             for a in (100.0, 1.0, 0.1)]
    assert skews[0] < skews[1] < skews[2]
    iid = label_skew(label_histograms(digits(tmp_path, kind="iid", clients=50)))
    assert iid < 0.3 and skews[2] > 0.6


def test_same_seed_same_partition_other_seed_differs(tmp_path):
    a = digits(tmp_path / "a", kind="dirichlet", clients=30, alpha=0.3)
    b = digits(tmp_path / "b", kind="dirichlet", clients=30, alpha=0.3)
    c = digits(tmp_path / "c", seed=1, kind="dirichlet", clients=30, alpha=0.3)
    assert not a.cache_hit and not b.cache_hit
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and torch.equal(a.sizes["train"], b.sizes["train"])
    assert not torch.equal(a.y, c.y)


def test_partition_identical_in_a_fresh_process(tmp_path):
    probe = ("from fedpilot.data import DatasetSpec, build_federated_data; import hashlib, sys; "
             "d = build_federated_data(DatasetSpec.from_dict({'source': {'kind': 'digits'}, 'partition': "
             "{'kind': 'dirichlet', 'alpha': 0.3, 'clients': 30}}), 0, sys.argv[1]); "
             "print(hashlib.sha256(d.y.numpy().tobytes() + d.x.numpy().tobytes()).hexdigest())")
    here = digits(tmp_path / "here", kind="dirichlet", clients=30, alpha=0.3)
    import hashlib

    expected = hashlib.sha256(here.y.numpy().tobytes() + here.x.numpy().tobytes()).hexdigest()
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "there")], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert out == expected


def test_cache_hit_and_fingerprint(tmp_path):
    first = digits(tmp_path, kind="iid", clients=10)
    second = digits(tmp_path, kind="iid", clients=10)
    assert second.cache_hit and second.fingerprint == first.fingerprint
    assert torch.equal(first.x, second.x) and first.client_names == second.client_names
    other_split = digits(tmp_path, kind="iid", clients=10, split={"train": 0.8, "val": 0.1, "test": 0.1})
    other_seed = digits(tmp_path, seed=3, kind="iid", clients=10)
    assert len({first.fingerprint, other_split.fingerprint, other_seed.fingerprint}) == 3


def test_split_fractions_are_honoured_and_stratified(tmp_path):
    data = digits(tmp_path, kind="iid", clients=5)
    total = data.sizes["train"] + data.sizes["val"] + data.sizes["test"]
    assert torch.all((data.sizes["val"].float() / total - 0.2).abs() < 0.01)
    hist_train, hist_test = label_histograms(data, "train"), label_histograms(data, "test")
    share = hist_test / (hist_train + hist_test)
    assert np.abs(share - 0.2).max() < 0.12


def test_describe_reports_sizes_and_skew(tmp_path):
    summary = describe(digits(tmp_path, kind="dirichlet", clients=20, alpha=0.3))
    assert summary["clients"] == 20 and sum(summary["samples"].values()) == 1797
    assert summary["sizes"]["train"]["min"] <= summary["sizes"]["train"]["median"] <= summary["sizes"]["train"]["max"]
    assert 0 < summary["label_skew"] < 1 and summary["classes_per_client"]["max"] <= 10


@pytest.mark.parametrize(("dataset", "message"), [
    ({"source": {"kind": "digit"}}, r"dataset.source.kind='digit'.*did you mean 'digits'"),
    ({"source": {"kind": "digits"}, "partition": {"kind": "dirichlet", "alpha": 0, "clients": 5}},
     r"dataset.partition.alpha=0.*> 0"),
    ({"source": {"kind": "digits"}, "partition": {"kind": "iid", "clients": 5000}},
     r"dataset.partition.clients=5000: more clients than samples"),
    ({"source": {"kind": "digits"}, "partition": {"kind": "iid", "clients": 5}, "split": {"train": 0.5, "val": 0.2, "test": 0.2}},
     r"dataset.split=.*sum to 1"),
    ({"source": {"kind": "digits"}, "partition": {"kind": "iid", "clients": 500, "min_size": 10}},
     r"dataset.partition.min_size=10"),
    ({"source": {"kind": "digits"}, "partition": {"kind": "iid", "clients": 5, "alfa": 1}},
     r"dataset.partition.alfa=1: unknown key.*did you mean 'alpha'"),
    ({"source": {"kind": "digits"}, "partition": {"kind": "natural"}}, r"dataset.partition.kind='natural'"),
])
def test_errors_name_the_key_and_value(tmp_path, dataset, message):
    with pytest.raises(SpecError, match=message):
        build(tmp_path, **dataset)
