"""Small in-memory federated datasets and models for engine tests: fedpilot.testing's public helpers."""

from __future__ import annotations

from fedpilot.testing import TinyCNN, TinyMLP, ToyData, fit, stage_for

__all__ = ["TinyCNN", "TinyMLP", "ToyData", "fit", "stage_for"]
