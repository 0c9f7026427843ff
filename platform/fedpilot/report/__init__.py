"""The report a researcher opens first: one HTML page per pipeline run (its `report.html` artifact), or several runs
side by side (`fedpilot report RUN_ID ...`): per-client CDFs, each client before and after a stage, the change per
client of each stage, the curves, the memory and communication footprints, and a sortable per-client table; the
stage table adds the novel clients and the per-client model choice where recorded. A comparison's run
(`fedpilot compare`) has its own page: its table and, per pipeline, each client's change against the baseline over
the seeds (fedpilot.client_effects).

Built only from what the runs recorded in MLflow, with plotly. The page carries plotly.js itself, so it opens offline
as a file and inside MLflow's artifact view (which shows an HTML artifact without its neighbouring files).
"""

from __future__ import annotations

from mlflow import MlflowClient

from fedpilot.errors import RunError
from fedpilot.report.comparison_page import is_comparison, load_comparison_run, render_comparison
from fedpilot.report.pipeline_page import REPORT_ARTIFACT, render
from fedpilot.report.runs import get_run, labelled, load_run

__all__ = ["REPORT_ARTIFACT", "build", "log_report"]


def build(client: MlflowClient, run_ids: list[str]) -> str:
    """The report page of pipeline runs, or of one comparison's run, read from the tracking store."""
    comparisons = [run for run in (get_run(client, i) for i in run_ids) if is_comparison(run)]
    if comparisons and len(run_ids) > 1:
        raise RunError("RUN_ID", comparisons[0].info.run_id, "a comparison's run is reported alone")
    if comparisons:
        return render_comparison(load_comparison_run(client, comparisons[0]), client.tracking_uri)
    return render(labelled([load_run(client, run_id) for run_id in run_ids]), client.tracking_uri)


def log_report(client: MlflowClient, run_id: str, run_ids: list[str] | None = None) -> None:
    """Log the report of `run_ids` (default: the run itself) as the run's `report.html`."""
    client.log_text(run_id, build(client, run_ids or [run_id]), REPORT_ARTIFACT)
