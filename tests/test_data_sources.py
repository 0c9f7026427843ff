"""Sources: LEAF synthetic, scikit-learn digits, Hugging Face datasets from disk and parquet (all offline)."""

from __future__ import annotations

import datasets
import numpy as np
import pytest
from PIL import Image

from fedpilot.data.config import DatasetSpec, HFSource, SyntheticSource
from fedpilot.data.federated import build_federated_data, task_targets
from fedpilot.data.sources import digits, hugging_face, synthetic
from fedpilot.errors import SpecError

WRITERS, PER_WRITER = 6, 20


def femnist_like() -> datasets.Dataset:
    """A tiny dataset with FEMNIST's schema: PIL 28x28 `image`, ClassLabel `character`, string `writer_id`."""
    rng = np.random.default_rng(0)
    n = WRITERS * PER_WRITER
    images = [Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8), mode="L") for _ in range(n)]
    features = datasets.Features({"image": datasets.Image(), "writer_id": datasets.Value("string"),
                                  "character": datasets.ClassLabel(num_classes=62)})
    writers = [f"f{(WRITERS - 1 - i // PER_WRITER):04d}" for i in range(n)]  # stored in reverse order
    return datasets.Dataset.from_dict({"image": images, "writer_id": writers,
                                       "character": rng.integers(0, 62, n).tolist()}, features=features)


