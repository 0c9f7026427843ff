"""A batch of trials (engine/trials.py) is each trial alone: the same cohorts and minibatches, each row with its trial's
values, each trial its own server, banks and records; a stop in the middle resumes every trial bit-identically; trials
leave a running batch with their records."""

from __future__ import annotations

import pytest
import torch

from engine_fixtures import TinyCNN, ToyData, fit
from fedpilot.api import Algorithm, AlgorithmParams, Cohort, Upload
from fedpilot.engine.config import LocalConfig
from fedpilot.engine.hooks import RoundCallback
from fedpilot.engine.trials import TrialBatch, check_batch
from fedpilot.testing import (
    HEAD,
    INPUT,
    TinyMLP,
    assert_close,
    assert_trials_match_alone,
    built_stage,
    run_trials,
    stage_result,
)

FEDAVG_TRIALS = [{"local.lr": 0.05}, {"local.lr": 0.2, "server.lr": 0.5}, {"local.lr": 0.1, "server.momentum": 0.5}]


@pytest.mark.parametrize(("execution", "chunk"), [("sequential", 5), ("vmap", 5), ("bmm", 4), ("loop", 3),
                                                  ("vmap_autograd", 21)])
def test_a_batch_of_fedavg_trials_is_each_trial_alone(execution, chunk):
    """Three FedAvg trials (client lr, server lr, server momentum), chunks spanning trials (21 rows: all at once)."""
    assert_trials_match_alone("fedavg", FEDAVG_TRIALS, personal=[], executions=((execution, chunk),))


def test_a_batch_of_convolutional_trials_is_each_trial_alone():
    """The loops on a CNN, the batched first step where a chunk is one trial's (its rows share the broadcast)."""
    assert_trials_match_alone("fedavg", FEDAVG_TRIALS[:2], personal=[], model=TinyCNN, data=ToyData(image=True),
                              local=LocalConfig(epochs=1, batch_size=4, lr=0.1),
                              executions=(("loop_batched_first", 7), ("loop_batched_first", 5), ("loop", 4)))


@pytest.mark.parametrize("span", [1, 2])
def test_a_batchs_chunks_hold_the_rows_of_at_most_its_span_of_trials(span, monkeypatch):
    """`span` (a search's `batch`) bounds the trials one chunk's rows come from, not what they compute: with 1 each
    trial's rows are computed on their own, bit for bit the trial alone."""
    from fedpilot.engine import rounds

    spans, train = [], rounds.train_chunk
    monkeypatch.setattr(rounds, "train_chunk", lambda cohort, pieces, algorithm: spans.append(len(pieces)) or
                        train(cohort, pieces, algorithm))
    data = ToyData()
    batch, results = run_trials("fedavg", [], FEDAVG_TRIALS, execution="vmap", chunk=21, data=data, span=span)
    assert spans and max(spans) == span  # 3 trials of 7 rows, chunks of 21 rows: all three at once without a span
    for values, (shared, _) in zip(FEDAVG_TRIALS, results, strict=True):
        alone = built_stage("fedavg", [], None, values, 21, None, TinyMLP, data)
        alone.executor_choice.pin("vmap")
        fit(alone)
        expected = stage_result(alone)[0]
        same = all(torch.equal(shared[n], expected[n]) for n in expected)
        assert same if span == 1 else all(torch.allclose(shared[n], expected[n], atol=1e-6) for n in expected)


def test_each_trial_keeps_the_records_it_would_keep_alone():
    """Per-trial validation at every evaluation, the end's per-client metrics, bytes sent, server state."""
    data = ToyData()
    batch, _ = run_trials("fedavg", [], FEDAVG_TRIALS, execution="vmap", chunk=6, data=data)
    for values, stage in zip(FEDAVG_TRIALS, batch.trials, strict=True):
        alone = built_stage("fedavg", [], None, values, 6, None, TinyMLP, data)
        alone.executor_choice.pin("vmap")
        fit(alone)
        assert [(e["round"], e["split"]) for e in stage.history] == [(e["round"], e["split"]) for e in alone.history]
        for mine, theirs in zip(stage.history, alone.history, strict=True):
            assert mine.keys() == theirs.keys()
            assert all(abs(mine[k] - theirs[k]) < 1e-5 for k in mine if k not in ("split",))
        assert stage.comm_bytes == alone.comm_bytes
        for split in ("val", "test"):
            torch.testing.assert_close(stage.client_metrics[split]["acc"], alone.client_metrics[split]["acc"])
    assert len({round(stage.history[-1]["test_loss_weighted"], 6) for stage in batch.trials}) == 3  # they differ


