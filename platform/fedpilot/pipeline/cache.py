"""The stage cache: finished stages on disk under a key of everything that determines their result.

A finished stage is stored under a hash of its inputs (dataset fingerprint, model, seed, its resolved spec and
split, the previous stage's key, the device type, the code that computes it); a rerun that changes only a later
stage reuses the earlier ones. `max_parallel_clients`, `execution` and stage names are left out of the key: they
change how a stage runs, not what it computes (equal within float tolerance, tests/test_engine_equivalence.py).
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

from fedpilot.data.federated import FederatedData
from fedpilot.spec import PipelineSpec

CACHE_FORMAT = 1
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


def stage_key(previous: str, data: FederatedData, spec: PipelineSpec, index: int, split: Any, device: str,
              code: str, beyond: dict[str, Any] | None = None) -> str:
    """The cache key of stage `index`: everything its result depends on (`code`: the code_fingerprint of what runs
    it; `beyond`: its evaluations beyond the participants, held-out clients and selection, when it has any), chained
    to the previous stage's key."""
    stage = spec.stages[index]
    payload = {"format": CACHE_FORMAT, "code": code, "fedpilot": version("fedpilot"), "previous": previous,
               "data": data.fingerprint, "model": spec.model.model_dump(mode="json"), "seed": spec.seed,
               "index": index, "stage": stage.model_dump(mode="json", exclude=NOT_IN_KEY), "split": split,
               "eval_every": stage.eval_every or spec.evaluation.every,
               "eval_clients": stage.eval_clients or spec.evaluation.clients, "device": device,
               **({"beyond": beyond} if beyond else {})}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


# Packages whose code never enters a stage key: the Python runtime and pinned libraries (their versions do).

def code_fingerprint(*components: object) -> str:
    """sha256 of the source of the code a stage computes with: fedpilot's engine, models and data packages, and
    the modules defining each component's class and bases (the algorithm; the model and its submodules, which is
    where a plugin's own code lives) and each function component's module (a plugin model's builder function, whose
    Net may be made of torch classes only). An edited model or algorithm gives the stage a new cache key."""
    from fedpilot import data, engine, models

    files = {f for package in (engine, models, data) for f in Path(package.__file__).parent.glob("*.py")}
    classes = {cls for c in components for obj in ([*c.modules()] if isinstance(c, torch.nn.Module) else [c])
               for cls in type(obj).__mro__}
    names = {cls.__module__ for cls in classes} | {c.__module__ for c in components if inspect.isfunction(c)}
    for name in names:
        module = sys.modules.get(name)
        if name.split(".")[0] not in NOT_OUR_CODE and getattr(module, "__file__", None):
            files.add(Path(module.__file__))
    digest = hashlib.sha256(torch.__version__.encode())
    for file in sorted(files):
        digest.update(str(file.name).encode() + file.read_bytes())
    return digest.hexdigest()[:32]