@pytest.fixture(scope="module")
def femnist_paths(tmp_path_factory) -> dict[str, str]:
    """The FEMNIST-like table saved with save_to_disk, as a DatasetDict, and as parquet."""
    root = tmp_path_factory.mktemp("hf")
    table = femnist_like()
    table.save_to_disk(str(root / "disk"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(root / "dict"))
    table.to_parquet(str(root / "femnist.parquet"))
    return {"disk": str(root / "disk"), "dict": str(root / "dict"), "parquet": str(root / "femnist.parquet"),
            "glob": str(root / "*.parquet")}


def hf(path: str, **extra) -> HFSource:
    return HFSource(path=path, feature="image", label="character", **extra)


def test_synthetic_sizes_clients_and_labels():
    raw = synthetic(SyntheticSource(n_clients=200, dim=20, classes=5), seed=0)
    sizes = np.bincount(raw.groups)
    assert len(sizes) == 200 and sizes.min() >= 50 and sizes.max() <= 2000 and len(raw.y) == sizes.sum()
    assert np.exp(3) < np.median(sizes - 50) < np.exp(5)  # lognormal(4, 2): median e^4
    assert raw.x.shape == (sizes.sum(), 20) and raw.x.dtype == np.float32 and raw.feature_shape == (20,)
    assert raw.y.min() >= 0 and raw.y.max() < 5 and len(np.unique(raw.y)) == 5


def test_synthetic_seed_and_natural_clients(tmp_path):
    a, b = (synthetic(SyntheticSource(n_clients=10), seed=s) for s in (0, 1))
    assert not np.array_equal(a.y[:50], b.y[:50])
    spec = DatasetSpec.from_dict({"source": {"kind": "synthetic", "n_clients": 30, "dim": 20, "classes": 5}})
    data = build_federated_data(spec, seed=0, cache_dir=tmp_path)
    assert data.n_clients == 30 and data.client_names == [str(i) for i in range(30)]


@pytest.mark.parametrize("extreme", [{"mean_size": 800}, {"sigma": 1e300}])
def test_synthetic_sizes_of_extreme_lognormals_stay_within_50_and_max_size(extreme):
    raw = synthetic(SyntheticSource(n_clients=20, dim=3, max_size=300, **extreme), seed=0)
    sizes = np.bincount(raw.groups)
    assert len(sizes) == 20 and sizes.min() >= 50 and sizes.max() <= 300 and len(raw.x) == sizes.sum()


def test_digits_source():
    raw = digits()
    assert raw.x.shape == (1797, 1, 8, 8) and raw.feature_shape == (1, 8, 8) and raw.class_names == 10
    assert raw.x.dtype == np.float32 and raw.x.min() == 0 and raw.x.max() == 1
    assert raw.y.dtype == np.int64 and set(raw.y.tolist()) == set(range(10)) and raw.groups is None


@pytest.mark.parametrize("store", ["disk", "dict", "parquet", "glob"])
def test_hf_images_labels_and_writers(femnist_paths, store):
    raw = hugging_face(hf(femnist_paths[store], partition_column="writer_id"))
    first = np.asarray(femnist_like()[0]["image"])
    assert raw.x.shape == (WRITERS * PER_WRITER, 1, 28, 28) and raw.x.dtype == np.uint8 and raw.scale == 1 / 255
    np.testing.assert_array_equal(raw.x[0, 0], first)  # pixels kept as bytes: a quarter of a float copy
    assert raw.class_names == 62 and raw.y.max() < 62
    assert len(set(raw.groups.tolist())) == WRITERS


@pytest.mark.parametrize("where", ["source", "partition"])
def test_hf_natural_partition_one_client_per_writer(femnist_paths, tmp_path, where):
    source = {"kind": "hf", "path": femnist_paths["disk"], "feature": "image", "label": "character"}
    partition = {"kind": "natural", "min_size": 5}
    (source if where == "source" else partition).update(
        {"partition_column" if where == "source" else "column": "writer_id"})
    data = build_federated_data(DatasetSpec.from_dict({"source": source, "partition": partition}), 0, tmp_path)
    assert data.client_names == [f"f{i:04d}" for i in range(WRITERS)]  # sorted by writer id
    totals = data.sizes["train"] + data.sizes["val"] + data.sizes["test"]
    assert totals.tolist() == [PER_WRITER] * WRITERS and data.feature_shape == (1, 28, 28)


def test_hf_string_labels_numeric_features_rgb_and_max_samples(tmp_path):
    rgb = [Image.new("RGBA", (4, 3), (255, 0, 0, 128)) for _ in range(5)]
    table = datasets.Dataset.from_dict({"vec": [[i, i + 0.5] for i in range(5)], "img": rgb,
                                        "name": ["cat", "ant", "cat", "bee", "ant"], "num": [7, 3, 7, 9, 3]},
                                       features=datasets.Features({"vec": datasets.Sequence(datasets.Value("float64")),
                                                                   "img": datasets.Image(),
                                                                   "name": datasets.Value("string"),
                                                                   "num": datasets.Value("int64")}))
    table.save_to_disk(str(tmp_path / "t"))
    source = HFSource(path=str(tmp_path / "t"), feature="vec", label="name")
    raw = hugging_face(source)
    assert raw.x.shape == (5, 2) and raw.x.dtype == np.float32 and raw.x[1].tolist() == [1, 1.5]
    spec = DatasetSpec(source=source)
    ids, classes = task_targets(raw, spec)
    assert ids.tolist() == [2, 0, 2, 1, 0] and classes == 3  # sorted: ant, bee, cat
    numbers = hugging_face(HFSource(path=str(tmp_path / "t"), feature="vec", label="num"))
    assert task_targets(numbers, spec)[0].tolist() == [1, 0, 1, 2, 0]
    image = hugging_face(HFSource(path=str(tmp_path / "t"), feature="img", label="name", max_samples=2))
    assert image.x.shape == (2, 3, 3, 4) and (image.x[0, :, 0, 0] * image.scale).tolist() == [1, 0, 0]


@pytest.mark.parametrize(("extra", "key"), [({"label": "char"}, "dataset.source.label='char'"),
                                            ({"feature": "img"}, "dataset.source.feature='img'"),
                                            ({"partition_column": "writer"}, "dataset.source.partition_column")])
def test_hf_unknown_column_lists_the_columns(femnist_paths, extra, key):
    with pytest.raises(SpecError, match=rf"{key}.*no such column.*allowed: image, writer_id, character"):
        hugging_face(HFSource(**{"path": femnist_paths["disk"], "feature": "image", "label": "character", **extra}))


def test_hf_unknown_split_and_partition_column(femnist_paths):
    with pytest.raises(SpecError, match=r"dataset.source.split='test'.*allowed: train"):
        hugging_face(hf(femnist_paths["dict"], split="test"))
    with pytest.raises(SpecError, match=r"dataset.partition.column='writer'.*did you mean 'writer_id'"):
        hugging_face(hf(femnist_paths["disk"]), column="writer")
