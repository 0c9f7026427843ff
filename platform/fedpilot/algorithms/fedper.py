"""FedPer: Arivazhagan et al. 2019, "Federated Learning with Personalization Layers" (a baseline of PFLEGO,
Nikoloutsopoulos et al. 2022).

The model is split into base layers, shared and averaged by the server as in FedAvg, and personalization
layers (the last ones), kept by each client. Every local SGD step updates both at the same point on the same
minibatch, which is exactly FedSim's update order (Pillutla et al., ICML 2022, LocalSim), so FedPer is FedSim under its
own name; the split is the pipeline's `personalization` (FedPer's is the head: `output_layer`).

Choices: the personal and shared learning rates default to the stage's local.lr (FedPer uses one client lr);
the server averages the base layers weighted by N_i (FedAvg's rule, as in the FedPer paper).
"""

from __future__ import annotations

from fedpilot.algorithms.fedsim import FedSim, FedSimParams
from fedpilot.api import Tunable

CLIENT_LR = Tunable(1e-4, 10.0, fallback="local.lr", source=(
    "Nikoloutsopoulos et al. 2022 (PFLEGO), Sec. 5.1: FedPer at client lr 0.001 (CIFAR-10); Pillutla et al., ICML "
    "2022, Table 9: 1e-3 to 1e-1 for the same update (FedSim's); fedpilot: widened to 1e-4 and 10"))


class FedPerParams(FedSimParams):
    """tau: local steps (null = the stage's local budget, FedPer's E epochs); lr_v / lr_u: personal / shared
    client lr (null = local.lr); stateful: personalization layers persist across rounds (FedPer: yes)."""


class FedPer(FedSim):
    """Base and personalization layers trained together each round; base layers averaged, head kept."""

    name = "fedper"
    Params = FedPerParams
    tunable = {"params.lr_u": CLIENT_LR, "params.lr_v": CLIENT_LR}
