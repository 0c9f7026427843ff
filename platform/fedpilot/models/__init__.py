"""Models and the personal/shared parameter split.

Contract for every model in the zoo, a plugin's (a `Net` subclass registered under the entry-point group
`fedpilot.models`, built as `Model(input_shape, num_classes, **options)`) and any model handed to the engine:
- exactly two children: `body` (inputs -> features) and `head` (an nn.Linear, features -> outputs), and
  forward(x) = head(body(x)); the engine computes body features once when only `head.*` is personal;
- functional-friendly: no BatchNorm (GroupNorm / LayerNorm instead), no buffers or state changed in forward
  and no data-dependent Python control flow, so it runs under torch.func.functional_call/vmap/grad with one
  parameter dict per client;
- seeded initialisation is the caller's job: torch.manual_seed before build_model.
"""

from fedpilot.models.split import PRESETS, Adapter, ParamSplit, apply_split
from fedpilot.models.zoo import MODELS, Net, build_model, check_model, option_types

__all__ = ["MODELS", "PRESETS", "Adapter", "Net", "ParamSplit", "apply_split", "build_model", "check_model",
           "option_types"]
