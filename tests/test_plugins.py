"""A researcher's own algorithm, model and dataset source, in a distribution of their own (issue 17).

The plugin package below is built in a temporary folder and installed with pip into a scratch site (its entry
points are what fedpilot discovers); then `fedpilot validate`, `run`, `search` over the plugin's hyperparameter and a
submitted job run by a worker all use it by name. A clashing or broken plugin is an error naming its distribution
only when a pipeline names it. The skeletons of `fedpilot new algorithm|model|source` pass their own tests.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from textwrap import dedent

import pytest
import torch
import yaml
from mlflow import MlflowClient

from fedpilot.db import connect
from fedpilot.jobs.queue import show_job
from pipeline_fixtures import cli, run_id_of, write_pipeline

ROOT = Path(__file__).resolve().parents[1]
PLATFORM = ROOT / "platform"

PLUGIN = {  # the distribution lab-fl 0.3.0: an algorithm written only against fedpilot.api, a model, a source
    "pyproject.toml": """
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "lab-fl"
        version = "0.3.0"

        [project.entry-points."fedpilot.algorithms"]
        twostep = "lab_fl.algorithm:TwoStep"
        plain = "lab_fl.algorithm:Plain"
        tempered = "lab_fl.tempered:Tempered"
        boom = "lab_fl.boom:Boom"

        [project.entry-points."fedpilot.models"]
        wide = "lab_fl.model:Wide"
        narrow = "lab_fl.model:narrow"

        [project.entry-points."fedpilot.sources"]
        blobs = "lab_fl.source:Blobs"

        [tool.hatch.build.targets.wheel]
        packages = ["lab_fl"]
        """,
    "lab_fl/__init__.py": '"""A lab\'s federated learning components."""\n',
    "lab_fl/algorithm.py": '''
        """Personal steps first with their own lr, then shared steps: send the shared part."""

        from pydantic import Field

        from fedpilot.api import Algorithm, AlgorithmParams, Cohort, Tunable, Upload, step_size


        class TwoStepParams(AlgorithmParams):
            lr_v: float = Field(0.05, gt=0)
            personal_epochs: float = Field(1.0, gt=0)


        class TwoStep(Algorithm):
            name = "twostep"
            Params = TwoStepParams
            tunable = {"params.lr_v": step_size(), "params.personal_epochs": Tunable(0.5, 4.0, budget=True)}

            def local_update(self, cohort: Cohort) -> Upload:
                cohort.personal = cohort.sgd("personal", lr=self.p.lr_v, epochs=self.p.personal_epochs).personal
                return Upload(shared=cohort.sgd("shared").shared)


        class Plain(TwoStep):
            """The same steps, declaring nothing tunable."""

            name = "plain"
            tunable = {}
        ''',
    "lab_fl/tempered.py": '''
        """Each client's logits divided by a temperature of its own (1, 2 or 3 by its id): a per-client constant."""

        import torch
        from torch import nn
        from torch.func import functional_call

        from fedpilot.api import Algorithm, Cohort, Tensors, Upload


        class Temperature(nn.Module):
            """Logits over the temperature `value`, a buffer each client has its own value of."""

            def __init__(self):
                super().__init__()
                self.register_buffer("value", torch.tensor(1.0))

            def forward(self, logits: torch.Tensor) -> torch.Tensor:
                return logits / self.value


        class Tempered(Algorithm):
            name = "tempered"
            constants = frozenset({"temperature.value"})

            def prepare_model(self, model: nn.Module, input_shape: tuple[int, ...]) -> None:
                if not isinstance(getattr(model, "temperature", None), Temperature):
                    model.temperature = Temperature()

            def forward(self, model: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
                own = {n.removeprefix("temperature."): v for n, v in params.items() if n.startswith("temperature.")}
                return functional_call(model.temperature, own, (functional_call(model, params, (x,)),))

            def local_update(self, cohort: Cohort) -> Upload:
                cohort.constants = {"temperature.value": 1.0 + (cohort.clients % 3).float()}
                trained = cohort.sgd("all")
                cohort.personal = trained.personal
                return Upload(shared=trained.shared)
        ''',
    "lab_fl/boom.py": '''
        """An algorithm with a bug: its local update divides by zero."""

        from fedpilot.api import Algorithm, Cohort, Upload


        class Boom(Algorithm):
            name = "boom"

            def local_update(self, cohort: Cohort) -> Upload:
                return Upload(shared=cohort.sgd("shared", lr=1 / 0).shared)
        ''',
    "lab_fl/model.py": '''
        import math
        from typing import Literal

        from torch import nn

        from fedpilot.api import Net


        class Wide(Net):
            def __init__(self, input_shape: tuple[int, ...], num_classes: int, width: int = 16):
                super().__init__(nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width), nn.Tanh()),
                                 nn.Linear(width, num_classes))


        def narrow(input_shape: tuple[int, ...], num_classes: int, width: int = 4,
                   act: Literal["tanh", "relu"] = "tanh") -> Net:
            """A builder function, as the built-in models are."""
            body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), width),
                                 nn.Tanh() if act == "tanh" else nn.ReLU())
            return Net(body, nn.Linear(width, num_classes))
        ''',
    "lab_fl/source.py": '''
        from pathlib import Path

        import numpy as np
        from pydantic import Field

        from fedpilot.api import RawData, Source


        class Blobs(Source):
            n: int = Field(400, ge=10)
            dim: int = Field(8, ge=1)
            classes: int = Field(4, ge=2)

            def load(self, seed: int, downloads: Path) -> RawData:
                rng = np.random.default_rng(seed)
                y = rng.integers(0, self.classes, self.n)
                x = rng.normal(0, 2, (self.classes, self.dim))[y] + rng.normal(size=(self.n, self.dim))
                return RawData(x.astype(np.float32), y, None, (self.dim,), class_names=self.classes)
        ''',
}

