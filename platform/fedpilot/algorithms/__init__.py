"""Algorithm registry: the names a pipeline may use, mapped to their classes (nothing is imported by path)."""

from __future__ import annotations

from typing import Any

from fedpilot.algorithms.base import Algorithm, AlgorithmParams
from fedpilot.algorithms.fedalt import FedAlt
from fedpilot.algorithms.fedavg import FedAvg
from fedpilot.algorithms.fedsim import FedSim
from fedpilot.algorithms.finetune import Finetune, LocalOnly
from fedpilot.errors import SpecError

ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (FedAvg, FedSim, FedAlt, Finetune, LocalOnly)}


def build_algorithm(name: str, params: dict[str, Any] | None = None, key: str = "algorithm") -> Algorithm:
    """The registered algorithm `name` with validated hyperparameters."""
    if name not in ALGORITHMS:
        raise SpecError(key, name, "unknown algorithm", allowed=sorted(ALGORITHMS))
    return ALGORITHMS[name](params)


__all__ = ["ALGORITHMS", "Algorithm", "AlgorithmParams", "build_algorithm"]
