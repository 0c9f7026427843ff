"""Public test helpers: the checks fedpilot makes of its built-in algorithms and models, for a plugin's tests too.

- `assert_matches_sequential(algorithm)`: the vectorized executor (several chunk sizes) and the per-client loop give
  the parameters the plain sequential executor gives (eager PyTorch, one client at a time), on the same batches;
- `assert_trials_match_alone(algorithm, values)`: trials that differ in the stage keys `values`, trained as one batch
  (engine.trials), end where each trial alone ends: the algorithm batches trials (`batches_trials`);
- `assert_learns(algorithm)`: a stage from scratch on scikit-learn's digits reaches a mean per-client test accuracy
  far above chance;
- `check_pipeline(path)`: every check `fedpilot validate` makes (with the installed plugins), the resolved spec;
- the pieces they are made of: `ToyData`, `TinyMLP`, `TinyCNN`, `stage_for`, `fit`, `run_stage`, `run_trials`,
  `assert_close`.

Names here are stable like those of fedpilot.api.
"""

from __future__ import annotations

import copy
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn

from fedpilot.api import Algorithm, LocalConfig, Tensors
from fedpilot.engine.config import StageConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.stage import FederatedStage
from fedpilot.engine.trials import TrialBatch
from fedpilot.models.split import ParamSplit

HEAD = ["head.weight", "head.bias"]  # TinyMLP's output layer
INPUT = ["body.1.weight", "body.1.bias"]  # TinyMLP's input layer
# (executor, clients per chunk) compared with sequential
EXECUTIONS = (("vmap", 7), ("vmap_autograd", 3), ("loop", 2), ("bmm", 5))