CLASHING = {  # the distribution clashing-plugin 0.0.2: its `fedavg` is a built-in's name
    "pyproject.toml": """
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "clashing-plugin"
        version = "0.0.2"

        [project.entry-points."fedpilot.algorithms"]
        fedavg = "clashing:Mine"
        mine = "clashing:Mine"

        [tool.hatch.build.targets.wheel]
        packages = ["clashing"]
        """,
    "clashing/__init__.py": '''
        from fedpilot.api import Algorithm, Upload


        class Mine(Algorithm):
            name = "mine"

            def local_update(self, cohort):
                return Upload(shared=cohort.sgd("shared").shared)
        ''',
}

BAD = {  # the distribution bad-plugins 0.0.1: a second `twostep`, and components that are broken
    "pyproject.toml": """
        [build-system]
        requires = ["hatchling"]
        build-backend = "hatchling.build"

        [project]
        name = "bad-plugins"
        version = "0.0.1"

        [project.entry-points."fedpilot.algorithms"]
        twostep = "bad_plugins:Anything"
        broken = "bad_plugins.missing:Nope"
        notalgo = "bad_plugins:Anything"

        [project.entry-points."fedpilot.models"]
        notnet = "bad_plugins:Anything"
        bare = "bad_plugins:bare"
        nothing = "bad_plugins:nothing"
        constant = "bad_plugins:WIDTH"
        onearg = "bad_plugins:one_arg"
        noinit = "bad_plugins:NoInit"

        [project.entry-points."fedpilot.sources"]
        crashes = "bad_plugins:Crashes"

        [tool.hatch.build.targets.wheel]
        packages = ["bad_plugins"]
        """,
    "bad_plugins/__init__.py": '''
        from torch import nn

        from fedpilot.api import Net, Source

        WIDTH = 12


        class Anything:
            pass


        def bare(input_shape, num_classes, width=12):
            return nn.Linear(input_shape[0], num_classes)


        def nothing(input_shape, num_classes, width=12):
            pass


        def one_arg(input_shape):
            pass


        class NoInit(Net):  # built as Net(input_shape, num_classes)
            pass


        class Crashes(Source):
            def load(self, seed, downloads):
                raise OSError("the lab's file server is down")
        ''',
}

