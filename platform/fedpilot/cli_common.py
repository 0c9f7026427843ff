"""What every fedpilot command shares: argument types, how a user error ends a command (exit 2), and the outcome a
command leaves in a job's result file."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, NoReturn

import typer

from fedpilot.errors import DataUnavailable, SpecError
from fedpilot.jobs.result_file import write_result

Pipeline = Annotated[Path, typer.Argument(help="Pipeline YAML file, e.g. pipelines/quickstart.yaml.")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted overrides such as dataset.partition.alpha=0.1 or stages.0.rounds=20."),
]
CacheDir = Annotated[Path | None, typer.Option(help="fedpilot's cache: data/, stages/, runs/ (default "
                                                    "$FEDPILOT_CACHE or .fedpilot-cache).")]
ResultFile = Annotated[Path | None, typer.Option(hidden=True, help="JSON file a worker reads: run id, status, "
                                                                  "error (written as they become known).")]
Db = Annotated[str | None, typer.Option("--db", help="Platform database URL (default $FEDPILOT_DB, else "
                                                     "sqlite:///fedpilot.db in the working directory).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for machines.")]


def fail(err: SpecError) -> NoReturn:
    """Print a user error and exit with code 2."""
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def program() -> str:
    """How the user invoked fedpilot (e.g. .venv/bin/fedpilot under `make demo`), for commands we suggest."""
    invoked = sys.argv[0]
    return invoked if invoked.endswith("/fedpilot") else "fedpilot"


def print_json(value: object) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def checked(check: Callable[[], object]) -> None:
    """Run the data checks of `validate` or `submit`; data this machine cannot reach is a warning, not an error
    (the worker or cluster may reach it; `run` refuses it before creating anything)."""
    try:
        check()
    except DataUnavailable as err:
        typer.secho(f"warning: {err}; the checks that need the data run again before anything is created",
                    fg=typer.colors.YELLOW, err=True)


@contextmanager
def reporting(result_file: Path | None) -> Iterator[None]:
    """The block's outcome in the job result file: succeeded, or failed/killed with the error."""
    try:
        yield
    except (SystemExit, KeyboardInterrupt) as err:
        write_result(result_file, status="killed", error=f"stopped by a signal ({type(err).__name__})")
        raise
    except BaseException as err:
        write_result(result_file, status="failed", error=f"{type(err).__name__}: {err}")
        raise
    write_result(result_file, status="succeeded")
