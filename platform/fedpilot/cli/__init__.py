"""The `fedpilot` command: the only face of the platform. Each module holds one group of commands; a command
imports what it runs (torch, Lightning, MLflow, the runner) inside its function, so `validate`, `submit`, `jobs`,
`schedule` and `data describe` start without them. Nothing below this package prints or exits: it returns values
or raises the errors of fedpilot.errors, which `common.fail` turns into one line and an exit code."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from fedpilot.cli import browse, jobs, pipeline
from fedpilot.cli.common import OneLineErrors, debug
from fedpilot.cli.data import data_app
from fedpilot.cli.new import new_app
from fedpilot.cli.pipeline import format_outcomes, where_to_look

__all__ = ["app", "format_outcomes", "main", "where_to_look"]

app = typer.Typer(
    name="fedpilot",
    help="Personalized federated learning experiments: pipelines, a vectorized engine, MLflow, Optuna.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=OneLineErrors,
)
app.add_typer(data_app, name="data")
for command in (pipeline.validate, pipeline.run, pipeline.search, pipeline.compare, browse.report, browse.ui,
                jobs.submit, jobs.cancel, jobs.worker, jobs.scheduler):
    app.command()(command)
app.add_typer(jobs.jobs_app, name="jobs")
app.add_typer(jobs.schedule_app, name="schedule")
app.add_typer(new_app, name="new")


@app.callback()
def _notices(
    debugging: Annotated[bool, typer.Option("--debug", help="Show the whole traceback of a failure in a plugin's code "
                                                           "or fedpilot's own (also FEDPILOT_DEBUG=1).")] = False,
) -> None:
    """What the layers below tell the user at once (fedpilot's log at WARNING: a stop asked by a signal, a worker's
    lost job) goes to stderr as it is."""
    debug(debugging)
    logger = logging.getLogger("fedpilot")
    if not any(getattr(h, "fedpilot_cli", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.fedpilot_cli = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False


def main() -> None:
    """The console script `fedpilot`."""
    app()
