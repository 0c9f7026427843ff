"""The memory model of Pillutla et al. (ICML 2022, App. B.4): its Table 10 for EMNIST, and what a stage records."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.models.memory import backprop_bytes, estimated_training_bytes
from fedpilot.models.split import apply_split
from fedpilot.models.zoo import build_model
from fedpilot.pipeline.stage_record import stage_record

MB = 1e6  # the paper's megabytes: its 11.2M-parameter ResNet-18 "requires around 45 megabytes"


@pytest.mark.parametrize(("personalization", "table10_mb"), [
    ("none", 142), ("input_layer", 142), ("output_layer", 142), ("all", 232)])
def test_emnist_resnet18_matches_table_10(personalization, table10_mb):
    """The paper's EMNIST model (Table 7: 11.2M shared parameters, a 0.7K input layer, a 0.03M output layer),
    trained with FedAlt/FedSim (u and v) or, for full personalization, a personal copy of the whole model."""
    torch.manual_seed(0)
    model = build_model("resnet18", (1, 28, 28), 62)
    split = apply_split(model, personalization).report()
    assert round(split["total_params"] / 1e6, 1) == 11.2
    full = personalization == "all"
    shared = split["personal_bytes_per_client"] if full else split["shared_bytes"]  # full: u and v both the model
    x = torch.randn(1, 1, 28, 28)
    estimate = estimated_training_bytes(shared, split["personal_bytes_per_client"],
                                        backprop_bytes(model, lambda: model(x)))
    assert round(estimate / MB) == table10_mb


def test_backprop_buffers_count_each_computed_output_twice():
    model = TinyMLP()  # Linear (24), ReLU (24), Linear (4) for one sample; Flatten of a flat input returns it
    assert backprop_bytes(model, lambda: model(torch.randn(1, 16))) == 2 * 4 * (24 + 24 + 4)
    model.body.append(torch.nn.Identity())  # hands its input through: no buffer of its own
    assert backprop_bytes(model, lambda: model(torch.randn(1, 16))) == 2 * 4 * (24 + 24 + 4)
    assert backprop_bytes(model, lambda: model(torch.randn(1, 4, 4))) == 2 * 4 * (16 + 24 + 24 + 4)


@pytest.mark.parametrize(("algorithm", "personal", "u", "v"), [
    ("fedalt", ["head.weight", "head.bias"], 16 * 24 + 24, 24 * 4 + 4),
    ("ditto", None, 16 * 24 + 24 + 24 * 4 + 4, 16 * 24 + 24 + 24 * 4 + 4)])
def test_a_stage_records_the_estimate_next_to_its_peak(algorithm, personal, u, v):
    model = TinyMLP()
    names = personal or [n for n, _ in model.named_parameters()]
    data = ToyData()
    cfg = StageConfig(rounds=1, clients_per_round=3, local=LocalConfig(steps=1))
    stage = stage_for(model, names, data, build_algorithm(algorithm), cfg)
    fit(stage)
    memory = stage_record(stage, stage.split, [str(c) for c in range(data.n_clients)], peak=123, before=None).memory
    backprop = 2 * 4 * (24 + 24 + 4)
    assert memory["estimated_training_bytes"] == 4 * (3 * u + 2 * v) + backprop
    assert memory["peak_memory_bytes"] == 123
