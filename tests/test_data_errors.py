"""User errors in a dataset spec name the dotted key, the bad value and what is allowed."""

from __future__ import annotations

import pytest

from fedpilot.data import DatasetSpec, build_federated_data
from fedpilot.errors import SpecError

DIGITS = {"kind": "digits"}


@pytest.mark.parametrize(("dataset", "message"), [
    ({"source": {"kind": "digit"}}, r"^dataset.source.kind='digit': unknown source kind \(allowed: synthetic, "
                                    r"digits, sklearn, shakespeare, hf\); did you mean 'digits'\?"),
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
])
def test_spec_errors(dataset, message):
    with pytest.raises(SpecError, match=message):
        DatasetSpec.from_dict(dataset)


@pytest.mark.parametrize(("partition", "message"), [
    ({"kind": "iid", "clients": 5000}, r"^dataset.partition.clients=5000: more clients than samples \(1797\)"),
    ({"kind": "iid", "clients": 500}, r"^dataset.partition.min_size=10: 500 client\(s\) would have fewer samples"),
    ({"kind": "shards", "clients": 1797, "min_size": 1}, r"^dataset.partition.min_size=1: .*smallest: 0"),
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
