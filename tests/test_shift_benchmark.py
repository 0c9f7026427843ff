"""The covariate-shift benchmark (issue 33): the `shifted_digits` federation (clients see the same digits through
their own device, drawn from the seed) and the set pipelines/compare/shift.yaml, run reduced (one seed, one round
a stage, two clients) under its matched budget."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from fedpilot.compare.plan import load_plan
from fedpilot.compare.run import prepare_plan, run_comparison
from fedpilot.data.config import DatasetSpec
from fedpilot.data.federated import build_federated_data
from fedpilot.data.shift import ShiftedDigitsSource, devices
from fedpilot.engine.cohort import RoundWork
from fedpilot.spec import load_pipeline

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "pipelines" / "compare" / "shift.yaml"
REDUCED = ["dataset.source.clients=2", "stages.0.rounds=1", "stages.1.rounds=1", "stages.0.clients_per_round=2",
           "stages.1.clients_per_round=2", "tracking.system_metrics=false", "tracking.plots=false"]
GRADIENTS = 4  # minibatch gradients per sampled client per round of a method stage
NAME = re.compile(r"c\d+_rot([+-]\d+)_stroke([+-]\d)_(inv|pos)_noise(\d\.\d\d)")


def shifted(seed: int | None = 3, **source) -> DatasetSpec:
    return DatasetSpec.from_dict({"source": {"kind": "shifted_digits", **source}, "partition": {"kind": "natural"},
                                  "seed": seed})


def test_devices_are_drawn_from_the_seed_and_differ_between_clients():
    spec = ShiftedDigitsSource(clients=12)
    drawn = devices(spec, 0)
    assert drawn == devices(spec, 0) and drawn != devices(spec, 1)
    assert len({(d.rotation, d.stroke, d.invert, d.noise) for d in drawn}) == 12
    assert all(abs(d.rotation) <= 45 and d.stroke in (-1, 0, 1) and 0 <= d.noise <= 0.3 for d in drawn)
    assert {d.invert for d in drawn} == {True, False} and len({d.stroke for d in drawn}) > 1
    assert devices(ShiftedDigitsSource(clients=4), 0) == drawn[:4]  # client k's device does not depend on the count


def test_the_same_seed_builds_the_same_federation_and_another_seed_another(tmp_path):
    one, again = (build_federated_data(shifted(clients=3, samples=40), 0, tmp_path / name) for name in "ab")
    other = build_federated_data(shifted(seed=4, clients=3, samples=40), 0, tmp_path / "c")
    assert not again.cache_hit and one.client_names == again.client_names
    assert np.array_equal(one.x, again.x) and np.array_equal(one.y, again.y)
    assert one.client_names != other.client_names and not np.array_equal(one.x, other.x)
    names = [NAME.fullmatch(name) for name in one.client_names]
    assert all(names) and [int(m.group(1)) for m in names] == [round(d.rotation) for d in devices(
        ShiftedDigitsSource(clients=3, samples=40), 3)]


def test_the_full_preset_gives_every_client_every_digit_and_over_100_test_samples(tmp_path):
    spec = load_pipeline(ROOT / "pipelines" / "shift" / "baselines.yaml").dataset
    data = build_federated_data(spec, 0, tmp_path)
    assert data.n_clients == 30 and data.feature_shape == (1, 16, 16) and data.num_classes == 10
    assert data.sizes["test"].min() > 100  # one test sample is below 1 pp of a client's accuracy
    for c in range(data.n_clients):
        assert len(np.unique(data.y[data.rows("test", c)])) == 10


def orientation(image: np.ndarray) -> float:
    """The angle of an image's principal axis from the vertical, in degrees counter-clockwise as seen."""
    rows, cols = np.mgrid[: image.shape[0], : image.shape[1]]
    mass = image.sum()
    y, x = -(rows - (rows * image).sum() / mass), cols - (cols * image).sum() / mass
    xx, yy, xy = ((image * a * b).sum() / mass for a, b in ((x, x), (y, y), (x, y)))
    angle = 0.5 * np.degrees(np.arctan2(2 * xy, xx - yy))
    return angle - 90 if angle > 0 else angle + 90


