"""Small in-memory federated datasets and models for engine tests."""

from __future__ import annotations

import lightning as L
import torch
from torch import nn

from fedpilot.engine import FederatedStage
from fedpilot.engine.data import ClientData
from fedpilot.models.split import ParamSplit


class ToyData(ClientData):
    """Client-major Gaussian classification data with uneven client sizes (the engine's ClientData)."""

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
    def __init__(self, dim: int = 16, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(dim, 24), nn.ReLU())
        self.head = nn.Linear(24, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class TinyCNN(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def stage_for(model: nn.Module, personal: list[str], *args, **kwargs) -> FederatedStage:
    """A FederatedStage of `model` with the parameters named in `personal` personal."""
    return FederatedStage(model, ParamSplit.of(model, personal), *args, **kwargs)


def fit(stage: FederatedStage, **trainer_kwargs) -> L.Trainer:
    """Run a stage with a quiet Lightning Trainer for its number of rounds."""
    trainer = L.Trainer(max_steps=stage.n_rounds, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                        **trainer_kwargs)
    trainer.fit(stage)
    return trainer
