"""Search ranges several built-in algorithms share, each with the papers it comes from. An algorithm's own ranges
stay in its module; docs/algorithms.md's table lists every one and says why it is as wide as it is."""

from __future__ import annotations

from fedpilot.api import Tunable

# the client step size of personalized training in Pillutla et al.'s pipeline (FedAlt, FedSim, Ditto run there)
PERSONALIZED_CLIENT_LR = Tunable(
    1e-3, 100.0, source="Pillutla et al., ICML 2022, Table 9: client lr 1e-3 to 1e-1 in personalized training (step "
    "b); fedpilot: up to 100 for clipped steps (the Shakespeare LSTM at clip_norm 1, written 1, where FedSim-output "
    "chose 8.59 at the top of the former [0.1, 10])")

# the learning rate pFedGate's authors search for every method they compare, their baselines included
PFEDGATE_GRID_LR = Tunable(
    1e-3, 10.0, source="Chen et al., ICML 2023, App. H: every method's lr on the grid 0.005-0.5 (pFedGate's own, "
    "Table 7: 0.03-0.3); fedpilot: widened to 1e-3 and 10")
