"""Names a user gives that become parts of paths (pipeline, stage, schedule, study, experiment), and paths that
must stay under their root. One pattern for every name, checked before anything runs."""

from __future__ import annotations

import re
from pathlib import Path

from fedpilot.errors import SpecError

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
NAME_RULE = "a name is 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit (no '/')"
_NAME = re.compile(NAME_PATTERN)


def check_name(key: str, value: object) -> str:
    """`value` if it is a valid name, else a SpecError on `key`."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise SpecError(key, value, NAME_RULE)
    return value


def safe_path(root: Path, *parts: str) -> Path:
    """root/parts resolved, refused unless it stays inside root (no '..', no absolute part, no symlink out)."""
    base = Path(root).resolve()
    path = base.joinpath(*parts).resolve()
    if not path.is_relative_to(base):
        raise SpecError("path", str(Path(root).joinpath(*parts)), f"leaves its root {base}")
    return path
