"""Federated datasets: sources, partitioners, per-client splits, client-major tensors with a disk cache.

Importing this package is cheap: the typed specs (fedpilot.data.config) import pydantic only, the rest loads on first
use, and scikit-learn, Hugging Face `datasets` and `tokenizers` only when a dataset is built, not loaded from the
cache."""

from importlib import import_module
from typing import Any

from fedpilot.data.config import DatasetSpec, PartitionSpec, SourceSpec, SplitSpec

_LAZY = {
    "FederatedData": "fedpilot.data.federated",
    "build_federated_data": "fedpilot.data.federated",
    "fingerprint": "fedpilot.data.federated",
    "describe": "fedpilot.data.summary",
    "format_summary": "fedpilot.data.summary",
    "label_skew": "fedpilot.data.summary",
}

__all__ = ["DatasetSpec", "PartitionSpec", "SourceSpec", "SplitSpec", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
