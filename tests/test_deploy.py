"""The team deployment: docker-compose.yml validated by a real compose implementation, and the same services
started natively (no Docker engine here) through the whole flow.

Natively: a real PostgreSQL (tests/postgres.py), the tracking server through tracking/entrypoint.py (creates its
databases, `mlflow db upgrade`, `mlflow server --app-name basic-auth`), one `fedpilot scheduler` and two
`fedpilot worker` processes signed in as the service account. A user submits a pipeline, the scheduler queues a
due search, workers run both, and the results are read back through the authenticated MLflow API; requests
without credentials, with a wrong password, under a foreign Host name or beyond a user's permission are refused.
Headless Chromium then shows the finished pipeline's per-client accuracy plot on its MLflow run page.

Without docker-compose, PostgreSQL or Chromium these tests skip on a developer machine and fail on CI (CI=true).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from mlflow.server import get_app_client

from fedpilot.db import connect, utcnow
from fedpilot.jobs.queue import list_jobs
from fedpilot.jobs.schedule import add
from pipeline_fixtures import PLOTTED, cli, write_pipeline
from postgres import fresh_postgres
from test_jobs import TINY
from test_mlflow_server import free_port, wait_healthy

pytestmark = pytest.mark.slow  # starts services or processes (conftest runs these files first)

ROOT = Path(__file__).resolve().parents[1]
ADMIN, SERVICE = ("admin", "admin-password-for-tests"), ("fedpilot", "service-password-for-tests")
SEARCH = {"space": {"stages.0.local.lr": {"type": "float", "low": 0.01, "high": 0.1}},
          "objective": {"metric": "val_acc_weighted"}, "trials": 1}
PLOT = "plots/test_acc_cdf.png"  # the parent run's CDF of per-client test accuracy, one line per stage


def need(tool: str, found: str | None) -> str:
    """The path of a tool the deployment tests need; absent: skip on a developer machine, fail on CI."""
    if found is None:
        message = f"{tool} not found (Debian: apt-get install {tool})"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return found


def compose_config(env_file: str) -> subprocess.CompletedProcess:
    """`docker-compose --env-file ENV_FILE -f docker-compose.yml config` (Debian's docker-compose 1.29)."""
    binary = need("docker-compose", shutil.which("docker-compose"))
    return subprocess.run([binary, "--env-file", env_file, "-f", "docker-compose.yml", "config"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def tracking_env(backend: str, auth_db: str, artifacts: Path, port: int) -> dict[str, str]:
    """The `mlflow` service's environment (docker-compose.yml) for a server on 127.0.0.1:`port`."""
    return {"MLFLOW_BACKEND_STORE_URI": backend, "MLFLOW_AUTH_DATABASE_URI": auth_db,
            "MLFLOW_ARTIFACTS_DESTINATION": str(artifacts), "MLFLOW_HOST": "127.0.0.1", "MLFLOW_PORT": str(port),
            "MLFLOW_WORKERS": "1", "MLFLOW_SERVER_ALLOWED_HOSTS": f"127.0.0.1:{port},localhost:{port}",
            "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN[0], "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN[1],
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key", "FEDPILOT_MLFLOW_USERNAME": SERVICE[0],
            "FEDPILOT_MLFLOW_PASSWORD": SERVICE[1], "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true"}


def test_compose_file_is_valid_and_takes_its_secrets_from_the_env_file(tmp_path):
    done = compose_config(".env.example")
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert set(services) == {"db", "mlflow", "scheduler", "worker", "optuna-dashboard"}
    for name, service in services.items():
        assert service["restart"] == "unless-stopped" and service["healthcheck"]["test"], name
    assert services["mlflow"]["build"]["context"] == str(ROOT / "tracking")
    assert set(services["mlflow"]["environment"]) == set(tracking_env("", "", ROOT, 0))  # what CI runs natively
    assert services["scheduler"]["command"] == ["scheduler"] and services["scheduler"]["deploy"]["replicas"] == 1
    assert services["worker"]["command"] == ["worker"]
    gpus = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpus == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    for name in ("scheduler", "worker"):
        env = services[name]["environment"]
        assert (env["FEDPILOT_DB"].startswith("postgresql+psycopg://fedpilot:")
                and env["FEDPILOT_DB"].endswith("@db:5432/fedpilot"))
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000" and env["MLFLOW_TRACKING_USERNAME"] == "fedpilot"
    assert "change-me" not in (ROOT / "docker-compose.yml").read_text()  # secrets live in the env file only
    (tmp_path / "empty.env").write_text("")
    missing = compose_config(str(tmp_path / "empty.env"))
    assert missing.returncode != 0 and "set POSTGRES_USER in .env" in missing.stderr
    ignored = subprocess.run(["git", "check-ignore", "-q", ".env"], cwd=ROOT)
    assert ignored.returncode == 0, ".env (the real secrets) must be ignored by git"


@dataclass
class Team:
    url: str
    db: str
    root: Path
    logs: list[Path]


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(command, env=env, cwd=log.parent, stdout=out, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def team(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Team]:
    """PostgreSQL, the tracking server (tracking/entrypoint.py), a scheduler and two workers, all native."""
    root = tmp_path_factory.mktemp("team")
    server, port = postgres_url.rsplit("/", 1)[0], free_port()
    url = f"http://127.0.0.1:{port}"
    suffix = root.name.replace("-", "_")
    env = {**os.environ, **tracking_env(f"{server}/mlflow_{suffix}", f"{server}/mlflow_auth_{suffix}",
                                        root / "artifacts", port)}
    processes = [start([sys.executable, str(ROOT / "tracking" / "entrypoint.py")], env, root / "mlflow.log")]
    member = {**os.environ, "FEDPILOT_DB": fresh_postgres(postgres_url), "MLFLOW_TRACKING_URI": url,
              "MLFLOW_TRACKING_USERNAME": SERVICE[0], "MLFLOW_TRACKING_PASSWORD": SERVICE[1],
              "FEDPILOT_CACHE": str(root / "cache"), "MLFLOW_DISABLE_TELEMETRY": "true"}
    fedpilot = [sys.executable, "-m", "fedpilot.cli"]
    logs = [root / "mlflow.log", root / "scheduler.log", root / "worker-0.log", root / "worker-1.log"]
    try:
        wait_healthy(url, processes[0], logs[0], timeout=240)
        processes.append(start([*fedpilot, "scheduler", "--poll-seconds", "1"], member, logs[1]))
        for i in range(2):
            processes.append(start([*fedpilot, "worker", "--name", f"worker-{i}", "--poll-seconds", "0.5",
                                    "--heartbeat-seconds", "2"], member, logs[2 + i]))
        with pytest.MonkeyPatch.context() as patch:  # this process reads back as the service account too
            patch.setenv("MLFLOW_TRACKING_USERNAME", SERVICE[0])
            patch.setenv("MLFLOW_TRACKING_PASSWORD", SERVICE[1])
            yield Team(url, member["FEDPILOT_DB"], root, logs)
    finally:
        for process in reversed(processes):
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_for_jobs(team: Team, count: int, timeout: float = 400) -> list[dict]:
    """The platform's jobs once `count` of them have ended (all must succeed); the services' logs otherwise."""
    engine = connect(team.db)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = list_jobs(engine)
        if len(rows) >= count and all(r["status"] in {"succeeded", "failed", "cancelled"} for r in rows):
            assert all(r["status"] == "succeeded" for r in rows), rows
            return rows
        time.sleep(1)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in team.logs)
    pytest.fail(f"jobs did not finish in {timeout} s: {list_jobs(engine)}\n{tails}")


@pytest.fixture(scope="module")
def finished(team: Team, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """A submitted pipeline and a due scheduled search, both run by the workers: the job rows by kind."""
    folder = tmp_path_factory.mktemp("pipelines")
    small = write_pipeline(folder, {**PLOTTED, "stages": [{**s, "rounds": 2} if "rounds" in s else s
                                                          for s in PLOTTED["stages"]]})
    code, output = cli("submit", str(small), "--db", team.db)
    assert code == 0, output
    searchable = write_pipeline(folder, {**TINY, "search": SEARCH}, "tuned.yaml")
    add(connect(team.db), searchable, [], "* * * * *", trials=1, now=utcnow() - timedelta(minutes=2))
    rows = wait_for_jobs(team, count=2)
    return {row["kind"]: row for row in rows}


def request(url: str, method: str = "GET", body: dict | None = None, auth: tuple[str, str] | None = None,
            host: str | None = None) -> int:
    """The HTTP status of one request to the tracking server."""
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Basic " + base64.b64encode(":".join(auth).encode()).decode()
    if host:
        headers["Host"] = host
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers, method=method), timeout=30) as reply:
            return reply.status
    except urllib.error.HTTPError as err:
        return err.code


def test_submitted_pipeline_and_scheduled_search_run_on_workers_and_read_back_with_auth(team, finished, tmp_path):
    run, search = finished["run"], finished["search"]
    assert run["worker"] in {"worker-0", "worker-1"} and run["attempts"] == 1
    client = MlflowClient(team.url)  # signed in as the service account (MLFLOW_TRACKING_USERNAME/PASSWORD)
    parent = client.get_run(run["run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["fedpilot.pipeline"] == "small"
    assert run["mlflow"] == f"{team.url}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}"
    stages = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
                                order_by=["tags.`fedpilot.stage_index` ASC"])
    assert [r.data.tags["fedpilot.stage"] for r in stages] == ["pretrain", "personalize", "finetune"]
    assert all(0 <= r.data.metrics["test_acc_mean"] <= 1 for r in stages)
    png = Path(client.download_artifacts(parent.info.run_id, PLOT, str(tmp_path)))  # served artifacts
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    searched = client.get_run(search["run_id"])
    assert searched.data.tags["fedpilot.search"] and searched.data.metrics["best_val_acc_weighted"] > 0
    # the worker's service account created the experiment, so it manages it; everyone else signed in may edit
    admin = get_app_client("basic-auth", tracking_uri=team.url)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN[0])
        patch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN[1])
        owner = admin.get_user_permission(SERVICE[0], "experiment", parent.info.experiment_id)
        assert owner.permission == "MANAGE"
        admin.create_user("alice", "alice-password-1")  # tracking/README.md: adding users and permissions
        admin.grant_user_permission("alice", "experiment", parent.info.experiment_id, "DENY")
    alice = ("alice", "alice-password-1")
    create = f"{team.url}/api/2.0/mlflow/runs/create"
    body = {"experiment_id": parent.info.experiment_id}
    assert request(create, "POST", body) == 401  # no credentials: refused
    assert request(create, "POST", body, auth=(SERVICE[0], "wrong-password-123")) == 401
    assert request(create, "POST", body, auth=alice) == 403  # DENY on this experiment
    get = f"{team.url}/api/2.0/mlflow/runs/get?run_id="
    assert request(get + parent.info.run_id, auth=alice) == 403
    assert request(get + search["run_id"], auth=alice) == 200  # other experiments: default_permission (EDIT)
    assert request(get + parent.info.run_id, auth=SERVICE, host="attacker.example:80") == 403  # not an allowed host
    assert request(f"{team.url}/health") == 200  # health checks need no credentials
    assert len(client.search_runs([parent.info.experiment_id])) == 4  # nothing was created by the refused calls


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_mlflow_ui_shows_the_per_client_accuracy_plot_in_chromium(team, finished, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser = need("chromium", shutil.which("chromium") or shutil.which("chromium-browser"))
    driver_path = need("chromium-driver", shutil.which("chromedriver"))
    run_id = finished["run"]["run_id"]
    client = MlflowClient(team.url)
    experiment = client.get_run(run_id).info.experiment_id
    width, height = png_size(Path(client.download_artifacts(run_id, PLOT, str(tmp_path))))
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--window-size=1400,1000", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        driver.execute_cdp_cmd("Network.enable", {})  # basic auth on every request the UI makes
        token = base64.b64encode(":".join(SERVICE).encode()).decode()
        driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}})
        driver.get(f"{team.url}/#/experiments/{experiment}/runs/{run_id}/artifacts/{PLOT}")
        shown = "return [...document.images].filter(i => i.complete && i.naturalWidth > 300)" \
                ".map(i => [i.naturalWidth, i.naturalHeight])"
        deadline = time.monotonic() + 60
        while not driver.execute_script(shown) and time.monotonic() < deadline:
            time.sleep(0.5)
        screenshot = tmp_path / "mlflow-run-page.png"
        driver.save_screenshot(str(screenshot))
        page = driver.find_element("tag name", "body").text
        images = driver.execute_script(shown)
    finally:
        driver.quit()
    assert [width, height] in images, (images, page[:2000], screenshot)  # the plot itself, at full size
    for text in ("small", "Artifacts", "test_acc_cdf.png", "stages.json", "pipeline.json", SERVICE[0]):
        assert text in page, (text, page[:2000])
    assert png_size(screenshot)[0] == 1400  # the screenshot of that page (kept in the test's tmp_path)
