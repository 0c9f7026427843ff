"""Where fedpilot keeps things by default, the environment variables that move them, and the checks that a command
makes of each place it reads or writes before it does any work (cheap to import: no MLflow, and SQLAlchemy only to
check a database URL other than an SQLite file's).

Every variable fedpilot reads is here: MLFLOW_TRACKING_URI (with MLflow's MLFLOW_TRACKING_USERNAME and
MLFLOW_TRACKING_PASSWORD for a tracking server), FEDPILOT_CACHE, FEDPILOT_DB, FEDPILOT_CONFIGS and FEDPILOT_DEBUG (the
CLI's `--debug`); FEDPILOT_SLURM is
read and checked with the Slurm options it holds (jobs.slurm.options). An empty variable counts as unset."""

from __future__ import annotations

import os
import re
import tempfile
from importlib import resources
from pathlib import Path
from urllib.parse import unquote, urlparse

from fedpilot.errors import SetupError, StoreUnavailable

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
DEFAULT_DB = "sqlite:///fedpilot.db"
DEFAULT_CACHE = ".fedpilot-cache"
UI_PORT = 5000  # where `fedpilot ui` serves a local tracking store by default (the pages fedpilot prints)
SQL_INT_MAX = 2**31 - 1  # the platform database's INTEGER columns (job ids, trials) have 32 bits in PostgreSQL
CONFIG_GROUPS = ("dataset", "model")  # the configs/ groups pipelines compose from
# The tracking stores MLflow 3 opens (mlflow.tracking._tracking_service.utils._register_tracking_stores): a folder
# ('' or file:), a database through SQLAlchemy (MLflow's DATABASE_ENGINES, with or without a driver:
# postgresql+psycopg), a tracking server, Databricks (`databricks-uc` and `uc` are registered only to be refused);
# plugins add schemes as entry points of TRACKING_PLUGINS.
DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
TRACKING_SCHEMES = ("", "file", *DATABASES, "http", "https", "databricks")
TRACKING_PLUGINS = "mlflow.tracking_store"
CREDENTIALS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")  # MLflow's basic auth with a tracking server
SERVER_TIMEOUT_S = 10  # for a tracking server's first answer
DATABASE_TIMEOUT_S = 5  # for a database server's answer to a connection


def variable(name: str) -> str | None:
    """An environment variable's value; empty counts as unset (`export NAME=`)."""
    return os.environ.get(name) or None


def tracking_uri(configured: str | None = None) -> str:
    """$MLFLOW_TRACKING_URI, else the pipeline's `tracking.uri`, else MLflow's local SQLite store mlflow.db."""
    return variable("MLFLOW_TRACKING_URI") or configured or DEFAULT_TRACKING_URI


def check_tracking(configured: str | None = None, reach: bool = False) -> str:
    """The tracking URI (tracking_uri), checked as MLflow will open it, without importing MLflow: a scheme of its
    tracking store registry; a store folder or SQLite file fedpilot can write; a database whose driver is installed;
    a server URL with a host, MLflow's basic-auth credentials both set or neither, and with `reach` (a command that
    records now, not `validate`) a server or database that answers."""
    uri = tracking_uri(configured)
    key = tracking_key(uri)
    scheme = tracking_scheme(key, uri)
    if scheme in ("", "file"):
        check_folder(key, uri, Path(unquote(urlparse(uri).path) if scheme else uri))
    elif scheme in DATABASES:
        check_database(key, uri)
        if reach:
            reach_database(key, uri)
    elif scheme in ("http", "https"):
        _check_server(key, uri)
        if reach:
            _reach_server(key, uri)
    return uri


def tracking_key(uri: str) -> str:
    """What gave a tracking URI, for its errors: the variable (also for the default: setting it is the fix), else
    the pipeline's key."""
    return "MLFLOW_TRACKING_URI" if uri == tracking_uri() else "tracking.uri"


def tracking_scheme(key: str, uri: str) -> str:
    """The scheme MLflow chooses a tracking store by (mlflow.utils.uri.get_uri_scheme: a database's without its
    driver, none for a path, also a Windows one); a SpecError on `key` when MLflow has no store for it."""
    scheme = uri if uri in ("databricks", "databricks-uc", "uc") else urlparse(uri).scheme  # MLflow's special cases
    database = scheme.split("+", 1)[0]
    if database in DATABASES:
        scheme = database
    elif len(scheme) == 1:  # a Windows path, C:\...
        scheme = ""
    if scheme not in TRACKING_SCHEMES and scheme not in _tracking_plugins():
        raise SetupError(key, hidden(uri), "not a tracking store MLflow can open",
                        allowed=["a folder", *(f"{s}:" for s in TRACKING_SCHEMES if s)])
    return scheme


