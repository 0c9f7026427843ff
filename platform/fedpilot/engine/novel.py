"""Evaluations beyond each participating client's personalized model, at a stage's end: clients held out of every
round (novel clients, Chen et al., ICML 2023) with the global model and after the adaptation a newcomer gets, and
the participating clients with the global model (for each client's choice between the two, Pillutla et al., ICML
2022, Sec. C.3). The adaptation runs as the stage's rounds do: the stage's work builder and its cohorts."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedpilot.engine.config import LocalConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.executor import Tensors
from fedpilot.metric_names import GLOBAL, NOVEL, NOVEL_GLOBAL

if TYPE_CHECKING:
    from fedpilot.engine.stage import FederatedStage

Scores = dict[str, torch.Tensor]  # metric -> per-client values


@dataclass(frozen=True)
class NovelClients:
    """Clients held out of every round: their data, and how a newcomer adapts: the local work and the cohort size
    (clients adapted together, as a fine-tuning stage's rounds take them; None: all at once) of the pipeline's
    fine-tuning recipe."""

    data: ClientData
    local: LocalConfig
    cohort: int | None = None


def global_model(stage: FederatedStage) -> Tensors:
    """The stage's global model as it stands: the shared parameters, and the personal ones at their starting value
    (the model's own, which no client's training changes)."""
    device = stage.device
    return {**{n: v.to(device) for n, v in stage.personal_init.items()}, **stage.shared_params()}


def beyond_participants(stage: FederatedStage, splits: tuple[str, ...], novel: NovelClients | None,
                        select: bool) -> dict[str, Scores]:
    """The stage's extra per-client evaluations, by name: `global_{split}` (participants, with `select`),
    `novel_global_{split}` and `novel_{split}` (the novel clients)."""
    results = {}
    if select:
        evaluator = stage.evaluator()
        results.update({f"{GLOBAL}_{s}": evaluator.scores(s, global_model(stage)) for s in splits})
    if novel is not None:
        evaluator = stage.evaluator(novel.data)
        results.update({f"{NOVEL_GLOBAL}_{s}": evaluator.scores(s, global_model(stage)) for s in splits})
        results.update(adapted_scores(stage, novel, splits))
    return results


def adapted_scores(stage: FederatedStage, novel: NovelClients, splits: tuple[str, ...]) -> dict[str, Scores]:
    """The novel clients on `splits` after each adapts (Algorithm.adapt) from the stage's starting personal value
    (a personal copy of every parameter, Ditto's, from the global model), cohort after cohort as a fine-tuning
    stage of the recipe would take them alone, each cohort evaluated and dropped before the next adapts."""
    n = novel.data.n_clients
    size = min(novel.cohort or n, n)
    rounds = math.ceil(n / size)
    results = {f"{NOVEL}_{s}": {m: torch.full((n,), math.nan) for m in stage.task.metrics} for s in splits}
    shared, evaluator = stage.shared_params(), stage.evaluator(novel.data)
    copy = stage.algorithm.personal_copy  # a copy of every parameter starts from the global model
    start = {name: shared[name] if copy and name in shared else value.to(stage.device)
             for name, value in stage.personal_init.items()}
    for r in range(rounds):
        clients = torch.arange(r * size, min(n, (r + 1) * size), device=stage.device)
        work = stage.round_work(r, clients, novel.data.gather(clients, stage.device), novel.local, rounds)
        for cohort in stage.cohorts(work, clients, start, fresh=True):
            stage.algorithm.adapt(cohort)
            for split in splits:
                scores = evaluator.scores(split, shared, rows_of(cohort.own, int(cohort.clients[0])), cohort.clients)
                for metric, values in scores.items():
                    results[f"{NOVEL}_{split}"][metric][cohort.clients.cpu()] = values
    return results


def rows_of(own: Tensors, first: int) -> Callable[[torch.Tensor], Tensors]:
    """personal_of for the Evaluator: the rows of a chunk's adapted values (parameters and constants), by client id
    (the chunk's clients are first, first + 1, ...)."""
    return lambda ids: {name: value[ids - first] for name, value in own.items()}
