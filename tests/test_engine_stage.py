"""Stage behaviour: resume from a checkpoint, cohort sampling, personal bank, evaluation of every client."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.accel import ExecutorChoice
from fedpilot.engine.cohort import Cohort
from fedpilot.engine.config import LocalConfig, ServerConfig, StageConfig
from fedpilot.engine.stage import FederatedStage
from fedpilot.testing import accelerator, device_under_test

HEAD = ["head.weight", "head.bias"]


def make_stage(rounds: int = 6, algo: str = "fedalt", server: ServerConfig | None = None,
               personal: list[str] = HEAD, execution: str = "auto") -> FederatedStage:
    torch.manual_seed(0)
    cfg = StageConfig(rounds=rounds, clients_per_round=5, local=LocalConfig(epochs=1, batch_size=4, lr=0.1),
                      server=server or ServerConfig(lr=0.7, momentum=0.9), eval_every=2, execution=execution)
    return stage_for(TinyMLP(), personal, ToyData(), build_algorithm(algo), cfg, seed=1)


def state(stage: FederatedStage) -> dict:
    """The stage's state: its tensors, and the banks' written rows (extra state)."""
    return copy.deepcopy(stage.state_dict())


def test_resume_mid_stage_gives_identical_parameters(tmp_path):
    """Bit-identical, on the device under test (FEDPILOT_TEST_DEVICE) too. One executor for the three runs: with
    `auto` the uninterrupted and the interrupted run each time the candidates and may keep different ones, whose
    numbers agree to float tolerance, not bit for bit (a resumed run keeps its own run's choice: the next test)."""
    full = make_stage(execution="vmap")
    fit(full)
    on = accelerator(device_under_test())
    interrupted = make_stage(execution="vmap")
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=True)
    L.Trainer(max_steps=3, logger=False, callbacks=[ckpt], enable_progress_bar=False,
              enable_model_summary=False, **on).fit(interrupted)
    resumed = make_stage(execution="vmap")
    L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, **on).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    expected, got = state(full), state(resumed)
    assert expected.keys() == got.keys()
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0, msg=key)
    assert not torch.equal(state(interrupted)["model.body.1.weight"], expected["model.body.1.weight"])


