"""Evaluations beyond each participating client's personalized model, at a stage's end: clients held out of every
round (novel clients, Chen et al., ICML 2023) with the global model and after the adaptation a newcomer gets, and
the participating clients with the global model (for each client's choice between the two, Pillutla et al., ICML
2022, Sec. C.3)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from fedpilot.engine.cohort import Cohort, RoundWork
from fedpilot.engine.config import LocalConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.evaluate import evaluate_clients
from fedpilot.engine.executor import Params
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


def global_model(stage: FederatedStage) -> Params:
    """The stage's global model as it stands: the shared parameters, and the personal ones at their starting value
    (the model's own, which no client's training changes)."""
    device = stage.device
    return {**{n: v.to(device) for n, v in stage.personal_init.items()}, **stage.shared_params()}


def global_scores(stage: FederatedStage, data: ClientData, split: str) -> Scores:
    """Each client of `data` on `split` with the global model (one model for every client)."""
    scores = evaluate_clients(stage.model, stage.split, stage.algorithm.forward, stage.task, global_model(stage),
                              lambda clients: {}, data, split, stage.execution, precision=stage.config.precision)
    return {m: v.cpu() for m, v in scores.items()}


def beyond_participants(stage: FederatedStage, splits: tuple[str, ...], novel: NovelClients | None,
                        select: bool) -> dict[str, Scores]:
    """The stage's extra per-client evaluations, by name: `global_{split}` (participants, with `select`),
    `novel_global_{split}` and `novel_{split}` (the novel clients)."""
    results = {f"{GLOBAL}_{s}": global_scores(stage, stage.data, s) for s in splits} if select else {}
    if novel is not None:
        results.update({f"{NOVEL_GLOBAL}_{s}": global_scores(stage, novel.data, s) for s in splits})
        results.update(adapted_scores(stage, novel, splits))
    return results


def adapted_scores(stage: FederatedStage, novel: NovelClients, splits: tuple[str, ...]) -> dict[str, Scores]:
    """The novel clients on `splits` after each adapts (Algorithm.adapt) from the stage's starting personal value
    (a personal copy of every parameter, Ditto's, from the global model), cohort after cohort as a fine-tuning
    stage of the recipe would take them alone, each cohort evaluated and dropped before the next adapts."""
    data, n = novel.data, novel.data.n_clients
    size = min(novel.cohort or n, n)
    rounds = math.ceil(n / size)
    results = {f"{NOVEL}_{s}": {m: torch.full((n,), math.nan) for m in stage.task.metrics} for s in splits}
    shared = stage.shared_params()
    start = {name: shared[name] if stage.algorithm.personal_copy else value.to(stage.device)
             for name, value in stage.personal_init.items()}
    state = stage.algorithm.client_state()
    for r in range(rounds):
        clients = torch.arange(r * size, min(n, (r + 1) * size), device=stage.device)
        work = adaptation_work(stage, novel, data.gather(clients, stage.device), r, rounds)
        for lo in range(0, len(clients), stage.config.max_parallel_clients):
            rows = slice(lo, min(lo + stage.config.max_parallel_clients, len(clients)))
            ids = clients[rows]
            cohort = Cohort(work, ids, rows, clients, shared, {k: v.expand(len(ids), *v.shape) for k, v in start.items()},
                            start, {k: v.to(stage.device).expand(len(ids), *v.shape) for k, v in state.items()})
            stage.algorithm.adapt(cohort)
            for split in splits:
                scores = evaluate_clients(stage.model, stage.split, stage.algorithm.forward, stage.task, shared,
                                          rows_of(cohort.personal, int(ids[0])), data, split, stage.execution, ids,
                                          precision=stage.config.precision)
                for metric, values in scores.items():
                    results[f"{NOVEL}_{split}"][metric][ids.cpu()] = values.cpu()
    return results


def adaptation_work(stage: FederatedStage, novel: NovelClients, data: ClientData, round_idx: int,
                    rounds: int) -> RoundWork:
    """Round `round_idx` of the novel clients' adaptation: the stage's model, executors and seed, the recipe's
    local work."""
    executor, head_executor = stage.executors(stage.execution, timed=bool(stage.executor_seconds))
    return RoundWork(model=stage.model, forward=stage.algorithm.forward, task=stage.task, data=data,
                     local=novel.local, lr_factor=novel.local.schedule.factor(round_idx, rounds),
                     seed_key=(stage.seed, stage.stage_index, round_idx), executor=executor,
                     head_executor=head_executor, split=stage.split, server_state=stage.server_state,
                     precision=stage.config.precision)


def rows_of(personal: Params, first: int):
    """personal_of for evaluate_clients: the rows of a chunk's adapted parameters, by client id (the chunk's clients
    are first, first + 1, ...)."""
    return lambda ids: {name: value[ids - first] for name, value in personal.items()}
