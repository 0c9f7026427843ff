"""Stages of several algorithms trained in one process, or with Lightning DDP over CPU processes (gloo).

`python tests/ddp_cases.py 2 OUT.pt` trains every case with `Trainer(strategy=DDPStrategy(...), accelerator="cpu",
devices=2)`: Lightning re-runs this script as rank 1, each process trains a slice of every cohort, and rank 0
saves each stage's state (shared parameters, personal and state banks), evaluation history, each client's final
metrics, per-round bytes and last training stats to OUT.pt. tests/test_ddp.py compares them with `train_cases(1)`.
Every case runs the executor EXECUTION: under `execution: auto` the choice is timed, and on a loaded machine the
two runs could choose differently and compute different floats (docs/engine.md).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.strategies import DDPStrategy

from engine_fixtures import TinyMLP, ToyData, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.models.zoo import build_model

EXECUTION = "vmap"
HEAD = ["head.weight", "head.bias"]
GATE = ["gate.budget", "gate.norm.weight", "gate.norm.bias", "gate.gates.weight", "gate.gates.bias",
        "gate.importance.weight", "gate.importance.bias"]
# name: (algorithm, its params, personal parameters, server optimizer) -- what each case puts through the reduction
CASES: dict[str, tuple[str, dict, list[str], dict]] = {
    "fedavg-adam": ("fedavg", {}, [], {"optimizer": "adam", "lr": 0.05}),  # dense deltas, stateful server optimizer
    "fedalt": ("fedalt", {}, HEAD, {}),  # personal bank rows of the cohort
    "pflego": ("pflego", {"tau": 3}, HEAD, {}),  # gradient uploads summed (no division by the weights)
    "pfedgate": ("pfedgate", {"s": 0.5}, GATE, {}),  # masked per-entry weights, the per-client state bank
    "finetune": ("finetune", {}, HEAD, {}),  # one visit per client, nothing uploaded
}


def model_for(algorithm: str) -> torch.nn.Module:
    """TinyMLP, or for pFedGate a 16-24-4 MLP with its gating layer (as the pipeline builds it)."""
    if algorithm != "pfedgate":
        return TinyMLP()
    model = build_model("mlp", (16,), 4, hidden=[24])
    build_algorithm("pfedgate", CASES["pfedgate"][1]).prepare_model(model, (16,))
    return model


def train_cases(devices: int) -> dict[str, dict[str, Any]]:
    """Every case trained for 3 rounds of 7 of 12 clients (one pass for finetune) on `devices` CPU processes."""
    results = {}
    for name, (algorithm, params, personal, server) in CASES.items():
        torch.manual_seed(0)
        config = StageConfig(rounds=3, clients_per_round=7, local=LocalConfig(epochs=1, batch_size=4, lr=0.1),
                             server=server, eval_every=3, execution=EXECUTION)
        stage = stage_for(model_for(algorithm), personal, ToyData(), build_algorithm(algorithm, params), config,
                               seed=3)
        strategy = DDPStrategy(forward_sync_buffers=False) if devices > 1 else "auto"
        trainer = L.Trainer(max_steps=stage.n_rounds, accelerator="cpu", devices=devices, strategy=strategy,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(stage)
        results[name] = {"state": copy.deepcopy(stage.state_dict()), "history": stage.history,
                         "clients": copy.deepcopy(stage.client_metrics), "comm_bytes": stage.comm_bytes,
                         "train": {k: stage.round_log[k] for k in ("train_loss", "train_acc")}}
    return results


if __name__ == "__main__":
    trained = train_cases(int(sys.argv[1]))
    if rank_zero_only.rank == 0:
        torch.save(trained, sys.argv[2])
