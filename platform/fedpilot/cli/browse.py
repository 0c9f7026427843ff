"""Browsing results: the HTML report of runs and the MLflow UI."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from fedpilot.cli.common import PORT, fail
from fedpilot.errors import UserError, within


def report(
    run_ids: Annotated[list[str], typer.Argument(help="Pipeline run ids (the `run_id:` that `fedpilot run` prints); "
                                                      "several are shown side by side. Or one comparison's run id "
                                                      "(`fedpilot compare`).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="The HTML file to write.")] = Path("report.html"),
) -> None:
    """Write the report of pipeline runs (per-client CDFs, before/after and change per client, curves, footprints,
    the per-client table) as one HTML file: a run's own report, or a pipeline against its variants, a search's best
    trials side by side; or a comparison's (its table, each client's change against the baseline over the seeds)."""
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


def ui(
    port: Annotated[int, typer.Option(help="Port of the MLflow UI (1 to 65535).")] = 5000,
    host: Annotated[str, typer.Option(help="Interface to bind (0.0.0.0 to share on the network).")] = "127.0.0.1",
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
    typer.echo(f"MLflow UI for {uri} on http://{host}:{port}  (Ctrl+C stops it)\nMLflow 3 opens experiments in "
               "its GenAI view: switch to \"Model training\" at the top left once, or open the pages "
               "fedpilot run prints")
    # MLflow's GenAI job execution (LLM judges, prompt optimization) is unused here and would start seven more
    # processes that each import MLflow; docker-compose.yml turns it off too
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.execvp(sys.executable, [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri,
                               "--host", host, "--port", str(port)])
