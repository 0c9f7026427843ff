"""ParamSplit: which parameters are personal (one copy per client) and which are shared."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fedpilot.errors import SpecError
from fedpilot.models.options import PRESETS
from fedpilot.models.zoo import BasicBlock, Block, Recurrent


class Adapter(nn.Module):
    """Residual bottleneck adapter x + up(relu(down(x))); `up` starts at zero, so it starts as the identity.

    conv=True uses 1x1 convolutions over channels (Rebuffi et al. 2017), otherwise Linear layers over the
    last dimension (Houlsby et al. 2019).
    """

    def __init__(self, dim: int, bottleneck: int, conv: bool):
        super().__init__()
        layer = (lambda a, b: nn.Conv2d(a, b, 1)) if conv else nn.Linear
        self.down, self.up = layer(dim, bottleneck), layer(bottleneck, dim)
        nn.init.zeros_(self.up.weight)
        nn.init.zeros_(self.up.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.up(F.relu(self.down(x)))


@dataclass
class ParamSplit:
    """Personal and shared parameter names (in `named_parameters` order) with their sizes, and where each
    parameter lives in the model's `body -> head` structure: `head` / `body` map a parameter's full name to its
    name inside that child (what the engine needs to run the body once and the heads on its features)."""

    personal_names: list[str]
    shared_names: list[str]
    numel: dict[str, int]
    bytes: dict[str, int]
    head: dict[str, str]
    body: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module, personal: list[str] | set[str]) -> ParamSplit:
        """The split of `model` with the parameters named in `personal` personal."""
        params = dict(model.named_parameters())
        parts = {part: {f"{part}.{n}": n for n, _ in getattr(model, part).named_parameters()}
                 for part in ("body", "head") if hasattr(model, part)}
        return cls(personal_names=[n for n in params if n in personal],
                   shared_names=[n for n in params if n not in personal],
                   numel={n: p.numel() for n, p in params.items()},
                   bytes={n: p.numel() * p.element_size() for n, p in params.items()},
                   head=parts.get("head", {}), body=parts.get("body", {}))

    def head_only(self, names: list[str]) -> bool:
        """Whether every parameter in `names` belongs to the head."""
        return all(n in self.head for n in names)

    def in_head(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The head's entries of `params`, named as inside the head."""
        return {self.head[n]: v for n, v in params.items() if n in self.head}

    def in_body(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The body's entries of `params`, named as inside the body."""
        return {self.body[n]: v for n, v in params.items() if n in self.body}

    def from_head(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Head parameters named as inside the head, back under their full names."""
        full = {local: name for name, local in self.head.items()}
        return {full[n]: v for n, v in params.items()}

    def report(self) -> dict[str, int]:
        """Parameter counts and bytes of the shared part and of one client's personal part."""
        return {
            "shared_params": sum(self.numel[n] for n in self.shared_names),
            "shared_bytes": sum(self.bytes[n] for n in self.shared_names),
            "personal_params_per_client": sum(self.numel[n] for n in self.personal_names),
            "personal_bytes_per_client": sum(self.bytes[n] for n in self.personal_names),
            "total_params": sum(self.numel.values()),
        }


def apply_split(model: nn.Module, spec: str | list[str], adapter_dim: int = 16) -> ParamSplit:
    """Decide the personal parameters by a preset or a list of name regexes; `adapters` inserts them first."""
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise SpecError("personalization", spec, "unknown preset (or give a list of regexes)", allowed=PRESETS)
        personal = _preset(model, spec, adapter_dim)
    else:
        personal = set()
        for pattern in spec:
            matched = {n for n, _ in model.named_parameters() if re.fullmatch(pattern, n)}
            if not matched:
                raise SpecError("personalization", pattern, "matches no parameter name",
                                allowed=[n for n, _ in model.named_parameters()])
            personal |= matched
    return ParamSplit.of(model, personal)


def _preset(model: nn.Module, preset: str, adapter_dim: int) -> set[str]:
    """The personal parameter names of a preset."""
    names = [n for n, _ in model.named_parameters()]
    if preset == "none":
        return set()
    if preset == "all":
        return set(names)
    if preset in getattr(model, "presets", {}):  # what the model says the preset means for it
        return {n for n in names if any(re.fullmatch(pattern, n) for pattern in model.presets[preset])}
    if preset == "output_layer":
        return {n for n in names if n.startswith("head.")}
    if preset == "input_layer":
        prefix = next(m for m, mod in model.named_modules() if any(True for _ in mod.parameters(recurse=False)))
        return {f"{prefix}.{n}" for n, _ in model.get_submodule(prefix).named_parameters(recurse=False)}
    if not any(isinstance(m, Adapter) for m in model.modules()):
        insert_adapters(model, adapter_dim)
    personal = {f"{m}.{n}" for m, mod in model.named_modules() if isinstance(mod, Adapter)
                for n, _ in mod.named_parameters()}
    if not personal:
        raise SpecError("personalization", preset, f"model {type(model.body).__name__} body has no place for "
                        "adapters", allowed=[p for p in PRESETS if p != "adapters"])
    return personal


def insert_adapters(model: nn.Module, bottleneck: int) -> None:
    """Insert identity-initialised adapters in place, leaving the names of existing parameters unchanged.

    Houlsby adapters after attention and after the MLP of each transformer block; a Rebuffi (1x1 conv)
    adapter after each residual block and after each conv+ReLU+max-pool stage; a bottleneck adapter after
    each hidden Linear+ReLU and after an LSTM's last layer.
    """
    like = next(model.parameters())

    def adapter(dim: int, conv: bool) -> Adapter:
        return Adapter(dim, bottleneck, conv).to(like.device, like.dtype)

    for module in list(model.modules()):
        if isinstance(module, Block):
            dim = module.proj.out_features
            module.adapter_attn, module.adapter_mlp = adapter(dim, False), adapter(dim, False)
        elif isinstance(module, BasicBlock):
            module.adapter = adapter(module.conv2.out_channels, True)
        elif isinstance(module, Recurrent):
            module.adapter = adapter(module.lstm.hidden_size, False)
    if not isinstance(model.body, nn.Sequential):
        return
    previous, channels = None, 0
    for i, layer in enumerate(list(model.body)):
        if isinstance(layer, nn.Conv2d):
            channels = layer.out_channels
        elif isinstance(layer, nn.MaxPool2d) and channels:
            model.body[i] = nn.Sequential(layer, adapter(channels, True))
        elif isinstance(layer, nn.ReLU) and isinstance(previous, nn.Linear):
            model.body[i] = nn.Sequential(layer, adapter(previous.out_features, False))
        previous = layer