PIPELINE = {
    "name": "lab",
    "seed": 0,
    "defaults": [{"model": "mlp"}, "_self_"],  # the mlp group's `hidden` must not reach the plugin's model
    "dataset": {"source": {"kind": "blobs", "n": 300}, "partition": {"kind": "dirichlet", "alpha": 0.5, "clients": 8}},
    "model": {"name": "wide", "width": 12},
    "personalization": "output_layer",
    "evaluation": {"every": 3},
    "tracking": {"system_metrics": False, "plots": False},
    "stages": [
        {"name": "pretrain", "algorithm": "fedavg", "rounds": 3, "clients_per_round": 4,
         "local": {"epochs": 1, "batch_size": 10, "lr": 0.05}},
        {"name": "twostep", "algorithm": "twostep", "rounds": 3, "clients_per_round": 4, "params": {"lr_v": 0.02}},
    ],
    "search": {"space": {"stages.1.params.lr_v": {"type": "float", "low": 0.001, "high": 0.1, "log": True}},
               "objective": {"metric": "val_acc_weighted"}, "sampler": {"kind": "random", "seed": 0},
               "pruner": {"kind": "none"}},
}


def pip_install(target: Path, *projects: Path) -> Path:
    """Install projects (no dependencies) into the scratch site `target`, as a user's `pip install` would."""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "--target", str(target), *map(str, projects)], check=True)
    return target


def write_project(folder: Path, files: dict[str, str]) -> Path:
    for relative, text in files.items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(dedent(text).lstrip())
    return folder


@pytest.fixture(scope="module")
def sites(tmp_path_factory) -> dict[str, Path]:
    """Scratch sites with lab-fl installed, and with clashing-plugin and bad-plugins installed."""
    root = tmp_path_factory.mktemp("plugins")
    return {"lab": pip_install(root / "site", write_project(root / "lab-fl", PLUGIN)),
            "bad": pip_install(root / "bad-site", write_project(root / "clashing-plugin", CLASHING),
                               write_project(root / "bad-plugins", BAD))}


@pytest.fixture
def lab(sites, monkeypatch, workdir) -> Path:
    """This process sees lab-fl (as it would after `pip install lab-fl`); a workdir with its own stores."""
    monkeypatch.syspath_prepend(str(sites["lab"]))
    return sites["lab"]


@contextmanager
def appended(path: Path, text: str) -> Iterator[None]:
    """`path` with `text` appended (an edit of the plugin's code) inside the block."""
    before = path.read_text()
    path.write_text(before + text)
    try:
        yield
    finally:
        path.write_text(before)


def test_validate_shows_the_plugins_params_and_only_its_models_own_options(lab, workdir):
    code, output = cli("validate", str(write_pipeline(workdir, PIPELINE)), "--full")
    assert code == 0, output
    resolved = yaml.safe_load(output[:output.index("ok: ")])
    assert resolved["stages"][1]["params"] == {"lr_v": 0.02, "personal_epochs": 1.0}  # every default filled in
    assert resolved["model"] == {"name": "wide", "width": 12}  # no `hidden` from the mlp group
    assert resolved["dataset"]["source"] == {"kind": "blobs", "n": 300, "dim": 8, "classes": 4}
    code, output = cli("validate", str(write_pipeline(workdir, PIPELINE)), "stages.1.params.lr_w=0.1")
    assert code == 2 and "stages.1.params.lr_w=0.1: unknown key" in output and "did you mean 'lr_v'" in output
    code, output = cli("validate", str(write_pipeline(workdir, PIPELINE)), "model.hidden=[8]")
    assert code == 2 and "model.hidden=[8]: not an option of model 'wide' (allowed: width)" in output


