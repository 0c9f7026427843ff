"""build_federated_data: client-major layout, determinism, the disk cache, normalisation, summaries, configs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest

from fedpilot.data.config import DatasetSpec
from fedpilot.data.federated import FederatedData, build_federated_data
from fedpilot.data.summary import describe, format_summary
from fedpilot.errors import SpecError
from fedpilot.spec import compose_pipeline

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import hashlib, sys; from fedpilot.data.config import DatasetSpec; "
         "from fedpilot.data.federated import build_federated_data; "
         "d = build_federated_data(DatasetSpec.from_dict({'source': {'kind': 'digits'}, 'partition': "
         "{'kind': 'dirichlet', 'alpha': 0.3, 'clients': 30}}), 0, sys.argv[1]); "
         "print(hashlib.sha256(d.x.tobytes() + d.y.tobytes()).hexdigest())")


def digits(cache: Path, seed: int = 0, split: dict | None = None, **partition) -> FederatedData:
    spec = {"source": {"kind": "digits"}, "partition": partition, **({"split": split} if split else {})}
    return build_federated_data(DatasetSpec.from_dict(spec), seed=seed, cache_dir=cache)


def test_client_major_layout(tmp_path):
    data = digits(tmp_path, kind="dirichlet", clients=30, alpha=0.3)
    covered = np.zeros(len(data.y), dtype=np.int64)
    for split in ("train", "val", "test"):
        for c in range(data.n_clients):
            covered[data.rows(split, c)] += 1
    assert np.all(covered == 1) and data.x.shape == (1797, 1, 8, 8) and data.y.dtype == np.int64
    assert np.array_equal(data.offsets["val"], data.offsets["train"] + data.sizes["train"])
    assert np.array_equal(data.offsets["test"], data.offsets["val"] + data.sizes["val"])
    assert np.array_equal(data.offsets["train"][1:], data.offsets["test"][:-1] + data.sizes["test"][:-1])
    assert data.client_names == [str(i) for i in range(30)] and data.n_clients == 30
    assert isinstance(data.x, np.memmap)  # memory-mapped from the cache, not read into memory


def test_same_seed_same_tensors_other_seed_differs(tmp_path):
    a = digits(tmp_path / "a", kind="dirichlet", clients=30, alpha=0.3)
    b = digits(tmp_path / "b", kind="dirichlet", clients=30, alpha=0.3)
    c = digits(tmp_path / "c", seed=1, kind="dirichlet", clients=30, alpha=0.3)
    assert not a.cache_hit and not b.cache_hit and a.fingerprint == b.fingerprint != c.fingerprint
    assert np.array_equal(a.x, b.x) and np.array_equal(a.y, b.y)
    assert np.array_equal(a.sizes["train"], b.sizes["train"]) and not np.array_equal(a.y, c.y)


def test_identical_in_a_fresh_process(tmp_path):
    here = digits(tmp_path / "here", kind="dirichlet", clients=30, alpha=0.3)
    expected = hashlib.sha256(here.x.tobytes() + here.y.tobytes()).hexdigest()
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "there")], check=True, capture_output=True,
                         text=True).stdout.strip()
    assert out == expected


def test_cache_hit_and_fingerprint(tmp_path):
    first = digits(tmp_path, kind="dirichlet", clients=100, alpha=0.3)
    start = time.perf_counter()
    second = digits(tmp_path, kind="dirichlet", clients=100, alpha=0.3)
    assert time.perf_counter() - start < 1.0
    assert second.cache_hit and not first.cache_hit and [p.name for p in tmp_path.iterdir()] == [first.fingerprint]
    assert {p.name for p in (tmp_path / first.fingerprint).iterdir()} == {"x.npy", "y.npy", "index.npz", "meta.json",
                                                                           "samples.npz", "summary.json"}
    assert np.array_equal(first.y, second.y) and np.array_equal(first.x, second.x)
    assert first.feature_shape == second.feature_shape
    other_split = digits(tmp_path, kind="dirichlet", clients=100, alpha=0.3,
                         split={"train": 0.8, "val": 0.1, "test": 0.1})
    other_seed = digits(tmp_path, seed=3, kind="dirichlet", clients=100, alpha=0.3)
    assert len({first.fingerprint, other_split.fingerprint, other_seed.fingerprint}) == 3


def test_spec_seed_overrides_the_pipeline_seed(tmp_path):
    spec = DatasetSpec.from_dict({"source": {"kind": "digits"}, "partition": {"kind": "iid", "clients": 5}, "seed": 7})
    assert build_federated_data(spec, 0, tmp_path).fingerprint == build_federated_data(spec, 1, tmp_path).fingerprint


def test_default_cache_dir_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "env"))
    spec = DatasetSpec.from_dict({"source": {"kind": "digits"}, "partition": {"kind": "iid", "clients": 5}})
    data = build_federated_data(spec, 0)
    assert (tmp_path / "env" / "data" / data.fingerprint / "meta.json").exists()


def test_normalize_standardises_train_features(tmp_path):
    spec = {"source": {"kind": "synthetic", "n_clients": 20, "dim": 8}, "normalize": True}
    data = build_federated_data(DatasetSpec.from_dict(spec), 0, tmp_path)
    train = np.concatenate([data.x[data.rows("train", c)] for c in range(data.n_clients)])
    np.testing.assert_allclose(train.mean(0), np.zeros(8), atol=1e-4)
    np.testing.assert_allclose(train.std(0), np.ones(8), atol=1e-4)


def test_describe_and_format_summary(tmp_path):
    summary = describe(digits(tmp_path, kind="dirichlet", clients=20, alpha=0.3))
    json.dumps(summary)
    assert summary["clients"] == 20 and summary["num_classes"] == 10 and summary["feature_shape"] == [1, 8, 8]
    assert sum(summary["samples"].values()) == 1797
    train = summary["sizes"]["train"]
    assert (train["min"] <= train["p10"] <= train["p25"] <= train["median"] <= train["p75"] <= train["p90"]
            <= train["max"])
    assert 1 <= summary["classes_per_client"]["min"] <= summary["classes_per_client"]["max"] <= 10
    iid = describe(digits(tmp_path, kind="iid", clients=20))
    assert iid["label_skew"] < 0.2 < summary["label_skew"] < 1
    text = format_summary(summary)
    assert "clients 20" in text and "label skew" in text and "train samples" in text


@pytest.mark.parametrize("name", ["digits", "synthetic", "femnist"])
def test_dataset_config_groups_compose(tmp_path, name):
    pipeline = tmp_path / "p.yaml"
    pipeline.write_text(f"defaults: [{{dataset: {name}}}, _self_]\nseed: 0\n")
    dataset = compose_pipeline(pipeline)["dataset"]
    spec = DatasetSpec.from_dict(dataset)
    assert set(dataset) == {"source", "partition", "split"} and spec.source.kind == dataset["source"]["kind"]
    if name == "digits":
        assert dataset["partition"] == {"kind": "dirichlet", "alpha": 0.3, "clients": 100, "min_size": 10}


def mapping_flags(path: Path) -> list[set[str]]:
    """The kernel's VmFlags of each mapping of `path` in this process (/proc/self/smaps)."""
    flags, current = [], None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and not fields[0].endswith(":"):
            current = fields[5] if len(fields) > 5 else None
        elif fields[0] == "VmFlags:" and current == str(path):
            flags.append(set(fields[1:]))
    return flags


