"""Run a pipeline: every input check first (checks), then the stages in order (runner), reusing finished ones from
the stage cache (cache), reporting each (report), stopping cleanly on signals (signals).

Importing this package is cheap: the checks import torch only where one needs it (fedpilot.pipeline.checks), and
the names below that train (torch, Lightning, MLflow) load on first use."""

from importlib import import_module
from typing import Any

from fedpilot.pipeline.checks import Prepared, check_devices, prepare

_LAZY = {
    "code_fingerprint": "fedpilot.pipeline.cache",
    "quiet_lightning": "fedpilot.pipeline.progress",
    "PipelineResult": "fedpilot.pipeline.runner",
    "PipelineRunner": "fedpilot.pipeline.runner",
    "StageOutcome": "fedpilot.pipeline.runner",
    "Stopped": "fedpilot.pipeline.signals",
}

__all__ = ["Prepared", "check_devices", "prepare", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
