"""Every environment variable and path option fedpilot reads is checked before any work: a bad one ends the command
with exit code 2 and one `error: NAME=value: problem` line naming it, no traceback, and nothing created (no cache,
MLflow store, platform database, report or result file)."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from pipeline_fixtures import SMALL, cli, write_pipeline

PIPE = "small.yaml"
SEARCH = {"space": {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
          "objective": {"metric": "val_acc_weighted"}, "trials": 2}
ENVIRONMENT = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "FEDPILOT_CACHE",
               "FEDPILOT_DB", "FEDPILOT_CONFIGS", "FEDPILOT_SLURM")


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding the pipeline small.yaml (with a search block), a file `a-file` to point paths at,
    and nothing else: every store a command would create (cache, MLflow store, platform database) lands here."""
    for name in ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDPILOT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FEDPILOT_DB", f"sqlite:///{tmp_path}/fedpilot.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.setattr(os, "execvp", lambda *args: pytest.fail("`fedpilot ui` started MLflow"))
    (tmp_path / "a-file").write_text("not a folder\n")
    write_pipeline(tmp_path, {**copy.deepcopy(SMALL), "search": SEARCH})
    return tmp_path


def refused(place: Path, expect: str, *args: str, secret: str | None = None) -> None:
    """`fedpilot ARGS` exits with 2 and one error line holding `expect` (never `secret`), and creates nothing."""
    before = sorted(place.rglob("*"))
    code, output = cli(*args)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and expect in errors[0], output
    assert "Traceback" not in output, output
    assert secret is None or secret not in output, output
    assert sorted(place.rglob("*")) == before


def case(name: str, environment: dict[str, str | None], args: tuple[str, ...], expect: str) -> object:
    return pytest.param(environment, args, expect, id=name)


TRACKING = [
    case("scheme", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("validate", PIPE),
         "MLFLOW_TRACKING_URI='bogus://x': not a tracking store MLflow can open (allowed: a folder, file:"),
    case("scheme-run", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("run", PIPE), "MLFLOW_TRACKING_URI='bogus://x'"),
    case("scheme-resume", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("run", "--resume", "abc"),
         "MLFLOW_TRACKING_URI='bogus://x'"),
    case("scheme-search", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("search", PIPE), "MLFLOW_TRACKING_URI='bogus://x'"),
    case("scheme-report", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("report", "abc"), "MLFLOW_TRACKING_URI='bogus://x'"),
    case("scheme-ui", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("ui",), "MLFLOW_TRACKING_URI='bogus://x'"),
    case("scheme-worker", {"MLFLOW_TRACKING_URI": "bogus://x"}, ("worker", "--exit-when-idle"),
         "MLFLOW_TRACKING_URI='bogus://x'"),
    case("folder-store-is-a-file", {"MLFLOW_TRACKING_URI": "a-file"}, ("run", PIPE),
         "MLFLOW_TRACKING_URI='a-file': not a folder fedpilot can write: "),
    case("sqlite-under-a-file", {"MLFLOW_TRACKING_URI": "sqlite:///a-file/mlflow.db"}, ("validate", PIPE),
         "MLFLOW_TRACKING_URI='sqlite:///a-file/mlflow.db': not a file fedpilot can write: "),
    case("sqlite-is-a-folder", {"MLFLOW_TRACKING_URI": "sqlite:///."}, ("run", PIPE),
         "MLFLOW_TRACKING_URI='sqlite:///.': is a folder, not a file"),
    case("server-without-host", {"MLFLOW_TRACKING_URI": "http://"}, ("run", PIPE),
         "MLFLOW_TRACKING_URI='http://': no host"),
    case("server-bad-port", {"MLFLOW_TRACKING_URI": "http://localhost:99999"}, ("run", PIPE),
         "MLFLOW_TRACKING_URI='http://localhost:99999': "),
    case("username-without-password", {"MLFLOW_TRACKING_URI": "http://localhost:5000",
                                       "MLFLOW_TRACKING_USERNAME": "alice"}, ("run", PIPE),
         "MLFLOW_TRACKING_PASSWORD=None: "),
    case("password-without-username", {"MLFLOW_TRACKING_URI": "http://localhost:5000",
                                       "MLFLOW_TRACKING_PASSWORD": "pw"}, ("validate", PIPE),
         "MLFLOW_TRACKING_USERNAME=None: "),
    case("pipeline-key", {"MLFLOW_TRACKING_URI": None}, ("validate", PIPE, "tracking.uri=bogus://x"),
         "tracking.uri='bogus://x': not a tracking store MLflow can open"),
]


