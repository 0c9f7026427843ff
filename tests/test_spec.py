"""Pipeline specs: every shipped pipeline validates; bad YAML gets a clear error, exit code 2, and writes nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fedpilot.algorithms import ALGORITHMS
from fedpilot.errors import SpecError
from fedpilot.spec import PipelineSpec, configs_dir, load_pipeline, load_pipeline_at_seeds
from hub_standins import VALIDATED, write_hub_copies
from pipeline_fixtures import SMALL, cli, write_pipeline

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))


@pytest.fixture(scope="module")
def hub_copies(tmp_path_factory) -> dict[str, Path]:
    return write_hub_copies(tmp_path_factory.mktemp("hub"))


def offline(path: Path, hub_copies: dict[str, Path]) -> list[str]:
    """Overrides that put a local stand-in with the hub dataset's columns in place of it: this suite runs offline."""
    if load_pipeline(path).dataset.source.kind != "hf":
        return []
    assert path.stem in VALIDATED, f"{path.name} reads the hub: give it a stand-in in tests/hub_standins.py"
    data, overrides = VALIDATED[path.stem]
    return [f"dataset.source.path={hub_copies[data]}", *overrides]


@pytest.mark.parametrize("path", PIPELINES, ids=[p.stem for p in PIPELINES])
def test_every_shipped_pipeline_validates(path, workdir, hub_copies):
    code, output = cli("validate", str(path), *offline(path, hub_copies))
    assert code == 0, output
    assert "ok: " in output and all(f"{s.name} " in output for s in load_pipeline(path).stages)  # the summary


def test_every_algorithm_has_its_defaults_in_one_place_its_params():
    assert not (configs_dir() / "algorithm").exists()  # no second copy of the defaults to drift apart
    for name in ALGORITHMS:
        params = ALGORITHMS[name].Params()  # every field has a default
        spec = load_pipeline(ROOT / "pipelines" / "quickstart.yaml", [f"stages.0.algorithm={name}",
                                                                      "stages.0.params={}"])
        assert spec.stages[0].params == params.model_dump(mode="json"), name


def test_resolved_spec_merges_defaults_and_overrides():
    spec = load_pipeline(ROOT / "pipelines" / "quickstart.yaml", ["stages.1.rounds=7", "dataset.partition.alpha=0.1"])
    stage = spec.resolved()["stages"][1]
    assert stage["rounds"] == 7 and stage["algorithm"] == "fedalt"
    assert stage["params"] == {"tau_v": None, "tau_u": None, "lr_v": 0.01, "lr_u": None, "stateful": True}
    assert spec.dataset.partition.alpha == 0.1
    assert spec.stages[1].engine_config(spec.evaluation).eval_every == spec.evaluation.every


BAD = [
    ("stages: [\n", "pipeline=", "not valid YAML"),
    ({**SMALL, "stagse": []}, "stagse=[]", "unknown key.*did you mean 'stages'"),
    ({**SMALL, "seed": "zero"}, "seed='zero'", "valid integer"),
    ({**SMALL, "stages": [{**SMALL["stages"][0], "rounds": "many"}]}, "stages.0.rounds='many'", "valid integer"),
    ({**SMALL, "stages": [{**SMALL["stages"][0], "algorithm": "fedavgg"}]}, "stages.0.algorithm='fedavgg'",
     "unknown algorithm.*did you mean 'fedavg'"),
    ({**SMALL, "stages": []}, "stages=[]", "at least 1 item"),
    ({**SMALL, "stages": [{**SMALL["stages"][1], "params": {"tau_vv": 2}}]}, "stages.0.params.tau_vv=2",
     "unknown key.*did you mean 'tau_v'"),
    ({**SMALL, "personalization": "head"}, "personalization='head'", "unknown preset"),
    ({**SMALL, "model": {"name": "mlp", "hiden": [3]}}, "model.hiden=[3]", "did you mean 'hidden'"),
    ({**SMALL, "stages": [SMALL["stages"][0], SMALL["stages"][0]]}, "stages.1.name='pretrain'", "unique"),
    ({**SMALL, "stages": [{**SMALL["stages"][0], "host_memory_budget": "lots"}]}, "stages.0.host_memory_budget='lots'",
     "='lots': expected a size in bytes.*'2GiB'"),
    ({**SMALL, "stages": [{**SMALL["stages"][0], "device_data_budget": -1}]}, "stages.0.device_data_budget=-1",
     "expected a size in bytes: an integer >= 0"),
]


