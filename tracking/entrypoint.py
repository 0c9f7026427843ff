#!/usr/bin/env python3
"""Entrypoint of fedpilot's MLflow tracking server: the `mlflow` service of docker-compose.yml (CI runs it natively).

1. creates the tracking and auth databases on their PostgreSQL server when they do not exist yet;
2. writes the auth config: basic_auth.ini beside this file with `database_uri` = $MLFLOW_AUTH_DATABASE_URI,
   and points $MLFLOW_AUTH_CONFIG_PATH at it;
3. runs `mlflow db upgrade` on the tracking store (creates the tables of a new one, migrates an old one);
4. creates the service account the scheduler and workers sign in with ($FEDPILOT_MLFLOW_USERNAME and
   $FEDPILOT_MLFLOW_PASSWORD, optional), or sets its password to the configured one;
5. replaces itself with `mlflow server --app-name basic-auth`, which reads everything else from the environment:
   MLFLOW_BACKEND_STORE_URI, MLFLOW_ARTIFACTS_DESTINATION, MLFLOW_HOST, MLFLOW_PORT, MLFLOW_WORKERS,
   MLFLOW_SERVER_ALLOWED_HOSTS, MLFLOW_AUTH_ADMIN_USERNAME / MLFLOW_AUTH_ADMIN_PASSWORD (the admin, created on the
   first start) and MLFLOW_FLASK_SERVER_SECRET_KEY.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import sqlalchemy

REQUIRED = ["MLFLOW_BACKEND_STORE_URI", "MLFLOW_AUTH_DATABASE_URI", "MLFLOW_AUTH_ADMIN_PASSWORD",
            "MLFLOW_FLASK_SERVER_SECRET_KEY"]


def create_database(url: str) -> None:
    """CREATE DATABASE for a PostgreSQL URL whose database does not exist (other stores create their own)."""
    target = sqlalchemy.engine.make_url(url)
    if not target.drivername.startswith("postgresql"):
        return
    server = sqlalchemy.create_engine(target.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with server.connect() as db:
        query = sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :name")
        if db.scalar(query, {"name": target.database}) is None:
            db.execute(sqlalchemy.text(f'CREATE DATABASE "{target.database}"'))
            print(f"created database {target.database}", flush=True)
    server.dispose()


def write_auth_config(database_uri: str) -> Path:
    """basic_auth.ini with the auth database filled in, in a private temporary file (it holds a password)."""
    config = configparser.ConfigParser(interpolation=None)
    config.read(Path(__file__).with_name("basic_auth.ini"))
    config["mlflow"]["database_uri"] = database_uri.replace("%", "%%")  # MLflow reads it with interpolation
    fd, path = tempfile.mkstemp(prefix="mlflow-auth-", suffix=".ini")
    with os.fdopen(fd, "w") as out:
        config.write(out)
    return Path(path)


def ensure_service_account(database_uri: str, username: str, password: str) -> None:
    """The scheduler's and workers' user: created if missing, its password set to the configured one."""
    from mlflow.server.auth.sqlalchemy_store import SqlAlchemyStore

    store = SqlAlchemyStore()
    store.init_db(database_uri)
    if store.has_user(username, use_primary=True):
        store.update_user(username, password=password)
    else:
        store.create_user(username, password)
        print(f"created MLflow user {username}", flush=True)


def main() -> None:
    account = os.environ.get("FEDPILOT_MLFLOW_USERNAME")
    required = REQUIRED + (["FEDPILOT_MLFLOW_PASSWORD"] if account else [])
    missing = [name for name in required if not os.environ.get(name)]
    if missing:
        sys.exit(f"tracking/entrypoint.py: set {', '.join(missing)} (see .env.example)")
    backend, auth_db = os.environ["MLFLOW_BACKEND_STORE_URI"], os.environ["MLFLOW_AUTH_DATABASE_URI"]
    for url in (backend, auth_db):
        create_database(url)
    os.environ["MLFLOW_AUTH_CONFIG_PATH"] = str(write_auth_config(auth_db))
    subprocess.run([sys.executable, "-m", "mlflow", "db", "upgrade", backend], check=True)
    if account:
        ensure_service_account(auth_db, account, os.environ["FEDPILOT_MLFLOW_PASSWORD"])
    os.execv(sys.executable, [sys.executable, "-m", "mlflow", "server", "--app-name", "basic-auth"])


if __name__ == "__main__":
    main()
