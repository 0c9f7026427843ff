"""What every fedpilot command shares: argument types, how an error ends a command (its one line and exit code),
and the outcome a command leaves in a job's result file."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from typer.core import TyperCommand, TyperGroup

from fedpilot.errors import DataUnavailable, StageCrashed, StageFailed, raised_at
from fedpilot.jobs.result_file import write_result

T = TypeVar("T")

# The panels of `fedpilot --help`, and how every help text is read: markdown (`code`, paragraphs rewrapped)
RUNS, STUDIES, JOBS, DATA, SCAFFOLDING = "Runs", "Comparisons and searches", "Jobs", "Data", "Scaffolding"
MARKUP = "markdown"


def _untyped_flags(params: list) -> list:
    """A flag takes no value: no `<bool>` beside it in --help (typer shows every option's type)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(TyperCommand):
    """A fedpilot command: its --help shows no type beside a flag."""

    def get_params(self, ctx):
        return _untyped_flags(super().get_params(ctx))


class Group(TyperGroup):
    """A group of fedpilot commands: its --help shows no type beside a flag."""

    def get_params(self, ctx):
        return _untyped_flags(super().get_params(ctx))

Pipeline = Annotated[Path, typer.Argument(help="Pipeline YAML file, e.g. pipelines/quickstart.yaml.")]
Overrides = Annotated[list[str] | None, typer.Argument(help="Dotted overrides, e.g. stages.0.rounds=20.")]
CacheDir = Annotated[Path | None, typer.Option(help="fedpilot's cache (default $FEDPILOT_CACHE, else "
                                                    ".fedpilot-cache).")]
ResultFile = Annotated[Path | None, typer.Option(hidden=True, help="JSON file a worker reads: run id, status, "
                                                                  "error (written as they become known).")]
Db = Annotated[str | None, typer.Option("--db", help="Platform database URL (default $FEDPILOT_DB, else "
                                                     "sqlite:///fedpilot.db in the working directory).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON for machines.")]

# Where a job runs (`--to`) and the Slurm options of one submitted there; defaults come from the pipeline's `slurm:`
# block, under it from $FEDPILOT_SLURM ("partition=gpu gpus=1 time=4:00:00").
SLURM_PANEL = "Slurm, with --to slurm (defaults: slurm: block, $FEDPILOT_SLURM)"
To = Annotated[str | None, typer.Option("--to", help="Where it runs: `queue` (fedpilot workers) or `slurm` (through "
                                                     "submitit).")]
Partition = Annotated[str | None, typer.Option(help="Partition.", rich_help_panel=SLURM_PANEL)]
Gpus = Annotated[int | None, typer.Option(help="GPUs per node (default `devices`; 0 on a CPU-only cluster).",
                                          rich_help_panel=SLURM_PANEL)]
Cpus = Annotated[int | None, typer.Option(help="CPUs per task.", rich_help_panel=SLURM_PANEL)]
Mem = Annotated[str | None, typer.Option(help="Memory per node, e.g. 16G.", rich_help_panel=SLURM_PANEL)]
Time = Annotated[str | None, typer.Option(help="Time limit, MINUTES or D-HH:MM:SS (a checkpoint just before, then "
                                               "requeued).",
                                          rich_help_panel=SLURM_PANEL)]
Account = Annotated[str | None, typer.Option(help="Account charged.", rich_help_panel=SLURM_PANEL)]
Qos = Annotated[str | None, typer.Option(help="Quality of service.", rich_help_panel=SLURM_PANEL)]
Parallel = Annotated[int, typer.Option(help="Workers on one study or comparison (1-1000, default 1): a job array, "
                                             "or queued jobs.", show_default=False)]
# Bounds of numeric options: past them a value is a typo, or fails inside the library it reaches.
PARALLEL_MAX = 1000  # a job array's tasks: Slurm's default MaxArraySize (1001) bounds them
PERIOD_MAX_S = 86_400  # heartbeats and polls: a day (past some thousand years, the times computed overflow datetime)
PORT = (1, 65_535)  # a TCP port


def exit_code(err: Exception) -> int:
    """How an error ends a command: 1 for a stage that failed (StageFailed), 2 for anything the user can fix
    (UserError: a bad spec or argument, this machine's setup, a missing job or run, a refused submission)."""
    return 1 if isinstance(err, StageFailed) else 2


def fail(err: Exception, code: int | None = None) -> NoReturn:
    """Print an error in one line and exit with `code` (default: the error's exit_code); a stage that crashed says
    where its whole traceback is, which --debug also shows."""
    where = err.traceback_at if isinstance(err, StageCrashed) else None
    if where is not None and debugging():
        typer.echo("".join(traceback.format_exception(err)), err=True)
    typer.secho(f"error: {err}" + (f" (traceback: {where})" if where else ""), fg=typer.colors.RED, err=True)
    raise typer.Exit(code=exit_code(err) if code is None else code)


_DEBUG = {"asked": False}  # `fedpilot --debug`, for this command


def debug(asked: bool) -> None:
    """Set by `fedpilot --debug`: failures show their whole traceback."""
    _DEBUG["asked"] = asked


def debugging() -> bool:
    """Whether failures show their traceback on screen: `fedpilot --debug`, or FEDPILOT_DEBUG set (not 0)."""
    from fedpilot.settings import variable

    return _DEBUG["asked"] or variable("FEDPILOT_DEBUG") not in (None, "0")


class OneLineErrors(Group):
    """The `fedpilot` group: a refusal of Typer's own (`--tune abc`, an unknown option, a missing argument) ends as
    every other bad input does, with one `error:` line naming the value and exit code 2; an exception nothing below
    the CLI expected (an internal failure) with one line, its traceback in a log file (on screen with --debug), and
    exit code 1."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except typer.TyperException as err:  # Typer's parsing: help for no arguments, else a refusal
            if type(err).__name__ == "NoArgsIsHelpError":
                err.show()  # type: ignore[attr-defined]
                sys.exit(0)
            typer.secho(f"error: {usage_error(err)}", fg=typer.colors.RED, err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        except Exception as err:  # nothing below expected it
            typer.secho(f"error: {internal_failure(err)}", fg=typer.colors.RED, err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


def usage_error(err: typer.TyperException) -> str:
    """A refusal of Typer's own in one line: `--tune='abc': input should be a valid integer` (the value from the
    validation error behind it), else its message, with where the command's help is."""
    param, cause = getattr(err, "param", None), err.__cause__
    found = cause.errors() if hasattr(cause, "errors") else []
    if isinstance(err, typer.BadParameter) and param is not None and found:
        key = param.opts[0] if param.param_type_name == "option" else (param.metavar or param.name.upper())
        problem = str(found[0]["msg"])
        return f"{key}={found[0]['input']!r}: {problem[:1].lower()}{problem[1:]}"
    message = " ".join(err.format_message().split())
    ctx = getattr(err, "ctx", None)
    return message + (f" (see {ctx.command_path} --help)" if ctx is not None else "")


