"""Every check that can fail on a user's input, before anything is created: `prepare` builds what a pipeline needs
(data, algorithms) and runs them; `fedpilot validate`, `run`, `search` and `submit` all call it.

Checking a pipeline imports torch only where a check needs it. A built-in model's options are checked by its
torch-free schema (fedpilot.models.options), and with them its fit to the data and whether the `adapters` preset has
somewhere to go, so it need not be built. The model is built (torch imported) only when a check needs its
parameters: a plugin model (its builder is code), a personalization given as name regexes (does each match a
parameter?), an algorithm that adds to the model (`prepare_model`: pFedGate's gate, HeteroFL's width masks, Self-FL's
state shapes). `device: cuda` asks torch whether CUDA is there, `devices` > 1 how many GPUs. What training needs on
top of the checks (the device, the model, the data's tensors, the task) a `Prepared` makes on first use."""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from fedpilot.algorithms import build_algorithm
from fedpilot.data.federated import FederatedData, build_federated_data, staging
from fedpilot.engine.protocol import Algorithm, Part
from fedpilot.errors import SpecError, check_memory
from fedpilot.metric_names import NOVEL, recorded_metrics
from fedpilot.models.options import MODELS, PRESETS, SCHEMAS, ModelOptions, reads_tokens, token_readers
from fedpilot.spec import PipelineSpec, StageSpec

if TYPE_CHECKING:
    import torch

    from fedpilot.engine.data import ClientData
    from fedpilot.engine.task import Task


def resolve_device(requested: str) -> torch.device:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise SpecError("device", requested, "no CUDA device is available here", allowed=["auto", "cpu"])
    return torch.device("cuda" if requested == "cuda" or (requested == "auto" and torch.cuda.is_available())
                        else "cpu")


def under_slurm() -> bool:
    """This process is a task of a Slurm job (Lightning's SLURM environment: ranks, nodes and the main address)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def check_devices(spec: PipelineSpec, device: torch.device | None, algorithms: list[Algorithm],
                  here: bool = True) -> None:
    """`devices` > 1 (DDP) needs that many GPUs on a GPU, and stages whose server aggregate is made of sums; `nodes`
    > 1 runs as a Slurm job. With `here` off (a pipeline checked for a cluster) what this machine has is not asked.
    `device` may be None when `devices` and `nodes` are 1 (nothing about it is asked then)."""
    if here and spec.nodes > 1 and not under_slurm():
        raise SpecError("nodes", spec.nodes, "several nodes run as a Slurm job: fedpilot submit PIPELINE --to slurm")
    if spec.devices == 1 and spec.nodes == 1:
        return
    import torch

    from fedpilot.engine.ddp import splits_across_processes

    if here and device is not None and device.type == "cuda" and spec.devices > torch.cuda.device_count():
        raise SpecError("devices", spec.devices, f"only {torch.cuda.device_count()} CUDA devices are visible here")
    if here and device is not None and device.type == "cpu" and spec.devices > (os.cpu_count() or 1):
        raise SpecError("devices", spec.devices, f"on the CPU each device is a process of its own, and this machine "
                        f"has {os.cpu_count()} cores")
    for i, algorithm in enumerate(algorithms):
        if not splits_across_processes(algorithm):
            raise SpecError(f"stages.{i}.algorithm", spec.stages[i].algorithm, "its server keeps every client's "
                            "upload, so its rounds cannot be split across devices; run this pipeline with devices: 1")


def stage_split(spec: PipelineSpec, stage: StageSpec, algorithm_part: str | None) -> tuple[str | list[str], int]:
    """(split, adapter_dim) of a stage: the algorithm's own part, else the stage's, else the pipeline's."""
    chosen = stage.personalization or spec.personalization
    return (algorithm_part or chosen.split), chosen.adapter_dim


def client_data(data: FederatedData) -> ClientData:
    """The engine's tensors of a built dataset, sharing its (memory-mapped) arrays: next-token windows become
    inputs [:, :-1] and targets [:, 1:] (two views of one array), pixels stay uint8 until a batch needs them."""
    import torch

    from fedpilot.engine.data import Augment, ClientData

    x = torch.from_numpy(data.x)
    inputs, targets = (x[:, :-1], x[:, 1:]) if data.y is None else (x, torch.from_numpy(data.y))
    pixels = x.dtype == torch.uint8
    augment = Augment(data.augment, data.feature_shape) if data.augment else None
    return ClientData(inputs, targets, {s: torch.from_numpy(v) for s, v in data.offsets.items()},
                      {s: torch.from_numpy(v) for s, v in data.sizes.items()}, scale=data.scale if pixels else None,
                      mean=None if data.mean is None else torch.tensor(data.mean),
                      std=None if data.std is None else torch.tensor(data.std), augment=augment)


