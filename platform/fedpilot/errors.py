"""Errors a user can fix: they name the bad key path, the bad value and what is allowed."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class SpecError(ValueError):
    """A bad value in a pipeline or dataset spec; the CLI prints it and exits with code 2."""

    def __init__(self, key: str, value: Any, problem: str, allowed: Iterable[Any] | None = None):
        self.key, self.value, self.problem = key, value, problem
        self.allowed = list(allowed) if allowed is not None else None
        message = f"{key}={value!r}: {problem}"
        if self.allowed:
            message += f" (allowed: {', '.join(map(str, self.allowed))})"
            hint = did_you_mean(value, self.allowed) or did_you_mean(key.rsplit(".", 1)[-1], self.allowed)
            if hint:
                message += f"; did you mean {hint!r}?"
        super().__init__(message)


def did_you_mean(value: Any, allowed: Iterable[Any]) -> str | None:
    """The closest allowed name to a misspelt one, if any is close."""
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, [str(a) for a in allowed], n=1, cutoff=0.6)
    return close[0] if close else None
