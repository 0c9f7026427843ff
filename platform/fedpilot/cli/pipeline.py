"""The pipeline commands: validate, run, search and compare."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from fedpilot.cli.common import (
    PARALLEL_MAX,
    PERIOD_MAX_S,
    Account,
    CacheDir,
    Cpus,
    Gpus,
    Mem,
    Overrides,
    Parallel,
    Partition,
    Pipeline,
    Qos,
    ResultFile,
    Time,
    To,
    checked,
    fail,
    program,
    reporting,
    slurm_flags,
    unreachable,
)
from fedpilot.cli.display import on_terminal, step
from fedpilot.errors import SpecError, StageFailed, UserError, within
from fedpilot.jobs.result_file import write_result


def validate(
    pipeline: Pipeline,
    overrides: Overrides = None,
    cache_dir: CacheDir = None,
    full: Annotated[bool, typer.Option("--full", help="Print the whole resolved spec (every default filled in, "
                                                      "without keys that do not apply).")] = False,
) -> None:
    """Check a pipeline as a run would and say what will run (--full: the resolved spec), or the first error.

    It builds the dataset into the cache; a built-in model's options are checked by their schema, and the model is
    built only where a check needs its parameters."""
    from omegaconf import OmegaConf

    from fedpilot.cli.data import build_progress
    from fedpilot.overview import applicable, summary
    from fedpilot.pipeline.checks import prepare
    from fedpilot.settings import check_cache, check_tracking
    from fedpilot.spec import load_pipeline

    try:
        root = check_cache(cache_dir)
        spec = load_pipeline(pipeline, overrides or [])
        check_tracking(spec.tracking.uri)
        with build_progress():
            prepared = checked(lambda: prepare(spec, root))
    except UserError as err:
        fail(err)
    typer.echo(OmegaConf.to_yaml(applicable(spec)).rstrip() if full
               else summary(spec, prepared and prepared.data.n_clients))
    count = f"{len(spec.stages)} stage{'s' if len(spec.stages) != 1 else ''}"
    typer.secho(f"ok: {pipeline} is a valid pipeline ({count}: "
                f"{' -> '.join(s.name for s in spec.stages)})", fg=typer.colors.GREEN, err=True)


Resume = Annotated[str | None, typer.Option(help="Continue an interrupted run (its MLflow parent run id) from its last "
                                                 "checkpoint.")]
UseCache = Annotated[bool, typer.Option(help="Reuse finished stages from the stage cache (--no-cache recomputes every "
                                             "stage and refreshes the cache).")]


def run(
    pipeline: Annotated[Path | None, typer.Argument(help="Pipeline YAML file (not needed with --resume).")] = None,
    overrides: Overrides = None, resume: Resume = None, cache_dir: CacheDir = None,
    progress: Annotated[bool, typer.Option(help="A progress bar per stage (on a terminal).")] = True,
    cache: UseCache = True,
    result_file: ResultFile = None,
) -> None:
    """Run a pipeline's stages in order, recorded in MLflow; ends with `run_id: <parent run id>`.

    Ctrl+C or SIGTERM stop it after the current round with a checkpoint (its runs are KILLED); `--resume RUN_ID`
    continues from there."""
    from fedpilot.settings import check_output

    try:
        check_output("--result-file", result_file)
    except UserError as err:  # not written to the result file: it may have no folder
        fail(err)
    try:
        spec, runner = _runner(pipeline, overrides or [], resume, cache_dir, progress, cache)
    except UserError as err:
        write_result(result_file, status="failed", error=str(err))
        fail(err)
    if runner.rank > 0:  # a DDP process Lightning started for `devices` > 1: it trains, rank 0 reports
        runner.follow(resume)
        return
    from fedpilot.pipeline.signals import Stopped

    name = " ".join([spec.name, *(overrides or [])])  # the run's name says what differs from the pipeline file
    typer.echo(f"pipeline {name}: {runner.data.n_clients} clients, model {spec.model.name}, device "
               f"{runner.device.type} x{spec.devices}, tracking {runner.uri}")
    try:
        with reporting(result_file):
            result = runner.run(resume=resume, started=lambda run_id: write_result(result_file, run_id=run_id),
                                name=None if resume else name)
    except Stopped as stop:
        typer.echo(f"\nstopped; continue with: {program()} run --resume {runner.run_id}", err=True)
        raise typer.Exit(stop.code) from None
    except StageFailed as err:  # diverged: a resumed run would diverge again, so no --resume is offered
        fail(err)
    typer.echo(f"\n{format_outcomes(result.stages, runner.task.primary)}\n")
    typer.echo(where_to_look(result.tracking_uri, result.experiment_id, result.run_id, spec.tracking.plots))
    typer.echo(f"run_id: {result.run_id}")


def _runner(pipeline: Path | None, overrides: list[str], resume: str | None, cache_dir: Path | None,
            progress: bool, cache: bool) -> tuple[Any, Any]:
    """The spec (from the file, or the run --resume names) and its PipelineRunner, every input checked first:
    torch, Lightning and MLflow load only for a valid spec, so a bad input is refused in a second or two."""
    from fedpilot.settings import check_cache, check_tracking
    from fedpilot.spec import PipelineSpec, load_pipeline

    root = check_cache(cache_dir)
    if resume:
        if pipeline is not None or overrides:
            raise SpecError("--resume", resume, "a resumed run uses its recorded pipeline; give no file or overrides")
        from fedpilot.tracking import load_resumed_spec

        spec = PipelineSpec.from_dict(load_resumed_spec(resume, check_tracking(reach=True)))
    elif pipeline is None:
        raise SpecError("pipeline", None, "give a pipeline file (or --resume RUN_ID)")
    else:
        with step("checking the pipeline"):
            spec = load_pipeline(pipeline, overrides)
    check_tracking(spec.tracking.uri, reach=True)
    with step("loading torch, Lightning and MLflow"):
        from fedpilot.pipeline.progress import quiet_lightning
        from fedpilot.pipeline.runner import PipelineRunner

    quiet_lightning()
    with step("building the federation and the model, opening the tracking store"):
        return spec, PipelineRunner(spec, cache_dir=root, progress=progress and on_terminal(sys.stderr),
                                    use_cache=cache)


def format_outcomes(stages: list, metric: str) -> str:
    """Per stage, the distribution of the per-client test `metric` (the task's primary one), the shares of clients
    better and worse than after the stage before, and where recorded the novel clients and the selected models, as a
    small text table."""
    from fedpilot.metric_names import TABLE_STATS, metric_label
    from fedpilot.report.pipeline_page import beyond_cells, stage_cells
    from fedpilot.stats.table import aligned

    beyond = [beyond_cells(o.metrics, metric) for o in stages]
    extra = list(dict.fromkeys(k for cells in beyond for k in cells))
    rows = [["stage", "cache", *TABLE_STATS, "better", "worse", *extra]]
    rows += [[o.name, o.cache, *stage_cells(o.metrics, metric).values(), *(cells.get(k, "") for k in extra)]
             for o, cells in zip(stages, beyond, strict=True)]
    return f"per-client test {metric_label(metric)}\n" + "\n".join(aligned(rows, right=tuple(range(1, len(rows[0])))))


def where_to_look(uri: str, experiment_id: str, run_id: str, report: bool) -> str:
    """The run's page in the MLflow UI and its report (a file when the artifacts are local)."""
    from fedpilot.report import REPORT_ARTIFACT
    from fedpilot.settings import UI_PORT
    from fedpilot.tracking import local_artifact, ui_url

    page = ui_url(uri, experiment_id, run_id)
    served = uri.startswith(("http://", "https://"))  # else `fedpilot ui` serves the store, on its default port
    browse = f"browse: {page}" if served else f"browse ({program()} ui --port {UI_PORT} first):\n  {page}"
    if not report:
        return browse
    path = local_artifact(uri, run_id, REPORT_ARTIFACT)
    return f"{browse}\nreport: {path or ui_url(uri, experiment_id, run_id, REPORT_ARTIFACT)}"


SetFile = Annotated[Path | None, typer.Argument(help="Set YAML, e.g. pipelines/compare/digits-k2.yaml (none with "
                                                   "--resume).")]
Tune = Annotated[int | None, typer.Option(help="Tune each pipeline first: an Optuna study of N finished trials.")]
Untuned = Annotated[bool, typer.Option("--untuned", help="With tuning, also run each pipeline as written.")]
ResumeComparison = Annotated[str | None, typer.Option("--resume", help="Go on with a stopped comparison (its run id; "
                                                                       "rerunning the command does too).")]
Storage = Annotated[str | None, typer.Option(help="Database of studies and leases (default $FEDPILOT_DB, else "
                                                  "sqlite:///fedpilot.db).")]
Heartbeat = Annotated[int, typer.Option(help="Seconds between heartbeats (1-86400, default 10); 3 missed: the work "
                                             "is taken over.", show_default=False)]
Trials = Annotated[int | None, typer.Option(help="Finished trials the study should have in total (default: the search "
                                                 "block's `trials`).")]
Study = Annotated[str | None, typer.Option(help="Study name (default: the search block's `study`, else the pipeline "
                                                "name); an existing study is resumed.")]


def search(
    pipeline: Pipeline, overrides: Overrides = None, trials: Trials = None, storage: Storage = None,
    study: Study = None, cache_dir: CacheDir = None, heartbeat_seconds: Heartbeat = 10,
    result_file: ResultFile = None, to: To = None, parallel: Parallel = 1,
    partition: Partition = None, gpus: Gpus = None, cpus: Cpus = None, mem: Mem = None, time: Time = None,
    account: Account = None, qos: Qos = None,
) -> None:
    """Tune a pipeline with Optuna until its study has --trials finished trials; ends with `run_id`.

    With `--to slurm --parallel N`, N trial workers share the study as a Slurm job array (their job ids are
    printed)."""
    from fedpilot.settings import SQL_INT_MAX, check_output

    try:  # the options, before anything (errors here are not written to the result file: it may have no folder)
        check_output("--result-file", result_file)
        within("--trials", trials, 1, SQL_INT_MAX)
        within("--heartbeat-seconds", heartbeat_seconds, 1, PERIOD_MAX_S)
        within("--parallel", parallel, 1, PARALLEL_MAX)
    except UserError as err:
        fail(err)
    if to is not None or parallel > 1:
        _search_elsewhere(pipeline, overrides, trials, storage, study, to, parallel,
                          slurm_flags(partition, gpus, cpus, mem, time, account, qos))
        return
    try:
        spec, runner = _search(pipeline, overrides or [], trials, storage, study, cache_dir, heartbeat_seconds)
    except UserError as err:
        write_result(result_file, status="failed", error=str(err))
        fail(err)
    write_result(result_file, run_id=runner.run_id)
    typer.echo(f"study {runner.study_name}: {runner.trials} trials, space {', '.join(spec.search.space)}")
    try:
        with reporting(result_file):
            result = runner.run()
    except StageFailed as err:  # a trial's stage crashed (a plugin's code, fedpilot's own): the search stops
        fail(err)
    best = ", ".join(f"{v:.4f}" for v in result.best_values) or "none"
    typer.echo(f"\nstudy {result.study}: {result.finished} finished trials ({result.pruned} pruned); best "
               f"{'/'.join(o.metric for o in spec.search.objective)} = {best} with {result.best_params}; "
               f"{result.rounds_trained} rounds trained by this process")
    typer.echo(f"run_id: {result.run_id}")


def _search(pipeline: Path, overrides: list[str], trials: int | None, storage: str | None, study: str | None,
            cache_dir: Path | None, heartbeat_seconds: int) -> tuple[Any, Any]:
    """The spec and its Search (the study and its MLflow run made), every input checked first; torch, Lightning and
    MLflow load once every input is checked."""
    from fedpilot.data.federated import staging
    from fedpilot.names import check_name
    from fedpilot.pipeline.checks import prepare
    from fedpilot.settings import check_cache, check_tracking, platform_db
    from fedpilot.spec import load_pipeline

    if study is not None:
        check_name("--study", study)
    storage_url, _ = platform_db(storage, "--storage")
    root = check_cache(cache_dir)
    with step("checking the pipeline"):
        spec = load_pipeline(pipeline, overrides)
    if spec.search is None:
        raise SpecError("search", None, "the pipeline has no `search:` block (space, objective, trials)")
    check_tracking(spec.tracking.uri, reach=True)
    with staging():  # a new dataset becomes a cache entry once the study and its MLflow run exist
        with step("building the federation, checking it as a run would"):
            prepare(spec, root)  # every input check before the study and its MLflow run exist
        with step("loading torch, Lightning, MLflow and Optuna"):
            from fedpilot.pipeline.progress import quiet_lightning
            from fedpilot.tuning import Search, quiet_optuna

        quiet_lightning()
        quiet_optuna()
        with step("opening the study and its MLflow run"):
            return spec, Search(spec, storage_url, trials, study, root, heartbeat_seconds, typer.echo)


def _search_elsewhere(pipeline: Path, overrides: list[str] | None, trials: int | None, storage: str | None,
                      study: str | None, to: str | None, parallel: int, flags: dict) -> None:
    """`fedpilot search --to slurm|queue`: the search as `parallel` jobs on one study (a Slurm job array, or queued
    for fedpilot workers); prints their job ids."""
    from fedpilot.cli.jobs import send
    from fedpilot.data.federated import staging
    from fedpilot.jobs.backend import backend
    from fedpilot.jobs.queue import job_fields
    from fedpilot.names import check_name
    from fedpilot.settings import platform_db

    try:
        if to is None:
            raise SpecError("--parallel", parallel, "starts trial workers elsewhere: add --to slurm (a job array) "
                            "or --to queue (jobs for fedpilot workers)")
        target = backend(to)
        platform_db(storage, "--storage")  # checked before the pipeline's data is built
        with staging():  # a new dataset becomes a cache entry once the jobs are sent
            fields = job_fields(pipeline, overrides or [], True, trials, here=target.here, unreachable=unreachable)
            if study is not None:
                fields["study"] = check_name("--study", study)
            ids = send(fields, target, flags, parallel, storage, "--storage")
    except UserError as err:
        fail(err)
    typer.echo(" ".join(map(str, ids)))


def compare(
    set_file: SetFile = None, overrides: Overrides = None,
    seeds: Annotated[int | None, typer.Option(help="Seeds 0..N-1 instead of the set's.")] = None,
    tune: Tune = None, untuned: Untuned = False, resume: ResumeComparison = None, storage: Storage = None,
    cache_dir: CacheDir = None,
    progress: Annotated[bool, typer.Option("--progress", help="Each stage's round bar in place of the "
                                                              "comparison's display (on a terminal).")] = False,
    heartbeat_seconds: Heartbeat = 10, result_file: ResultFile = None, to: To = None, parallel: Parallel = 1,
    partition: Partition = None, gpus: Gpus = None, cpus: Cpus = None, mem: Mem = None, time: Time = None,
    account: Account = None, qos: Qos = None,
) -> None:
    """Run a set of pipelines over seeds against its baseline, print and record the table; ends with `run_id`.

    With `--tune N` each is tuned first, on seeds it is not judged on. Stopped, the same command goes on."""
    from fedpilot.data.federated import staging
    from fedpilot.settings import SQL_INT_MAX, check_output, platform_db

    try:
        check_output("--result-file", result_file)
        within("--heartbeat-seconds", heartbeat_seconds, 1, PERIOD_MAX_S)
        within("--tune", tune, 1, SQL_INT_MAX)
        within("--parallel", parallel, 1, PARALLEL_MAX)
        storage_url, _ = platform_db(storage, "--storage")
        target = _elsewhere(to, parallel)
        with staging():  # new datasets become cache entries once every pipeline passed (and the jobs are sent)
            plan, root = _comparison_plan(set_file, overrides or [], seeds, tune, untuned, resume, cache_dir)
            if target is not None:
                _send_comparison(plan, resume, target, parallel, storage, slurm_flags(partition, gpus, cpus, mem,
                                                                                      time, account, qos))
                return
    except UserError as err:
        write_result(result_file, status="failed", error=str(err))
        fail(err)
    _compare_here(plan, root, resume, storage_url, progress, heartbeat_seconds, result_file)


def _compare_here(plan: Any, root: Path, resume: str | None, storage_url: str, progress: bool, heartbeat: int,
                  result_file: Path | None) -> None:
    """The comparison's work in this process (beside any other), then its table, report and run id printed."""
    from fedpilot.compare.run import comparison_run, run_comparison
    from fedpilot.pipeline.progress import quiet_lightning
    from fedpilot.pipeline.signals import Stopped
    from fedpilot.tuning import quiet_optuna

    quiet_lightning()
    quiet_optuna()
    _, run_id, _ = comparison_run(plan, resume)
    write_result(result_file, run_id=run_id)
    tuned = f", each tuned over {plan.comparison.tune.trials} trials" if plan.tuning else ""
    typer.echo(f"comparison {plan.comparison.name}: {len(plan.specs)} pipelines x seeds {plan.seeds}{tuned}; "
               f"run {run_id}")
    display = comparison_display(plan, live=on_terminal(sys.stdout) and not progress)
    try:
        with reporting(result_file), display.shown():
            result = run_comparison(plan, storage_url, root, progress and on_terminal(sys.stderr), display.echo,
                                    run_id, heartbeat, display.event)
    except Stopped as stop:
        typer.echo(f"\nstopped; continue with: {program()} compare --resume {run_id}", err=True)
        raise typer.Exit(stop.code) from None
    except (UserError, StageFailed) as err:  # the tracking store refused a request; a stage could not go on
        fail(err)
    typer.echo("\n" + result.table)
    typer.echo(where_to_look(result.tracking_uri, result.experiment_id, result.run_id, report=True))
    typer.echo(f"run_id: {result.run_id}")


def comparison_display(plan: Any, live: bool) -> Any:
    """The display of a comparison's work (cli.display): rich's on a terminal (`live`), else plain lines."""
    from fedpilot.cli.display import LiveDisplay, PlainDisplay, Standing

    objective = next(iter(plan.tuning.values())).search.objective[0] if plan.tuning else None
    standing = Standing(list(plan.specs), {name: spec.search.trials for name, spec in plan.tuning.items()},
                        len(plan.comparison.tuning_seeds()) if plan.tuning else 0,
                        objective.metric if objective else "", objective is None or objective.direction == "maximize")
    return LiveDisplay(standing, f"comparison {plan.comparison.name}") if live else PlainDisplay(standing)


def _elsewhere(to: str | None, parallel: int) -> Any:
    """The backend `--to` names (None: this process), checked before anything is loaded: Slurm's commands are on
    this machine, `--parallel` comes with a `--to`."""
    if to is None:
        if parallel > 1:
            raise SpecError("--parallel", parallel, "starts workers elsewhere: add --to queue (jobs for fedpilot "
                            "workers) or --to slurm (a job array)")
        return None
    from fedpilot.jobs.backend import SLURM, backend
    from fedpilot.jobs.slurm import need_slurm

    target = backend(to)
    if target.name == SLURM:
        need_slurm()
    return target


def _send_comparison(plan: Any, resume: str | None, target: Any, parallel: int, storage: str | None,
                     flags: dict) -> None:
    """The comparison's run (made here, or the one --resume names or the same plan's unfinished one), then
    `parallel` jobs that do its work with each other; their job ids printed. The jobs' options are checked before
    any run is found or made; a backend that then refuses the jobs leaves no run behind (a run made here is
    deleted, one found is left as it was)."""
    import json

    from fedpilot.cli.jobs import send
    from fedpilot.compare.run import comparison_run
    from fedpilot.jobs.backend import SLURM, configured
    from fedpilot.jobs.slurm import reach_slurm

    first = next(iter(plan.specs.values()))[plan.seeds[0]]
    spec = {"name": plan.comparison.name, "device": first.device, "tracking": {"uri": first.tracking.uri},
            **({"slurm": first.slurm.model_dump(exclude_none=True)} if first.slurm else {})}
    configured(target, spec, flags)  # --gpus with --to queue, $FEDPILOT_SLURM: refused before any run exists
    if target.name == SLURM:
        reach_slurm()
    tracker, run_id, made = comparison_run(plan, resume)
    fields = {"kind": "compare", "pipeline": plan.comparison.name, "spec": json.dumps(spec), "run_id": run_id}
    try:
        ids = send(fields, target, flags, parallel, storage, "--storage")
    except UserError:
        if made:
            tracker.client.delete_run(run_id)
        raise
    typer.echo(f"comparison {plan.comparison.name}: run {run_id}, {len(ids)} job(s) on {target.name} share its work; "
               f"the last to finish records the table ({program()} compare --resume {run_id} shows it, or does what "
               "is left)", err=True)
    typer.echo(" ".join(map(str, ids)))


def _comparison_plan(set_file: Path | None, overrides: list[str], seeds: int | None, tune: int | None,
                     untuned: bool, resume: str | None, cache_dir: Path | None) -> tuple[Any, Path]:
    """The comparison's plan, from the set file or the run --resume names, every input checked (datasets built
    into the cache) before anything is recorded; and the cache root."""
    from fedpilot.settings import check_cache, check_tracking

    root = check_cache(cache_dir)
    uri = check_tracking(reach=True)  # the comparison's own run
    if resume is not None:
        if set_file is not None or overrides or seeds is not None or tune is not None or untuned:
            raise SpecError("--resume", resume, "a resumed comparison uses its recorded plan; give no set file, "
                            "overrides, --seeds, --tune or --untuned")
        from mlflow import MlflowClient

        from fedpilot.compare.work import recorded_plan
        from fedpilot.errors import NoSuchRun
        from fedpilot.settings import store_exists

        if not store_exists(uri):
            raise NoSuchRun("--resume", resume, f"no such run: the tracking store {uri} does not exist")
        return recorded_plan(MlflowClient(uri), resume), root
    if set_file is None:
        raise SpecError("set", None, "give a comparison set file (or --resume RUN_ID)")
    from fedpilot.compare.plan import load_plan

    with step("checking the set and its pipelines"):
        plan = load_plan(set_file, seeds, overrides, tune, untuned)
    with step("loading torch, Lightning, MLflow and Optuna"):
        from fedpilot.compare.run import prepare_plan
    count = sum(len(by_seed) for by_seed in plan.specs.values()) + len(plan.tuning) * len(
        plan.comparison.tuning_seeds())
    with step(f"checking {count} (pipeline, seed) pairs as a run would, building their federations"):
        prepare_plan(plan, root)
    return plan, root