def check_model_fits(spec: PipelineSpec, data: FederatedData) -> None:
    """The model reads this data: token ids or features (known from its name), and for a built-in its schema's
    checks against the data's shape and vocabulary (no torch)."""
    name, tokens = spec.model.name, data.specials is not None
    if tokens != reads_tokens(name):
        what = "token ids (a tokenized text column)" if tokens else f"inputs of shape {data.feature_shape}"
        raise SpecError("model.name", name, f"does not read this dataset's {what}", allowed=token_readers(tokens))
    if name in SCHEMAS:
        SCHEMAS[name].model_validate(spec.model.options).fits(name, data.feature_shape, data.vocab_size)


def model_for(spec: PipelineSpec, data: FederatedData) -> torch.nn.Module:
    """The pipeline's model for this data (seeded): its outputs and, for token inputs, its vocabulary. A plugin that
    fails to build is a SpecError naming it, whatever it raises; a built-in whose options passed its schema builds."""
    import torch

    from fedpilot.models.zoo import build_model

    tokens = data.specials is not None
    vocab = {"vocab_size": data.vocab_size, "pad_id": data.specials["pad"]} if tokens else None
    name = spec.model.name
    try:
        check_model_memory(spec, lambda: build_model(name, data.feature_shape, data.num_classes, vocab,
                                                     **spec.model.options))
        torch.manual_seed(spec.seed)
        return build_model(name, data.feature_shape, data.num_classes, vocab, **spec.model.options)
    except Exception as err:  # a plugin's failure to build is its own: whatever it raises, named
        if name in MODELS.builtins:
            raise
        problem = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise SpecError("model", spec.model.model_dump(), f"cannot be built (the {MODELS.origin(name)}): "
                        f"{problem}") from None


def check_model_memory(spec: PipelineSpec, build: Callable[[], torch.nn.Module]) -> None:
    """A SpecError when the model's parameters and their gradients need more memory than this machine has, counted
    on torch's meta device (which allocates nothing) before the real build would fail to allocate them. A builder
    that cannot run on the meta device is left to the real build."""
    import torch

    try:
        with torch.device("meta"):
            probe = build()
    except SpecError:
        raise
    except Exception:  # e.g. a plugin initialising its weights from data: nothing to count here
        return
    count = sum(p.numel() for p in probe.parameters())
    nbytes = 2 * sum(p.numel() * p.element_size() for p in probe.parameters())
    check_memory("model", spec.model.model_dump(), nbytes, f"its {count:,} parameters and their gradients")


class Prepared:
    """A checked pipeline: its federated data and its stages' algorithms. What training needs on top, the device,
    the model, the data's tensors and the task, is made on first use (torch then), so checking a pipeline imports
    torch only where a check needs it."""

    def __init__(self, spec: PipelineSpec, data: FederatedData, algorithms: list[Algorithm], here: bool = True):
        self.spec, self.data, self.algorithms, self.here = spec, data, algorithms, here

    @cached_property
    def device(self) -> torch.device:
        return resolve_device(self.spec.device if self.here else "cpu")

    @cached_property
    def model(self) -> torch.nn.Module:
        return model_for(self.spec, self.data)

    @cached_property
    def novel(self) -> np.ndarray:
        """The ids of the clients held out of training (`evaluation.novel_clients`; none without it)."""
        return held_out_clients(self.data.n_clients, self.spec)

    @cached_property
    def participants(self) -> np.ndarray:
        """The ids of the clients that take part in training, in the federation's order."""
        return np.setdiff1d(np.arange(self.data.n_clients), self.novel)

    @cached_property
    def all_tensors(self) -> ClientData:
        return client_data(self.data)

    @cached_property
    def tensors(self) -> ClientData:
        """The participating clients' data (client i of the engine is the federation's client participants[i])."""
        return self.all_tensors if not len(self.novel) else self.all_tensors.clients(self.participants)

    @cached_property
    def novel_tensors(self) -> ClientData | None:
        """The novel clients' data, None when none is held out."""
        return self.all_tensors.clients(self.novel) if len(self.novel) else None

    @cached_property
    def task(self) -> Task:
        from fedpilot.engine.task import make_task

        return make_task(self.data.task, self.data.specials)


def needs_model(spec: PipelineSpec, algorithms: list[Algorithm]) -> bool:
    """Whether a check needs the built model's parameters: a plugin model, a stage whose personal part is a list of
    name regexes, or an algorithm that adds to the model (overrides `prepare_model`)."""
    if spec.model.name not in MODELS.builtins:
        return True
    return any(isinstance(stage_split(spec, stage, algorithm.personal_part)[0], list)
               or type(algorithm).prepare_model is not Algorithm.prepare_model
               for stage, algorithm in zip(spec.stages, algorithms, strict=True))