@pytest.mark.parametrize(("content", "key", "problem"), BAD, ids=[b[1] for b in BAD])
def test_bad_pipelines_exit_2_naming_the_key_and_write_nothing(tmp_path, monkeypatch, content, key, problem):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "bad.yaml"
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content))
    for command in ("validate", "run"):
        code, output = cli(command, str(path))
        assert code == 2, output
        assert key in output, output
        assert re.search(problem, output), output
    assert list(work.iterdir()) == []  # no mlflow.db, no cache, no half-written run


def test_errors_found_only_when_building_come_before_any_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    path = write_pipeline(tmp_path, {**SMALL, "personalization": ["head\\.nothing"]})
    code, output = cli("run", str(path), "--no-progress")
    assert code == 2 and "personalization='head\\\\.nothing': matches no parameter name" in output, output
    assert not (tmp_path / "mlflow.db").exists()


def test_overrides_set_keys_the_file_lacks_and_typos_are_still_caught(tmp_path):
    path = write_pipeline(tmp_path)
    spec = load_pipeline(path, ["stages.2.params.part=all", "stages.2.params.prox=0.1", "dataset=synthetic"])
    assert spec.stages[2].params == {"part": "all", "prox": 0.1} and spec.dataset.source.kind == "synthetic"
    with pytest.raises(SpecError, match=r"stages.0.roundz=3: unknown key.*did you mean 'rounds'"):
        load_pipeline(path, ["stages.0.roundz=3"])
    with pytest.raises(SpecError, match=r"stages.7.rounds='3': cannot be set: list index out of range"):
        load_pipeline(path, ["stages.7.rounds=3"])


def test_memory_budgets_are_bytes_or_sizes_with_units(tmp_path):
    path = write_pipeline(tmp_path)
    spec = load_pipeline(path, ["stages.0.host_memory_budget=2GiB", "stages.0.device_data_budget=1.5 GB",
                                "stages.1.host_memory_budget=4096", "stages.2.device_data_budget=0"])
    configs = [stage.engine_config(spec.evaluation) for stage in spec.stages]
    assert [(c.host_memory_budget, c.device_data_budget) for c in configs] == [
        (2 * 2**30, 1_500_000_000), (4096, None), (None, 0)]
    assert spec.resolved()["stages"][0]["host_memory_budget"] == 2 * 2**30  # a plain int in the recorded spec


def test_stage_names_default_to_the_algorithm():
    spec = PipelineSpec.from_dict({**{k: v for k, v in SMALL.items() if k != "defaults"},
                                   "dataset": {"source": {"kind": "digits"}}, "model": {"name": "mlp"},
                                   "stages": [{"algorithm": "fedavg"}, {"algorithm": "finetune"}]})
    assert [s.name for s in spec.stages] == ["fedavg", "finetune"]


QUICKSTART = ROOT / "pipelines" / "quickstart.yaml"
BIG = str(2**70)


