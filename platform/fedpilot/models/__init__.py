"""Models and the personal/shared split.

Contract for every model: exactly two children, `body` (inputs -> features) and `head` (a Linear, features
-> outputs), forward = head(body(x)); no BatchNorm and no state changed in forward, so the engine can run
it under torch.func.vmap/grad/functional_call.
"""

from fedpilot.models.split import PRESETS, Adapter, ParamSplit, apply_split
from fedpilot.models.zoo import MODELS, build_model

__all__ = ["MODELS", "PRESETS", "Adapter", "ParamSplit", "apply_split", "build_model"]