def check_personal_parts(spec: PipelineSpec, prepared: Prepared) -> None:
    """Each stage's personal part exists in the model as its algorithm leaves it, and has what the algorithm needs
    (a personal part, a shared part): checked on a copy of the built model where a check needs its parameters
    (needs_model), else by the built-in model's schema (every preset applies, `adapters` where the model has places
    for adapters)."""
    probe = options = None
    if needs_model(spec, prepared.algorithms):
        probe = copy.deepcopy(prepared.model)
    else:
        options = SCHEMAS[spec.model.name].model_validate(spec.model.options)
    for i, (stage, algorithm) in enumerate(zip(spec.stages, prepared.algorithms, strict=True)):
        split, dim = stage_split(spec, stage, algorithm.personal_part)
        try:
            parts = split_parts(probe, options, algorithm, split, dim, prepared.data.feature_shape, spec.model.name)
        except SpecError as err:
            raise _stage_split_error(spec, i, algorithm, err) from None
        check_needs(spec, i, algorithm, split, parts)


def split_parts(probe: torch.nn.Module | None, options: ModelOptions | None, algorithm: Algorithm,
                split: str | list[str], dim: int, input_shape: tuple[int, ...], model: str) -> set[Part]:
    """The parts ("personal", "shared") the split leaves non-empty: on the built model `probe` as the algorithm
    prepares it, else from a built-in model's schema `options` (no torch)."""
    if probe is not None:
        from fedpilot.models.split import apply_split

        algorithm.prepare_model(probe, input_shape)
        applied = apply_split(probe, split, dim)
        return {part for part, names in (("personal", applied.personal_names), ("shared", applied.shared_names))
                if names}
    if split == "adapters" and not options.adapter_places():
        raise SpecError("personalization", split, f"model {model!r} has no place for adapters",
                        allowed=[p for p in PRESETS if p != "adapters"])
    if split == "none":
        return {"shared"}
    if split == "all":
        return {"personal"}
    return {"personal", "shared"} if split == "adapters" or options.body_has_parameters() else {"personal"}


def _stage_split_error(spec: PipelineSpec, i: int, algorithm: Algorithm, err: SpecError) -> SpecError:
    """A split that does not apply, on the key that chose it: the stage's personalization, the pipeline's, or the
    algorithm (which brings its own personal part)."""
    if algorithm.personal_part is not None and spec.stages[i].personalization is None and \
            err.key == "personalization":
        return SpecError(f"stages.{i}.algorithm", algorithm.name, f"its own personal part {err.value!r}: "
                         f"{err.problem} in model {spec.model.name!r}", err.allowed)
    return SpecError(f"stages.{i}.personalization" if spec.stages[i].personalization else err.key, err.value,
                     err.problem, err.allowed)


def check_needs(spec: PipelineSpec, i: int, algorithm: Algorithm, split: str | list[str], parts: set[Part]) -> None:
    """A SpecError naming the stage, its algorithm and the fix when the split leaves a part the algorithm needs
    empty; on the algorithm when the split is its own (a plugin whose personal_part contradicts its needs)."""
    missing = sorted(set(algorithm.needs) - parts)
    if not missing:
        return
    stage = spec.stages[i]
    what = f"stage {stage.name!r} ({algorithm.name})"
    if algorithm.personal_part is not None and stage.personalization is None:
        raise SpecError(f"stages.{i}.algorithm", algorithm.name, f"{what} needs a {missing[0]} part, and its own "
                        f"personal part {split!r} leaves none in model {spec.model.name!r}")
    key = f"stages.{i}.personalization" if stage.personalization else "personalization"
    if missing == ["personal"]:
        fix = (f"set {key} to a preset with personal parameters (output_layer, input_layer, adapters) or to name "
               "regexes; for a baseline without personal parameters use fedavg, or finetune with params.part: all")
        raise SpecError(key, split, f"{what} trains personal parameters, and this split has none: {fix}")
    raise SpecError(key, split, f"{what} sends shared parameters to the server, and this split leaves none shared "
                    f"in model {spec.model.name!r}: set {key} to a split that keeps some shared (output_layer or "
                    "input_layer on a model whose body has parameters, adapters, or name regexes)")


def check_objectives_have_data(spec: PipelineSpec, data: FederatedData) -> None:
    """A search whose objective is a validation metric needs a client with a validation sample (dataset.split.val
    may be 0, or round to 0 on every client); one on the novel clients' validation metrics, a novel client with one."""
    if spec.search is None:
        return
    novel = held_out_clients(data.n_clients, spec)
    for i, objective in enumerate(spec.search.objective):
        if objective.metric.startswith(f"{NOVEL}_val_") and not data.sizes["val"][novel].any():
            raise SpecError(f"search.objective.{i}.metric", objective.metric, f"none of the {len(novel)} novel "
                            "clients has a validation sample: raise dataset.split.val or evaluation.novel_clients")
    if data.sizes["val"].any():
        return
    for i, objective in enumerate(spec.search.objective):
        if objective.metric.startswith("val_"):
            raise SpecError(f"search.objective.{i}.metric", objective.metric, "no client has a validation sample "
                            f"(dataset.split.val={spec.dataset.split.val:g}): raise dataset.split.val, or "
                            "optimize a footprint", allowed=[m for m in recorded_metrics(spec.dataset.task)
                                                            if not m.startswith("val_")])


