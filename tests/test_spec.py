"""Pipeline specs: every shipped pipeline validates; bad YAML gets a clear error, exit code 2, and writes nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from fedpilot.algorithms import ALGORITHMS
from fedpilot.errors import SpecError
from fedpilot.spec import PipelineSpec, configs_dir, load_pipeline
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
