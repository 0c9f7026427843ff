"""Components chosen by name in a pipeline (algorithms, models, dataset sources): a built-in name maps to
"module:attribute", imported on first use, so listing or validating names imports nothing heavy. Plugins add names
through the entry points of installed distributions (groups `fedpilot.algorithms`, `fedpilot.models`,
`fedpilot.sources`), loaded only when a pipeline names them: a broken plugin fails then, with its distribution
named, and never breaks the built-ins (a plugin registering a built-in's name is ignored for that name, with a
warning, and its distribution's other components are errors). Nothing a user writes is imported by path: only
registered names."""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from fedpilot.errors import SpecError

Check = Callable[[str, Any], str | None]  # (name, loaded component) -> what is wrong with it, or None


@functools.lru_cache(maxsize=32)
def _discovered(group: str, path: tuple[str, ...]) -> tuple[EntryPoint, ...]:
    """The entry points of `group` in the distributions found on `path` (sys.path: a process that extends it sees
    the distributions it adds)."""
    return tuple(entry_points(group=group))


def plugin_entries(group: str) -> tuple[EntryPoint, ...]:
    """The installed plugins' entry points of `group`."""
    return _discovered(group, tuple(sys.path))


def plugin_distributions(group: str, names: Iterable[str]) -> dict[str, str]:
    """{distribution: version} of the installed plugins registering any of `names` in entry-point `group`."""
    wanted = set(names)
    return {ep.dist.name: ep.dist.version for ep in plugin_entries(group) if ep.name in wanted and ep.dist}


def describe(entry: EntryPoint) -> str:
    """A plugin as an error names it: its entry point and its distribution with the version."""
    dist = f"{entry.dist.name} {entry.dist.version}" if entry.dist else "an unknown distribution"
    return f"plugin `{entry.name} = {entry.value}` (group {entry.group}) of distribution {dist}"


def _same_dist(a: EntryPoint, b: EntryPoint) -> bool:
    return a.dist is not None and b.dist is not None and a.dist.name == b.dist.name


def first_line(err: BaseException) -> str:
    """An exception in one line: its type and its message's first line."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


class Registry(Mapping[str, Any]):
    """name -> component: the built-ins (loaded from their "module:attribute" targets on first access), then the
    plugins of entry-point `group`. `check` says what is wrong with a plugin's component (None if nothing); `key`
    is the spec key errors name when the caller gives none."""

    def __init__(self, kind: str, builtins: dict[str, str], group: str, check: Check | None = None,
                 key: str | None = None):
        self.kind, self.builtins, self.group, self.check = kind, dict(builtins), group, check
        self.key = key or kind
        self._loaded: dict[str, Any] = {}

    def plugins(self) -> dict[str, list[EntryPoint]]:
        """The plugins' entry points by name (several for a name two distributions register)."""
        found: dict[str, list[EntryPoint]] = {}
        for entry in plugin_entries(self.group):
            found.setdefault(entry.name, []).append(entry)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*self.builtins, *sorted(self.plugins())]))

    def __len__(self) -> int:
        return len(list(iter(self)))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self.builtins or name in self.plugins())

    def __getitem__(self, name: str) -> Any:
        return self.get_checked(name, self.key)

    def get_checked(self, name: str, key: str) -> Any:
        """The component `name`, or a SpecError on `key`: an unknown name (listing the registered ones), a name two
        plugins register, a plugin whose distribution also registers a built-in's name, or a plugin that cannot be
        loaded or is not a component. A built-in name is always the built-in (a plugin cannot replace it)."""
        if name not in self:
            raise SpecError(key, name, f"unknown {self.kind}", allowed=list(self))
        entries = self.plugins().get(name, [])
        if name in self.builtins:
            for entry in entries:
                warnings.warn(f"the {describe(entry)} is ignored: {name!r} is a built-in {self.kind}", stacklevel=1)
            return self._load(self.builtins[name], lambda: self._builtin(name))
        if len(entries) > 1:
            raise SpecError(key, name, "is registered by several plugins: "
                            f"{'; '.join(sorted(map(describe, entries)))}: keep one")
        entry = entries[0]
        clash = next((e for e in plugin_entries(self.group) if e.name in self.builtins and _same_dist(e, entry)), None)
        if clash is not None:
            raise SpecError(key, name, f"the {describe(entry)} cannot be used: its distribution also registers "
                            f"`{clash.name} = {clash.value}`, the name of a built-in {self.kind}: rename that entry "
                            "point")
        return self._load(f"{entry.value} ({entry.group})", lambda: self._plugin(entry, key))

    def _load(self, target: str, load: Callable[[], Any]) -> Any:
        if target not in self._loaded:
            self._loaded[target] = load()
        return self._loaded[target]

    def _builtin(self, name: str) -> Any:
        module, _, attribute = self.builtins[name].partition(":")
        return getattr(import_module(module), attribute)

    def _plugin(self, entry: EntryPoint, key: str) -> Any:
        """A plugin's component, imported and checked."""
        try:
            component = entry.load()
        except Exception as err:  # anything its import raises: a missing dependency, a syntax error, a bad target
            raise SpecError(key, entry.name, f"the {describe(entry)} cannot be loaded: {first_line(err)}") from None
        problem = self.check(entry.name, component) if self.check else None
        if problem:
            raise SpecError(key, entry.name, f"the {describe(entry)} {problem}")
        return component

    def origin(self, name: str) -> str:
        """Where `name` comes from, in words: the built-in, or the plugin and its distribution."""
        entries = [] if name in self.builtins else self.plugins().get(name, [])
        return describe(entries[0]) if entries else f"built-in {self.kind} {name!r}"

    def loadable(self) -> list[str]:
        """The names whose components load (to list alternatives in an error without failing on a broken plugin)."""
        names = []
        for name in self:
            try:
                self.get_checked(name, self.key)
            except SpecError:
                continue
            names.append(name)
        return names
