"""Database fixtures: a real PostgreSQL server for the session, a fresh database (SQLite or PostgreSQL) per test.

Registered by `pytest_plugins = ["postgres"]` in tests/conftest.py. Without the PostgreSQL
binaries the PostgreSQL tests skip on a developer machine and fail on CI (CI=true).
"""

from __future__ import annotations

import glob
import itertools
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

BACKENDS = ["sqlite", "postgres"]
_databases = itertools.count()


def _binaries() -> Path | None:
    """The folder holding initdb and pg_ctl: /usr/local/bin, $PATH, or /usr/lib/postgresql/*/bin."""
    found = shutil.which("initdb")
    candidates = ["/usr/local/bin", *([str(Path(found).parent)] if found else []),
                  *sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)]
    for folder in map(Path, candidates):
        if (folder / "initdb").is_file() and (folder / "pg_ctl").is_file():
            return folder
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(command: list[str]) -> list[str]:
    """initdb and pg_ctl refuse to run as root: run them as the `postgres` system user then."""
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def _run(command: list[str]) -> None:
    done = subprocess.run(_as_postgres(command), capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh PostgreSQL server on a free local port, trust auth; the URL of a database `fedpilot` on it."""
    folder = _binaries()
    if folder is None:
        message = "PostgreSQL binaries (initdb, pg_ctl) not found; install the `postgresql` package"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    root = Path(tempfile.mkdtemp(prefix="fedpilot-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    data, port = root / "data", _free_port()
    _run([str(folder / "initdb"), "-D", str(data), "--auth=trust", "-U", "postgres", "-E", "UTF8"])
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200"
    _run([str(folder / "pg_ctl"), "-D", str(data), "-l", str(root / "server.log"), "-o", options, "-w", "start"])
    try:
        yield _create_database(f"postgresql+psycopg://postgres@127.0.0.1:{port}", "fedpilot")
    finally:
        subprocess.run(_as_postgres([str(folder / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=120)
        shutil.rmtree(root, ignore_errors=True)


def _create_database(server: str, name: str) -> str:
    """CREATE DATABASE `name` on the server; its URL."""
    import psycopg

    with psycopg.connect(server.replace("postgresql+psycopg", "postgresql") + "/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return f"{server}/{name}"


def fresh_postgres(postgres_url: str) -> str:
    """A new empty database on the session's server."""
    return _create_database(postgres_url.rsplit("/", 1)[0], f"test_{os.getpid()}_{next(_databases)}")


@pytest.fixture(params=BACKENDS)
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh platform database for this test, once on SQLite and once on a real PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'platform.db'}"
    return fresh_postgres(request.getfixturevalue("postgres_url"))
