"""What a finished stage records: the per-client distributions, the change against the previous stage, the memory
footprints and the per-client table (the runner logs them; the stage cache keeps what they are made from)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedpilot.engine.stage import FederatedStage
from fedpilot.models.memory import backprop_bytes, estimated_training_bytes
from fedpilot.models.split import ParamSplit

SPLITS = ("val", "test")


@dataclass
class StageRecord:
    accuracy: dict[str, np.ndarray]  # split -> per-client values of the task's primary metric (accuracy, mse)
    metrics: dict[str, float]  # final distributions, and the fractions of clients better / worse than before
    memory: dict[str, float]  # footprints, and the algorithm's per-client scalars (mean, max)
    clients: dict[str, list[Any]]  # the per-client table


def stage_record(stage: FederatedStage, split: ParamSplit, names: list[str], peak: int,
                 before: FederatedStage | None) -> StageRecord:
    """The record of a finished `stage` (clients `names`, peak memory `peak`), compared with the stage `before`."""
    data, task = stage.data, stage.task
    primary = task.primary
    accuracy = {s: stage.client_metrics[s][primary].numpy() for s in SPLITS}
    metrics = {k: v for s in SPLITS for k, v in final_evaluation(stage, s).items()}
    sizes = split.report()
    shared = [p for n, p in stage.model.named_parameters() if n in set(stage.shared_names)]
    memory = {"shared_bytes": sum(p.numel() * p.element_size() for p in shared),
              "shared_params": sum(p.numel() for p in shared),
              "personal_bytes_per_client": sizes["personal_bytes_per_client"],
              "personal_params_per_client": sizes["personal_params_per_client"],
              "personal_bank_bytes": stage.bank.nbytes(),
              "comm_bytes_per_round": float(np.mean(stage.comm_bytes)) if stage.comm_bytes else 0.0,
              "peak_memory_bytes": peak, "rounds": stage.n_rounds}
    params, sample = {n: p.detach() for n, p in stage.model.named_parameters()}, data.inputs(data.x[:1])
    backprop = backprop_bytes(stage.model, lambda: stage.algorithm.forward(stage.model, params, sample))
    memory["estimated_training_bytes"] = estimated_training_bytes(  # Pillutla et al., App. B.4: one client
        memory["shared_bytes"], memory["personal_bytes_per_client"], backprop)
    clients: dict[str, Any] = {"client": list(range(data.n_clients)), "name": list(names)}
    clients.update({f"{s}_samples": data.sizes[s].tolist() for s in ("train", *SPLITS)})
    clients.update({f"{s}_{m}": stage.client_metrics[s][m].tolist() for s in SPLITS for m in task.metrics})
    for state in stage.state_bank.names:
        values = stage.state_bank.tensor(state)
        if values.dim() == 1:  # per-client scalars of the algorithm (pFedGate densities, Self-FL steps)
            clients[state] = values.tolist()
            memory[f"{state}_mean"], memory[f"{state}_max"] = float(values.mean()), float(values.max())
    if before is not None:
        previous = {s: before.client_metrics[s][primary].numpy() for s in SPLITS}
        clients[f"previous_test_{primary}"] = previous["test"].tolist()
        sign = 1 if task.higher_is_better else -1
        for s in SPLITS:
            change = sign * (accuracy[s] - previous[s])
            metrics[f"{s}_{primary}_frac_better"] = float(np.nanmean(change > 0))
            metrics[f"{s}_{primary}_frac_worse"] = float(np.nanmean(change < 0))
    return StageRecord(accuracy, metrics, memory, clients)


def final_evaluation(stage: FederatedStage, split: str) -> dict[str, float]:
    """The metrics the stage's last evaluation of `split` recorded (distributions, weighted means)."""
    last = [entry for entry in stage.history if entry["split"] == split][-1]
    return {k: v for k, v in last.items() if k not in ("round", "split")}