@pytest.mark.parametrize(("override", "expect"), [
    # numpy's SeedSequence takes seeds >= 0, scikit-learn and numpy's RandomState below 2**32
    ("seed=-1", "seed=-1: Input should be greater than or equal to 0"),
    (f"seed={2**32}", f"seed={2**32}: must be at most {2**32 - 1} (numpy's RandomState and scikit-learn"),
    ("search.sampler.seed=-1", "search.sampler.seed=-1: Input should be greater than or equal to 0"),
    (f"search.sampler.seed={2**32}", f"search.sampler.seed={2**32}: must be at most {2**32 - 1}"),
    # a job's trials are an SQL INTEGER (32 bits in PostgreSQL)
    (f"search.trials={2**31}", f"search.trials={2**31}: Input should be less than or equal to {2**31 - 1}"),
    # torch.optim.Adam refuses betas outside [0, 1)
    ("stages.0.server.betas=[1.5,0.9]", "stages.0.server.betas.0=1.5: Input should be less than 1"),
    ("stages.0.server.betas=[0.9,1.0]", "stages.0.server.betas.1=1.0: Input should be less than 1"),
    ("stages.0.server.betas=[-0.1,0.9]", "stages.0.server.betas.0=-0.1: Input should be greater than or equal to 0"),
    # the engine computes in float32, and torch's sizes and counts are 64-bit
    ("stages.0.local.weight_decay=1e300", "stages.0.local.weight_decay=1e+300: past float32's largest number"),
    ("stages.0.server.lr=1e39", "stages.0.server.lr=1e+39: past float32's largest number"),
    ("stages.1.params.lr_v=1e300", "stages.1.params.lr_v=1e+300: past float32's largest number"),
    (f"stages.0.local.batch_size={BIG}", f"stages.0.local.batch_size={BIG}: past a 64-bit integer"),
    (f"stages.1.params.tau_v={BIG}", f"stages.1.params.tau_v={BIG}: past a 64-bit integer"),
    (f"model.hidden=[{BIG}]", f"model.hidden.0={BIG}: past a 64-bit integer"),
    (f"personalization={{split: adapters, adapter_dim: {BIG}}}", f"personalization.adapter_dim={BIG}: past"),
    # pydantic would read true as 1 (and YAML reads yes, no, on and off as booleans)
    ("seed=true", "seed=True: a number, not true or false"),
    ("devices=true", "devices=True: a number, not true or false"),
    ("stages.0.rounds=false", "stages.0.rounds=False: a number, not true or false"),
    ("stages.0.local.lr=true", "stages.0.local.lr=True: a number, not true or false"),
    ("search.trials=true", "search.trials=True: a number, not true or false"),
])
def test_numbers_a_library_would_refuse_are_errors_naming_their_key(override, expect):
    with pytest.raises(SpecError) as raised:
        load_pipeline(QUICKSTART, [override])
    assert expect in str(raised.value)


@pytest.mark.parametrize(("param", "expect"), [
    ({"type": "int", "low": 1, "high": 3, "step": 0.5}, "an int parameter's low, high and step are whole numbers"),
    ({"type": "int", "low": 1.5, "high": 3}, "an int parameter's low, high and step are whole numbers"),
    ({"type": "float", "low": -1e300, "high": 1e300}, "past float32's largest number"),
])
def test_search_dimensions_optuna_would_refuse_are_errors(param, expect):
    dimension = yaml.safe_dump(param, default_flow_style=True).strip()
    with pytest.raises(SpecError, match=re.escape(expect)):
        load_pipeline(QUICKSTART, [f"search.space={{stages.0.rounds: {dimension}}}"])


def test_true_and_false_stay_booleans_where_a_key_is_one():
    spec = load_pipeline(QUICKSTART, ["tracking.plots=false", "stages.1.params.stateful=false"])
    assert spec.tracking.plots is False and spec.stages[1].params["stateful"] is False


def test_a_quoted_group_choice_is_the_choice():
    assert load_pipeline(QUICKSTART, ["model='logreg'"]).model == load_pipeline(QUICKSTART, ["model=logreg"]).model


@pytest.mark.parametrize("name", ["shift/fedalt-adapters.yaml", "shakespeare-next-token.yaml", "quickstart.yaml"])
def test_a_file_composed_once_for_several_seeds_is_the_file_loaded_at_each_seed(tmp_path, name):
    """A comparison composes each file once and sets the seed before resolving: the same specs as one composition
    per seed, `${seed}` interpolations included (here the data's seed and a stage's rounds follow it)."""
    path = ROOT / "pipelines" / name
    overrides = ["stages.0.rounds=3"]
    for seed, spec in load_pipeline_at_seeds(path, overrides, [7, 2]).items():
        assert spec == load_pipeline(path, [*overrides, f"seed={seed}"]), (name, seed)
    follows = write_pipeline(tmp_path, {**SMALL, "dataset": {**SMALL["dataset"], "seed": "${seed}"},
                                        "stages": [{**SMALL["stages"][0], "rounds": "${seed}"}, *SMALL["stages"][1:]]})
    specs = load_pipeline_at_seeds(follows, [], [3, 5])
    assert [(s.seed, s.dataset.seed, s.stages[0].rounds) for s in specs.values()] == [(3, 3, 3), (5, 5, 5)]
    assert specs[5] == load_pipeline(follows, ["seed=5"])
