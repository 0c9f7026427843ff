"""Models and the personal/shared parameter split.

Contract for every model in the zoo, a plugin's (a `Net` subclass registered under the entry-point group
`fedpilot.models`, built as `Model(input_shape, num_classes, **options)`) and any model handed to the engine:
- exactly two children: `body` (inputs -> features) and `head` (an nn.Linear, features -> outputs), and
  forward(x) = head(body(x)); the engine computes body features once when only `head.*` is personal;
- functional-friendly: no BatchNorm (GroupNorm / LayerNorm instead), no buffers or state changed in forward
  and no data-dependent Python control flow, so it runs under torch.func.functional_call/vmap/grad with one
  parameter dict per client;
- seeded initialisation is the caller's job: torch.manual_seed before build_model.

Importing this package is cheap (no torch): fedpilot.models.options (the registry, the built-in models' option
schemas, the presets) is torch-free, and the names below that need torch load it on first use.
"""

from importlib import import_module
from typing import Any

from fedpilot.models.options import MODELS, PRESETS

_LAZY = {
    "Adapter": "fedpilot.models.split",
    "ParamSplit": "fedpilot.models.split",
    "apply_split": "fedpilot.models.split",
    "Net": "fedpilot.models.zoo",
    "build_model": "fedpilot.models.zoo",
}

__all__ = ["MODELS", "PRESETS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
