"""Every check that can fail on a user's input, before anything is created: `prepare` builds what a pipeline needs
(data, model, algorithms, device) and runs them; `fedpilot validate`, `run`, `search` and `submit` all call it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from fedpilot.algorithms import build_algorithm
from fedpilot.data import FederatedData, build_federated_data
from fedpilot.engine.protocol import Algorithm
from fedpilot.engine.stage import splits_across_processes
from fedpilot.errors import SpecError
from fedpilot.models import apply_split, build_model
from fedpilot.spec import PipelineSpec, StageSpec


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise SpecError("device", requested, "no CUDA device is available here", allowed=["auto", "cpu"])
    return torch.device("cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
                        else "cpu")


def under_slurm() -> bool:
    """This process is a task of a Slurm job (Lightning's SLURM environment: ranks, nodes and the main address)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def check_devices(spec: PipelineSpec, device: torch.device, algorithms: list[Algorithm], here: bool = True) -> None:
    """`devices` > 1 (DDP) needs that many GPUs on a GPU, and stages whose server aggregate is made of sums; `nodes`
    > 1 runs as a Slurm job. With `here` off (a pipeline checked for a cluster) what this machine has is not asked."""
    if here and spec.nodes > 1 and not under_slurm():
        raise SpecError("nodes", spec.nodes, "several nodes run as a Slurm job: fedpilot submit PIPELINE --to slurm")
    if spec.devices == 1 and spec.nodes == 1:
        return
    if here and device.type == "cuda" and spec.devices > torch.cuda.device_count():
        raise SpecError("devices", spec.devices, f"only {torch.cuda.device_count()} CUDA devices are visible here")
    for i, algorithm in enumerate(algorithms):
        if not splits_across_processes(algorithm):
            raise SpecError(f"stages.{i}.algorithm", spec.stages[i].algorithm, "its server keeps every client's "
                            "upload, so its rounds cannot be split across devices; run this pipeline with devices: 1")


def stage_split(spec: PipelineSpec, stage: StageSpec, algorithm_part: str | None) -> tuple[str | list[str], int]:
    """(split, adapter_dim) of a stage: the algorithm's own part, else the stage's, else the pipeline's."""
    chosen = stage.personalization or spec.personalization
    return (algorithm_part or chosen.split), chosen.adapter_dim


@dataclass
class Prepared:
    """What every check of a pipeline builds: the federated data, the model, the stages' algorithms, the device."""

    data: FederatedData
    model: torch.nn.Module
    algorithms: list[Algorithm]
    device: torch.device


def prepare(spec: PipelineSpec, root: Path, here: bool = True) -> Prepared:
    """Build what a pipeline needs and run every check that can fail on the user's input (data, model options,
    cohort sizes, algorithms, devices, personalization), before any run is created. `fedpilot validate` and
    `fedpilot run` both call it; `root` is the cache root (the dataset is cached under root/data). With `here` off
    (a pipeline submitted to a cluster) the devices it asks for need not exist on this machine."""
    device = resolve_device(spec.device if here else "cpu")
    data = build_federated_data(spec.dataset, spec.seed, root / "data")
    for i, stage in enumerate(spec.stages):
        if stage.clients_per_round is not None and stage.clients_per_round > data.n_clients:
            raise SpecError(f"stages.{i}.clients_per_round", stage.clients_per_round,
                            f"the federation has only {data.n_clients} clients")
    torch.manual_seed(spec.seed)
    try:
        model = build_model(spec.model.name, data.feature_shape, data.num_classes, **spec.model.options)
    except (RuntimeError, ValueError, TypeError) as err:  # a builder refusing its options (e.g. a negative size)
        problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecError("model", spec.model.model_dump(), f"cannot be built: {problem}") from None
    algorithms = [build_algorithm(s.algorithm, s.params, f"stages.{i}.algorithm") for i, s in enumerate(spec.stages)]
    check_devices(spec, device, algorithms, here)
    probe = copy.deepcopy(model)
    for i, stage in enumerate(spec.stages):
        split, dim = stage_split(spec, stage, algorithms[i].personal_part)
        try:
            algorithms[i].prepare_model(probe, data.feature_shape)
            apply_split(probe, split, dim)
        except SpecError as err:
            raise SpecError(f"stages.{i}.personalization" if stage.personalization else err.key,
                            err.value, err.problem, err.allowed) from None
    return Prepared(data, model, algorithms, device)
