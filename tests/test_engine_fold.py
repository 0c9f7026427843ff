"""A reducible aggregate (sums: FedAvg's weighted mean and its kin) takes each chunk's uploads as the chunk finishes,
and under `execution: auto` a chunk holds only the clients the chosen executor works on at once (more while their
values are immaterial next to the memory in use): the rounds' memory follows the executor, not the cohort. The
results are the sequential reference's for every algorithm; an aggregate that needs every upload keeps whole chunks."""

from __future__ import annotations

import weakref

import pytest
import torch

from engine_fixtures import TinyMLP, ToyData, fit, stage_for
from fedpilot.algorithms import ALGORITHMS, build_algorithm
from fedpilot.algorithms.fedavg import FedAvg
from fedpilot.engine.accel import choice
from fedpilot.engine.config import LocalConfig, StageConfig
from fedpilot.engine.protocol import ReducibleAggregator, Upload
from fedpilot.models.options import MODELS
from fedpilot.testing import HEAD, INPUT, assert_close

LOCAL = LocalConfig(epochs=1, batch_size=4, lr=0.1, clip_norm=1.0, weight_decay=0.01)
GATE = ["gate.budget", "gate.norm.weight", "gate.norm.bias", "gate.gates.weight", "gate.gates.bias",
        "gate.importance.weight", "gate.importance.bias"]
# every registered algorithm: (its personal parameters, None for all; its params; its local work)
CASES = {
    "ditto": (None, {"lam": 0.5}, LOCAL),
    "fedalt": (HEAD, {}, LOCAL),
    "fedavg": ([], {}, LOCAL),
    "fedper": (HEAD, {}, LOCAL),
    "fedprox": ([], {"mu": 0.5}, LOCAL),
    "fedrep": (HEAD, {}, LOCAL),
    "fedsim": (INPUT, {"stateful": False}, LOCAL),
    "ffgg": (INPUT, {}, LOCAL),
    "ffgg_async": (HEAD, {"max_delay": 2}, LOCAL),
    "ffgg_local": (HEAD, {"tau": 1}, LOCAL.model_copy(update={"epochs": 0.5})),
    "ffgg_robust": (HEAD, {"byzantine_fraction": 0.25, "attack": "gaussian"}, LOCAL),
    "finetune": (HEAD, {}, LOCAL),
    "heterofl": (["width.rate"], {"rates": {"values": [1.0, 0.5], "shares": [0.5, 0.5]}},
                 LocalConfig(epochs=1, batch_size=4, lr=0.1)),
    "lg_fedavg": (INPUT, {"lr_v": 0.2}, LOCAL),
    "local": (None, {}, LOCAL),
    "perfedavg": ([], {"tau": 2, "alpha": 0.05}, LocalConfig(epochs=1, batch_size=4, lr=0.1)),
    "pfedgate": (GATE, {"s": 0.5}, LocalConfig(steps=2, batch_size=3, lr=0.1)),
    "pfedme": (None, {"lam": 2.0, "local_rounds": 2, "inner_steps": 2}, LocalConfig(batch_size=4, lr=0.05)),
    "pflego": (HEAD, {"tau": 3}, LOCAL),
    "selffl": (None, {"l_max": 6}, LocalConfig(batch_size=4, lr=0.1)),
    "selffl_aug": (None, {"l_max": 6, "optimum_steps": 2}, LocalConfig(batch_size=4, lr=0.1)),
}


@pytest.fixture
def lean(monkeypatch):
    """No client's values are immaterial: a folded chunk holds what the executor works on at once, and no more; the
    loop the only candidate (a client per thread: fewer than a chunk of 7 at once, whatever the timing)."""
    monkeypatch.setattr(choice, "MATERIAL_MEMORY", 0.0)
    monkeypatch.setattr(choice, "executor_candidates", lambda model, device: ["loop"])


def algorithm_stage(name: str, execution: str, chunk: int = 7):
    """4 rounds of 7 of ToyData's 12 clients of `name` (CASES) on the zoo's MLP, prepared as a pipeline prepares it."""
    personal, params, local = CASES[name]
    torch.manual_seed(0)
    model = MODELS["mlp"]((16,), 4, hidden=[24])
    algorithm = build_algorithm(name, params)
    algorithm.prepare_model(model, (16,))
    names = [n for n, _ in model.named_parameters()] if personal is None else personal
    config = StageConfig(rounds=4, clients_per_round=7, local=local, max_parallel_clients=chunk, eval_every=4)
    stage = stage_for(model, names, ToyData(), algorithm, config, seed=3)
    stage.executor_choice.pin(execution)
    return stage, names


