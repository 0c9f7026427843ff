"""The algorithms a pipeline can name. A new algorithm is one module here (its Params, docstring and
`local_update`), one line below, and its tests; nothing is imported by a path from a user's YAML."""

from __future__ import annotations

from typing import Any

from fedpilot.engine.protocol import Algorithm
from fedpilot.registry import Registry

ALGORITHMS = Registry("algorithm", {
    "ditto": "fedpilot.algorithms.ditto:Ditto",
    "fedalt": "fedpilot.algorithms.fedalt:FedAlt",
    "fedavg": "fedpilot.algorithms.fedavg:FedAvg",
    "fedper": "fedpilot.algorithms.fedper:FedPer",
    "fedprox": "fedpilot.algorithms.fedprox:FedProx",
    "fedrep": "fedpilot.algorithms.fedrep:FedRep",
    "fedsim": "fedpilot.algorithms.fedsim:FedSim",
    "ffgg": "fedpilot.algorithms.ffgg:Ffgg",
    "ffgg_async": "fedpilot.algorithms.ffgg:AsyncFfgg",
    "ffgg_local": "fedpilot.algorithms.ffgg:LocalFfgg",
    "ffgg_robust": "fedpilot.algorithms.ffgg:RobustFfgg",
    "finetune": "fedpilot.algorithms.finetune:Finetune",
    "heterofl": "fedpilot.algorithms.heterofl:HeteroFL",
    "lg_fedavg": "fedpilot.algorithms.lgfedavg:LGFedAvg",
    "local": "fedpilot.algorithms.finetune:LocalOnly",
    "perfedavg": "fedpilot.algorithms.perfedavg:PerFedAvg",
    "pfedgate": "fedpilot.algorithms.pfedgate:PFedGate",
    "pfedme": "fedpilot.algorithms.pfedme:PFedMe",
    "pflego": "fedpilot.algorithms.pflego:Pflego",
    "selffl": "fedpilot.algorithms.selffl:SelfFL",
    "selffl_aug": "fedpilot.algorithms.selffl:SelfFLAug",
})


def build_algorithm(name: str, params: dict[str, Any] | None = None, key: str = "algorithm") -> Algorithm:
    """The registered algorithm `name` with validated hyperparameters."""
    return ALGORITHMS.get_checked(name, key)(params)


__all__ = ["ALGORITHMS", "build_algorithm"]