class ToyData(ClientData):
    """Client-major Gaussian classification data with uneven client sizes (the engine's ClientData): 12 clients,
    16 features (or 1x4x4 images with image=True), 4 classes."""

    def __init__(self, n_clients: int = 12, dim: int = 16, classes: int = 4, seed: int = 0, image: bool = False,
                 **inputs):
        g = torch.Generator().manual_seed(seed)
        sizes = torch.randint(6, 30, (n_clients,), generator=g)
        train = (sizes * 0.6).long().clamp_min(1)
        val = (sizes - train) // 2
        shift = torch.randn(n_clients, dim, generator=g).repeat_interleave(sizes, 0)
        x = torch.randn(int(sizes.sum()), dim, generator=g) + shift
        y = (x @ torch.randn(dim, classes, generator=g)).argmax(1)
        start = torch.cumsum(sizes, 0) - sizes
        super().__init__(x.view(-1, 1, 4, dim // 4) if image else x, y,
                         {"train": start, "val": start + train, "test": start + train + val},
                         {"train": train, "val": val, "test": sizes - train - val}, **inputs)


class TinyMLP(nn.Module):
    """body (flatten, Linear 16 -> 24, ReLU) -> head (Linear 24 -> 4), for ToyData."""

    def __init__(self, dim: int = 16, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(dim, 24), nn.ReLU())
        self.head = nn.Linear(24, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TinyCNN(nn.Module):
    """body (Conv 1 -> 3 channels, ReLU, flatten) -> head (Linear 48 -> 4), for ToyData(image=True)."""

    def __init__(self, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def stage_for(model: nn.Module, personal: list[str], *args, **kwargs) -> FederatedStage:
    """A FederatedStage of `model` with the parameters named in `personal` personal (the rest of the arguments are
    FederatedStage's: data, algorithm, config, seed, stage index, bank, task)."""
    return FederatedStage(model, ParamSplit.of(model, personal), *args, **kwargs)


def device_under_test() -> torch.device:
    """The device the engine's tests run on: FEDPILOT_TEST_DEVICE (default cpu; `cuda` on a GPU node). When it is
    absent the calling test is skipped, except under CI (CI=true), where it fails: a run that names a device must
    not pass without it."""
    device = torch.device(os.environ.get("FEDPILOT_TEST_DEVICE", "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        message = f"FEDPILOT_TEST_DEVICE={device}: no CUDA device here"
        if os.environ.get("CI", "").lower() == "true":
            raise RuntimeError(message)
        import pytest

        pytest.skip(message)
    return device


def accelerator(device: torch.device) -> dict[str, Any]:
    """Lightning Trainer arguments that run on `device`."""
    if device.type == "cuda":
        return {"accelerator": "gpu", "devices": [device.index or 0]}
    return {"accelerator": "cpu", "devices": 1}


def fit(stage: FederatedStage | TrialBatch, ckpt_path: str | None = None, **trainer_kwargs) -> L.Trainer:
    """Run a stage (or a batch of trials) with a quiet Lightning Trainer (unless `trainer_kwargs` say otherwise,
    `max_steps` too) for its number of rounds, on the device under test; `ckpt_path`: resumed from that checkpoint."""
    quiet = {"max_steps": stage.n_rounds, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
             "enable_model_summary": False, **accelerator(device_under_test())}
    trainer = L.Trainer(**{**quiet, **trainer_kwargs})
    trainer.fit(stage, ckpt_path=ckpt_path)
    return trainer


def run_stage(algorithm: Algorithm | str, personal: list[str] | None, params: dict[str, Any] | None = None,
              execution: str = "sequential", chunk: int = 1, local: LocalConfig | None = None,
              model: Callable[[], nn.Module] = TinyMLP, data: ClientData | None = None,
              precision: str = "32-true", per_call: int | None = None) -> tuple[Tensors, Tensors]:
    """(shared parameters, personal bank) after 4 rounds of 7 clients of ToyData (seed 3) with `execution` in chunks
    of `chunk` clients (an executor that batches clients taking `per_call` of them a call), under `precision`.
    `algorithm`: an instance (copied: each run starts afresh), or a registered name built with `params`; `personal`: the
    personal parameter names (None: all); `model`: a zero-argument factory of a fresh model for `data`."""
    stage = built_stage(algorithm, personal, params, {}, chunk, local, model, data or ToyData(), precision)
    stage.executor_choice.pin(execution, per_call)
    fit(stage)
    return stage_result(stage, personal)


def built_stage(algorithm: Algorithm | str, personal: list[str] | None, params: dict[str, Any] | None,
                values: dict[str, Any], chunk: int, local: LocalConfig | None, model: Callable[[], nn.Module],
                data: ClientData, precision: str = "32-true") -> FederatedStage:
    """The stage `run_stage` runs, with the stage keys in `values` (a trial's: `local.lr`, `server.lr`,
    `params.lr_v`, ...) set."""
    from fedpilot.algorithms import build_algorithm

    torch.manual_seed(0)
    net = model()
    names = [n for n, _ in net.named_parameters()] if personal is None else personal
    config = StageConfig(rounds=4, clients_per_round=7, local=local or LocalConfig(batch_size=4, lr=0.1),
                         max_parallel_clients=chunk, eval_every=2, precision=precision)
    blocks = {block: {k.partition(".")[2]: v for k, v in values.items() if k.startswith(f"{block}.")}
              for block in ("local", "server", "params")}
    config = StageConfig.model_validate({**config.model_dump(), **{b: {**config.model_dump()[b], **blocks[b]}
                                                                    for b in ("local", "server")}})
    if isinstance(algorithm, str):
        built = build_algorithm(algorithm, {**(params or {}), **blocks["params"]})
    else:
        built = copy.deepcopy(algorithm)
        built.params = type(built.params).model_validate({**built.params.model_dump(), **blocks["params"]})
    return stage_for(net, names, data, built, config, seed=3)


def stage_result(stage: FederatedStage, own: list[str] | None = None) -> tuple[Tensors, Tensors]:
    """A stage's (shared parameters, personal bank of `own`: default its personal parameters), on the CPU."""
    names = stage.personal_names if own is None else own
    shared = {n: p.detach().cpu().clone() for n, p in stage.model.named_parameters() if n not in names}
    return shared, {n: stage.bank.tensor(n).cpu().clone() for n in names}


def run_trials(algorithm: Algorithm | str, personal: list[str] | None, values: list[dict[str, Any]],
               params: dict[str, Any] | None = None, execution: str = "sequential", chunk: int = 1,
               local: LocalConfig | None = None, model: Callable[[], nn.Module] = TinyMLP,
               data: ClientData | None = None, span: int | None = None) -> tuple[TrialBatch, list[tuple[Tensors,
                                                                                                     Tensors]]]:
    """The trials with the stage keys `values` (one dict a trial) of `run_stage`'s stage trained as one batch
    (engine.trials.TrialBatch; chunks of `chunk` rows may span `span` trials, None: all): the batch, and each
    trial's (shared parameters, personal bank)."""
    from fedpilot.engine.trials import TrialBatch

    data = data or ToyData()
    batch = TrialBatch([built_stage(algorithm, personal, params, v, chunk, local, model, data) for v in values], span)
    batch.lead.executor_choice.pin(execution)
    fit(batch)
    return batch, [stage_result(stage) for stage in batch.trials]


def assert_trials_match_alone(algorithm: Algorithm | str, values: list[dict[str, Any]],
                              personal: list[str] | None = HEAD, params: dict[str, Any] | None = None,
                              local: LocalConfig | None = None, model: Callable[[], nn.Module] = TinyMLP,
                              data: ClientData | None = None,
                              executions: tuple[tuple[str, int], ...] = (("vmap", 5), ("bmm", 4))) -> None:
    """Trials that differ in the stage keys `values` (one dict a trial), trained as one batch with each of
    `executions` ((executor, rows a chunk) pairs: chunks span trials), end where each trial run alone by the same
    executor ends: the algorithm batches trials (Algorithm.batches_trials) reading each row's values."""
    data = data or ToyData()
    for execution, chunk in executions:
        _, batched = run_trials(algorithm, personal, values, params, execution, chunk, local, model, data)
        for trial, got in zip(values, batched, strict=True):
            alone = built_stage(algorithm, personal, params, trial, chunk, local, model, data)
            alone.executor_choice.pin(execution)
            fit(alone)
            expected = stage_result(alone)
            assert_close(got[0], expected[0])
            assert_close(got[1], expected[1])


def assert_close(a: Tensors, b: Tensors) -> None:
    """Same names, and every tensor equal within float tolerance."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=2e-5, rtol=1e-4, msg=name)


def assert_matches_sequential(algorithm: Algorithm | str, personal: list[str] | None = HEAD,
                              params: dict[str, Any] | None = None, local: LocalConfig | None = None,
                              model: Callable[[], nn.Module] = TinyMLP, data: ClientData | None = None,
                              executions: tuple[tuple[str, int], ...] = EXECUTIONS) -> None:
    """The vectorized and per-client executors (`executions`: (executor, chunk) pairs) end a stage (run_stage) with
    the shared parameters and personal bank of the sequential reference: the algorithm is written so that the engine
    may batch its clients."""
    local = local or LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)
    reference = run_stage(algorithm, personal, params, "sequential", 1, local, model, data)
    for execution, chunk in executions:
        got = run_stage(algorithm, personal, params, execution, chunk, local, model, data)
        assert_close(got[0], reference[0])
        assert_close(got[1], reference[1])


def learned_accuracy(algorithm: Algorithm | str, model: str | Callable[..., nn.Module] = "mlp",
                     personalization: str | list[str] = "output_layer", rounds: int = 30, clients: int = 20,
                     clients_per_round: int = 10, local: LocalConfig | None = None, seed: int = 0,
                     **model_options: Any) -> float:
    """Mean per-client test accuracy after one stage of `algorithm` (an instance or a registered name) from a fresh
    `model` (a registered name or a Net class) on scikit-learn's digits over `clients` clients with Dirichlet(0.5)
    label skew (chance: 0.1); `personalization` is the split unless the algorithm sets its own."""
    from fedpilot.algorithms import build_algorithm
    from fedpilot.data.config import DatasetSpec
    from fedpilot.data.federated import build_federated_data
    from fedpilot.models.options import MODELS
    from fedpilot.models.split import apply_split
    from fedpilot.pipeline.checks import client_data

    algorithm = build_algorithm(algorithm) if isinstance(algorithm, str) else algorithm
    spec = DatasetSpec.from_dict({"source": {"kind": "digits"},
                                  "partition": {"kind": "dirichlet", "alpha": 0.5, "clients": clients}})
    with tempfile.TemporaryDirectory(prefix="fedpilot-learns-") as cache:
        built = build_federated_data(spec, seed=seed, cache_dir=Path(cache))
        torch.manual_seed(seed)
        net = (MODELS[model] if isinstance(model, str) else model)(built.feature_shape, built.num_classes,
                                                                    **model_options)
        algorithm.prepare_model(net, built.feature_shape)
        split = apply_split(net, algorithm.personal_part or personalization)
        config = StageConfig(rounds=rounds, clients_per_round=clients_per_round, eval_every=rounds,
                             local=local or LocalConfig(epochs=1, batch_size=10, lr=0.05))
        stage = FederatedStage(net, split, client_data(built), algorithm, config, seed)
        fit(stage)
    return float(stage.client_metrics["test"]["acc"].nanmean())


def assert_learns(algorithm: Algorithm | str, min_accuracy: float = 0.6, **options: Any) -> float:
    """learned_accuracy(algorithm, **options) reaches `min_accuracy` (a floor well below what FedAvg's MLP
    reaches, so that only an algorithm that does not learn fails); returns it."""
    accuracy = learned_accuracy(algorithm, **options)
    assert accuracy >= min_accuracy, f"{algorithm}: mean per-client test accuracy {accuracy:.3f} < {min_accuracy}"
    return accuracy


def check_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = (),
                   cache_dir: Path | None = None) -> dict[str, Any]:
    """Every check `fedpilot validate` makes (composition, schema, the algorithms' params, model options, building
    the dataset and the model): the resolved spec, or the SpecError a user would see."""
    from fedpilot.pipeline.checks import prepare
    from fedpilot.spec import load_pipeline

    spec = load_pipeline(path, list(overrides))
    if cache_dir is not None:
        prepare(spec, cache_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="fedpilot-check-") as cache:
            prepare(spec, Path(cache))
    return spec.resolved()