@pytest.mark.parametrize(("environment", "args", "expect"), TRACKING)
def test_a_tracking_store_mlflow_cannot_open_is_refused_before_anything(place, monkeypatch, environment, args,
                                                                         expect):
    for name, value in environment.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    refused(place, expect, *args)


def test_a_database_driver_that_is_not_installed_is_named_and_the_password_is_not_shown(place, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "mysql://alice:s3cr3t@localhost/mlflow")
    refused(place, "MLFLOW_TRACKING_URI='mysql://alice:***@localhost/mlflow': its driver is not installed (MySQLdb)",
            "run", PIPE, secret="s3cr3t")


FOLDERS = [
    case("cache-is-a-file", {"FEDPILOT_CACHE": "a-file"}, ("validate", PIPE),
         "FEDPILOT_CACHE='a-file': not a folder fedpilot can write: "),
    case("cache-run", {"FEDPILOT_CACHE": "a-file"}, ("run", PIPE), "FEDPILOT_CACHE='a-file'"),
    case("cache-search", {"FEDPILOT_CACHE": "a-file"}, ("search", PIPE), "FEDPILOT_CACHE='a-file'"),
    case("cache-submit", {"FEDPILOT_CACHE": "a-file"}, ("submit", PIPE), "FEDPILOT_CACHE='a-file'"),
    case("cache-schedule", {"FEDPILOT_CACHE": "a-file"},
         ("schedule", "add", PIPE, "--cron", "0 2 * * *", "--trials", "1"), "FEDPILOT_CACHE='a-file'"),
    case("cache-describe", {"FEDPILOT_CACHE": "a-file"}, ("data", "describe", PIPE), "FEDPILOT_CACHE='a-file'"),
    case("cache-under-a-file", {"FEDPILOT_CACHE": "a-file/cache"}, ("validate", PIPE),
         "FEDPILOT_CACHE='a-file/cache': not a folder fedpilot can write: "),
    case("cache-dir-option", {}, ("validate", PIPE, "--cache-dir", "a-file"),
         "--cache-dir='a-file': not a folder fedpilot can write"),
    case("cache-dir-run", {}, ("run", PIPE, "--cache-dir", "a-file/x"),
         "--cache-dir='a-file/x': not a folder fedpilot can write"),
    case("cache-dir-describe", {}, ("data", "describe", PIPE, "--cache-dir", "a-file"), "--cache-dir='a-file'"),
    case("configs-missing", {"FEDPILOT_CONFIGS": "missing"}, ("validate", PIPE),
         "FEDPILOT_CONFIGS='missing': no such folder"),
    case("configs-without-groups", {"FEDPILOT_CONFIGS": "."}, ("run", PIPE),
         "FEDPILOT_CONFIGS='.': has no dataset, model folder"),
    case("configs-is-a-file", {"FEDPILOT_CONFIGS": "a-file"}, ("submit", PIPE), "FEDPILOT_CONFIGS='a-file'"),
]


@pytest.mark.parametrize(("environment", "args", "expect"), FOLDERS)
def test_a_cache_or_configs_folder_fedpilot_cannot_use_is_refused_before_anything(place, monkeypatch, environment,
                                                                                 args, expect):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    refused(place, expect, *args)


