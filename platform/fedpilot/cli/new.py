"""`fedpilot new algorithm|model|source NAME`: write a ready plugin package (fedpilot.scaffold writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedpilot.cli.common import MARKUP, Command, Group, fail
from fedpilot.errors import UserError

new_app = typer.Typer(cls=Group, rich_markup_mode=MARKUP, no_args_is_help=True,
                      help="Write a ready plugin package: an algorithm, a model or a dataset source of your own.")
Name = Annotated[str, typer.Argument(help="The name pipelines will use (lowercase letters, digits, _).")]
Into = Annotated[Path, typer.Option("--into", help="Folder to create the package in.")]


def _new(kind: str, name: str, into: Path) -> None:
    from fedpilot.scaffold import write_plugin

    try:
        root = write_plugin(kind, name, into)
    except UserError as err:
        fail(err)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        typer.echo(f"wrote {path}")
    typer.echo(f"\nnext: cd {root} && pip install -e . && pytest tests && fedpilot run pipelines/{name}.yaml")


@new_app.command("algorithm", cls=Command)
def new_algorithm(name: Name, into: Into = Path(".")) -> None:
    """An algorithm plugin: a FedAvg-like starting point (local SGD on every parameter; personal parts kept, shared
    parts averaged), a pipeline and a search over its learning rate, tests."""
    _new("algorithm", name, into)


@new_app.command("model", cls=Command)
def new_model(name: Name, into: Into = Path(".")) -> None:
    """A model plugin: a Net(body, head) subclass with one option (its width), a pipeline, tests."""
    _new("model", name, into)


@new_app.command("source", cls=Command)
def new_source(name: Name, into: Into = Path(".")) -> None:
    """A dataset source plugin: Gaussian clusters over natural clients (replace `load` with reading your data), a
    pipeline, tests."""
    _new("source", name, into)