def test_a_builder_function_is_a_model_like_the_builtins(lab, workdir):
    spec = {**{k: v for k, v in PIPELINE.items() if k != "search"},
            "model": {"name": "narrow", "width": 6, "act": "relu"}, "stages": PIPELINE["stages"][:1]}
    pipeline = str(write_pipeline(workdir, spec))
    code, output = cli("validate", pipeline, "--full")
    assert code == 0, output
    assert yaml.safe_load(output[:output.index("ok: ")])["model"] == {"name": "narrow", "width": 6, "act": "relu"}
    code, output = cli("run", pipeline, "--no-progress")
    assert code == 0, output
    run_id_of(output)


FUNCTION_OPTIONS = [  # (override of the builder function's options, what the one error line says)
    ("model.depth=2", "model.depth=2: not an option of model 'narrow' (allowed: width, act)"),
    ("model.width=wide", "model.width='wide': Input should be a valid integer,"),
    ("model.act=gelu", "model.act='gelu': Input should be 'tanh' or 'relu'"),
]


@pytest.mark.parametrize(("override", "message"), FUNCTION_OPTIONS, ids=[c[0] for c in FUNCTION_OPTIONS])
def test_a_builder_functions_options_are_checked_by_its_signature(override, message, lab, workdir):
    code, output = cli("validate", str(write_pipeline(workdir, PIPELINE)), "model.name=narrow", override)
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {message}"), output


def test_run_and_search_use_the_plugin_and_its_code_is_in_the_stage_key(lab, workdir):
    pipeline = str(write_pipeline(workdir, PIPELINE))
    code, output = cli("run", pipeline, "--no-progress")
    assert code == 0, output
    assert re.search(r"^pretrain\s+miss", output, re.M) and re.search(r"^twostep\s+miss", output, re.M), output
    with appended(lab / "lab_fl" / "algorithm.py", "\n# an edit of the algorithm\n"):
        code, output = cli("run", pipeline, "--no-progress")
    assert code == 0, output
    assert re.search(r"^pretrain\s+hit", output, re.M) and re.search(r"^twostep\s+miss", output, re.M), output
    run_id_of(output)
    code, output = cli("search", pipeline, "--trials", "2", "--storage", f"sqlite:///{workdir}/studies.db")
    assert code == 0, output
    assert "study lab: 2 finished trials" in output and "'stages.1.params.lr_v'" in output, output


