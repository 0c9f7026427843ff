"""The federated engine: the stage LightningModule, its cohorts, the Executor that runs their local SGD, aggregation.

Read a round as stage -> cohort -> Executor -> sequential (the reference executor); engine/accel/ holds the fast
executors behind the same Executor.

Importing the package imports nothing heavy; each name below loads its module (and torch) on first use, so the
torch-free contracts in `fedpilot.engine.protocol` and `fedpilot.engine.config` stay cheap to import.
"""

from importlib import import_module
from typing import Any

_WHERE = {
    "Cohort": "cohort", "Local": "cohort", "FederatedStage": "stage", "carry_bank": "stage",
    "Executor": "executor", "RoundCallback": "hooks", "RoundResult": "hooks",
    "WeightedMean": "aggregate", "distribution": "metrics",
    "Algorithm": "protocol", "AlgorithmParams": "protocol", "Aggregator": "protocol",
    "ReducibleAggregator": "protocol", "RoundInfo": "protocol", "Upload": "protocol", "StatefulParams": "protocol",
    "LocalConfig": "config", "LrSchedule": "config", "ServerConfig": "config", "StageConfig": "config",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
