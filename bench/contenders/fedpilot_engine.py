"""fedpilot on the shared workload: a FederatedStage (FedAvg) run by a Lightning Trainer, as `fedpilot run` does.

The zoo's model starts from the workload's initial weights; the client data become one client-major
ClientData on the device. Round time: between consecutive on_train_batch_end hooks (the whole Trainer
step: sampling, local training, aggregation, server step). The stage has one more round than is run, so
the end-of-stage evaluation stays out of the timing.
`--execution` picks the executor (auto = what the engine chooses; sequential = the test-only reference).
"""

from __future__ import annotations  # noqa: I001  (fedpilot first: see below)

import logging
import sys
from pathlib import Path

import fedpilot  # noqa: F401  first, as in `fedpilot run`: its OpenMP wait policy is set before torch loads
import lightning as L
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from workload import RoundClock, Workload, build_model, contender_args, load_data, report  # noqa: E402

from fedpilot.algorithms import build_algorithm  # noqa: E402
from fedpilot.engine.config import LocalConfig, StageConfig  # noqa: E402
from fedpilot.engine.data import ClientData  # noqa: E402
from fedpilot.engine.stage import FederatedStage  # noqa: E402
from fedpilot.models.split import ParamSplit  # noqa: E402
from fedpilot.models.zoo import build_model as zoo_model  # noqa: E402


def federated_data(work: Workload) -> ClientData:
    """The workload's clients as fedpilot's client-major tensors (val and test alias the train samples)."""
    x, y = load_data(work)
    starts = torch.arange(work.clients) * work.samples
    sizes = torch.full((work.clients,), work.samples)
    return ClientData(x=torch.from_numpy(np.array(x)).flatten(0, 1), y=torch.from_numpy(np.array(y)).flatten(),
                      offsets=dict.fromkeys(("train", "val", "test"), starts),
                      sizes=dict.fromkeys(("train", "val", "test"), sizes))


def stage_for(work: Workload, rounds: int, execution: str = "auto", precision: str = "32-true") -> FederatedStage:
    """A FedAvg stage of `rounds` rounds whose model equals the workload's (same initial weights)."""
    model = zoo_model(work.model, work.input_shape, work.classes,
                      **({"hidden": work.width} if work.model == "cnn" else {"hidden": [work.width]}))
    model.load_state_dict(build_model(work).state_dict())
    config = StageConfig(rounds=rounds + 1, clients_per_round=work.clients_per_round, eval_every=rounds + 1,
                         precision=precision,
                         local=LocalConfig(epochs=work.epochs, batch_size=work.batch_size, lr=work.lr))
    stage = FederatedStage(model, ParamSplit.of(model, []), federated_data(work), build_algorithm("fedavg"), config,
                           seed=work.seed)
    stage.executor_choice.pin(execution)  # "sequential" is the tests' reference, not a spec value
    return stage


class RoundTimer(L.Callback):
    def __init__(self, clock: RoundClock):
        self.clock = clock

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        if not self.clock.times:
            self.clock.start()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.clock.stop()
        self.clock.start()


def round_times(work: Workload, rounds: int, device: str, execution: str = "auto",
                precision: str = "32-true") -> list[float]:
    """Seconds of each of `rounds` rounds of the stage, run by a quiet Lightning Trainer."""
    return timed_stage(work, rounds, device, execution, precision)[0]


def timed_stage(work: Workload, rounds: int, device: str, execution: str = "auto",
                precision: str = "32-true") -> tuple[list[float], str]:
    """`round_times`, and the executor the stage ran (with "auto": the one it timed fastest on its first round)."""
    clock = RoundClock(device)
    stage = stage_for(work, rounds, execution, precision)
    quiet_trainer(rounds, device, [RoundTimer(clock)]).fit(stage)
    return clock.times, stage.execution


def quiet_trainer(rounds: int, device: str, callbacks: list[L.Callback]) -> L.Trainer:
    """A Trainer of `rounds` rounds on one device, with no logger, checkpoints, progress bar or summary."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    return L.Trainer(max_steps=rounds, accelerator="gpu" if device.startswith("cuda") else "cpu", devices=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, callbacks=callbacks)


def main() -> None:
    args = contender_args(__doc__, {"--execution": {"default": "auto"}, "--precision": {"default": "32-true"}})
    times, executor = timed_stage(args.workload, args.rounds, args.device, args.execution, args.precision)
    report(args.out, f"fedpilot-{args.execution}", args.workload, times, args.warmup, executor=executor,
           precision=args.precision)


if __name__ == "__main__":
    main()