def internal_failure(err: Exception) -> str:
    """An exception nothing below the CLI expected, in one line (its type, message and where it was raised), its
    whole traceback written to a log file under the cache (logs/), and shown on screen with --debug."""
    text = "".join(traceback.format_exception(err))
    if debugging():
        typer.echo(text, err=True)
    message = " ".join(str(err).split())
    at = raised_at(err)
    line = f"internal failure: {type(err).__name__}" + (f": {message}" if message else "") + (f", at {at}" if at
                                                                                              else "")
    try:
        from fedpilot.settings import cache_root

        log = cache_root().absolute() / "logs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(text)
    except OSError:  # no log where the cache cannot be written: the traceback on screen instead
        typer.echo(text, err=True)
        return line
    return f"{line} (traceback: {log})"


def slurm_flags(partition: str | None, gpus: int | None, cpus: int | None, mem: str | None, time: str | None,
                account: str | None, qos: str | None) -> dict[str, object]:
    """The Slurm options a command was given, by name (None: not given); jobs.backend.configured reads them."""
    return {"partition": partition, "gpus": gpus, "cpus": cpus, "mem": mem, "time": time, "account": account,
            "qos": qos}


def program() -> str:
    """How the user invoked fedpilot (e.g. .venv/bin/fedpilot under `make demo`), for commands we suggest."""
    invoked = sys.argv[0]
    return invoked if invoked.endswith("/fedpilot") else "fedpilot"


def print_json(value: object) -> None:
    json.dump(value, sys.stdout, indent=2)
    sys.stdout.write("\n")


def unreachable(err: DataUnavailable) -> None:
    """Warn that data this machine cannot reach was not checked (the worker or cluster may reach it)."""
    typer.secho(f"warning: {err}; the checks that need the data run again before anything is created",
                fg=typer.colors.YELLOW, err=True)


def checked(check: Callable[[], T]) -> T | None:
    """Run the data checks of `validate` (their result); data this machine cannot reach is a warning, not an error
    (`run` refuses it before creating anything): None."""
    try:
        return check()
    except DataUnavailable as err:
        unreachable(err)
        return None


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