NOVEL_STREAM = 2  # the held-out clients' draw, apart from the cohorts' (0) and the evaluation samples' (1)


def held_out_clients(n_clients: int, spec: PipelineSpec) -> np.ndarray:
    """The ids of the clients `evaluation.novel_clients` holds out, sorted: drawn with the federation's seed (the
    dataset's, else the pipeline's), so the same in every stage, on resume, in every process, and on every seed of a
    comparison that holds the federation fixed (dataset.seed)."""
    count = spec.evaluation.novel_count(n_clients)
    seed = spec.seed if spec.dataset.seed is None else spec.dataset.seed
    rng = np.random.default_rng(np.random.SeedSequence([seed, NOVEL_STREAM]))
    return np.sort(rng.choice(n_clients, size=count, replace=False)) if count else np.zeros(0, dtype=np.int64)


def check_cohorts(spec: PipelineSpec, n_clients: int) -> None:
    """The clients held out (`evaluation.novel_clients`) leave some to train, and every stage's cohort and evaluation
    sample fit in the clients that take part."""
    held_out = spec.evaluation.novel_count(n_clients)
    if held_out >= n_clients:
        raise SpecError("evaluation.novel_clients", spec.evaluation.novel_clients, f"holds out {held_out} of the "
                        f"federation's {n_clients} clients: leave at least one to train")
    taking_part = n_clients - held_out
    of = f"the federation has only {n_clients} clients" if not held_out else \
        f"only {taking_part} of the federation's {n_clients} clients take part ({held_out} held out as novel clients)"
    for i, stage in enumerate(spec.stages):
        if stage.clients_per_round is not None and stage.clients_per_round > taking_part:
            raise SpecError(f"stages.{i}.clients_per_round", stage.clients_per_round, of)
        sampled = stage.eval_clients or spec.evaluation.clients
        if sampled is not None and sampled > taking_part:
            key = f"stages.{i}.eval_clients" if stage.eval_clients else "evaluation.clients"
            raise SpecError(key, sampled, of)


PLANNED_SAMPLE_BYTES = 32  # a round's batch plan per planned sample: its index, weight, sort key and ordering


def check_round_plans(spec: PipelineSpec, data: FederatedData) -> None:
    """Each stage's batch plan of a round (every step of every sampled client, drawn at once) fits in memory: a huge
    `epochs`, `steps` or `batch_size` is refused here instead of failing to allocate in the first round."""
    largest = int(data.sizes["train"].max())
    for i, stage in enumerate(spec.stages):
        local = stage.local
        clients = min(stage.clients_per_round or data.n_clients, data.n_clients)
        batch = max(1, min(local.batch_size, largest))
        steps = local.steps or math.ceil(local.epochs) * math.ceil(largest / batch)
        check_memory(f"stages.{i}.local", local.model_dump(exclude_defaults=True), clients * steps * batch *
                     PLANNED_SAMPLE_BYTES, f"a round's batch plan ({clients:,} clients x {steps:,} steps x {batch:,} "
                     "samples)")


def prepare(spec: PipelineSpec, root: Path, here: bool = True) -> Prepared:
    """Build what a pipeline needs and run every check that can fail on the user's input (data, model options,
    cohort sizes, algorithms, devices, personalization), before any run is created. `fedpilot validate` and
    `fedpilot run` both call it; `root` is the cache root (a new dataset becomes a cache entry under root/data once
    every check passed, or when the `staging` block around the call ends). With `here` off (a pipeline submitted to
    a cluster) the devices it asks for need not exist on this machine."""
    if here and spec.device == "cuda":
        resolve_device(spec.device)
    with staging():  # the dataset becomes a cache entry once every check below has passed
        data = build_federated_data(spec.dataset, spec.seed, root / "data")
        check_cohorts(spec, data.n_clients)
        check_objectives_have_data(spec, data)
        check_round_plans(spec, data)
        check_model_fits(spec, data)
        algorithms = [build_algorithm(s.algorithm, s.params, f"stages.{i}.algorithm")
                      for i, s in enumerate(spec.stages)]
        prepared = Prepared(spec, data, algorithms, here)
        several = spec.devices > 1 or spec.nodes > 1
        check_devices(spec, prepared.device if here and several else None, algorithms, here)
        check_personal_parts(spec, prepared)
    return prepared
