"""The small JSON file a job's child process (`fedpilot run` / `fedpilot search`) keeps for the worker that
started it: the MLflow run id as soon as the run exists, then the final status and error. The worker reads it
(never the child's printed text)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_result(path: Path | None, **fields: Any) -> None:
    """Merge `fields` into the result file at `path` (atomically; nothing without a path)."""
    if path is None:
        return
    path = Path(path)
    merged = {**read_result(path), **fields}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged))
    os.replace(tmp, path)


def read_result(path: Path) -> dict[str, Any]:
    """The fields written so far ({} before the child wrote any)."""
    try:
        return json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
