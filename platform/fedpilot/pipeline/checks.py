"""Every check that can fail on a user's input, before anything is created: `prepare` builds what a pipeline needs
(data, model, algorithms, device) and runs them; `fedpilot validate`, `run`, `search` and `submit` all call it."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from fedpilot.algorithms import build_algorithm
from fedpilot.data import FederatedData, build_federated_data
from fedpilot.engine.data import Augment, ClientData
from fedpilot.engine.protocol import Algorithm
from fedpilot.engine.stage import splits_across_processes
from fedpilot.engine.task import Task, make_task
from fedpilot.errors import SpecError
from fedpilot.models import MODELS, apply_split, build_model
from fedpilot.models.zoo import takes_tokens
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
    """What every check of a pipeline builds: the federated data (and its tensors for the engine), the task, the
    model, the stages' algorithms, the device."""

    data: FederatedData
    tensors: ClientData
    task: Task
    model: torch.nn.Module
    algorithms: list[Algorithm]
    device: torch.device


def client_data(data: FederatedData) -> ClientData:
    """The engine's tensors of a built dataset, sharing its (memory-mapped) arrays: next-token windows become
    inputs [:, :-1] and targets [:, 1:] (two views of one array), pixels stay uint8 until a batch needs them."""
    x = torch.from_numpy(data.x)
    inputs, targets = (x[:, :-1], x[:, 1:]) if data.y is None else (x, torch.from_numpy(data.y))
    pixels = x.dtype == torch.uint8
    augment = Augment(data.augment, data.feature_shape) if data.augment else None
    return ClientData(inputs, targets, {s: torch.from_numpy(v) for s, v in data.offsets.items()},
                      {s: torch.from_numpy(v) for s, v in data.sizes.items()}, scale=data.scale if pixels else None,
                      mean=None if data.mean is None else torch.tensor(data.mean),
                      std=None if data.std is None else torch.tensor(data.std), augment=augment)


def model_for(spec: PipelineSpec, data: FederatedData) -> torch.nn.Module:
    """The pipeline's model for this data (seeded): its outputs and, for token inputs, its vocabulary."""
    name, tokens = spec.model.name, data.specials is not None
    if tokens != takes_tokens(name):
        reads = [m for m in MODELS.loadable() if takes_tokens(m) == tokens]
        what = "token ids (a tokenized text column)" if tokens else f"inputs of shape {data.feature_shape}"
        raise SpecError("model.name", name, f"does not read this dataset's {what}", allowed=reads)
    vocab = {"vocab_size": data.vocab_size, "pad_id": data.specials["pad"]} if tokens else None
    torch.manual_seed(spec.seed)
    plugin = name not in MODELS.builtins  # a plugin's failure to build is its own: whatever it raises, named
    try:
        return build_model(name, data.feature_shape, data.num_classes, vocab, **spec.model.options)
    except Exception as err:
        if not (plugin or isinstance(err, RuntimeError | ValueError | TypeError)):  # a builder refusing its options
            raise
        problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        where = f" (the {MODELS.origin(name)})" if plugin else ""
        raise SpecError("model", spec.model.model_dump(), f"cannot be built{where}: {problem}") from None


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
        sampled = stage.eval_clients or spec.evaluation.clients
        if sampled is not None and sampled > data.n_clients:
            key = f"stages.{i}.eval_clients" if stage.eval_clients else "evaluation.clients"
            raise SpecError(key, sampled, f"the federation has only {data.n_clients} clients")
    model = model_for(spec, data)
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
    return Prepared(data, client_data(data), make_task(data.task, data.specials), model, algorithms, device)
