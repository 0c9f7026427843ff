"""Cost that follows the cohort: personal rows exist for the clients that trained, on the host (in a file past a
budget), checkpoints write what changed; evaluation of a seeded sample of clients during training."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine.accel import EXECUTORS, Evaluator
from fedpilot.engine.bank import ClientBank, starting_bank
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.testing import INPUT

HEAD = ["head.weight", "head.bias"]


def test_a_bank_holds_rows_only_for_written_clients():
    init = {"w": torch.arange(6.0).view(2, 3)}
    bank = ClientBank(init, n_clients=1_000_000)
    assert bank.written == 0 and bank.nbytes() == 24
    bank.put(torch.tensor([7, 999_999]), {"w": torch.ones(2, 2, 3)})
    got = bank.get(torch.tensor([999_999, 3, 7]))["w"]
    assert torch.equal(got[0], torch.ones(2, 3)) and torch.equal(got[1], init["w"]) and torch.equal(got[2], got[0])
    assert bank.written == 2 and bank.nbytes() == 24 + 2 * 24  # memory follows the clients written, not a million
    bank.put(torch.tensor([7]), {"w": torch.full((1, 2, 3), 5.0)})
    assert bank.written == 2 and float(bank.get(torch.tensor([7]))["w"].mean()) == 5.0


def test_rows_past_the_budget_live_in_a_memory_mapped_file_that_leaves_nothing_on_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    bank = ClientBank({"w": torch.zeros(4)}, n_clients=100, budget_bytes=64)
    for c in range(20):
        bank.put(torch.tensor([c]), {"w": torch.full((1, 4), float(c))})
    maps = Path("/proc/self/maps").read_text().splitlines()
    mapped = [line for line in maps if str(tmp_path) in line]  # 20 rows x 16 bytes > 64 bytes: a mapped file
    assert mapped and all(line.endswith("(deleted)") for line in mapped)
    assert not any(tmp_path.iterdir())  # every capacity's file unlinked once mapped, even the one in use
    assert torch.equal(bank.get(torch.tensor([13]))["w"], torch.full((1, 4), 13.0))


def test_changes_since_the_last_save_replay_to_the_same_bank():
    bank = ClientBank({"w": torch.zeros(2)}, n_clients=50)
    bank.put(torch.tensor([1, 2]), {"w": torch.ones(2, 2)})
    first = bank.take_changes()
    bank.put(torch.tensor([2, 9]), {"w": 2 * torch.ones(2, 2)})
    second = bank.take_changes()
    assert first["clients"].tolist() == [1, 2] and second["clients"].tolist() == [2, 9]  # only what changed
    replayed = ClientBank({"w": torch.zeros(2)}, n_clients=50)
    for change in (first, second):
        replayed.apply(change)
    assert torch.equal(replayed.tensor("w"), bank.tensor("w"))


def test_a_carried_bank_keeps_rows_and_starts_new_names_from_their_value():
    previous = ClientBank({"a": torch.zeros(1)}, n_clients=10)
    previous.put(torch.tensor([4]), {"a": torch.ones(1, 1)})
    bank = starting_bank({"a": previous.init["a"], "b": torch.full((1,), 3.0)}, 10, previous)
    assert bank.tensor("a")[:, 0].tolist() == [0, 0, 0, 0, 1, 0, 0, 0, 0, 0]
    assert bank.tensor("b")[:, 0].tolist() == [3.0] * 10 and bank.written == 1


def test_checkpoints_write_the_changed_rows_and_resume_identically(tmp_path):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make():
        torch.manual_seed(0)
        config = StageConfig(rounds=6, clients_per_round=3, local=LocalConfig(steps=1, batch_size=4), eval_every=2)
        return stage_for(TinyMLP(), HEAD, ToyData(), build_algorithm("fedalt"), config, seed=2)

    full = make()
    fit(full)
    first = make()
    first.save_changes_in(tmp_path / "banks")
    saving = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, save_last=True)
    L.Trainer(max_steps=4, logger=False, callbacks=[saving], enable_progress_bar=False,
              enable_model_summary=False).fit(first)
    changes = sorted((tmp_path / "banks").glob("bank-*.pt"))
    written = [len(torch.load(f, weights_only=True)["clients"]) for f in changes]
    assert len(changes) >= 2 and all(0 < n <= 2 * 3 for n in written)  # each holds at most two rounds' clients
    resumed = make()
    resumed.save_changes_in(tmp_path / "banks")
    L.Trainer(max_steps=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False).fit(resumed, ckpt_path=str(tmp_path / "last.ckpt"))
    for name in HEAD:
        torch.testing.assert_close(resumed.bank.tensor(name), full.bank.tensor(name))


def test_training_evaluates_a_seeded_sample_and_the_end_every_client():
    config = StageConfig(rounds=4, clients_per_round=3, local=LocalConfig(steps=1, batch_size=4), eval_every=1,
                         eval_clients=5)
    torch.manual_seed(0)
    stage = stage_for(TinyMLP(), HEAD, ToyData(), build_algorithm("fedalt"), config, seed=2)
    samples = [stage.sampling.evaluated() for _ in range(2)]
    assert torch.equal(samples[0], samples[1]) and len(samples[0]) == 5  # the same clients at every evaluation
    fit(stage)
    during = [e for e in stage.history if e["round"] < 4]
    assert len(during) == 3 and all(e["split"] == "val" for e in during)
    assert stage.client_metrics["val"]["acc"].shape == (stage.data.n_clients,)  # the end: every client
    stage.executor_choice.pin("vmap")
    scores, everyone = (stage.evaluator().scores("val", stage.shared_params(), stage.personal_of, clients)
                        for clients in (samples[0], None))
    assert scores["acc"].shape == (5,)  # only the sample's clients, each with its own model
    torch.testing.assert_close(scores["acc"], everyone["acc"][samples[0]])


def test_flat_evaluation_without_personal_parameters_equals_the_per_client_one():
    config = StageConfig(rounds=2, clients_per_round=3, local=LocalConfig(steps=1, batch_size=4))
    torch.manual_seed(0)
    stage = stage_for(TinyMLP(), [], ToyData(), build_algorithm("fedavg"), config, seed=2)
    fit(stage)
    shared, data = stage.shared_params(), stage.data
    stage.executor_choice.pin("loop")
    flat = Evaluator(stage.executor_choice, stage.split, data, max_samples=7).scores(  # batches cut through clients
        "test", shared, stage.personal_of)
    for c in range(data.n_clients):
        lo, n = int(data.offsets["test"][c]), int(data.sizes["test"][c])
        with torch.no_grad():
            out = stage.model(data.inputs(data.x[lo : lo + n]))
        torch.testing.assert_close(flat["acc"][c], (out.argmax(-1) == data.y[lo : lo + n]).float().mean())


def kept_by_the_rule(stage) -> bool:
    """The stage kept its fastest candidate, or a leaner one within SAME_SPEED of it (`timing.kept`)."""
    from fedpilot.engine.accel.timing import MATERIAL_MEMORY, SAME_SPEED

    peaks = stage.executor_choice.peak_bytes  # of the candidates timed (not those their sized calls left out)
    seconds = {n: s for n, s in stage.executor_choice.seconds.items() if n in peaks}
    best = min(seconds, key=seconds.get)
    return stage.execution == best or (seconds[stage.execution] <= SAME_SPEED * seconds[best]
                                       and peaks[stage.execution] < (1 - MATERIAL_MEMORY) * peaks[best])


def test_auto_times_the_candidates_on_the_first_round_and_keeps_the_fastest(tmp_path):
    from fedpilot.engine.accel import executor_candidates

    def make(execution: str):
        torch.manual_seed(0)
        config = StageConfig(rounds=3, clients_per_round=4, local=LocalConfig(steps=2, batch_size=4),
                             execution=execution)
        return stage_for(TinyMLP(), HEAD, ToyData(), build_algorithm("fedalt"), config, seed=2)

    auto = make("auto")
    fit(auto)
    assert set(auto.executor_choice.seconds) == set(executor_candidates(auto.model)) == {"vmap", "vmap_autograd",
                                                                                          "loop", "bmm"}
    assert kept_by_the_rule(auto)
    pinned = make(auto.execution)
    fit(pinned)
    assert not pinned.executor_choice.seconds  # a pinned executor is not timed
    # timing wrote nothing and drew no random numbers (head-only steps of a timed stage keep the rule of thumb, so
    # the two may differ in rounding, not more)
    for name, value in auto.shared_params().items():
        torch.testing.assert_close(value, pinned.shared_params()[name])
    for name in HEAD:
        torch.testing.assert_close(auto.bank.tensor(name), pinned.bank.tensor(name))


def test_executor_trials_take_a_few_steps_of_the_first_chunk(monkeypatch):
    from fedpilot.engine.accel import executor_candidates
    from fedpilot.engine.accel.timing import TRIAL_STEPS

    algorithm = build_algorithm("fedavg")
    trained = algorithm.local_update
    steps: list[tuple[int, float]] = []  # (clients, the most steps a client took) of every local update

    def local_update(cohort):
        upload = trained(cohort)
        steps.append((len(cohort), float(cohort.stats.steps.max())))
        return upload

    monkeypatch.setattr(algorithm, "local_update", local_update)
    torch.manual_seed(0)
    config = StageConfig(rounds=2, clients_per_round=8, max_parallel_clients=5,
                         local=LocalConfig(epochs=2, batch_size=2))
    stage = stage_for(TinyMLP(), [], ToyData(), algorithm, config, seed=3)
    fit(stage)
    rounds, trials = steps[-4:], steps[:-4]  # 2 rounds of 2 chunks (5 and 3 clients)
    assert [k for k, _ in rounds] == [5, 3, 5, 3] and max(most for _, most in rounds) > TRIAL_STEPS  # not capped
    first_turn = next(i for i, (_, most) in enumerate(trials) if most > 1)
    one_step, turns = trials[:first_turn], trials[first_turn:]
    warm_ups = len(stage.executor_choice.peak_bytes)  # every candidate but those their sized calls showed slower
    assert set(stage.executor_choice.seconds) == set(executor_candidates(stage.model))
    assert one_step[-warm_ups:] == [(5, 1.0)] * warm_ups  # each candidate warms up on one step of the chunk
    assert turns and all(trial == (5, TRIAL_STEPS) for trial in turns)
    # before them, the executors that batch clients measured calls of 1 client (a tiny model: then all 5 a call)
    sizing = one_step[:-warm_ups]
    assert all(k in (1, 2, 4, 5) and most == 1 for k, most in sizing)
    assert sizing.count((1, 1.0)) >= len(stage.executor_choice.clients_per_call) == 3  # vmap, vmap_autograd, bmm
    assert kept_by_the_rule(stage)


def test_a_candidate_out_of_memory_on_the_first_round_leaves_the_stage_to_the_others(monkeypatch):
    from fedpilot.engine.accel.vmap import VmapExecutor

    def out_of_memory(*args, **kwargs):  # what a GPU does when every client's gradients at once do not fit
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(VmapExecutor, "train", out_of_memory)  # vmap and vmap_autograd
    torch.manual_seed(0)
    config = StageConfig(rounds=3, clients_per_round=4, local=LocalConfig(steps=2, batch_size=4))
    stage = stage_for(TinyMLP(), [], ToyData(), build_algorithm("fedavg"), config, seed=2)
    start = {n: p.clone() for n, p in stage.shared_params().items()}
    with pytest.warns(UserWarning, match="executor candidate 'vmap' ran out of memory"):
        fit(stage)
    assert stage.execution == "loop" and set(stage.executor_choice.seconds) == {"loop"}
    assert stage.rounds_run == 3 and all(not torch.equal(p, start[n]) for n, p in stage.shared_params().items())


def test_data_past_the_device_budget_stays_on_the_host_and_rounds_gather_their_cohort():
    def make(budget: int | None):
        torch.manual_seed(0)
        config = StageConfig(rounds=3, clients_per_round=3, local=LocalConfig(epochs=1, batch_size=4), eval_every=1,
                             device_data_budget=budget, execution="vmap")
        return stage_for(TinyMLP(), HEAD, ToyData(), build_algorithm("fedalt"), config, seed=2)

    whole, gathered = make(None), make(0)
    fit(whole)
    fit(gathered)
    assert whole.data_on_device and not gathered.data_on_device
    for name, value in whole.shared_params().items():
        assert torch.equal(value, gathered.shared_params()[name])
    for name in HEAD:
        assert torch.equal(whole.bank.tensor(name), gathered.bank.tensor(name))
    assert whole.history == gathered.history
    cohort = torch.tensor([1, 4])
    part = gathered.data.gather(cohort, torch.device("cpu"))
    assert len(part.x) == int(gathered.data.sizes["train"][cohort].sum())  # only the cohort's training samples
    for c in cohort.tolist():
        lo, n = int(gathered.data.offsets["train"][c]), int(gathered.data.sizes["train"][c])
        mine = int(part.offsets["train"][c])
        assert torch.equal(part.x[mine : mine + n], gathered.data.x[lo : lo + n])


def test_each_executor_evaluates_the_personal_models_alike_and_both_vmaps_vectorize(monkeypatch):
    import fedpilot.engine.accel.evaluate as evaluate

    config = StageConfig(rounds=2, clients_per_round=4, local=LocalConfig(steps=2, batch_size=4))
    torch.manual_seed(0)
    stage = stage_for(TinyMLP(), INPUT, ToyData(), build_algorithm("fedalt"), config, seed=2)
    fit(stage)

    def scores(execution: str) -> dict[str, torch.Tensor]:
        stage.executor_choice.pin(execution)
        return stage.evaluator().scores("val", stage.shared_params(), stage.personal_of)

    looped = scores("loop")
    monkeypatch.setattr(evaluate, "for_each_client", None)  # a vmapped evaluation never loops over clients
    for execution in (name for name, executor in EXECUTORS.items() if executor.batched):
        for metric, values in scores(execution).items():
            torch.testing.assert_close(values, looped[metric])
