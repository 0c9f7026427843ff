"""What a finished stage reports: the per-client distributions, the change against the previous stage, the memory
footprints and the per-client table (the runner logs them; the stage cache keeps what they are made from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedpilot.engine.metrics import distribution
from fedpilot.engine.stage import FederatedStage
from fedpilot.models import ParamSplit
from fedpilot.models.memory import backprop_bytes, estimated_training_bytes

SPLITS = ("val", "test")


@dataclass
class StageReport:
    accuracy: dict[str, np.ndarray]  # split -> per-client accuracy
    metrics: dict[str, float]  # distributions, and the fractions of clients better / worse than before
    memory: dict[str, float]  # footprints, and the algorithm's per-client scalars (mean, max)
    clients: dict[str, list[Any]]  # the per-client table


def stage_report(stage: FederatedStage, split: ParamSplit, peak: int, before: FederatedStage | None) -> StageReport:
    """The report of a finished `stage` (its peak memory `peak`), compared with the stage `before` it if any."""
    data = stage.data
    accuracy = {s: stage.client_metrics[s]["acc"].numpy() for s in SPLITS}
    metrics: dict[str, float] = {}
    for s in SPLITS:
        weights = data.sizes[s].cpu().double()
        metrics.update({f"{s}_acc_{k}": v for k, v in distribution(stage.client_metrics[s]["acc"], weights).items()})
    report = split.report()
    shared = [p for n, p in stage.model.named_parameters() if n in set(stage.shared_names)]
    memory = {"shared_bytes": sum(p.numel() * p.element_size() for p in shared),
              "shared_params": sum(p.numel() for p in shared),
              "personal_bytes_per_client": report["personal_bytes_per_client"],
              "personal_params_per_client": report["personal_params_per_client"],
              "personal_bank_bytes": stage.bank.nbytes(),
              "comm_bytes_per_round": float(np.mean(stage.comm_bytes)) if stage.comm_bytes else 0.0,
              "peak_memory_bytes": peak, "rounds": stage.n_rounds}
    params, sample = {n: p.detach() for n, p in stage.model.named_parameters()}, data.x[:1]
    backprop = backprop_bytes(stage.model, lambda: stage.algorithm.forward(stage.model, params, sample))
    memory["estimated_training_bytes"] = estimated_training_bytes(  # paper 000's estimate, one client (App. B.4)
        memory["shared_bytes"], memory["personal_bytes_per_client"], backprop)
    clients: dict[str, Any] = {"client": list(range(data.n_clients)), "name": list(data.client_names)}
    clients.update({f"{s}_samples": data.sizes[s].tolist() for s in ("train", *SPLITS)})
    clients.update({f"{s}_{m}": stage.client_metrics[s][m].tolist() for s in SPLITS for m in ("acc", "loss")})
    for state in stage.state_bank.names:
        values = stage.state_bank.tensor(state)
        if values.dim() == 1:  # per-client scalars of the algorithm (pFedGate densities, Self-FL steps)
            clients[state] = values.tolist()
            memory[f"{state}_mean"], memory[f"{state}_max"] = float(values.mean()), float(values.max())
    if before is not None:
        previous = {s: before.client_metrics[s]["acc"].numpy() for s in SPLITS}
        clients["previous_test_acc"] = previous["test"].tolist()
        for s in SPLITS:
            change = accuracy[s] - previous[s]
            metrics[f"{s}_acc_frac_better"] = float(np.nanmean(change > 0))
            metrics[f"{s}_acc_frac_worse"] = float(np.nanmean(change < 0))
    return StageReport(accuracy, metrics, memory, clients)