def test_the_batch_under_auto_times_its_own_rows_and_each_trial_is_alone_on_its_choice():
    """`execution: auto` times the candidates on the batch's first chunk (rows of several trials) and keeps one
    executor for the batch; each trial equals itself alone on that executor."""
    data = ToyData()
    stages = [built_stage("fedavg", [], None, v, 256, None, TinyMLP, data) for v in FEDAVG_TRIALS]
    batch = TrialBatch(stages)
    fit(batch)
    chosen = batch.execution
    assert chosen != "auto" and batch.lead.executor_choice.seconds
    for values, stage in zip(FEDAVG_TRIALS, batch.trials, strict=True):
        alone = built_stage("fedavg", [], None, values, batch.lead.executor_choice.clients_per_chunk or 256, None,
                            TinyMLP, data)
        alone.executor_choice.pin(chosen)
        fit(alone)
        assert_close(stage_result(stage)[0], stage_result(alone)[0])


@pytest.mark.parametrize(("algorithm", "personal", "values"), [
    ("fedavg", [], [{"local.lr": 0.05, "server.momentum": 0.5}, {"local.lr": 0.2, "server.momentum": 0.9}]),
    ("fedalt", HEAD, [{"params.lr_v": 0.05, "params.lr_u": 0.1}, {"params.lr_v": 0.3, "params.lr_u": 0.05}]),
])
def test_a_stop_in_the_middle_of_a_batch_resumes_every_trial_bit_identically(tmp_path, algorithm, personal, values):
    """A batch stopped after two of its four rounds (a checkpoint of each trial's model, banks as chains of changes,
    server optimizer, records) and resumed ends where the batch that was not stopped ends, bit for bit."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = ToyData()

    def batch(folder: str) -> TrialBatch:
        made = TrialBatch([built_stage(algorithm, personal, None, v, 5, None, TinyMLP, data) for v in values])
        made.lead.executor_choice.pin("vmap")
        made.save_changes_in(tmp_path / folder)
        return made

    straight = batch("straight")
    fit(straight)
    first = batch("banks")
    fit(first, max_steps=2, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)])
    resumed = batch("banks")
    fit(resumed, enable_checkpointing=True, ckpt_path=str(tmp_path / "last.ckpt"),
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "more", save_top_k=0)])
    for mine, theirs in zip(resumed.trials, straight.trials, strict=True):
        got, expected = stage_result(mine), stage_result(theirs)
        for part in (0, 1):
            assert got[part].keys() == expected[part].keys()
            assert all(torch.equal(got[part][n], expected[part][n]) for n in expected[part]), part
        assert mine.history == theirs.history and mine.rounds_run == 2


class DropAfter(RoundCallback):
    """Drops `trial` from the batch once `rounds` rounds are done, keeping the validation the batch reported."""

    def __init__(self, trial: int, rounds: int):
        self.trial, self.rounds, self.seen = trial, rounds, []

    def on_round_end(self, trainer, stage, result) -> None:
        self.seen.append({k: dict(r.metrics) for k, r in result.trials.items()})
        if result.round == self.rounds:
            stage.drop([self.trial])


def test_a_dropped_trial_leaves_the_computation_and_keeps_its_records():
    data = ToyData()
    values = FEDAVG_TRIALS
    stages = [built_stage("fedavg", [], None, v, 4, None, TinyMLP, data) for v in values]
    batch = TrialBatch(stages)
    batch.lead.executor_choice.pin("bmm")
    dropping = DropAfter(1, 2)
    fit(batch, callbacks=[dropping])
    assert batch.active == [0, 2] and batch.stopped == {1: {"round": 2, "why": "dropped", "error": ""}}
    assert [sorted(seen) for seen in dropping.seen] == [[0, 1, 2], [0, 1, 2], [0, 2], [0, 2]]
    assert all("val_acc_mean" in dropping.seen[1][k] for k in (0, 1, 2))  # each trial's validation at round 2
    dropped = batch.trials[1]
    assert dropped.rounds_run == 2 and [e["round"] for e in dropped.history] == [2]
    for k in (0, 2):  # the others as alone
        alone = built_stage("fedavg", [], None, values[k], 4, None, TinyMLP, data)
        alone.executor_choice.pin("bmm")
        fit(alone)
        assert_close(stage_result(batch.trials[k])[0], stage_result(alone)[0])


def test_a_diverging_trial_stops_alone_and_the_others_go_on():
    data = ToyData()
    values = [{"local.lr": 0.1}, {"local.lr": 1e30}]
    batch, results = run_trials("fedavg", [], values, execution="vmap", chunk=4, data=data)
    assert batch.active == [0] and batch.stopped[1]["why"] == "diverged"
    assert "diverged at round" in batch.stopped[1]["error"]
    alone = built_stage("fedavg", [], None, values[0], 4, None, TinyMLP, data)
    alone.executor_choice.pin("vmap")
    fit(alone)
    assert_close(results[0][0], stage_result(alone)[0])


def test_trials_differing_in_what_changes_the_work_do_not_batch():
    """check_batch names what stands in the way; a TrialBatch trains such trials as groups of their own."""
    data = ToyData()
    local = [built_stage("fedavg", [], None, v, 4, None, TinyMLP, data) for v in ({}, {"local.batch_size": 5})]
    with pytest.raises(ValueError, match=r"differ in local.batch_size, which fedavg does not batch"):
        check_batch(local)
    steps = [built_stage("fedavg", [], None, v, 4, None, TinyMLP, data) for v in ({}, {"local.epochs": 2.0})]
    with pytest.raises(ValueError, match=r"differ in local.epochs, which fedavg does not batch"):
        check_batch(steps)
    tau = [built_stage("fedalt", HEAD, None, v, 4, None, TinyMLP, data) for v in ({"params.tau_v": 1},
                                                                                    {"params.tau_v": 2})]
    with pytest.raises(ValueError, match=r"differ in params.tau_v, which fedalt does not batch"):
        check_batch(tau)
    unset = [built_stage("fedalt", HEAD, None, v, 4, None, TinyMLP, data) for v in ({}, {"params.lr_v": 0.2})]
    with pytest.raises(ValueError, match=r"differ in params.lr_v between numbers and values that are not"):
        check_batch(unset)
    mixed = [*local, built_stage("fedavg", [], None, {"local.lr": 0.2}, 4, None, TinyMLP, data)]
    assert TrialBatch(mixed).groups == [[0, 2], [1]]  # the third batches with the first
    other = [built_stage("fedavg", [], None, {}, 4, None, TinyMLP, d) for d in (data, ToyData())]
    with pytest.raises(ValueError, match="differ in their federation"):
        TrialBatch(other)  # not even side by side: the batch keeps one copy of the data
    longer = [built_stage("fedavg", [], None, {}, 4, None, TinyMLP, data) for _ in range(2)]
    longer[1].config = longer[1].config.model_copy(update={"rounds": 5})
    with pytest.raises(ValueError, match="differ in their rounds"):
        TrialBatch(longer)


class Scaled(Algorithm):
    """A plugin that does not say it batches trials (batches_trials is False by default)."""

    name = "scaled-test"

    class Params(AlgorithmParams):
        scale: float = 1.0

    tunable = {}

    def local_update(self, cohort: Cohort) -> Upload:
        trained = cohort.sgd("shared", lr=0.1 * self.params.scale)
        return Upload(shared=trained.shared)


class ScaledBatching(Scaled):
    """The same plugin, declaring it batches trials but reading its value as one number: refused at the read."""

    name = "scaled-batching-test"
    batches_trials = True
    tunable = {"params.scale": __import__("fedpilot.api", fromlist=["step_size"]).step_size()}


def test_an_algorithm_that_does_not_batch_refuses_a_batch_and_one_that_reads_a_value_as_one_number_fails_loudly():
    data = ToyData()
    plain = [built_stage(Scaled(), [], None, v, 4, None, TinyMLP, data) for v in ({}, {"params.scale": 2.0})]
    with pytest.raises(ValueError, match="scaled-test does not batch trials"):
        check_batch(plain)
    batching = [built_stage(ScaledBatching(), [], None, v, 4, None, TinyMLP, data)
                for v in ({}, {"params.scale": 2.0})]
    batch = TrialBatch(batching)
    batch.lead.executor_choice.pin("vmap")
    with pytest.raises(TypeError, match=r"params.scale differs between the trials of this batch.*cohort.params.scale"):
        fit(batch)


def test_trials_that_cannot_batch_train_in_lockstep_each_bit_for_bit_alone():
    """A plugin that does not batch trials, two values of its param and one of the local lr: three groups of one, a
    round of each every step (the search's rungs judge them together), each trial its own computation, server
    optimizer and executor choice: bit for bit the trial alone."""
    data = ToyData()
    values = [{}, {"params.scale": 2.0}, {"local.lr": 0.2}]
    stages = [built_stage(Scaled(), [], None, v, 4, None, TinyMLP, data) for v in values]
    batch = TrialBatch(stages)
    assert batch.groups == [[0], [1], [2]]
    trained = []

    class Rounds(RoundCallback):
        def on_round_end(self, trainer, stage, result):
            trained.append(sorted(result.trials))

    fit(batch, callbacks=[Rounds()])
    assert trained == [[0, 1, 2]] * batch.n_rounds  # every trial every round
    assert len({id(stage.executor_choice) for stage in batch.trials}) == 3
    for v, stage in zip(values, batch.trials, strict=True):
        alone = built_stage(Scaled(), [], None, v, 4, None, TinyMLP, data)
        alone.executor_choice.pin(stage.execution)
        fit(alone)
        expected, got = stage_result(alone)[0], stage_result(stage)[0]
        assert all(torch.equal(got[n], expected[n]) for n in expected)


class ScaledPerRow(Scaled):
    """The plugin batching: its value read per row through the cohort (a number, or one per row), its update damped by
    a factor of it, shaped by per_client."""

    name = "scaled-per-row-test"
    batches_trials = True
    tunable = ScaledBatching.tunable

    def local_update(self, cohort: Cohort) -> Upload:
        scale = cohort.params.scale
        trained = cohort.sgd("shared", lr=0.1 * scale)
        damp = scale / (1 + scale)
        return Upload(shared={n: b + cohort.per_client(damp, b) * (trained.shared[n] - b)
                              for n, b in cohort.broadcast.items()})


def test_a_plugin_written_against_the_api_batches_by_reading_its_values_through_the_cohort():
    assert_trials_match_alone(ScaledPerRow(), [{"params.scale": 0.5}, {"params.scale": 2.0}, {"params.scale": 1.0}],
                              personal=[], executions=(("vmap", 5), ("loop", 4)))


BATCHED = {  # every built-in that batches trials: its split, params and trials differing in what it batches
    "fedalt": (INPUT, {"tau_v": 2, "tau_u": 3, "stateful": False},
               [{"params.lr_v": 0.05, "params.lr_u": 0.1}, {"params.lr_v": 0.2, "params.lr_u": 0.05, "local.lr": 0.05},
                {"params.lr_v": 0.1, "params.lr_u": 0.3, "server.lr": 0.5}]),
    "fedsim": (HEAD, {}, [{"params.lr_v": 0.05, "params.lr_u": 0.1}, {"params.lr_v": 0.3, "params.lr_u": 0.05}]),
    "fedper": (HEAD, {}, [{"params.lr_v": 0.05, "params.lr_u": 0.1}, {"params.lr_v": 0.3, "params.lr_u": 0.05}]),
    "lg_fedavg": (INPUT, {}, [{"params.lr_v": 0.05, "params.lr_u": 0.1}, {"params.lr_v": 0.3, "params.lr_u": 0.05}]),
    "fedrep": (HEAD, {"head_epochs": 2.0}, [{"params.lr_head": 0.05, "params.lr_body": 0.1},
                                             {"params.lr_head": 0.3, "params.lr_body": 0.05}]),
    "fedprox": ([], {}, [{"params.mu": 0.01, "local.lr": 0.05}, {"params.mu": 0.5, "local.lr": 0.2}]),
    "ditto": (None, {"personal_steps": 2}, [{"params.lr_v": 0.05, "params.lam": 0.1},
                                            {"params.lr_v": 0.2, "params.lam": 1.0, "local.lr": 0.05}]),
    "pflego": (HEAD, {"tau": 3}, [{"params.rho": 0.1, "params.beta": 0.05}, {"params.rho": 0.5, "params.beta": 0.2}]),
    "finetune": (HEAD, {}, [{"local.lr": 0.05}, {"local.lr": 0.2, "local.weight_decay": 0.01}]),
    "local": (None, {}, [{"local.lr": 0.05}, {"local.lr": 0.2}]),
    "perfedavg": ([], {"tau": 2}, [{"params.alpha": 0.01, "local.lr": 0.05}, {"params.alpha": 0.1, "local.lr": 0.2}]),
    "ffgg": (HEAD, {"tau": 2}, [{"params.lr_w": 0.05, "server.lr": 0.5}, {"params.lr_w": 0.3, "server.lr": 1.0}]),
    "ffgg_robust": (HEAD, {"tau": 2}, [{"params.lr_w": 0.05}, {"params.lr_w": 0.3}]),
    "ffgg_local": (HEAD, {"tau": 2, "alt_steps": 2}, [{"params.lr_w": 0.05, "params.lr_theta": 0.1},
                                                      {"params.lr_w": 0.3, "params.lr_theta": 0.02}]),
    "pfedme": (None, {"local_rounds": 2, "inner_steps": 2}, [{"params.lam": 1.0, "params.lr_personal": 0.05},
                                                             {"params.lam": 15.0, "params.lr_personal": 0.1,
                                                              "local.lr": 0.2}]),
}


@pytest.mark.parametrize("algorithm", sorted(BATCHED))
def test_every_built_in_that_batches_trials_is_each_trial_alone(algorithm):
    """Each built-in declaring batches_trials, its trials differing in every value it batches (its params' batchable
    ones, the local lr, the server's), on the vmap and bmm executors, chunks spanning trials."""
    personal, params, values = BATCHED[algorithm]
    assert_trials_match_alone(algorithm, values, personal, params, executions=(("vmap", 5), ("bmm", 4)))


@pytest.mark.parametrize(("execution", "chunk"), [("sequential", 4), ("loop", 3), ("vmap_autograd", 14)])
def test_fedalt_trials_are_each_alone_on_every_executor(execution, chunk):
    assert_trials_match_alone("fedalt", [{"params.lr_v": 0.05, "params.lr_u": 0.1, "local.weight_decay": 0.01},
                                         {"params.lr_v": 0.3, "params.lr_u": 0.05, "local.weight_decay": 0.0}],
                              HEAD, executions=((execution, chunk),))


def test_the_built_ins_that_batch_trials_are_tested_and_listed_in_the_docs():
    """Every built-in declaring batches_trials is in BATCHED above, and docs/algorithms.md's table says which batch
    and which of their params may differ in a batch."""
    from pathlib import Path

    from fedpilot.algorithms import ALGORITHMS

    batching = {name for name in ALGORITHMS.builtins if ALGORITHMS[name].batches_trials}
    assert batching - {"fedavg"} == set(BATCHED)
    text = (Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    table = text[text.index("## Which algorithms train trials together"):].split("\n## ")[0]
    rows = {line.split("|")[1].strip(" `"): line for line in table.splitlines() if line.startswith("| `")}
    for name in ALGORITHMS.builtins:
        kind = ALGORITHMS[name]
        assert rows[name].split("|")[2].strip() == ("yes" if kind.batches_trials else "no"), name
        batched = [key for key in kind.tunable if key.startswith("params.") and kind.batchable(key)]
        assert all(f"`{key}`" in rows[name] for key in batched), name


def test_the_batched_first_step_takes_each_trials_rows_together(monkeypatch):
    """loop_batched_first takes each trial's first step as one batch (its rows start from its global model): in the
    rounds, whose chunks end where trials do (a loop gains nothing from rows of several trials), and in a call of
    several trials' rows (the executor timing's first chunk), where it equals each trial's call alone."""
    from fedpilot.engine.accel import loop, shared_start
    from fedpilot.engine.executor import Batches, StepRule, TrainStats
    from fedpilot.engine.task import make_task

    calls = []
    monkeypatch.setattr(loop, "first_step_grads", lambda *a: calls.append(a[6].shape[0]) or
                        shared_start.first_step_grads(*a))
    local = LocalConfig(epochs=1, batch_size=4, lr=0.1)
    run_trials("fedavg", [], FEDAVG_TRIALS[:2], execution="loop_batched_first", chunk=10, local=local, model=TinyCNN,
               data=ToyData(image=True))
    assert calls[:2] == [7, 7]  # 14 rows in chunks of 10: each trial's 7 rows, each trial's first step at once
    torch.manual_seed(0)
    model, executor = TinyCNN(), loop.BatchedFirstStepExecutor(None, make_task("classification"))
    models = [{n: p.detach() + 0.1 * torch.randn_like(p) for n, p in model.named_parameters()} for _ in range(2)]
    rows = {n: torch.cat([m[n].expand(3, *m[n].shape) for m in models]) for n in models[0]}  # 2 trials x 3 rows
    x, y = torch.randn(30, 1, 4, 4), torch.randint(0, 4, (30,))
    index = torch.randint(0, 30, (6, 2, 4))
    batches = Batches(x, index, y[index], torch.ones(6, 2, 4), torch.ones(6, 2, dtype=torch.bool), trials=(3, 3),
                      trial_models=frozenset(rows))
    rule = StepRule(dict.fromkeys(rows, 0.1))
    calls.clear()
    together = executor.train(model, rows, {}, {}, batches, rule, TrainStats.zeros(6, x.device))
    assert calls == [3, 3]
    for t, m in enumerate(models):
        mine = slice(3 * t, 3 * t + 3)
        alone = executor.train(model, {n: v.expand(3, *v.shape) for n, v in m.items()}, {}, {},
                               Batches(x, index[mine], y[index[mine]], torch.ones(3, 2, 4), batches.active[mine]),
                               rule, TrainStats.zeros(3, x.device))
        assert_close({n: v[mine] for n, v in together.items()}, alone)