def _tracking_plugins() -> set[str]:
    """The schemes installed MLflow plugins add (entry points read only for a scheme MLflow does not have)."""
    from importlib.metadata import entry_points

    return {entry.name for entry in entry_points(group=TRACKING_PLUGINS)}


def _check_server(key: str, uri: str) -> None:
    """A tracking server's URL has a host and a valid port; MLflow signs in with both credentials or with none."""
    parts = urlparse(uri)
    try:
        parts.port  # noqa: B018 (parsing the port is the check)
    except ValueError as err:
        raise SetupError(key, hidden(uri), f"not a server's URL: {err}") from None
    if not parts.hostname:
        raise SetupError(key, hidden(uri), "no host: a tracking server's URL is http(s)://HOST[:PORT]")
    given = [name for name in CREDENTIALS if variable(name)]
    if len(given) == 1:
        missing = next(name for name in CREDENTIALS if name not in given)
        raise SetupError(missing, None, f"{given[0]} is set without it: MLflow signs in to the tracking server with "
                        "both or with neither")


def _reach_server(key: str, uri: str) -> None:
    """The tracking server answers (any HTTP answer will do) within SERVER_TIMEOUT_S: MLflow would retry for minutes
    before failing. A TLS failure is left to MLflow, whose own settings (MLFLOW_TRACKING_INSECURE_TLS) may allow it."""
    import ssl
    from urllib.error import HTTPError, URLError
    from urllib.request import urlopen

    try:
        urlopen(f"{uri.rstrip('/')}/health", timeout=SERVER_TIMEOUT_S).close()
    except HTTPError:
        return
    except (URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        if not isinstance(reason, ssl.SSLError):
            raise SetupError(key, hidden(uri), f"no tracking server answers there: {reason}") from None


def platform_db(cli_value: str | None, option: str = "--db") -> tuple[str, str]:
    """(the URL, what gave it: `option` or FEDPILOT_DB) of the platform database: `option`'s value (`--db`,
    `--storage`), else $FEDPILOT_DB, else sqlite:///fedpilot.db; checked (check_database) and a database server
    reached (reach_database), before a command creates anything. PostgreSQL URLs go through psycopg 3."""
    key = option if cli_value else "FEDPILOT_DB"
    url = written = cli_value or variable("FEDPILOT_DB") or DEFAULT_DB
    for prefix in ("postgresql://", "postgres://"):
        if url.startswith(prefix):
            url = "postgresql+psycopg://" + url[len(prefix):]
    check_database(key, url)
    reach_database(key, url, written)
    return url, key


def check_database(key: str, url: str) -> None:
    """A database URL SQLAlchemy can open from here: an SQLite file fedpilot can write or create, or a URL that
    parses and names a dialect whose driver is installed. Errors show the URL without its password."""
    path = sqlite_file(url)
    if path is not None:
        check_file(key, url, path, create_folder=True)
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        dialect = make_url(url).get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as err:
        raise SetupError(key, hidden(url), f"not a database SQLAlchemy can open (sqlite:///FILE, "
                        f"postgresql://USER:PASSWORD@HOST/DB): {err}") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        raise SetupError(key, hidden(url), f"its driver is not installed ({err.name})") from None


def reach_database(key: str, url: str, written: str | None = None) -> None:
    """A database server (not an SQLite file: check_database checked it) takes a connection within
    DATABASE_TIMEOUT_S, with these credentials, to this database: a command finds out before it creates anything,
    not once its first run or study exists. Errors show the URL as the user `written` it, without its password."""
    if url.startswith("sqlite"):
        return
    from sqlalchemy import create_engine
    from sqlalchemy.exc import SQLAlchemyError
    from sqlalchemy.pool import NullPool

    timeout = {"connect_timeout": DATABASE_TIMEOUT_S} if url.startswith(("postgresql", "mysql")) else {}
    engine = create_engine(url, poolclass=NullPool, connect_args=timeout)
    try:
        with engine.connect():
            pass
    except SQLAlchemyError as err:
        cause = str(getattr(err, "orig", None) or err).strip()
        problem = cause.splitlines()[0] if cause else type(err).__name__
        raise StoreUnavailable(key, hidden(written or url), f"cannot connect to the database: {problem}") from None
    finally:
        engine.dispose()


def sqlite_file(url: str) -> Path | None:
    """The file of an SQLite URL (sqlite:///relative.db, sqlite:////absolute.db); None for another database, or an
    in-memory one."""
    found = re.fullmatch(r"sqlite(?:\+pysqlite)?:///([^?]+)(\?.*)?", url)
    return Path(found.group(1)) if found and found.group(1) != ":memory:" else None


def store_exists(url: str) -> bool:
    """Whether the store at `url` may hold anything: False for an SQLite file that does not exist (a lookup there,
    a run or a job by id, is refused without creating it)."""
    path = sqlite_file(url)
    return path is None or path.exists()


def hidden(url: str) -> str:
    """A URL with its password shown as *** (errors are printed, and stored with failed jobs)."""
    parts = urlparse(url)
    if parts.password is None:
        return url
    user, _, host = parts.netloc.rpartition("@")
    return parts._replace(netloc=f"{user.split(':', 1)[0]}:***@{host}").geturl()


def cache_root() -> Path:
    """fedpilot's cache ($FEDPILOT_CACHE, else .fedpilot-cache in the working directory): data/, stages/, runs/."""
    return Path(variable("FEDPILOT_CACHE") or DEFAULT_CACHE)


def check_cache(cli_value: Path | None = None, option: str = "--cache-dir") -> Path:
    """`option`'s folder, else the cache root (cache_root), checked: a folder fedpilot can write, or create."""
    path = cli_value or cache_root()
    check_folder(option if cli_value else "FEDPILOT_CACHE", str(path), path)
    return path


def check_output(key: str, path: Path | None) -> None:
    """A file a command writes (`--output`, `--result-file`; None: none) is in an existing folder, and a file fedpilot
    can write."""
    if path is not None:
        check_file(key, str(path), path, create_folder=False)


def check_folder(key: str, value: str, path: Path) -> None:
    """`path` is a folder fedpilot can write in, or one it can create; else a SpecError on `key` showing `value`."""
    problem = _blocked(Path(path).absolute())
    if problem:
        raise SetupError(key, value, f"not a folder fedpilot can write: {problem}")


def check_file(key: str, value: str, path: Path, create_folder: bool) -> None:
    """`path` is a file fedpilot can write: not a folder, writable if it exists, else in a folder that exists (or,
    with `create_folder`, one fedpilot can create); else a SpecError on `key` showing `value` (passwords hidden)."""
    path, value = Path(path).absolute(), hidden(value)
    if path.is_dir():
        raise SetupError(key, value, "is a folder, not a file")
    if path.exists():
        try:  # opened, not os.access: that answers yes to root for files nothing can write (under /proc)
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # a FIFO without a reader does not wait
        except OSError as err:
            raise SetupError(key, value, f"is not writable ({err.strerror})") from None
        return
    if not create_folder and not path.parent.is_dir():
        raise SetupError(key, value, f"no such folder: {path.parent}")
    problem = _blocked(path.parent)
    if problem:
        raise SetupError(key, value, f"not a file fedpilot can write: {problem}")


def _blocked(folder: Path) -> str | None:
    """Why `folder` (absolute) cannot be written in or created: itself or its first existing parent is a file, or a
    folder cannot be created in that one; None when it can."""
    found = next(p for p in (folder, *folder.parents) if p.exists())
    if not found.is_dir():
        return f"{found} is a file"
    try:  # tried, then removed: os.access answers yes to root where nothing can be created (under /proc, /sys)
        os.rmdir(tempfile.mkdtemp(dir=found, prefix=".fedpilot-probe-"))
    except OSError as err:
        return f"cannot create a folder in {found} ({err.strerror})"
    return None


def configs_dir() -> Path:
    """The configs/ tree: $FEDPILOT_CONFIGS (checked: a folder with the groups pipelines compose from), else the
    copy inside an installed wheel, else the checkout's."""
    given = variable("FEDPILOT_CONFIGS")
    if given:
        path = Path(given).resolve()
        if not path.is_dir():
            raise SetupError("FEDPILOT_CONFIGS", given,
                             "is a file, not a folder" if path.exists() else "no such folder")
        missing = [group for group in CONFIG_GROUPS if not (path / group).is_dir()]
        if missing:
            raise SetupError("FEDPILOT_CONFIGS", given, f"has no {', '.join(missing)} folder: a configs tree has a "
                            "folder of .yaml files per config group (dataset/digits.yaml, model/mlp.yaml)")
        return path
    packaged = Path(str(resources.files("fedpilot"))) / "configs"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parents[2] / "configs"