def test_a_plugins_failure_is_one_line_naming_it_with_its_traceback_in_the_runs_artifacts(lab, workdir):
    """A plugin's `local_update` that raises: `fedpilot run` ends with one line naming the plugin, the stage, the
    round, the error and its place, and where the whole traceback was recorded (the stage run's error.txt); its runs
    FAILED (and resumable: a fixed plugin may go on), exit code 1; --debug shows the traceback."""
    crashing = {**{k: v for k, v in PIPELINE.items() if k != "search"},
                "stages": [PIPELINE["stages"][0], {"name": "buggy", "algorithm": "boom", "rounds": 2,
                                                   "clients_per_round": 4}]}
    path = str(write_pipeline(workdir, crashing))
    code, output = cli("run", path, "--no-progress")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert ("error: stage 'buggy' (plugin `boom = lab_fl.boom:Boom` (group fedpilot.algorithms) of distribution lab-fl "
            "0.3.0) failed in round 1: ZeroDivisionError: division by zero, at lab_fl.boom:10 in local_update() "
            "(traceback: ") in errors[0], output
    log = Path(errors[0].rsplit("(traceback: ", 1)[1].rstrip(")"))
    assert log.name == "error.txt" and "Traceback" in log.read_text() and "1 / 0" in log.read_text()
    client = MlflowClient()
    runs = client.search_runs([client.get_experiment_by_name("lab").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FAILED", "FAILED", "FINISHED"]  # the parent, buggy; pretrain
    assert all(r.data.tags.get("fedpilot.resumable") != "false" for r in runs)
    code, output = cli("--debug", "run", path, "--no-progress")
    assert code == 1 and "Traceback (most recent call last)" in output and "ZeroDivisionError" in output, output
    assert len([line for line in output.splitlines() if line.startswith("error: ")]) == 1
    searched = {**crashing, "search": {**PIPELINE["search"], "space": {"stages.0.local.lr": {
        "type": "float", "low": 0.01, "high": 0.1, "log": True}}}}  # a trial crashes: the search stops, named
    code, output = cli("search", str(write_pipeline(workdir, searched)), "--trials", "1", "--storage",
                       f"sqlite:///{workdir}/studies.db")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 1 and len(errors) == 1 and "Traceback" not in output, output
    assert "error: stage 'buggy' (plugin `boom" in errors[0] and "(traceback: " in errors[0], output


def test_space_auto_searches_what_the_plugin_declares_and_refuses_a_plugin_declaring_nothing(lab, workdir):
    from fedpilot.spec import load_pipeline

    auto = {**PIPELINE, "search": {**PIPELINE["search"], "space": "auto", "stages": ["twostep"]}}
    space = load_pipeline(write_pipeline(workdir, auto)).search.space
    assert set(space) == {"stages.1.params.lr_v"} and (space["stages.1.params.lr_v"].low,
                                                       space["stages.1.params.lr_v"].high) == (0.002, 0.2)
    with_budget = {**auto, "search": {**auto["search"], "tune_budget": True}}
    assert set(load_pipeline(write_pipeline(workdir, with_budget)).search.space) == {
        "stages.1.params.lr_v", "stages.1.params.personal_epochs"}
    plain = {**auto, "stages": [auto["stages"][0], {**auto["stages"][1], "algorithm": "plain"}]}
    before = sorted(p.name for p in workdir.iterdir())
    code, output = cli("search", str(write_pipeline(workdir, plain)), "--storage", f"sqlite:///{workdir}/s.db")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert (code == 2 and len(errors) == 1
            and "stages.1.algorithm='plain': declares nothing tunable" in errors[0]), output
    assert "Traceback" not in output and not (workdir / "s.db").exists()
    assert sorted(p.name for p in workdir.iterdir()) == before


def test_the_plugins_model_and_source_code_are_in_the_stage_key_and_the_dataset_fingerprint(lab):
    from fedpilot.algorithms import build_algorithm
    from fedpilot.data.config import DatasetSpec
    from fedpilot.data.federated import fingerprint
    from fedpilot.models.options import MODELS
    from fedpilot.models.zoo import build_model
    from fedpilot.pipeline.cache import code_fingerprint

    algorithm, model = build_algorithm("twostep"), build_model("wide", (8,), 4)
    narrow = build_model("narrow", (8,), 4), MODELS["narrow"]  # a builder function's Net of torch classes only
    spec = DatasetSpec.from_dict(PIPELINE["dataset"])
    stage_code, narrow_code, data_key = (code_fingerprint(algorithm, model), code_fingerprint(algorithm, *narrow),
                                         fingerprint(spec, 0))
    with appended(lab / "lab_fl" / "model.py", "\n# an edit of the model\n"):
        assert code_fingerprint(algorithm, model) != stage_code
        assert code_fingerprint(algorithm, *narrow) != narrow_code
    with appended(lab / "lab_fl" / "source.py", "\n# an edit of the source\n"):
        assert fingerprint(spec, 0) != data_key
    assert (code_fingerprint(algorithm, model), fingerprint(spec, 0)) == (stage_code, data_key)


@pytest.mark.slow
def test_a_submitted_job_runs_on_a_worker_and_records_the_plugins_version(lab, workdir):
    db = f"sqlite:///{workdir}/fedpilot.db"
    spec = {**{k: v for k, v in PIPELINE.items() if k != "search"}, "stages": PIPELINE["stages"][1:]}
    code, output = cli("submit", str(write_pipeline(workdir, spec)), "--db", db)
    assert code == 0, output
    job_id = int(re.search(r"(\d+)\s*$", output).group(1))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lab), str(PLATFORM)])}  # the worker's environment
    worker = subprocess.run([sys.executable, "-m", "fedpilot.cli", "worker", "--db", db, "--exit-when-idle",
                             "--poll-seconds", "0.2", "--heartbeat-seconds", "1"], env=env, cwd=workdir,
                            capture_output=True, text=True, timeout=300)
    assert worker.returncode == 0, worker.stdout + worker.stderr
    job = show_job(connect(db), job_id)
    assert job["status"] == "succeeded", job
    assert job["plugins"] == {"lab-fl": "0.3.0"}
    assert [a["plugins"] for a in job["attempts_detail"]] == [{"lab-fl": "0.3.0"}]


