"""The engine's speed settings change no result they promise to keep: client threads are bit-for-bit the same as
one thread, bf16-mixed is an opt-in that learns as well as float32 and leaves parameters in float32."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import TinyCNN, TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.errors import SpecError
from fedpilot.spec import load_pipeline
from pipeline_fixtures import SMALL, write_pipeline


def trained_stage(threads: int, precision: str = "32-true", model_cls=TinyCNN, personal=("body.0.weight",),
                  rounds: int = 3, algorithm: str = "fedalt") -> FederatedStage:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        model = model_cls()
        config = StageConfig(rounds=rounds, clients_per_round=6, execution="loop", precision=precision,
                             eval_every=rounds, local=LocalConfig(epochs=1, batch_size=4, lr=0.1))
        data = ToyData(image=model_cls is TinyCNN)
        stage = stage_for(model, list(personal), data, build_algorithm(algorithm), config, seed=1)
        fit(stage)
        return stage
    finally:
        torch.set_num_threads(before)


def test_client_threads_give_bitwise_the_results_of_one_thread():
    one, two = trained_stage(1), trained_stage(2)
    for (name, a), b in zip(one.model.named_parameters(), two.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(one.bank.tensor("body.0.weight"), two.bank.tensor("body.0.weight"))
    for split in ("val", "test"):  # per-client evaluation of personal conv models runs on the threads too
        assert torch.equal(one.client_metrics[split]["acc"], two.client_metrics[split]["acc"])
        assert torch.equal(one.client_metrics[split]["loss"], two.client_metrics[split]["loss"])


def test_precision_defaults_to_float32_and_rejects_unknown_names(tmp_path):
    assert StageConfig().precision == "32-true"
    stage = {**SMALL["stages"][0], "precision": "bf16-mixed"}
    spec = load_pipeline(write_pipeline(tmp_path, {**SMALL, "stages": [stage]}), [])
    assert spec.stages[0].engine_config(spec.evaluation).precision == "bf16-mixed"
    with pytest.raises(SpecError, match=r"stages\.0\.precision='bf16'"):
        load_pipeline(write_pipeline(tmp_path, {**SMALL, "stages": [{**stage, "precision": "bf16"}]}), [])


def test_bf16_mixed_learns_like_float32_with_float32_parameters():
    runs = {p: trained_stage(2, p, TinyMLP, personal=(), rounds=12, algorithm="fedavg")
            for p in ("32-true", "bf16-mixed")}
    fp32, bf16 = (runs[p] for p in ("32-true", "bf16-mixed"))
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())
    assert not torch.equal(fp32.model.head.weight, bf16.model.head.weight)  # the forward passes did run in bf16
    accuracy = {p: float(s.client_metrics["val"]["acc"].nanmean()) for p, s in runs.items()}
    assert accuracy["32-true"] > 0.5  # the run learns (4 classes)
    assert abs(accuracy["bf16-mixed"] - accuracy["32-true"]) < 0.05, accuracy