DATABASES = [
    case("dialect", {"FEDPILOT_DB": "nosuchdb://x"}, ("jobs",),
         "FEDPILOT_DB='nosuchdb://x': not a database SQLAlchemy can open"),
    case("unparsable", {"FEDPILOT_DB": "::nothing"}, ("jobs", "show", "1"), "FEDPILOT_DB='::nothing': "),
    case("sqlite-under-a-file", {"FEDPILOT_DB": "sqlite:///a-file/fedpilot.db"}, ("cancel", "1"),
         "FEDPILOT_DB='sqlite:///a-file/fedpilot.db': not a file fedpilot can write"),
    case("submit", {"FEDPILOT_DB": "nosuchdb://x"}, ("submit", PIPE), "FEDPILOT_DB='nosuchdb://x'"),
    case("schedule", {"FEDPILOT_DB": "nosuchdb://x"},
         ("schedule", "add", PIPE, "--cron", "0 2 * * *", "--trials", "1"), "FEDPILOT_DB='nosuchdb://x'"),
    case("search", {"FEDPILOT_DB": "nosuchdb://x"}, ("search", PIPE), "FEDPILOT_DB='nosuchdb://x'"),
    case("search-elsewhere", {"FEDPILOT_DB": "nosuchdb://x"}, ("search", PIPE, "--to", "queue", "--parallel", "2"),
         "FEDPILOT_DB='nosuchdb://x'"),
    case("worker", {"FEDPILOT_DB": "nosuchdb://x"}, ("worker", "--exit-when-idle"), "FEDPILOT_DB='nosuchdb://x'"),
    case("scheduler", {"FEDPILOT_DB": "nosuchdb://x"}, ("scheduler", "--once"), "FEDPILOT_DB='nosuchdb://x'"),
    case("db-option", {}, ("schedule", "list", "--db", "nosuchdb://x"),
         "--db='nosuchdb://x': not a database SQLAlchemy can open"),
    case("storage-option", {}, ("search", PIPE, "--storage", "redis://localhost"),
         "--storage='redis://localhost': not a database SQLAlchemy can open"),
]


@pytest.mark.parametrize(("environment", "args", "expect"), DATABASES)
def test_a_platform_database_sqlalchemy_cannot_open_is_refused_before_anything(place, monkeypatch, environment, args,
                                                                               expect):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    refused(place, expect, *args)


def test_a_database_url_shows_no_password(place, monkeypatch):
    monkeypatch.setenv("FEDPILOT_DB", "mysql://alice:s3cr3t@localhost/fedpilot")
    refused(place, "FEDPILOT_DB='mysql://alice:***@localhost/fedpilot': its driver is not installed", "jobs",
            secret="s3cr3t")


@pytest.mark.parametrize(("args", "expect"), [
    (("report", "abc", "-o", "missing/report.html"), "--output='missing/report.html': no such folder"),
    (("report", "abc", "--output", "."), "--output='.': is a folder, not a file"),
    (("report", "abc", "-o", "a-file/report.html"), "--output='a-file/report.html': no such folder"),
    (("run", PIPE, "--result-file", "missing/result.json"), "--result-file='missing/result.json': no such folder"),
    (("search", PIPE, "--result-file", "."), "--result-file='.': is a folder, not a file"),
])
def test_a_file_to_write_in_a_missing_folder_is_refused_before_anything(place, args, expect):
    refused(place, expect, *args)


def test_empty_variables_mean_the_defaults(place, monkeypatch):
    """`export FEDPILOT_CACHE=` is unset, as it is for the other variables (never the working directory itself)."""
    for name in ("FEDPILOT_CACHE", "FEDPILOT_DB", "MLFLOW_TRACKING_URI", "FEDPILOT_CONFIGS"):
        monkeypatch.setenv(name, "")
    code, output = cli("validate", PIPE)
    assert code == 0, output
    assert (place / ".fedpilot-cache" / "data").is_dir() and not (place / "data").exists()


def test_the_error_names_the_variable_or_the_option_that_gave_the_value(place, monkeypatch):
    monkeypatch.setenv("FEDPILOT_CACHE", "a-file")
    monkeypatch.setenv("FEDPILOT_DB", "nosuchdb://x")
    refused(place, "--cache-dir='a-file/x'", "validate", PIPE, "--cache-dir", "a-file/x")
    code, output = cli("validate", PIPE, "--cache-dir", "cache")  # the option wins: the variable is not read
    assert code == 0, output
    refused(place, "--db='sqlite:///a-file/x.db'", "jobs", "--db", "sqlite:///a-file/x.db")


def test_a_tracking_server_that_does_not_answer_is_refused_at_once_where_runs_are_recorded(place, monkeypatch):
    """MLflow would retry for minutes; `validate`, which records nothing, does not ask the server."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    for args in (("run", PIPE), ("search", PIPE), ("report", "abc"), ("run", "--resume", "abc")):
        refused(place, "MLFLOW_TRACKING_URI='http://127.0.0.1:1': no tracking server answers there: ", *args)
    code, output = cli("validate", PIPE)
    assert code == 0, output
