"""User errors in a dataset spec name the dotted key, the bad value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
import pytest

from fedpilot.data.config import DatasetSpec, Source
from fedpilot.data.federated import build_federated_data
from fedpilot.data.sources import RawData
from fedpilot.errors import SpecError

DIGITS = {"kind": "digits"}


@pytest.mark.parametrize(("dataset", "message"), [
    ({"source": {"kind": "digit"}}, r"^dataset.source.kind='digit': unknown source kind \(allowed: synthetic, "
                                    r"digits, sklearn, shakespeare, hf, shifted_digits\); did you mean 'digits'\?"),
    ({"source": {}}, r"dataset.source.kind=None: unknown source kind"),
    ({"sorce": DIGITS}, r"^dataset.sorce=\{'kind': 'digits'\}: unknown key.*did you mean 'source'"),
    ({"source": {"kind": "hf", "feature": "image", "label": "y"}}, r"^dataset.source.path=None: required"),
    ({"source": {"kind": "hf", "path": "p", "feature": "f", "label": "y", "partitoin_column": "w"}},
     r"^dataset.source.partitoin_column='w': unknown key.*did you mean 'partition_column'"),
    ({"source": DIGITS, "partition": {"kind": "dirichlet", "alpha": 0, "clients": 5}},
     r"^dataset.partition.alpha=0: .*greater than 0"),
    ({"source": DIGITS, "partition": {"kind": "dirichelt", "clients": 5}},
     r"^dataset.partition.kind='dirichelt'.*allowed: natural, iid, dirichlet, shards.*did you mean 'dirichlet'"),
    ({"source": DIGITS, "partition": {"kind": "iid"}}, r"^dataset.partition.clients=None: required"),
    ({"source": DIGITS, "partition": {"kind": "iid", "clients": 5, "alfa": 1}},
     r"^dataset.partition.alfa=1: unknown key.*did you mean 'alpha'"),
    ({"source": DIGITS, "partition": {"kind": "iid", "clients": 5}, "split": {"train": 0.5, "val": 0.2, "test": 0.2}},
     r"^dataset.split=.*fractions must sum to 1, not 0.9"),
    ({"source": DIGITS, "split": {"train": 1.5, "val": 0, "test": -0.5}}, r"^dataset.split.train=1.5"),
    ({"source": DIGITS, "partition": {"kind": "iid", "clients": 5}, "normalise": True},
     r"^dataset.normalise=True: unknown key.*did you mean 'normalize'"),
    ({"source": DIGITS, "split": {"train": 1.0, "val": 0, "test": 0}},
     r"^dataset.split.test=0.0: must be > 0: every stage records each client's test metrics"),
    ({"source": DIGITS, "partition": {"kind": "dirichlet", "alpha": 1e308, "clients": 5}},
     r"^dataset.partition.alpha=1e\+308: must be at most 1e\+300 \(numpy's Dirichlet draws zeros or nan"),
    ({"source": DIGITS, "seed": -1}, r"^dataset.seed=-1: .*greater than or equal to 0"),
    ({"source": {"kind": "synthetic", "seed": 2**32}},
     r"^dataset.source.seed=4294967296: must be at most 4294967295 \(numpy's RandomState and scikit-learn"),
    ({"source": {"kind": "synthetic", "beta": 1e300}}, r"^dataset.source.beta=1e\+300: must be at most"),
    ({"source": {"kind": "synthetic", "alpha": 1e31}}, r"^dataset.source.alpha=1e\+31: must be at most"),
    ({"source": {"kind": "synthetic", "max_size": 10**20}},
     r"^dataset.source.max_size=100000000000000000000: must be at most 9007199254740992"),
    ({"source": DIGITS, "text": {"vocab_size": 2**32 + 1}},
     r"^dataset.text.vocab_size=4294967297: must be at most 4294967296 \(Hugging Face tokenizers"),
    ({"source": DIGITS, "augment": [{"kind": "normalize", "std": [0]}]},
     r"^dataset.augment.0.std.0=0: .*greater than 0"),
])
def test_spec_errors(dataset, message):
    with pytest.raises(SpecError, match=message):
        DatasetSpec.from_dict(dataset)


@pytest.mark.parametrize(("partition", "message"), [
    ({"kind": "iid", "clients": 5000}, r"^dataset.partition.clients=5000: more clients than samples \(1797\)"),
    ({"kind": "iid", "clients": 500}, r"^dataset.partition.min_size=10: 500 client\(s\) would have fewer samples"),
    ({"kind": "shards", "clients": 898, "min_size": 3}, r"^dataset.partition.min_size=3: .*smallest: 2"),
    ({"kind": "shards", "clients": 1797, "min_size": 1},
     r"^dataset.partition.classes_per_client=2: .* 3594 shards, more than the 1797 samples"),
    ({"kind": "dirichlet", "alpha": 0.3, "clients": 100, "balanced": False},
     r"^dataset.partition.min_size=10: no per-class Dirichlet draw in 100 tries"),
    ({"kind": "shards", "clients": 2, "classes_per_client": 2},
     r"^dataset.partition.classes_per_client=2: .* 4 shards cannot cover 10 classes"),
    ({"kind": "natural"}, r"^dataset.partition.kind='natural': this source has no natural client column"),
    ({"kind": "natural", "column": "writer"}, r"^dataset.partition.column='writer': no such column in a digits"),
])
def test_partition_errors(tmp_path, partition, message):
    with pytest.raises(SpecError, match=message):
        build_federated_data(DatasetSpec.from_dict({"source": DIGITS, "partition": partition}), 0, tmp_path)
    assert not list(tmp_path.iterdir())


def test_natural_errors_on_synthetic(tmp_path):
    source = {"kind": "synthetic", "n_clients": 5, "dim": 4}
    for partition, message in [({"column": "clients"}, r"column='clients'.*allowed: client.*did you mean 'client'"),
                               ({"clients": 6}, r"clients=6: only 5 natural clients"),
                               ({"min_size": 10**6}, r"min_size=1000000: no natural client has that many")]:
        with pytest.raises(SpecError, match=message):
            build_federated_data(DatasetSpec.from_dict({"source": source, "partition": partition}), 0, tmp_path)


@pytest.fixture(scope="module")
def odd_values(tmp_path_factory) -> str:
    """A parquet file with finite columns (x, y) and columns holding nan, inf or nulls."""
    n, rng = 40, np.random.default_rng(0)
    target = rng.normal(size=n)
    target[[3, 7]] = np.nan
    vector = rng.normal(size=(n, 3))
    vector[5, [0, 2]], vector[9, 1] = np.inf, -np.inf
    image = rng.random((n, 1, 4, 4))
    image[2, 0, 1, 1] = np.nan
    table = datasets.Dataset.from_dict({
        "x": rng.normal(size=(n, 2)).tolist(), "y": [i % 2 for i in range(n)], "target": target.tolist(),
        "vector": vector.tolist(), "image": image.tolist(),
        "name": [None if i == 4 else f"c{i % 2}" for i in range(n)],
        "text": [None if i == 6 else "a b c" for i in range(n)], "words": ["a b c"] * n,
        "pairs": [None if i == 8 else [1.0, 2.0] for i in range(n)],
        "holes": [None if i == 1 else float("nan") if i == 2 else i / n for i in range(n)]})
    path = tmp_path_factory.mktemp("odd") / "odd.parquet"
    table.to_parquet(str(path))
    return str(path)


@pytest.mark.parametrize(("source", "extra", "message"), [
    ({"feature": "x", "label": "target"}, {"task": "regression"},
     r"^dataset.source.label='target': 2 value\(s\) are missing or not finite \(null, inf or nan\) in 2 "),
    ({"feature": "vector", "label": "y"}, {}, r"^dataset.source.feature='vector': 3 value\(s\) .* in 2 sam"),
    ({"feature": "image", "label": "y"}, {}, r"^dataset.source.feature='image': 1 value\(s\) .* in 1 sample"),
    ({"feature": "x", "label": "name"}, {}, r"^dataset.source.label='name': 1 value\(s\) are missing"),
    ({"feature": "x", "label": "holes"}, {"task": "regression"}, r"^dataset.source.label='holes': 2 value.* in 2 "),
    ({"feature": "text", "label": "y"}, {"text": {"tokenizer": "word"}},
     r"^dataset.source.feature='text': 1 value"),
    ({"feature": "x", "label": "pairs"}, {"task": "regression"},
     r"^dataset.source.label='pairs': cannot be made one array of numbers"),
])
def test_missing_and_non_finite_values_are_refused(odd_values, tmp_path, source, extra, message):
    spec = DatasetSpec.from_dict({"source": {"kind": "hf", "path": odd_values, **source},
                                  "partition": {"kind": "iid", "clients": 2}, **extra})
    with pytest.raises(SpecError, match=message):
        build_federated_data(spec, 0, tmp_path)
    assert not list(tmp_path.iterdir())


class Unfinished(Source):
    """A plugin source whose features or targets hold a nan or an inf, or whose scale is nan."""

    kind: str = "unfinished"
    where: str = "x"

    def load(self, seed: int, downloads: Path) -> RawData:
        x, y = np.ones((40, 3), dtype=np.float32), np.linspace(0, 1, 40)
        if self.where == "x":
            x[4, 1:] = np.inf
        elif self.where == "y":
            y[7] = np.nan
        return RawData(x, y, None, (3,), scale=float("nan") if self.where == "scale" else 1.0)


@pytest.mark.parametrize(("where", "message"), [
    ("x", r"^dataset.source.kind='unfinished': in its features \(RawData.x\), 2 value\(s\) .* in 1 sample"),
    ("y", r"^dataset.source.kind='unfinished': in its targets \(RawData.y\), 1 value\(s\) are missing"),
    ("scale", r"^dataset.source.kind='unfinished': .* returned scale=nan: the inputs are multiplied by it")])
def test_a_plugin_sources_non_finite_values_are_refused(tmp_path, where, message):
    spec = DatasetSpec.from_dict({"source": Unfinished(where=where), "task": "regression",
                                  "partition": {"kind": "iid", "clients": 2}})
    with pytest.raises(SpecError, match=message):
        build_federated_data(spec, 0, tmp_path)
    assert not list(tmp_path.iterdir())


def test_a_federation_without_a_test_sample_is_refused(tmp_path):
    spec = DatasetSpec.from_dict({"source": DIGITS, "partition": {"kind": "iid", "clients": 179},
                                  "split": {"train": 0.76, "val": 0.2, "test": 0.04}})
    with pytest.raises(SpecError, match=r"^dataset.split.test=0.04: 0 of 179 clients get a test sample"):
        build_federated_data(spec, 0, tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("dataset", "message"), [
    ({"source": DIGITS, "partition": {"kind": "shards", "clients": 2, "classes_per_client": 10**9}},
     r"^dataset.partition.classes_per_client=1000000000: .* 2000000000 shards, more than the 1797 samples"),
    ({"source": {"kind": "synthetic", "n_clients": 10**14}},
     r"^dataset.source=\{'n_clients': 100000000000000, .*: 5,000,000,000,000,000 samples .* this machine"),
    ({"source": {"kind": "synthetic", "n_clients": 5, "dim": 10**14}}, r"^dataset.source=.*of memory$"),
    ({"source": {"kind": "synthetic", "n_clients": 5, "classes": 10**14}}, r"^dataset.source=.*of memory$"),
    ({"source": {"kind": "synthetic", "n_clients": 5, "mean_size": 30, "max_size": 2**53}},
     r"^dataset.source=.*'mean_size': 30.0.*of memory$"),
    ({"source": {"kind": "hf", "path": "@odd", "feature": "words", "label": "y"}, "text": {"seq_len": 10**11},
      "partition": {"kind": "iid", "clients": 2}},
     r"^dataset.text.seq_len=100000000000: 40 sequences of 100,000,000,000 tokens would take about"),
    ({"source": {"kind": "hf", "path": "@odd", "feature": "words"}, "task": "next_token",
      "text": {"seq_len": 10**20}, "partition": {"kind": "iid", "clients": 2}},
     r"^dataset.text.seq_len=100000000000000000000: 6 sequences"),
    ({"source": DIGITS, "partition": {"kind": "iid", "clients": 5},
      "augment": [{"kind": "random_crop", "padding": 8}]},
     r"^dataset.augment.0.padding=8: a crop of images \(1, 8, 8\) padded this much could hold none of their"),
])
def test_numbers_too_large_for_the_data_or_the_machine(odd_values, tmp_path, dataset, message):
    if "path" in dataset["source"]:
        dataset["source"]["path"] = odd_values
    with pytest.raises(SpecError, match=message):
        build_federated_data(DatasetSpec.from_dict(dataset), 0, tmp_path)
    assert not list(tmp_path.iterdir())
