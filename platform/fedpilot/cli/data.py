"""`fedpilot data`: inspect the federated dataset a pipeline builds."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from fedpilot.cli.common import MARKUP, Command, Group, Overrides, Pipeline, fail, print_json
from fedpilot.errors import SpecError, UserError

data_app = typer.Typer(cls=Group, rich_markup_mode=MARKUP, help="Inspect the federated dataset a pipeline builds.",
                       no_args_is_help=True)


@contextmanager
def build_progress() -> Iterator[None]:
    """While open, a dataset build draws a bar on stderr per thing it does (loading, building the vocabulary,
    tokenizing, packing, writing) with its steps, elapsed time and ETA; a cache hit draws nothing."""
    from fedpilot.data.federated import reporting

    bars: dict[str, object] = {}

    def show(what: str, done: int, total: int) -> None:
        if not bars:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            bars[""] = Progress("building the dataset:", "{task.description}", BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), "ETA", TimeRemainingColumn(), console=Console(stderr=True))
            bars[""].start()
        if what not in bars:
            bars[what] = bars[""].add_task(what, total=total)
        bars[""].update(bars[what], completed=done, total=total)

    try:
        with reporting(show):
            yield
    finally:
        if bars:
            bars[""].stop()


@data_app.command("describe", cls=Command)
def data_describe(
    pipeline: Pipeline,
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON for machines.")] = False,
    cache_dir: Annotated[Path | None, typer.Option(help="Dataset cache (default <$FEDPILOT_CACHE or "
                                                       ".fedpilot-cache>/data).")] = None,
) -> None:
    """Build (or load from the cache) the pipeline's federated dataset and summarise it."""
    from fedpilot.data.config import DatasetSpec
    from fedpilot.data.federated import build_federated_data
    from fedpilot.data.summary import describe, format_summary
    from fedpilot.settings import check_cache
    from fedpilot.spec import compose_pipeline, pipeline_seed

    try:
        check_cache(cache_dir)
        composed = compose_pipeline(pipeline, overrides or [])
        if "dataset" not in composed:
            raise SpecError("dataset", None, "the pipeline names no dataset (add `defaults: [{dataset: digits}]`)")
        spec = DatasetSpec.from_dict(composed["dataset"])
        seed = pipeline_seed(composed)
        start = time.perf_counter()
        with build_progress():
            data = build_federated_data(spec, seed=seed, cache_dir=cache_dir)
        seconds = time.perf_counter() - start
    except UserError as err:
        fail(err)
    summary = {**describe(data), "cache_hit": data.cache_hit, "build_seconds": round(seconds, 3)}
    if as_json:
        print_json(summary)
    else:
        typer.echo(format_summary(summary))
        origin = "loaded from cache" if data.cache_hit else "built"
        typer.echo(f"\n{origin} in {seconds:.2f} s (fingerprint {data.fingerprint})")