def test_the_images_of_a_client_share_its_device(tmp_path):
    """Each client's images show its device: the ones (a vertical stroke) lean by its rotation; the background is
    light when it inverts contrast, dark otherwise, and spreads by its noise in every image alike."""
    data = build_federated_data(shifted(seed=5, clients=8, samples=300, rotation=40), 0, tmp_path)
    for c, name in enumerate(data.client_names):
        rotation, _, polarity, noise = NAME.fullmatch(name).groups()
        rows = np.concatenate([data.rows(s, c) for s in ("train", "val", "test")])
        pixels = data.x[rows, 0].astype(np.float64) / 255
        pixels = 1 - pixels if polarity == "inv" else pixels
        corners = pixels[:, [0, 0, -1, -1], [0, -1, 0, -1]]  # background in every image (a digit is centred)
        clipped = float(noise) / np.sqrt(2 * np.pi)  # E[max(0, N(0, noise))]: the noise clipped at the background
        assert abs(corners.mean() - clipped) < 0.02, name
        halves = corners[: len(corners) // 2].mean(), corners[len(corners) // 2 :].mean()
        assert abs(halves[0] - halves[1]) < 0.02, name
        ones = pixels[data.y[rows] == 1].mean(0)
        assert abs(orientation(np.clip(ones - np.median(ones), 0, None)) - int(rotation)) < 6, name


@pytest.mark.slow  # sixteen pipelines end to end: started early (conftest.py)
def test_the_reduced_set_runs_every_method_on_one_pretraining_under_the_matched_budget(workdir, monkeypatch):
    """The set at one seed, one round a stage and two clients: every pipeline runs on the CNN from the same FedAvg
    pretraining (a cache hit after the first), each method stage's sampled clients take GRADIENTS minibatch
    gradients (counted through the engine from the round's batch plans), and the fine-tuning is the baseline's."""
    comparison = load_plan(SET, seeds=1, overrides=REDUCED)
    prepare_plan(comparison, workdir / "cache")
    runs = {name: by_seed[0] for name, by_seed in comparison.specs.items()}
    baseline = runs[comparison.baseline]
    assert baseline.stages[-1].algorithm == "finetune" and len(runs) == 16
    assert all(spec.model.name == "cnn" and spec.stages[0] == baseline.stages[0] for spec in runs.values())
    assert all(s.local == baseline.stages[-1].local for spec in runs.values() for s in spec.stages[2:])
    works: list[RoundWork] = []
    gradients: dict[str, list[int]] = {}
    plan = RoundWork.plan

    def recorded(self: RoundWork, *args, **kwargs):
        works.append(self)
        return plan(self, *args, **kwargs)

    def finished(line: str) -> None:  # run_comparison's line after each pipeline
        method = {id(w): w for w in works if w.seed_key[1] == 1}.values()
        if method:
            gradients[line.split()[2].rstrip(":")] = sum(p.active.sum(1) for w in method
                                                         for p in w.plans.values()).tolist()
        works.clear()

    monkeypatch.setattr(RoundWork, "plan", recorded)
    result = run_comparison(comparison, f"sqlite:///{workdir}/fedpilot.db", workdir / "cache", echo=finished)
    assert set(result.scores) == set(runs)
    assert all(0 <= s[0]["test_acc_mean"] <= 1 for s in result.scores.values())
    # shift-fedavg's method stage is the baseline's second stage: the stage cache gives it, untrained
    assert gradients == {name: [GRADIENTS] * 2 for name in runs if name != "shift-fedavg"}
    client = MlflowClient()
    for name, by_seed in result.runs.items():
        stages = client.search_runs([result.experiment_id], f"tags.mlflow.parentRunId = '{by_seed[0]}'",
                                    order_by=["attributes.start_time ASC"])
        cached = stages[0].data.tags.get("fedpilot.cache")
        assert name in ("shift-baselines", "shift-pfedgate") or cached == "hit", name
