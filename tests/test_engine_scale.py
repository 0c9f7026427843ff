"""Cost that follows the cohort: personal rows exist for the clients that trained, on the host (in a file past a
budget), checkpoints write what changed; evaluation of a seeded sample of clients during training."""

from __future__ import annotations

import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import build_algorithm
from fedpilot.engine import LocalConfig, StageConfig
from fedpilot.engine.bank import ClientBank, starting_bank

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


def test_rows_past_the_budget_live_in_a_memory_mapped_file():
    bank = ClientBank({"w": torch.zeros(4)}, n_clients=100, budget_bytes=64)
    for c in range(20):
        bank.put(torch.tensor([c]), {"w": torch.full((1, 4), float(c))})
    assert bank.folder is not None and any(bank.folder.iterdir())  # 20 rows x 16 bytes > 64 bytes: a file
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
