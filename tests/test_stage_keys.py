"""A cached stage is never stale (issue 51): a stage's key is one pure function of its spec, its data's fingerprint
and the code that computes it (pipeline.cache.stage_keys), used by the runner, by a comparison asking whether a
pipeline is cached and by a plan counting the stages its pipelines share; the code is every module of fedpilot's
engine (engine/accel/ included), models and data, and the algorithm's and model's own modules."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow import MlflowClient

import fedpilot
from fedpilot.compare.plan import shared_stages
from fedpilot.pipeline.cache import data_fingerprint, stage_keys
from fedpilot.spec import configs_dir, load_pipeline
from fedpilot.tracking import CACHE_KEY_TAG
from pipeline_fixtures import SMALL, cli, run_id_of, runs_of, write_pipeline

TINY = {**SMALL, "tracking": {"system_metrics": False, "plots": False},
        "stages": [{**SMALL["stages"][0], "rounds": 1}, {**SMALL["stages"][1], "rounds": 1}]}
CACHED = textwrap.dedent("""
    import sys
    from pathlib import Path

    from fedpilot.pipeline.runner import PipelineRunner
    from fedpilot.spec import configs_dir, load_pipeline

    runner = PipelineRunner(load_pipeline(Path(sys.argv[2]), []), cache_dir=Path(sys.argv[3]), progress=False)
    if sys.argv[1] == "run":
        runner.run()
    print("cached" if runner.cached() else "not cached", *runner.keys)
""")


def cached_in(package_root: Path, *args: str) -> list[str]:
    """What CACHED prints, run by the fedpilot package under `package_root` (a copy) in a process of its own."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")]),
           "FEDPILOT_CONFIGS": str(configs_dir())}  # the checkout's: the copy has none beside it
    done = subprocess.run([sys.executable, "-c", CACHED, *args], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert f"{package_root}" in subprocess.run([sys.executable, "-c", "import fedpilot; print(fedpilot.__file__)"],
                                               env=env, capture_output=True, text=True).stdout  # the copy ran
    return done.stdout.split()


def test_an_edit_in_engine_accel_is_a_cache_miss(workdir):
    """A copy of the package trains and caches a pipeline; the same copy finds it cached; once a file of engine/accel/
    (the executors and the evaluation) changes, every stage is a miss."""
    copy = workdir / "copy"
    shutil.copytree(Path(fedpilot.__file__).parent, copy / "fedpilot", ignore=shutil.ignore_patterns("__pycache__"))
    path, cache = str(write_pipeline(workdir, TINY)), str(workdir / "cache")
    trained = cached_in(copy, "run", path, cache)
    assert trained[:1] == ["cached"] and cached_in(copy, "look", path, cache) == trained
    evaluate = copy / "fedpilot" / "engine" / "accel" / "evaluate.py"
    evaluate.write_text(evaluate.read_text() + "\n# a fix in the evaluation\n")
    edited = cached_in(copy, "look", path, cache)
    assert edited[:2] == ["not", "cached"] and not set(edited[2:]) & set(trained[1:])  # every stage misses


def test_the_runner_the_comparison_and_the_plan_key_a_stage_alike(workdir):
    """The keys the runner's stage runs record are those `stage_keys` computes from the spec alone, and the stages
    two pipelines share by those keys are what a plan counts as shared."""
    path = write_pipeline(workdir, TINY)
    code, output = cli("run", str(path), "--no-progress")
    assert code == 0, output
    spec = load_pipeline(path, [])
    recorded = [run.data.tags[CACHE_KEY_TAG] for run in runs_of(MlflowClient(), run_id_of(output))[1:]]
    assert recorded == stage_keys(spec, data_fingerprint(spec), "cpu")
    other = load_pipeline(path, ["stages.1.params.lr_v=0.02"])
    assert shared_stages([spec, other]) == 1 and shared_stages([spec, load_pipeline(path, ["seed=1"])]) == 0
    assert shared_stages([spec, load_pipeline(path, ["stages.1.name=tune"])]) == 2  # names are not in a key


def test_a_rerun_pins_the_executors_its_run_recorded(workdir, monkeypatch):
    """Under `execution: auto` each stage records the executor it chose with its clients per call and per chunk
    (tags fedpilot.executor, fedpilot.execution, after its first round); a rerun given those (what `--resume` passes
    for a stage without a checkpoint, and a comparison for a unit run again) runs them without timing the candidates,
    so a loaded machine cannot change its numbers."""
    from fedpilot.engine.accel import ExecutorChoice
    from fedpilot.engine.config import EXECUTORS
    from fedpilot.pipeline.runner import PipelineRunner
    from fedpilot.tracking import recorded_executions

    spec = load_pipeline(write_pipeline(workdir, TINY), [])
    first = PipelineRunner(spec, cache_dir=workdir / "first", progress=False)
    done = first.run()
    recorded = recorded_executions(first.tracker.client, first.tracker.experiment_id, done.run_id)
    assert sorted(recorded) == [0, 1] and {pin["execution"] for pin in recorded.values()} <= set(EXECUTORS), recorded
    monkeypatch.setattr(ExecutorChoice, "time", lambda *args: pytest.fail("a pinned stage timed the candidates"))
    again = PipelineRunner(spec, cache_dir=workdir / "again", progress=False, executions=recorded)
    assert again._recorded_executions(done.run_id) == recorded  # --resume's pins: no stage kept a checkpoint
    rerun = again.run()
    assert recorded_executions(again.tracker.client, again.tracker.experiment_id, rerun.run_id) == recorded
    for one, two in zip(done.stages, rerun.stages, strict=True):
        assert {k: v for k, v in two.metrics.items() if not k.startswith(("peak_", "executor_"))} == {
            k: v for k, v in one.metrics.items() if not k.startswith(("peak_", "executor_"))}, one.name  # bit for bit