@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="Linux reports a mapping's advice in smaps")
def test_cached_arrays_are_mapped_for_random_access(tmp_path):
    data = digits(tmp_path, kind="iid", clients=5)
    flags = mapping_flags(Path(data.x.filename).resolve())
    assert flags and all("rr" in f for f in flags)  # MADV_RANDOM: no read-around of megabytes per fault


def test_normalize_augmentation_of_a_constant_channel_centres_it(tmp_path):
    images = np.random.default_rng(0).random((40, 2, 4, 4))
    images[:, 0] = 0.5
    path = tmp_path / "flat.parquet"
    table = datasets.Dataset.from_dict({"img": images.tolist(), "y": [i % 2 for i in range(40)]})
    table.to_parquet(str(path))
    spec = {"source": {"kind": "hf", "path": str(path), "feature": "img", "label": "y"},
            "partition": {"kind": "iid", "clients": 2}, "augment": ["normalize"]}
    data = build_federated_data(DatasetSpec.from_dict(spec), 0, tmp_path / "cache")
    assert data.mean[0] == pytest.approx(0.5) and data.std[0] == 1e-6 and 0.2 < data.std[1] < 0.4


def test_redrawn_splits_keep_each_clients_test_samples(tmp_path):
    """split.redraw: the run seed re-cuts train / val only; the clients and their test samples are dataset.seed's,
    so no seed trains or validates on another seed's test samples. Without it a seed redraws everything."""
    def build(seed: int, redraw: bool, dataset_seed: int | None = 5) -> FederatedData:
        spec = {"source": {"kind": "digits"}, "partition": {"kind": "dirichlet", "clients": 20, "alpha": 0.5},
                "split": {"redraw": redraw}, "seed": dataset_seed}
        return build_federated_data(DatasetSpec.from_dict(spec), seed=seed, cache_dir=tmp_path)

    one, two = build(1, True), build(2, True)
    assert one.fingerprint != two.fingerprint
    for c in range(20):
        assert np.array_equal(one.samples("test")[c], two.samples("test")[c])
        assert not set(two.samples("test")[c]) & (set(one.samples("train")[c]) | set(one.samples("val")[c]))
        assert np.array_equal(np.sort(np.concatenate([one.samples("train")[c], one.samples("val")[c]])),
                              np.sort(np.concatenate([two.samples("train")[c], two.samples("val")[c]])))
    assert any(not np.array_equal(one.samples("val")[c], two.samples("val")[c]) for c in range(20))
    fixed = build(1, False), build(2, False)  # dataset.seed alone: one federation for every seed
    assert fixed[0].fingerprint == fixed[1].fingerprint
    drawn = build(1, False, None), build(2, False, None)  # no dataset.seed: every seed another federation
    test_of_one = set(np.concatenate(drawn[0].samples("test")))
    assert test_of_one & set(np.concatenate(drawn[1].samples("train") + drawn[1].samples("val")))
    with pytest.raises(SpecError, match="dataset.split.redraw"):
        build(1, True, None)
