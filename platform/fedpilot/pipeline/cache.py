"""The stage cache: finished stages on disk under a key of everything that determines their result.

A finished stage is stored under a hash of its inputs (dataset fingerprint, model, seed, its resolved spec and
split, the previous stage's key, the device type, the code that computes it), computed from the spec alone
(`stage_keys`); a rerun that changes only a later stage reuses the earlier ones. `max_parallel_clients`,
`execution` and stage names are left out of the key: they change how a stage runs, not what it computes (equal
within float tolerance, tests/test_engine_equivalence.py; docs/engine.md says what may differ).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch

from fedpilot.spec import PipelineSpec, StageSpec

CACHE_FORMAT = 2  # 2: the code of engine/accel/ and a plugin's whole package in the key, the novel clients by count
NOT_IN_KEY = {"name", "max_parallel_clients", "execution", "host_memory_budget", "device_data_budget"}
# Packages whose code never enters a stage key: the Python runtime and pinned libraries (their versions do).
NOT_OUR_CODE = {"builtins", "abc", "typing", "torch", "pydantic", "functools", "collections"}


class StageCache:
    """Finished stages on disk: <cache root>/stages/<key>.pt, written atomically."""

    def __init__(self, root: Path):
        self.dir = root / "stages"

    def load(self, key: str) -> dict[str, Any] | None:
        path = self.dir / f"{key}.pt"
        return torch.load(path, map_location="cpu", weights_only=False) if path.is_file() else None

    def has(self, key: str) -> bool:
        return (self.dir / f"{key}.pt").is_file()

    def save(self, key: str, payload: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        os.close(fd)
        os.chmod(tmp, 0o644)
        torch.save(payload, tmp)
        os.replace(tmp, self.dir / f"{key}.pt")


def stage_keys(spec: PipelineSpec, data: str, device: str) -> list[str]:
    """The cache key of every stage of `spec` on the federated data of fingerprint `data` (data_fingerprint) on a
    `device` type: everything a stage's result depends on, its code included (code_fingerprint of its algorithm and
    the model's builder), each chained to the key of the stage before. A pure function of the spec, the data's
    fingerprint and the code, with nothing built: the runner keys its stages with it, a comparison asks whether a
    pipeline's stages are cached, and a plan counts the stages its pipelines share."""
    from fedpilot.algorithms import ALGORITHMS, build_algorithm
    from fedpilot.models.options import MODELS
    from fedpilot.pipeline.checks import stage_split

    keys, previous = [], ""
    for i, stage in enumerate(spec.stages):
        algorithm = build_algorithm(stage.algorithm, stage.params)
        code = code_fingerprint(ALGORITHMS[stage.algorithm], MODELS[spec.model.name])
        previous = _key({"format": CACHE_FORMAT, "code": code, "fedpilot": version("fedpilot"), "previous": previous,
                         "data": data, "model": spec.model.model_dump(mode="json"), "seed": spec.seed, "index": i,
                         "stage": stage.model_dump(mode="json", exclude=NOT_IN_KEY),
                         "split": list(stage_split(spec, stage, algorithm.personal_part)),
                         "eval_every": stage.eval_every or spec.evaluation.every,
                         "eval_clients": stage.eval_clients or spec.evaluation.clients, "device": device,
                         **beyond_participants(spec, i)})
        keys.append(previous)
    return keys


def beyond_participants(spec: PipelineSpec, index: int) -> dict[str, Any]:
    """What stage `index` evaluates beyond its participants, as its key holds it: the held-out clients (how many of
    the federation: which ones follows from the data and the seeds) and how they adapt (the pipeline's first
    finetune stage's local work and cohort, else the stage's own), and with `evaluation.select: val` on the last
    stage each client's choice of model."""
    novel, recipe = spec.evaluation.novel_clients, novel_recipe(spec, index)
    select = spec.evaluation.select == "val" and index == len(spec.stages) - 1
    beyond = {"novel": novel, "recipe": recipe.local.model_dump(mode="json"), "cohort": recipe.clients_per_round} \
        if novel is not None else {}
    return {"beyond": {**beyond, "select": select}} if novel is not None or select else {}


def novel_recipe(spec: PipelineSpec, index: int) -> StageSpec:
    """How stage `index`'s held-out clients adapt: as the pipeline's first `finetune` stage, else as the stage."""
    return next((s for s in spec.stages if s.algorithm == "finetune"), spec.stages[index])


def data_fingerprint(spec: PipelineSpec) -> str:
    """The fingerprint of the pipeline's federated data (its dataset spec at its effective seed), as the data cache
    keys it, without building or loading it."""
    from fedpilot.data.federated import fingerprint

    return fingerprint(spec.dataset, spec.seed if spec.dataset.seed is None else spec.dataset.seed)


def _key(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def code_fingerprint(*components: object) -> str:
    """sha256 of the source of the code a stage computes with: every module of fedpilot's engine (engine/accel/
    included), models and data packages, and for each component (an algorithm or model class or object, a model's
    builder function) the modules defining it and its bases with the modules of their own package they use
    (_own_modules: a plugin's helpers, a built-in algorithm's). An edited engine, model or algorithm gives the stage
    a new cache key."""
    from fedpilot import data, engine, models

    files = {f for package in (engine, models, data) for f in Path(package.__file__).parent.rglob("*.py")}
    for name in _modules(components):
        if name.split(".")[0] not in NOT_OUR_CODE:
            files |= _own_modules(name)
    digest = hashlib.sha256(torch.__version__.encode())
    for file in sorted(files):
        digest.update(str(file.name).encode() + file.read_bytes())
    return digest.hexdigest()[:32]


def _modules(components: tuple[object, ...]) -> set[str]:
    """The names of the modules that define the components: each class's (a component's, its type's for an object,
    every submodule's for a torch module) and those of its bases; a function's own."""
    classes = set()
    for component in components:
        if inspect.isfunction(component):
            continue
        objects = [*component.modules()] if isinstance(component, torch.nn.Module) else [component]
        classes |= {cls for obj in objects for cls in (obj if isinstance(obj, type) else type(obj)).__mro__}
    return {cls.__module__ for cls in classes} | {c.__module__ for c in components if inspect.isfunction(c)}


def _own_modules(name: str) -> set[Path]:
    """The files of module `name` and of the modules of its own package that it uses (imports, or takes a class or
    a function from), transitively: a plugin's modules with their packages' `__init__` (whose own imports are not
    followed: a package holds its submodules), or a built-in algorithm's module with the algorithms' helpers it uses
    (fedpilot's engine, models and data count whole)."""
    plugin = not name.startswith("fedpilot.")
    prefix = name.split(".")[0] if plugin else "fedpilot.algorithms"
    seen: set[str] = set()
    todo = [name]
    while todo:
        current = todo.pop()
        module = sys.modules.get(current)
        if current in seen or not getattr(module, "__file__", None):
            continue
        seen.add(current)
        used = [v.__name__ if inspect.ismodule(v) else getattr(v, "__module__", None) for v in vars(module).values()]
        todo += [n for n in used if isinstance(n, str) and n != prefix and n.startswith(f"{prefix}.")]
    parents = {m.rsplit(".", k)[0] for m in seen for k in range(1, m.count(".") + 1)} if plugin else set()
    return {Path(sys.modules[n].__file__) for n in seen | parents if getattr(sys.modules.get(n), "__file__", None)}
