"""What `fedpilot validate` shows of a pipeline: a short summary of what will run, or (`--full`) the resolved spec
without the keys that do not apply to it (a Dirichlet split's `classes_per_client`, a fine-tuning stage's `server`)."""

from __future__ import annotations

import copy
import math
from typing import Any

from fedpilot.algorithms import build_algorithm
from fedpilot.engine.protocol import Algorithm
from fedpilot.spec import PipelineSpec
from fedpilot.stats.table import aligned

# Keys of a block that only some of its kinds use: block kind -> the keys beyond those every kind uses.
PARTITION_KEYS = {"natural": ("column",), "iid": (), "dirichlet": ("alpha", "balanced"),
                  "shards": ("classes_per_client",)}
SCHEDULE_KEYS = {"constant": (), "exponential": ("gamma", "every"), "linear": ("warmup",)}
SERVER_KEYS = {"sgd": ("momentum",), "adam": ("betas", "eps")}


def _keep(block: dict[str, Any], kind: str, by_kind: dict[str, tuple[str, ...]]) -> None:
    """Drop from `block` the keys that only other kinds than `kind` use."""
    others = {key for keys in by_kind.values() for key in keys} - set(by_kind.get(kind, ()))
    for key in others:
        block.pop(key, None)


def _without_none(value: Any, inside_params: bool = False) -> Any:
    """Unset optional keys (null) removed, except in algorithm `params` where null has a meaning."""
    if isinstance(value, dict):
        return {k: _without_none(v, inside_params or k == "params") for k, v in value.items()
                if v is not None or inside_params}
    if isinstance(value, list):
        return [_without_none(v, inside_params) for v in value]
    return value


def applicable(spec: PipelineSpec) -> dict[str, Any]:
    """The resolved spec without the keys that do not apply: other kinds' options (partition, learning-rate
    schedule, server optimizer, adapter size), the server and rounds of stages that visit each client once (they
    send nothing back; their rounds follow from the cohort size), a stage personalization its algorithm overrides,
    unset optional keys; `eval_every` shows the value in force."""
    data = copy.deepcopy(spec.resolved())
    partition = data["dataset"]["partition"]
    _keep(partition, partition["kind"], PARTITION_KEYS)
    for personalization in [data["personalization"], *(s["personalization"] for s in data["stages"])]:
        if personalization and personalization["split"] != "adapters":
            personalization.pop("adapter_dim")
    for stage in data["stages"]:
        algorithm = build_algorithm(stage["algorithm"], stage["params"])
        _keep(stage["local"]["schedule"], stage["local"]["schedule"]["kind"], SCHEDULE_KEYS)
        _keep(stage["server"], stage["server"]["optimizer"], SERVER_KEYS)
        stage["eval_every"] = stage["eval_every"] or data["evaluation"]["every"]
        if algorithm.visits_each_client_once:
            del stage["server"], stage["rounds"]
        if algorithm.personal_part is not None:
            stage.pop("personalization")
    return _without_none(data)


def _personal(spec: PipelineSpec, index: int, algorithm: Algorithm) -> str:
    """The personal parameters of stage `index`: the algorithm's own part, else the stage's or pipeline's split."""
    chosen = spec.stages[index].personalization or spec.personalization
    split = algorithm.personal_part or chosen.split
    text = split if isinstance(split, str) else " ".join(split)
    return f"{text} (dim {chosen.adapter_dim})" if split == "adapters" else text


def _local(stage: Any) -> str:
    local = stage.local
    work = f"{local.steps} steps" if local.steps else f"{local.epochs:g} epoch{'s' if local.epochs != 1 else ''}"
    return f"{work}, batch {local.batch_size}, lr {local.lr:g}" + (
        f" ({local.schedule.kind})" if local.schedule.kind != "constant" else "")


def _changed_params(algorithm: Algorithm, params: dict[str, Any]) -> str:
    """The algorithm parameters the pipeline sets to other values than their defaults."""
    defaults = type(algorithm).Params().model_dump(mode="json")
    return " ".join(f"{k}={v}" for k, v in params.items() if defaults.get(k) != v)


def summary(spec: PipelineSpec, n_clients: int | None, hint: bool = True) -> str:
    """What will run: the data and model, then per stage its algorithm, rounds, cohort, local work, personal
    parameters and the algorithm parameters set away from their defaults (`n_clients` None: data not reachable);
    `hint`: where the whole resolved spec is (`validate --full`)."""
    d, options = spec.dataset, " ".join(f"{k}={v}" for k, v in spec.model.options.items())
    kind = d.partition.kind
    partition = " ".join([kind, *(f"{k}={getattr(d.partition, k)}" for k in PARTITION_KEYS[kind]
                                  if getattr(d.partition, k) is not None)])
    clients = "? clients (the data is not reachable here)" if n_clients is None else f"{n_clients} clients"
    lines = [f"{spec.name}: {d.source.kind} data, {clients} ({partition}), each split "
             f"{d.split.train:g}/{d.split.val:g}/{d.split.test:g} train/val/test; model {spec.model.name}"
             + (f" ({options})" if options else "") + f"; seed {spec.seed}", ""]
    rows = [["stage", "algorithm", "rounds", "clients/round", "local work", "personal", "parameters"]]
    for i, stage in enumerate(spec.stages):
        algorithm = build_algorithm(stage.algorithm, stage.params)
        cohort = stage.clients_per_round if n_clients is None else min(stage.clients_per_round or n_clients, n_clients)
        rounds = str(stage.rounds)
        if algorithm.visits_each_client_once:
            rounds = f"{math.ceil(n_clients / cohort)} (each client once)" if n_clients else "each client once"
        rows.append([stage.name, stage.algorithm, rounds, str(cohort or "all"), _local(stage),
                     _personal(spec, i, algorithm), _changed_params(algorithm, stage.params)])
    lines += aligned(rows, right=(2, 3))
    lines += ["", f"every client is evaluated on its val split every {spec.evaluation.every} rounds, and on val and "
              "test at each stage's end", *(["the whole resolved spec: --full"] if hint else [])]
    return "\n".join(lines)