def ended(stage, names: list[str]) -> dict[str, torch.Tensor]:
    """The stage's shared parameters, personal bank and client state."""
    return {**{f"shared.{n}": p.detach().cpu() for n, p in stage.model.named_parameters() if n not in names},
            **{f"bank.{n}": stage.bank.tensor(n).cpu() for n in stage.bank.names},
            **{f"state.{n}": stage.state_bank.tensor(n).double().cpu() for n in stage.state_bank.names}}


def test_the_cases_are_every_registered_algorithm():
    assert set(CASES) == set(ALGORITHMS)


@pytest.mark.parametrize("name", sorted(CASES))
def test_auto_rounds_in_folded_chunks_match_sequential(name, lean):
    reference, names = algorithm_stage(name, "sequential", chunk=1)
    fit(reference)
    stage, _ = algorithm_stage(name, "auto")
    fit(stage)
    reducible = isinstance(stage.algorithm.aggregator(), ReducibleAggregator)
    plan = stage.executor_choice.plan(torch.device("cpu"))
    executor, folded = plan.executor, plan.chunk
    assert folded == (executor.clients_at_once(7, torch.device("cpu")) if reducible else None)
    assert_close(ended(stage, names), ended(reference, names))


class Watched(FedAvg):
    """FedAvg that sees the chunks it trains, and checks that no earlier chunk's upload is still held."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []
        self.uploads: list[weakref.ref] = []

    def local_update(self, cohort) -> Upload:
        held = [ref for ref in self.uploads if ref() is not None]
        assert not held, f"{len(held)} earlier uploads are still held while a chunk trains"
        self.sizes.append(len(cohort))
        upload = super().local_update(cohort)
        self.uploads += [weakref.ref(v) for v in upload.shared.values()]
        return upload


def test_a_chunks_upload_is_let_go_before_the_next_chunk_trains():
    config = StageConfig(rounds=2, clients_per_round=7, local=LOCAL, max_parallel_clients=3, eval_every=2)
    algorithm = Watched()
    stage = stage_for(TinyMLP(), [], ToyData(), algorithm, config, seed=3)
    stage.executor_choice.pin("vmap")
    fit(stage)
    assert algorithm.sizes == [3, 3, 1, 3, 3, 1]


def test_the_executor_timing_and_the_rounds_run_in_the_chosen_chunks(lean):
    """Under `auto` the candidates' turns take the chunks their rounds would (their memory is what the timing
    weighs), and the rounds take the chosen candidate's; a resumed stage keeps them with its executor."""
    config = StageConfig(rounds=2, clients_per_round=7, local=LOCAL, eval_every=2)
    algorithm = Watched()
    stage = stage_for(TinyMLP(), [], ToyData(), algorithm, config, seed=3)
    fit(stage)
    per_chunk = stage.executor_choice.clients_per_chunk
    assert per_chunk == min(torch.get_num_threads(), 7) < 7
    chunks = [per_chunk] * (7 // per_chunk) + ([7 % per_chunk] if 7 % per_chunk else [])
    timing, rounds = algorithm.sizes[: -2 * len(chunks)], algorithm.sizes[-2 * len(chunks):]
    assert rounds == 2 * chunks and timing and set(timing) <= set(chunks)
    saved = stage.executor_choice.state_dict()
    again = stage_for(TinyMLP(), [], ToyData(), FedAvg(), config, seed=3)
    again.executor_choice.load_state_dict(saved)
    assert again.executor_choice.clients_per_chunk == per_chunk and not again.executor_choice.pending


def test_immaterial_values_take_the_whole_chunk():
    """A small model's clients are immaterial next to the process's memory: its rounds keep one chunk a round."""
    config = StageConfig(rounds=1, clients_per_round=7, local=LOCAL, eval_every=1)
    stage = stage_for(TinyMLP(), [], ToyData(), FedAvg(), config, seed=3)
    fit(stage)
    assert stage.executor_choice.clients_per_chunk == 7
