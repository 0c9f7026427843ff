"""Algorithm registry: every Algorithm subclass with a `name` in a module of this package, by that name.

A new algorithm is one module here (plus configs/algorithm/NAME.yaml and tests); nothing is imported by a
path from a user's YAML, only these names.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from fedpilot.algorithms.base import Algorithm, AlgorithmParams
from fedpilot.errors import SpecError


def _discover() -> dict[str, type[Algorithm]]:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    found: dict[str, type[Algorithm]] = {}
    pending = list(Algorithm.__subclasses__())
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        if "name" in vars(cls):
            found[cls.name] = cls
    return dict(sorted(found.items()))


ALGORITHMS: dict[str, type[Algorithm]] = _discover()


def build_algorithm(name: str, params: dict[str, Any] | None = None, key: str = "algorithm") -> Algorithm:
    """The registered algorithm `name` with validated hyperparameters."""
    if name not in ALGORITHMS:
        raise SpecError(key, name, "unknown algorithm", allowed=sorted(ALGORITHMS))
    return ALGORITHMS[name](params)


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmParams", "build_algorithm"]
