"""The `fedpilot` command: the only face of the platform. Each module holds one group of commands; a command
imports what it runs (torch, Lightning, MLflow, the runner) inside its function, so `validate`, `submit`, `jobs`,
`schedule` and `data describe` start without them. Nothing below this package prints or exits: it returns values
or raises the errors of fedpilot.errors, which `common.fail` turns into one line and an exit code."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
import threading
from typing import Annotated

import typer

from fedpilot.cli import browse, jobs, pipeline
from fedpilot.cli.common import DATA, JOBS, MARKUP, RUNS, SCAFFOLDING, STUDIES, Command, OneLineErrors, debug
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
    rich_markup_mode=MARKUP,
    cls=OneLineErrors,
)
for panel, commands in ((RUNS, (pipeline.validate, pipeline.run, browse.report, browse.ui)),
                        (STUDIES, (pipeline.search, pipeline.compare, browse.dashboard)),
                        (JOBS, (jobs.submit, jobs.cancel, jobs.worker, jobs.scheduler))):
    for command in commands:
        app.command(cls=Command, rich_help_panel=panel)(command)
app.add_typer(jobs.jobs_app, name="jobs", rich_help_panel=JOBS)
app.add_typer(jobs.schedule_app, name="schedule", rich_help_panel=JOBS)
app.add_typer(data_app, name="data", rich_help_panel=DATA)
app.add_typer(new_app, name="new", rich_help_panel=SCAFFOLDING)


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
    """The console script `fedpilot`. Once a command is done (its exit handlers run, its threads joined), the
    process ends without the interpreter's teardown: after a run, freeing the modules of torch, Lightning and MLflow
    one by one took 2.5-3.5 s after the last line on 2 idle cores (more on a loaded machine), for nothing."""
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
        if not isinstance(done.code, int | None):
            print(done.code, file=sys.stderr)
    threading._shutdown()  # what the interpreter's exit does first: join non-daemon threads (their exit hooks)
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a closed pipe (`| head`)
            stream.flush()
    os._exit(code)
