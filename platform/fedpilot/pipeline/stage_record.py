"""What a finished stage records: the per-client distributions, the change against the previous stage, the memory
footprints and the per-client table (the runner logs them; the stage cache keeps what they are made from)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fedpilot.engine.metrics import summarize
from fedpilot.engine.stage import FederatedStage
from fedpilot.metric_names import (
    GLOBAL,
    NOVEL,
    NOVEL_GLOBAL,
    SELECTED,
    SELECTED_SHARE,
    participation_gap,
)
from fedpilot.models.memory import backprop_bytes, estimated_training_bytes
from fedpilot.models.split import ParamSplit

SPLITS = ("val", "test")


@dataclass
class StageRecord:
    primary: dict[str, np.ndarray]  # split -> per-client values of the task's primary metric (accuracy, mse)
    metrics: dict[str, float]  # final distributions, and the fractions of clients better / worse than before
    memory: dict[str, float]  # footprints, and the algorithm's per-client scalars (mean, max)
    clients: dict[str, list[Any]]  # the per-client table


def stage_record(stage: FederatedStage, split: ParamSplit, names: list[str], peak: int,
                 before: FederatedStage | None, participants: Sequence[int] | None = None,
                 novel: Sequence[int] = ()) -> StageRecord:
    """The record of a finished `stage` (the federation's clients `names`, of which `participants` trained, default
    all, and `novel` were held out; peak memory `peak`), compared with the stage `before`."""
    data, task = stage.data, stage.task
    primary = task.primary
    participants = list(range(data.n_clients)) if participants is None else [int(c) for c in participants]
    ours = {s: stage.client_metrics[s][primary].numpy() for s in SPLITS}  # the primary metric per client
    metrics = {k: v for s in SPLITS for k, v in final_evaluation(stage, s).items()}
    metrics.update(beyond_participants_metrics(stage))
    sizes = split.report()
    shared = [p for n, p in stage.model.named_parameters() if n in set(stage.shared_names)]
    memory = {"shared_bytes": sum(p.numel() * p.element_size() for p in shared),
              "shared_params": sum(p.numel() for p in shared),
              "personal_bytes_per_client": sizes["personal_bytes_per_client"],
              "personal_params_per_client": sizes["personal_params_per_client"],
              "personal_bank_bytes": stage.bank.nbytes(),
              "comm_bytes_per_round": float(np.mean(stage.comm_bytes)) if stage.comm_bytes else 0.0,
              "peak_memory_bytes": peak, "rounds": stage.n_rounds}
    params = {n: p.detach() for n, p in stage.model.named_parameters()}
    # Lightning hands the module back on the CPU after fit; the stage's data may stay on the accelerator
    sample = data.inputs(data.x[:1]).to(next(iter(params.values())).device)
    backprop = backprop_bytes(stage.model, lambda: stage.algorithm.forward(stage.model, params, sample))
    memory["estimated_training_bytes"] = estimated_training_bytes(  # Pillutla et al., App. B.4: one client
        memory["shared_bytes"], memory["personal_bytes_per_client"], backprop)
    clients: dict[str, Any] = {"client": participants, "name": [names[c] for c in participants]}
    clients.update({f"{s}_samples": data.sizes[s].tolist() for s in ("train", *SPLITS)})
    clients.update({f"{s}_{m}": stage.client_metrics[s][m].tolist() for s in SPLITS for m in task.metrics})
    clients.update(selection_columns(stage))
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
            change = sign * (ours[s] - previous[s])
            metrics[f"{s}_{primary}_frac_better"] = float(np.nanmean(change > 0))
            metrics[f"{s}_{primary}_frac_worse"] = float(np.nanmean(change < 0))
    if len(novel):
        clients = with_novel_rows(stage, clients, [int(c) for c in novel], names, before)
    return StageRecord(ours, metrics, memory, clients)


def beyond_participants_metrics(stage: FederatedStage) -> dict[str, float]:
    """The distributions of the stage's evaluations beyond the participants' personalized models (engine.novel): the
    novel clients' after adaptation and with the global model, the participation gap, and with selection each
    client's chosen model and the share that kept the personal one."""
    scores, task, metrics = stage.client_metrics, stage.task, {}
    if f"{NOVEL}_test" in scores:
        sizes = {s: n.cpu() for s, n in stage.novel.data.sizes.items()}
        for prefix in (NOVEL, NOVEL_GLOBAL):
            for s in SPLITS:
                metrics.update(summarize(f"{prefix}_{s}", scores[f"{prefix}_{s}"], sizes[s].double(),
                                         task.distributions))
        gap = final_evaluation(stage, "test").get(f"test_{task.primary}_mean", math.nan) - \
            metrics.get(f"{NOVEL}_test_{task.primary}_mean", math.nan)
        metrics[participation_gap(task.name)] = gap
    if f"{GLOBAL}_val" in scores:
        keep = keeps_personal(stage)
        for s in SPLITS:
            chosen = {m: torch.where(keep, scores[s][m], scores[f"{GLOBAL}_{s}"][m]) for m in task.metrics}
            metrics.update(summarize(f"{SELECTED}_{s}", chosen, stage.data.sizes[s].cpu().double(),
                                     task.distributions))
        metrics[SELECTED_SHARE] = float(keep.double().mean())
    return metrics


