"""Learning works: FedAvg -> FedAlt (personal output layer) -> fine-tuning beats FedAvg alone on digits.

Digits over 100 clients leaves ~10 training samples per client, so personal steps need a small lr
(lr_v 0.01, fine-tuning 0.005): at 0.05 a client's head overfits its few labels and loses accuracy.
"""

from __future__ import annotations

import statistics

import torch

from engine_fixtures import fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.data.config import DatasetSpec
from fedpilot.data.federated import build_federated_data
from fedpilot.engine.bank import carry_bank
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.models.split import apply_split
from fedpilot.models.zoo import build_model
from fedpilot.pipeline.checks import client_data


def three_stages(seed: int, cache_dir) -> tuple[float, float]:
    """(FedAvg mean per-client test accuracy, after FedAlt + fine-tuning) for one seed."""
    spec = DatasetSpec.from_dict({"source": {"kind": "digits"},
                                  "partition": {"kind": "dirichlet", "alpha": 0.3, "clients": 100}})
    built = build_federated_data(spec, seed=seed, cache_dir=cache_dir)
    data = client_data(built)
    torch.manual_seed(seed)
    model = build_model("mlp", built.feature_shape, built.num_classes)
    local = LocalConfig(epochs=1, batch_size=10, lr=0.05)
    pretrain = stage_for(model, [], data, build_algorithm("fedavg"),
                              StageConfig(rounds=100, clients_per_round=10, local=local, eval_every=100), seed, 0)
    fit(pretrain)
    head = apply_split(model, "output_layer").personal_names
    personalize = stage_for(model, head, data, build_algorithm("fedalt", {"lr_v": 0.01}),
                                 StageConfig(rounds=50, clients_per_round=10, local=local, eval_every=50), seed, 1,
                                 bank=carry_bank(pretrain.bank, pretrain.model, head))
    fit(personalize)
    finetune = stage_for(model, head, data, build_algorithm("finetune"),
                              StageConfig(clients_per_round=50, local=LocalConfig(epochs=5, batch_size=10, lr=0.005)),
                              seed, 2, bank=carry_bank(personalize.bank, personalize.model, head))
    fit(finetune)
    accuracy = [float(s.client_metrics["test"]["acc"].nanmean()) for s in (pretrain, finetune)]
    return accuracy[0], accuracy[1]


def test_personalization_beats_fedavg_over_three_seeds(tmp_path):
    results = [three_stages(seed, tmp_path) for seed in range(3)]
    gains = [after - before for before, after in results]
    print("FedAvg -> FedAlt+FT mean per-client test accuracy:", results, "gains:", gains)
    assert all(gain > 0.03 for gain in gains)
    assert statistics.mean(gains) > 0.05
