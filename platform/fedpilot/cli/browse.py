"""Browsing results: the HTML report of runs and the MLflow UI."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fedpilot.cli.common import PORT, fail
from fedpilot.errors import SetupError, UserError, within
from fedpilot.settings import UI_PORT


def report(
    run_ids: Annotated[list[str], typer.Argument(help="Pipeline run ids (the `run_id:` that `fedpilot run` prints); "
                                                      "several are shown side by side. Or one comparison's run id "
                                                      "(`fedpilot compare`).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file to write.")] = Path("report.html"),
) -> None:
    """Write the report of runs side by side, or of a comparison, as one HTML file.

    Per-client CDFs, before/after and change per client, curves, footprints, the per-client table: a run's own
    report, or a pipeline against its variants, a search's best trials side by side; or a comparison's (its table,
    each client's change against the baseline over the seeds)."""
    from fedpilot.errors import NoSuchRun
    from fedpilot.settings import check_output, check_tracking, store_exists

    try:
        uri = check_tracking(reach=True)
        check_output("--output", output)
        if not store_exists(uri):
            raise NoSuchRun("RUN_ID", run_ids[0], f"no such run: the tracking store {uri} does not exist")
    except UserError as err:
        fail(err)
    from mlflow import MlflowClient

    from fedpilot.report import build
    from fedpilot.tracking import quiet_mlflow

    quiet_mlflow()
    try:
        page = build(MlflowClient(uri), run_ids)
    except UserError as err:
        fail(err)
    output.write_text(page)
    typer.echo(f"report of {len(run_ids)} run{'s' if len(run_ids) != 1 else ''}: {output.resolve()}")


Host = Annotated[str, typer.Option(help="Interface to bind (0.0.0.0 to share on the network).")]


def ui(
    port: Annotated[int, typer.Option(help="Port of the MLflow UI (1 to 65535); the pages `fedpilot run` prints "
                                           f"name {UI_PORT}.")] = UI_PORT,
    host: Host = "127.0.0.1",
) -> None:
    """Start the MLflow UI on the configured store ($MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)."""
    import os

    from fedpilot.settings import check_tracking

    try:
        within("--port", port, *PORT)
        uri = check_tracking()
    except UserError as err:
        fail(err)
    if uri.startswith(("http://", "https://")):
        typer.echo(f"the tracking store is a server: open {uri} in a browser")
        return
    moved = f" (with port {port} in place of their {UI_PORT})" if port != UI_PORT else ""
    typer.echo(f"MLflow UI for {uri} on http://{host}:{port}  (Ctrl+C stops it)\nMLflow 3 opens experiments in "
               "its GenAI view: switch to \"Model training\" at the top left once, or open the pages "
               f"fedpilot run prints{moved}")
    # MLflow's GenAI job execution (LLM judges, prompt optimization) is unused here and would start seven more
    # processes that each import MLflow; docker-compose.yml turns it off too
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execvp(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                               "--host", host, "--port", str(port)])


DASHBOARD_PORT = 8080  # optuna-dashboard's own default, and docker-compose.yml's


def dashboard(
    storage: Annotated[str | None, typer.Option(help="Database of the studies (default $FEDPILOT_DB, else "
                                                     "sqlite:///fedpilot.db).")] = None,
    port: Annotated[int, typer.Option(help="Port of the dashboard (1 to 65535).")] = DASHBOARD_PORT,
    host: Host = "127.0.0.1",
) -> None:
    """Start Optuna's dashboard on fedpilot's studies (`fedpilot search`, `fedpilot compare --tune`).

    Its studies, their trials and figures, read from the platform database. Needs the optional extra:
    `pip install 'fedpilot[dashboard]'`."""
    from fedpilot.settings import hidden, platform_db, store_exists

    try:
        within("--port", port, *PORT)
        url, key = platform_db(storage, "--storage")
        if not store_exists(url):
            raise SetupError(key, hidden(url), "no such database: no study was made here yet (`fedpilot search` "
                             "and `fedpilot compare --tune` make them)")
        try:
            import optuna_dashboard
        except ImportError:
            raise SetupError("optuna-dashboard", None, "not installed: pip install 'fedpilot[dashboard]'") from None
    except UserError as err:
        fail(err)
    from fedpilot.dashboard import LabelledStudies

    typer.echo(f"Optuna dashboard for {hidden(url)} on http://{host}:{port}/dashboard  (Ctrl+C stops it); a "
               "comparison's studies are listed as <comparison>: <study>")
    optuna_dashboard.run_server(LabelledStudies(url), host=host, port=port)
