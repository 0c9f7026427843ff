"""The algorithms a pipeline can name. A new built-in algorithm is one module here (its Params, docstring and
`local_update`), one line below, and its tests; a plugin's is a class in its own distribution, registered under the
entry-point group `fedpilot.algorithms`. Nothing is imported by a path from a user's YAML."""

from __future__ import annotations

import inspect
from typing import Any

from fedpilot.engine.config import LocalConfig, ServerConfig
from fedpilot.engine.protocol import Algorithm, AlgorithmParams, Tunable
from fedpilot.registry import Registry


def algorithm_problem(name: str, component: Any) -> str | None:
    """What keeps a plugin's `component` from being the algorithm `name`, or None."""
    if not (isinstance(component, type) and issubclass(component, Algorithm)):
        return "is not a subclass of fedpilot.api.Algorithm"
    if inspect.isabstract(component):
        return f"does not implement {', '.join(sorted(component.__abstractmethods__))}"
    if not (isinstance(component.Params, type) and issubclass(component.Params, AlgorithmParams)):
        return "has a Params that is not a subclass of fedpilot.api.AlgorithmParams"
    if getattr(component, "name", None) != name:
        return f"sets name = {getattr(component, 'name', None)!r}: an algorithm's name is its entry point's, {name!r}"
    return tunable_problem(component)


def tunable_problem(algorithm: type[Algorithm]) -> str | None:
    """What is wrong with an algorithm's `tunable` declaration, or None: a dict of Tunable by a stage key that exists
    (`local.<field>`, `server.<field>`, `params.<field of its Params>`), fallbacks included."""
    declared = algorithm.tunable
    if not isinstance(declared, dict) or not all(isinstance(t, Tunable) for t in declared.values()):
        return "has a `tunable` that is not a dict of fedpilot.api.Tunable by stage key"
    fields = {"local": LocalConfig.model_fields, "server": ServerConfig.model_fields,
              "params": algorithm.Params.model_fields}
    for key in [*declared, *(t.fallback for t in declared.values() if t.fallback)]:
        block, _, field = str(key).partition(".")
        if field not in fields.get(block, {}):
            return (f"declares tunable {key!r}, which is not a stage key (local.<field>, server.<field> or "
                    "params.<field of its Params>)")
    return None


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
}, group="fedpilot.algorithms", check=algorithm_problem)


def build_algorithm(name: str, params: dict[str, Any] | None = None, key: str = "algorithm") -> Algorithm:
    """The registered algorithm `name` with validated hyperparameters."""
    return ALGORITHMS.get_checked(name, key)(params)


__all__ = ["ALGORITHMS", "build_algorithm"]
