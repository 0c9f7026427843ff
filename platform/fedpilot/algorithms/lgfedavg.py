"""LG-FedAvg: Liang et al., "Think Locally, Act Globally: Federated Learning with Local and Global
Representations", 2020 (a baseline of pFedGate, Chen et al., ICML 2023).

Each client keeps its own local representation (the lower layers: the model's `body`) and shares the global
layers on top (the `head`); every local SGD step updates both at the same point, the clients send only the global
layers and the server averages them. It is FedSim's update order (Pillutla et al., ICML 2022) with the opposite split of
FedPer: the personal part is the body, so each round uploads the head alone (LG-FedAvg's communication saving).

Choices: the split is the whole body local and the head global (the paper's experiments keep the last layers
global; with the zoo's `body -> head` models that is the head); the server averages by sample count (FedAvg).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from fedpilot.algorithms.fedsim import FedSim, FedSimParams
from fedpilot.algorithms.ranges import PFEDGATE_GRID_LR

CLIENT_LR = replace(PFEDGATE_GRID_LR, fallback="local.lr")  # LG-FedAvg is a baseline of pFedGate


class LGFedAvgParams(FedSimParams):
    """tau: local steps (null = the stage's local budget); lr_v / lr_u: local-representation / global-layer
    client lr (null = local.lr); stateful: the local representations persist across rounds."""


class LGFedAvg(FedSim):
    """Local representation (body) and global layers (head) trained together; the heads averaged, bodies kept."""

    name = "lg_fedavg"
    Params = LGFedAvgParams
    tunable = {"params.lr_u": CLIENT_LR, "params.lr_v": CLIENT_LR}

    @property
    def personal_part(self) -> Any:
        return [r"body\..*"]