def keeps_personal(stage: FederatedStage) -> torch.Tensor:
    """Per participating client: whether its personalized model scores at least as well on its val split as the
    global model (a tie, or no val sample, keeps the personal model: the pipeline's own answer)."""
    primary = stage.task.primary
    personal, shared = stage.client_metrics["val"][primary], stage.client_metrics[f"{GLOBAL}_val"][primary]
    better = shared > personal if stage.task.higher_is_better else shared < personal
    return ~better  # a comparison with NaN is False: no val sample keeps the personal model


def selection_columns(stage: FederatedStage) -> dict[str, list[Any]]:
    """With selection: each client's global-model metrics, the model it kept and its test metric with that model."""
    scores, task = stage.client_metrics, stage.task
    if f"{GLOBAL}_val" not in scores:
        return {}
    keep = keeps_personal(stage)
    columns = {f"{GLOBAL}_{s}_{m}": scores[f"{GLOBAL}_{s}"][m].tolist() for s in SPLITS for m in task.metrics}
    columns[SELECTED] = ["personal" if k else "global" for k in keep.tolist()]
    columns[f"{SELECTED}_test_{task.primary}"] = torch.where(
        keep, scores["test"][task.primary], scores[f"{GLOBAL}_test"][task.primary]).tolist()
    return columns


def with_novel_rows(stage: FederatedStage, clients: dict[str, list[Any]], novel: list[int], names: list[str],
                    before: FederatedStage | None) -> dict[str, list[Any]]:
    """The per-client table with the novel clients' rows after the participants', marked `novel`: their metrics
    after adaptation, with the global model (`global_*`) and at the stage before; None where a column does not
    apply to them."""
    scores, task, data = stage.client_metrics, stage.task, stage.novel.data
    theirs: dict[str, list[Any]] = {"client": novel, "name": [names[c] for c in novel]}
    theirs.update({f"{s}_samples": data.sizes[s].tolist() for s in ("train", *SPLITS)})
    theirs.update({f"{s}_{m}": scores[f"{NOVEL}_{s}"][m].tolist() for s in SPLITS for m in task.metrics})
    theirs.update({f"{GLOBAL}_{s}_{m}": scores[f"{NOVEL_GLOBAL}_{s}"][m].tolist()
                   for s in SPLITS for m in task.metrics})
    if before is not None and f"{NOVEL}_test" in before.client_metrics:
        theirs[f"previous_test_{task.primary}"] = before.client_metrics[f"{NOVEL}_test"][task.primary].tolist()
    n, m = len(clients["client"]), len(novel)
    columns = {**clients, **{k: [None] * n for k in theirs if k not in clients}}
    table = {k: [*v, *theirs.get(k, [None] * m)] for k, v in columns.items()}
    table[NOVEL] = [False] * n + [True] * m
    return table


def final_evaluation(stage: FederatedStage, split: str) -> dict[str, float]:
    """The metrics the stage's last evaluation of `split` recorded (distributions, weighted means)."""
    last = [entry for entry in stage.history if entry["split"] == split][-1]
    return {k: v for k, v in last.items() if k not in ("round", "split")}
