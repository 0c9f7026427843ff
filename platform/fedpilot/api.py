"""fedpilot's public API for algorithms, models, sources and tasks written outside the package (and the built-in
ones, which use nothing else). Names here are stable; everything else in fedpilot is private.

Importing this module is cheap (no torch); the names that need torch load it on first use.
"""

from importlib import import_module
from typing import Any

from fedpilot.engine.protocol import (
    Aggregator,
    Algorithm,
    AlgorithmParams,
    ReducibleAggregator,
    RoundInfo,
    StatefulParams,
    Upload,
)
from fedpilot.errors import SpecError

_LAZY = {
    "Cohort": "fedpilot.engine.cohort",  # the clients of a round as one value; its sgd and gradient
    "Local": "fedpilot.engine.cohort",  # what Cohort.sgd returns: shared and personal parameters [K, ...]
    "WeightedMean": "fedpilot.engine.aggregate",  # the default aggregator, to subclass
    "LocalConfig": "fedpilot.engine.config",  # the stage's `local` block (cohort.local)
    "round_generator": "fedpilot.engine.batches",  # a torch.Generator seeded by (seed, stage, round, ...)
    "Params": "fedpilot.engine.local",  # dict[str, torch.Tensor]: parameters by name
}

__all__ = ["Aggregator", "Algorithm", "AlgorithmParams", "ReducibleAggregator", "RoundInfo", "SpecError",
           "StatefulParams", "Upload",
           *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
