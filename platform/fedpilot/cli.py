"""The `fedpilot` command."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from fedpilot.errors import SpecError

app = typer.Typer(
    name="fedpilot",
    help="Personalized federated learning experiments: pipelines, a vectorized engine, MLflow, Optuna.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
data_app = typer.Typer(help="Inspect the federated dataset a pipeline builds.", no_args_is_help=True)
app.add_typer(data_app, name="data")

Pipeline = Annotated[Path, typer.Argument(help="Pipeline YAML file, e.g. pipelines/quickstart.yaml.")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(help="Dotted overrides such as dataset.partition.alpha=0.1 or stages.0.rounds=20."),
]


def fail(err: SpecError) -> None:
    """Print a user error and exit with code 2."""
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


@data_app.command("describe")
def data_describe(
    pipeline: Pipeline,
    overrides: Overrides = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON for machines.")] = False,
    cache_dir: Annotated[Path | None, typer.Option(help="Dataset cache (default $FEDPILOT_CACHE or "
                                                       ".fedpilot-cache/data).")] = None,
) -> None:
    """Build (or load from the cache) the pipeline's federated dataset and summarise it."""
    from fedpilot.data import DatasetSpec, build_federated_data, describe, format_summary
    from fedpilot.spec import compose_pipeline

    try:
        composed = compose_pipeline(pipeline, overrides or [])
        if "dataset" not in composed:
            raise SpecError("dataset", None, "the pipeline names no dataset (add `defaults: [{dataset: digits}]`)")
        spec = DatasetSpec.from_dict(composed["dataset"])
        start = time.perf_counter()
        data = build_federated_data(spec, seed=int(composed.get("seed", 0)), cache_dir=cache_dir)
        seconds = time.perf_counter() - start
    except SpecError as err:
        fail(err)
    summary = {**describe(data), "cache_hit": data.cache_hit, "build_seconds": round(seconds, 3)}
    if as_json:
        json.dump(summary, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        typer.echo(format_summary(summary))
        origin = "loaded from cache" if data.cache_hit else "built"
        typer.echo(f"\n{origin} in {seconds:.2f} s (fingerprint {data.fingerprint})")


if __name__ == "__main__":
    app()