def test_a_resumed_auto_stage_keeps_the_executor_it_timed_without_timing_again(tmp_path, monkeypatch, untimed):
    interrupted = make_stage()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, save_last=True)
    L.Trainer(max_steps=2, logger=False, callbacks=[ckpt], enable_progress_bar=False,
              enable_model_summary=False).fit(interrupted)
    timed, was = interrupted.executor_choice, interrupted.executor_choice.record()
    assert interrupted.execution != "auto" and timed.seconds
    resumed = make_stage()
    monkeypatch.setattr(ExecutorChoice, "time", lambda *a: pytest.fail("timed again on resume"))
    L.Trainer(max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    choice = resumed.executor_choice
    assert resumed.execution == interrupted.execution
    assert choice.seconds == timed.seconds
    assert choice.clients_per_call == timed.clients_per_call and "vmap" in timed.clients_per_call
    assert choice.timing_s == timed.timing_s > 0
    assert choice.record() == was


def test_a_stage_whose_local_work_was_timed_before_takes_that_choice_and_says_so(untimed, monkeypatch):
    """ExecutorChoice.time's memo: a stage that differs from one timed earlier in this process only in values that
    enter arithmetic (lrs, the server's) takes its choice without timing and records it as taken; one whose local
    work differs (its batch size) times its own."""
    first = make_stage(rounds=1)
    fit(first)
    assert first.execution != "auto" and first.execution_record()["executor_timing_s"] > 0
    assert "executor_timing_reused" not in first.execution_record()
    measured = ExecutorChoice._measured
    monkeypatch.setattr(ExecutorChoice, "_measured", lambda *a: pytest.fail("timed again"))
    again = make_stage(rounds=1, server=ServerConfig(lr=0.3))
    again.config = again.config.model_copy(update={"local": LocalConfig(epochs=1, batch_size=4, lr=0.02)})
    fit(again)
    record = again.execution_record()
    assert again.execution == first.execution and record["executor_timing_reused"] == 1.0
    assert record["executor_timing_s"] == 0.0 and again.executor_choice.seconds == first.executor_choice.seconds
    assert again.executor_choice.state_dict()["executor_timing_reused"] is True
    monkeypatch.setattr(ExecutorChoice, "_measured", measured)
    other = make_stage(rounds=1)
    other.config = other.config.model_copy(update={"local": LocalConfig(epochs=1, batch_size=2, lr=0.1)})
    fit(other)
    timed_again = other.execution_record()
    assert timed_again["executor_timing_s"] > 0 and "executor_timing_reused" not in timed_again


def test_cohort_is_seeded_uniform_without_replacement():
    stage = make_stage()
    cohorts = [stage.sample_cohort(r) for r in range(200)]
    assert all(len(c) == 5 and len(set(c.tolist())) == 5 for c in cohorts)
    assert torch.equal(cohorts[7], make_stage().sample_cohort(7))
    counts = torch.bincount(torch.cat(cohorts), minlength=12).float()
    assert counts.min() > 0.6 * counts.mean()


def test_unsampled_clients_keep_their_personal_parameters():
    stage = make_stage(rounds=1)
    before = stage.bank.tensor("head.weight").clone()
    fit(stage)
    sampled = stage.sample_cohort(0)
    after = stage.bank.tensor("head.weight")
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[sampled] = False
    assert torch.equal(after[untouched], before[untouched])
    assert not torch.equal(after[sampled], before[sampled])


def test_final_evaluation_covers_every_client_and_splits():
    stage = make_stage(rounds=2)
    fit(stage)
    assert set(stage.client_metrics) == {"val", "test"}
    acc = stage.client_metrics["test"]["acc"]
    assert acc.shape == (12,) and torch.all((acc >= 0) & (acc <= 1))
    final = [h for h in stage.history if h["split"] == "test"][-1]
    assert final["test_acc_min"] <= final["test_acc_p50"] <= final["test_acc_max"]
    assert abs(final["test_acc_mean"] - acc.double().mean().item()) < 1e-9


def test_finetune_visits_every_client_once():
    stage = make_stage(algo="finetune")
    assert stage.n_rounds == 3
    assert torch.equal(torch.cat([stage.sample_cohort(r) for r in range(3)]), torch.arange(12))


def test_fedavg_with_server_lr_one_is_the_weighted_mean_of_client_models():
    stage = make_stage(rounds=1, algo="fedavg", server=ServerConfig(lr=1.0), personal=[])
    before = {n: v.clone() for n, v in stage.shared_params().items()}
    fit(stage)
    clients = stage.sample_cohort(0)
    work = stage.round_work(0, clients)
    cohort = Cohort(work, clients, slice(0, len(clients)), clients, before, {}, {})
    local = cohort.sgd("shared").shared
    w = stage.data.sizes["train"][clients].float()
    for name, value in stage.shared_params().items():
        expected = (local[name] * w.view(-1, *[1] * (value.dim()))).sum(0) / w.sum()
        torch.testing.assert_close(value, expected, atol=1e-6, rtol=1e-5)


def test_the_progress_bar_shows_the_latest_loss_and_val_accuracy(capsys):
    from fedpilot.pipeline.progress import RoundProgress

    stage, bar = make_stage(rounds=4), RoundProgress("fedalt")
    trainer = fit(stage, callbacks=[bar], enable_progress_bar=True)
    shown = bar.get_metrics(trainer, stage)
    last = stage.history[-2]  # the val evaluation of round 4 (the test one follows it)
    assert shown["train_loss"] == f"{stage.round_log['train_loss']:.3g}"
    assert shown["val_acc_mean"] == f"{last['val_acc_mean']:.3g}" and "v_num" not in shown
    assert f"val_acc_mean={shown['val_acc_mean']}" in capsys.readouterr().out  # Lightning's bar writes to stdout
