"""Where fedpilot keeps things by default, and the environment variables that move them (cheap to import)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_DB = "sqlite:///fedpilot.db"


def tracking_uri(configured: str | None = None) -> str:
    """$MLFLOW_TRACKING_URI, else the pipeline's `tracking.uri`, else MLflow's local SQLite store mlflow.db."""
    return os.environ.get("MLFLOW_TRACKING_URI") or configured or DEFAULT_TRACKING_URI


def platform_db_url(cli_value: str | None) -> str:
    """`--db`, else $FEDPILOT_DB, else sqlite:///fedpilot.db; PostgreSQL URLs go through psycopg 3."""
    url = cli_value or os.environ.get("FEDPILOT_DB") or DEFAULT_DB
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix):]
    return url


def cache_root() -> Path:
    """fedpilot's cache ($FEDPILOT_CACHE, else .fedpilot-cache in the working directory): data/, stages/, runs/."""
    return Path(os.environ.get("FEDPILOT_CACHE", ".fedpilot-cache"))
