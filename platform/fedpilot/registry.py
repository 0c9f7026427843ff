"""Components chosen by name in a pipeline (algorithms, models, ...): a name maps to "module:attribute", imported on
first use, so listing or validating names imports nothing heavy. Nothing a user writes is imported by path: only
the names registered here."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module
from typing import Any

from fedpilot.errors import SpecError


class Registry(Mapping[str, Any]):
    """name -> component, loaded from its "module:attribute" target on first access."""

    def __init__(self, kind: str, targets: dict[str, str]):
        self.kind, self.targets = kind, dict(sorted(targets.items()))
        self._loaded: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded:
            module, _, attribute = self.targets[name].partition(":")
            self._loaded[name] = getattr(import_module(module), attribute)
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.targets)

    def __len__(self) -> int:
        return len(self.targets)

    def get_checked(self, name: str, key: str) -> Any:
        """The component `name`, or a SpecError on `key` listing the registered names."""
        if name not in self.targets:
            raise SpecError(key, name, f"unknown {self.kind}", allowed=list(self.targets))
        return self[name]