BAD_CASES = [  # (overrides, what the one error line says)
    ("stages.1.algorithm=mine", r"stages.1.algorithm='mine': the plugin `mine = clashing:Mine` .* of distribution "
                                r"clashing-plugin 0.0.2 cannot be used: its distribution also registers `fedavg = "
                                r"clashing:Mine`, the name of a built-in algorithm"),
    ("stages.1.algorithm=twostep", r"'twostep': is registered by several plugins: .*bad-plugins 0.0.1; .*lab-fl 0.3.0: "
                                   r"keep one"),
    ("stages.1.algorithm=broken", r"'broken': the plugin `broken = bad_plugins.missing:Nope` .* of distribution "
                                  r"bad-plugins 0.0.1 cannot be loaded: ModuleNotFoundError"),
    ("stages.1.algorithm=notalgo", r"bad-plugins 0.0.1 is not a subclass of fedpilot.api.Algorithm"),
    ("model.name=notnet", r"model.name='notnet': .*bad-plugins 0.0.1 is not a subclass of fedpilot.api.Net"),
    ("model.name=constant", r"model.name='constant': the plugin `constant = bad_plugins:WIDTH` .* is an int, not a "
                            r"fedpilot.api.Net subclass or a function returning a Net"),
    ("model.name=onearg", r"model.name='onearg': .*bad-plugins 0.0.1 does not take \(input_shape, num_classes, "
                          r"\*\*options\)"),
    ("model.name=bare", r"model=\{'name': 'bare', 'width': 12\}: cannot be built \(the plugin `bare = bad_plugins:bare`"
                        r" .*\): .*returned a torch.nn.modules.linear.Linear, not a fedpilot.api.Net"),
    ("model.name=nothing", r"model=\{'name': 'nothing', 'width': 12\}: cannot be built .*: .*returned None, not a "
                           r"fedpilot.api.Net"),
    ("model.name=noinit ~model.width", r"model=\{'name': 'noinit'\}: cannot be built .*: Net\(body, head\) takes "
                                       r"two modules, not tuple and int"),
    ("dataset.source.kind=crashes", r"dataset.source.kind='crashes': the plugin `crashes = bad_plugins:Crashes` .*"
                                    r"bad-plugins 0.0.1 failed to load its samples: OSError: the lab's file server"),
]


@pytest.fixture
def bad(sites, monkeypatch, workdir) -> str:
    """This process sees lab-fl, clashing-plugin and bad-plugins; a pipeline of built-ins and lab-fl's source and
    model (the built-in `fedavg` in its first stage)."""
    monkeypatch.syspath_prepend(str(sites["lab"]))
    monkeypatch.syspath_prepend(str(sites["bad"]))
    stages = [PIPELINE["stages"][0], {"name": "twostep", "algorithm": "fedalt", "rounds": 3, "clients_per_round": 4}]
    dataset = {**PIPELINE["dataset"], "source": {"kind": "blobs"}}
    return str(write_pipeline(workdir, {**PIPELINE, "dataset": dataset, "stages": stages}))


def test_a_plugin_cannot_replace_or_break_a_builtin(bad):
    with pytest.warns(UserWarning, match=r"plugin `fedavg = clashing:Mine` .* is ignored: 'fedavg' is a built-in"):
        code, output = cli("validate", bad, "--full")
    assert code == 0, output
    assert "algorithm: fedavg" in output


