"""Small local datasets with the columns of the hub datasets the shipped pipelines name (this suite runs offline),
and the overrides that point each hub pipeline at its stand-in with cohorts that fit it."""

from __future__ import annotations

from pathlib import Path

import datasets
import numpy as np
from PIL import Image

from test_data_sources import femnist_like

WORDS = ["thou", "art", "the", "king", "and", "i", "am", "but", "a", "fool", "to", "love", "thee", "more", "than",
         "all", "the", "world"]


def images(n: int, rng: np.random.Generator) -> list[Image.Image]:
    return [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8), mode="RGB") for _ in range(n)]


def write_hub_copies(root: Path) -> dict[str, Path]:
    """Parquet files with the columns of uoft-cs/cifar10, stanfordnlp/sentiment140, TFF's Stack Overflow,
    flwrlabs/shakespeare and flwrlabs/femnist."""
    rng = np.random.default_rng(0)
    labels = [i % 10 for i in range(200)]
    cifar = datasets.Dataset.from_dict({"img": images(200, rng), "label": labels}, features=datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}))
    tweets = {"text": [" ".join(rng.choice(WORDS, 9)) for _ in range(120)], "sentiment": [0, 4] * 60,
              "user": [f"u{i % 6}" for i in range(120)]}
    sentences = {"tokens": [" ".join(rng.choice(WORDS, 7)) for _ in range(240)],
                 "user_id": [f"{i % 4}" for i in range(240)]}
    snippets = {"x": ["".join(rng.choice(list("abcde "), 80)) for _ in range(200)], "y": ["a"] * 200,
                "character_id": [f"c{i % 5}" for i in range(200)]}
    paths = {}
    for name, table in (("cifar10", cifar), ("sent140", datasets.Dataset.from_dict(tweets)),
                        ("stackoverflow", datasets.Dataset.from_dict(sentences)),
                        ("shakespeare", datasets.Dataset.from_dict(snippets)), ("femnist", femnist_like())):
        paths[name] = root / f"{name}.parquet"
        table.to_parquet(str(paths[name]))
    return paths


HUB = {  # pipeline -> (its stand-in, overrides that fit the stand-in and keep the run short)
    "cifar10-pflego": ("cifar10", ["dataset.partition.clients=10", "model.hidden=16", "stages.0.rounds=2",
                                   "stages.0.clients_per_round=3", "stages.0.params.tau=2"]),
    "cifar10-pfedgate": ("cifar10", ["dataset.partition.clients=5", "dataset.partition.min_size=5",
                                     "model.hidden=16", "stages.0.rounds=2", "stages.0.clients_per_round=3"]),
    "sent140-selffl": ("sent140", ["dataset.partition.clients=null", "model.d_model=8", "model.n_layers=1",
                                   "stages.0.rounds=2", "stages.1.rounds=2", "stages.0.clients_per_round=3",
                                   "stages.1.clients_per_round=3", "stages.1.params.l_max=2"]),
    "stackoverflow-fedalt": ("stackoverflow", ["dataset.partition.clients=null", "dataset.partition.min_size=10",
                                               "model.d_model=16", "model.n_layers=2", "stages.0.rounds=2",
                                               "stages.1.rounds=2", "stages.0.clients_per_round=2",
                                               "stages.1.clients_per_round=2", "stages.2.local.epochs=1"]),
    "shakespeare-fedavg": ("shakespeare", ["dataset.partition.clients=null", "dataset.partition.min_size=10",
                                           "model.hidden=8", "model.layers=1",
                                           "stages.0.rounds=2", "stages.0.clients_per_round=2"]),}
# validated on its stand-in, run by test_data_sources
VALIDATED = {**HUB, "femnist-fedalt": ("femnist", ["dataset.partition.clients=6", "stages.0.clients_per_round=6",
                                                  "stages.1.clients_per_round=6"])}
