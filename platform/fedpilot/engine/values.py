"""The hyperparameters a cohort's rows train with. A stage trains with one set (its `local` block, its algorithm's
`params`, its server's state); a batch of trials (engine/trials.py) trains K sets at once, its rows trial after trial,
and a value that differs between them is one value per row where the algorithm reads it (`cohort.params`,
`cohort.value`). A value is always a plain number where every row of a chunk has the same one (outside a batch: always).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedpilot.engine.config import LocalConfig
from fedpilot.engine.protocol import AlgorithmParams


@dataclass(frozen=True)
class TrialValues:
    """What one trial's clients train with: the stage's `local` block, the algorithm's `params` and the server's state
    as the round started."""

    local: LocalConfig
    params: AlgorithmParams
    server_state: Mapping[str, Any]


class Varying:
    """A hyperparameter that differs between the trials of a batch where an algorithm reads it as one value (its
    `self.params`, `cohort.local`): any use of it is an error saying where each row's value is."""

    def __init__(self, key: str, owner: str):
        self.key, self.owner = key, owner

    def refuse(self, *args: Any, **kwargs: Any) -> Any:
        block, _, name = self.key.partition(".")
        per_row = f"cohort.params.{name} or " if block == "params" else ""
        raise TypeError(f"{self.owner}: {self.key} differs between the trials of this batch and was read as one "
                        f"value; read each row's as {per_row}cohort.value({self.key!r}) (a number, or one per row "
                        "[K]: cohort.per_client shapes it), or declare batches_trials = False")

    __float__ = __int__ = __bool__ = __index__ = __neg__ = __abs__ = refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __pow__ = refuse
    __lt__ = __le__ = __gt__ = __ge__ = refuse

    def __repr__(self) -> str:
        return f"Varying({self.key!r})"


def guarded(values: Any, differing: set[str], owner: str) -> Any:
    """A copy of pydantic `values` (an algorithm's params, a local block) whose `differing` fields are `Varying`."""
    return values.model_copy(update={name: Varying(key, owner) for key in differing
                                     for name in [key.partition(".")[2]]})


class RowValues:
    """The values of a chunk's rows: `parts`, a trial's values and its number of rows, in row order."""

    def __init__(self, parts: list[tuple[TrialValues, int]], device: torch.device | str = "cpu"):
        self.parts, self.device = parts, device
        self.count = sum(count for _, count in parts)

    def rows(self, rows: slice) -> RowValues:
        """The values of the rows `rows` of these."""
        parts, lo = [], 0
        for values, count in self.parts:
            inside = min(lo + count, rows.stop) - max(lo, rows.start)
            if inside > 0:
                parts.append((values, inside))
            lo += count
        return RowValues(parts, self.device)

    def value(self, key: str) -> Any:
        """The value of the stage key `key` (`local.lr`, `params.lr_v`, ...) for these rows: the plain value where
        every row has the same one, else one per row [K] (float32, on the rows' device)."""
        block, _, name = key.partition(".")
        if block not in ("local", "params") or not name:
            raise ValueError(f"cohort.value: {key!r} is not a key of the `local` block or the algorithm's `params` "
                             "(local.<field>, params.<field>)")
        found = [getattr(getattr(values, block), name) for values, _ in self.parts]
        if all(_same(value, found[0]) for value in found):
            return found[0]
        if not all(isinstance(value, int | float) and not isinstance(value, bool) for value in found):
            raise ValueError(f"{key} differs between the trials of this batch and is not a number: {found}")
        counts = torch.tensor([count for _, count in self.parts])
        return torch.tensor(found, dtype=torch.float32).repeat_interleave(counts).to(self.device)

    @property
    def params(self) -> Any:
        """The algorithm's params as these rows have them: the params themselves outside a batch, else a view whose
        attributes are `value(f"params.{name}")`."""
        return self.parts[0][0].params if len(self.parts) == 1 else _View(self, "params")

    @property
    def local(self) -> LocalConfig:
        """The stage's `local` block as these rows have it: a field that differs between their trials is `Varying`
        (read it per row through `value`)."""
        local = self.parts[0][0].local
        differing = {f"local.{name}" for name in type(local).model_fields
                     if not all(_same(getattr(values.local, name), getattr(local, name)) for values, _ in self.parts)}
        return guarded(local, differing, "cohort.local") if differing else local

    @property
    def server_state(self) -> Mapping[str, Any]:
        """The server's state these rows' trial started the round with (a chunk spanning trials with states of their
        own has none it could give: an algorithm that reads it does not batch)."""
        states = [values.server_state for values, _ in self.parts]
        if len(states) > 1 and any(states):
            raise ValueError("cohort.server_state: this chunk's rows belong to several trials, each with its own "
                             "server state; an algorithm that reads it declares batches_trials = False")
        return states[0]


class _View:
    """Attribute access to a block of RowValues: `view.lr` is `values.value("<block>.lr")`."""

    def __init__(self, values: RowValues, block: str):
        self._values, self._block = values, block

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return self._values.value(f"{self._block}.{name}")


def _same(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and a == b)