@pytest.mark.parametrize(("override", "message"), BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_clashing_and_broken_plugins_fail_when_named_with_their_distribution(override, message, bad, workdir):
    before = (workdir / "mlflow.db").read_bytes()  # the empty store
    code, output = cli("run", bad, *override.split(), "--no-progress")
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert code == 2 and len(errors) == 1 and re.search(message, errors[0]), output
    assert (workdir / "mlflow.db").read_bytes() == before and not (workdir / "cache" / "stages").exists()


def test_a_plugin_algorithm_with_a_per_client_constant(lab):
    """`tempered` (lab-fl) divides each client's logits by a temperature of its own, a per-client constant
    (Algorithm.constants): the vectorized executors end its stage as the sequential reference does (weight decay
    on), and the personal bank holds each client's own value, which training never moved (the buffer's, 1, for a
    client that never took part)."""
    from fedpilot.algorithms import build_algorithm
    from fedpilot.api import Upload
    from fedpilot.testing import HEAD, TinyMLP, assert_matches_sequential, run_stage

    def model():
        net = TinyMLP()
        build_algorithm("tempered").prepare_model(net, (16,))
        return net

    own = [*HEAD, "temperature.value"]
    assert not build_algorithm("tempered").models_forward  # its constants reach its forward: no fast path
    assert_matches_sequential("tempered", own, model=model)
    shared, bank = run_stage("tempered", own, execution="vmap", chunk=5, model=model)
    temperature, theirs = bank["temperature.value"], 1.0 + torch.arange(12) % 3
    assert all(float(t) in (1.0, float(mine)) for t, mine in zip(temperature, theirs, strict=True))
    assert int((temperature > 1).sum()) >= 4  # clients took part with their own temperature

    class Untempered(type(build_algorithm("tempered"))):  # every client at the buffer's temperature, 1
        def local_update(self, cohort):
            trained = cohort.sgd("all")
            cohort.personal = trained.personal
            return Upload(shared=trained.shared)

    plain = run_stage(Untempered(), own, execution="vmap", chunk=5, model=model)[0]
    assert not torch.equal(plain["body.1.weight"], shared["body.1.weight"])  # the forward saw each temperature


def test_the_api_imports_no_torch_and_the_builtin_algorithms_use_only_the_api():
    probe = "import sys, fedpilot.api; print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(PLATFORM)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for module in sorted((PLATFORM / "fedpilot" / "algorithms").glob("*.py")):
        if module.name == "__init__.py":  # the registry of names
            continue
        tree = ast.parse(module.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        ours = {m for m in imported if m.split(".")[0] == "fedpilot" and not m.startswith("fedpilot.algorithms.")}
        assert ours <= {"fedpilot.api"}, module.name  # (an algorithm may build on another one)


@pytest.mark.slow
def test_the_new_skeletons_pass_their_own_tests(tmp_path, workdir):
    for kind, name in (("algorithm", "myalgo"), ("model", "mynet"), ("source", "mysource")):
        code, output = cli("new", kind, name, "--into", str(tmp_path))
        assert code == 0, output
    code, output = cli("new", "algorithm", "fedalt", "--into", str(tmp_path))
    assert code == 2 and "NAME='fedalt': is a built-in algorithm's name" in output
    projects = sorted(tmp_path.glob("fedpilot-*"))
    site = pip_install(tmp_path / "site", *projects)
    entry_points = {p.parent.name.split("-")[0]: p.read_text() for p in site.glob("*.dist-info/entry_points.txt")}
    assert "[fedpilot.algorithms]\nmyalgo = fedpilot_myalgo:Myalgo" in entry_points["fedpilot_myalgo"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(PLATFORM)])}
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                            *(str(p / "tests") for p in projects)], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-4000:] + tests.stderr[-2000:]
    assert re.search(r"\b8 passed\b", tests.stdout), tests.stdout[-2000:]
