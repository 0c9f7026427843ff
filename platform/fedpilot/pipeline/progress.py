"""What a running pipeline shows in the terminal: a progress bar per stage, and no third-party noise."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar

from fedpilot.engine.hooks import RoundCallback, RoundResult, RoundStart
from fedpilot.tracking import quiet_mlflow


class RoundProgress(TQDMProgressBar, RoundCallback):
    """Lightning's progress bar counting the stage's rounds, with the latest loss and val accuracy."""

    def __init__(self, label: str):
        super().__init__()
        self.label = label
        self.shown: dict[str, float] = {}  # the latest round's `shown` values

    @property
    def train_description(self) -> str:
        return self.label

    def on_train_epoch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self.train_progress_bar.reset(total=trainer.max_steps)
        self.train_progress_bar.n = trainer.global_step  # a resumed stage starts part-way
        self.train_progress_bar.set_description(self.label)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        RoundCallback.on_train_batch_start(self, trainer, pl_module, *args)

    def on_round_start(self, trainer: L.Trainer, stage: L.LightningModule, start: RoundStart) -> None:
        if start.timing:  # a longer first round
            self.train_progress_bar.set_postfix_str("timing the executor candidates on the first round", refresh=True)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        RoundCallback.on_train_batch_end(self, trainer, pl_module, *args)

    def on_round_end(self, trainer: L.Trainer, stage: L.LightningModule, result: RoundResult) -> None:
        self.shown = dict(result.shown)
        self.train_progress_bar.n = result.round
        self.train_progress_bar.set_postfix(self.get_metrics(trainer, stage), refresh=True)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        """The latest round's loss and val accuracy (`RoundResult.shown`), without Lightning's version number."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return {**metrics, **{k: f"{v:.3g}" for k, v in self.shown.items()}}


def quiet_lightning() -> None:
    """Lightning's per-fit banners and warnings that do not apply to federated stages are noise in a pipeline, and so
    are third-party hints: Lightning's SLURM hint (whenever `srun` is on the PATH) and MLflow's (quiet_mlflow)."""
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    quiet_mlflow()
    # On a Slurm login node srun exists, but `fedpilot run` there is not a Slurm job (submit --to slurm is).
    warnings.filterwarnings("ignore", message=".*The `srun` command is available on your system but is not used.*")
    # Our round is the manual-optimization step; its checkpoint is meant to hold the state after it.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
