"""The value an algorithm sees: a cohort of clients, their parameters, and the engine's local SGD."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.func import functional_call

from fedpilot.engine.batches import BatchPlan, epoch_plan, round_generator, step_plan
from fedpilot.engine.config import LocalConfig
from fedpilot.engine.data import ClientData
from fedpilot.engine.executor import (
    Batches,
    ExecutionPlan,
    Forward,
    Rate,
    StepRule,
    Tensors,
    TrainStats,
    per_client,
    plain_forward,
    precision_context,
)
from fedpilot.engine.protocol import AlgorithmParams
from fedpilot.engine.task import Task
from fedpilot.engine.values import RowValues, TrialValues
from fedpilot.errors import NothingToTrain
from fedpilot.models.split import ParamSplit

if TYPE_CHECKING:
    from fedpilot.engine.protocol import Algorithm

Part = Literal["personal", "shared", "all"]
__all__ = ["Cohort", "Forward", "Local", "Part", "RoundWork", "TimingRun", "plain_forward"]


@dataclass
class RoundWork:
    """Everything the engine fixes for one round, the same for every trial of a batch: data, model, task, local work
    (its budget and batch size; the values a trial may have its own of are the cohort's `values`), the lr schedule's
    factor, seeds, the execution plan the stage's executor choice gives (executors, forward, chunks), the split."""

    model: nn.Module
    task: Task
    data: ClientData
    local: LocalConfig
    lr_factor: float
    seed_key: tuple[int, int, int]
    execution: ExecutionPlan  # the executors, the forward, the chunks: as the stage's executor choice decided
    split: ParamSplit
    precision: str = "32-true"
    plans: dict[tuple, BatchPlan] = field(default_factory=dict)
    step_cap: int | None = None  # at most this many steps a phase (an executor trial: the speed, not the result)
    constants: frozenset[str] = frozenset()  # the algorithm's per-client constants (Algorithm.constants)

    @property
    def x(self) -> torch.Tensor:
        return self.data.x

    @property
    def y(self) -> torch.Tensor:
        return self.data.y

    @property
    def offsets(self) -> torch.Tensor:
        """Where each client's training samples start."""
        return self.data.offsets["train"]

    @property
    def sizes(self) -> torch.Tensor:
        """Each client's number of training samples."""
        return self.data.sizes["train"]

    def plan(self, cohort_clients: torch.Tensor, phase: int, epochs: float | None, steps) -> BatchPlan:
        """The batch plan of the whole cohort for one local phase, with its samples' augmentations (made once, then
        sliced per chunk)."""
        key = (phase, epochs, steps if not torch.is_tensor(steps) else tuple(steps.tolist()), self.step_cap)
        if key not in self.plans:
            gen = round_generator(*self.seed_key, phase + 1)
            offsets, sizes = self.offsets[cohort_clients].cpu(), self.sizes[cohort_clients].cpu()
            batch = self.local.batch_size
            if steps is not None:
                plan = step_plan(offsets, sizes, steps, batch, gen)
            else:
                plan = epoch_plan(offsets, sizes, epochs, batch, gen)
            if self.step_cap is not None:
                plan = plan.first_steps(self.step_cap)
            if self.data.augment is not None:
                plan.augment = self.data.augment.draw(tuple(plan.index.shape), gen)
            self.plans[key] = plan.to(self.x.device)
        return self.plans[key]

    def head_only(self, names: list[str]) -> bool:
        """Whether `names` are all head parameters while the body is entirely shared."""
        return self.split.head_only(names) and self.split.head_only(self.split.personal_names)


@dataclass
class Local:
    """Parameters of the clients of a cohort after local work, each [K, ...]."""

    shared: Tensors
    personal: Tensors


class Cohort:
    """The clients sampled in a round, or one chunk of them: the engine hands an algorithm the round's cohort
    `cohort_clients` ([R] ids, every chunk) chunk by chunk, as K `clients` at a time.

    In a batch of trials (engine/trials.py) a chunk's rows may belong to several trials (rows trial after trial; a
    trial's rows, the round's cohort in order): `clients` repeats, and each row has its trial's values
    (`params`, `value`) and global model (`shared` is then one per row).

    Shapes: everything per client is per client of this chunk, [K, ...] in the order of `clients`, except where
    a name says the whole cohort ([R], in the order of `cohort_clients`: a per-client `steps` tensor for `sgd` or
    `gradient`, since the round's batch plan is drawn once for the whole cohort) or the federation ([n_clients],
    indexed by client id: `server_state` tensors, `train_samples(ids)`). `chunk_of` takes this chunk's rows of a
    whole-cohort tensor, `per_client` shapes a [K] tensor to broadcast against [K, ...] ones.

    Read and write: `personal`, each client's personal parameters [K, ...] (set it to keep new ones);
    `constants`, each client's per-client constants [K, ...] (Algorithm.constants: buffers of the model each client
    has its own value of; its forward sees them in `params`, in training and evaluation, and no local step changes
    them; set it to keep new ones); and `state`, the algorithm's per-client state [K, ...] (Algorithm.client_state;
    set it to keep a new one). Read only: `clients` (ids of this chunk), `rows` (their rows in the whole cohort: a
    slice, or in a batch of trials an index), `shared` (the broadcast global model, no client dimension; in a chunk
    of several trials one per row, `shared_per_row`; `broadcast` is always [K, ...]), `personal_init` (the stage's
    starting personal values, for stateless variants and L2 pulls; one per row where `shared_per_row`), `weights`
    (the clients' train sample counts), `server_state` (the server's state as the round started), `params` and
    `value(key)` (the hyperparameters of each row), and the properties below. `sgd` and `gradient` run the engine's
    local work.
    """

    def __init__(self, work: RoundWork, clients: torch.Tensor, rows: slice | torch.Tensor, cohort_clients: torch.Tensor,
                 shared: Tensors, personal: Tensors, personal_init: Tensors, state: Tensors | None = None,
                 values: RowValues | None = None, shared_per_row: bool = False):
        """`personal` and `personal_init`: the clients' own values, personal parameters and constants together (as
        the personal bank keeps them); `values`: the rows' hyperparameters (default: the work's local block, no
        params, no server state); `shared_per_row`: `shared` and `personal_init` hold one row per client (rows of
        several trials)."""
        self.work, self.clients, self.rows, self.cohort_clients = work, clients, rows, cohort_clients
        self.shared, self.personal_init, self.shared_per_row = shared, personal_init, shared_per_row
        self.values = values or RowValues([(TrialValues(work.local, AlgorithmParams(), {}), len(clients))],
                                          work.x.device)
        self.personal = {n: v for n, v in personal.items() if n not in work.constants}
        self.constants = {n: v for n, v in personal.items() if n in work.constants}
        self.state = state or {}
        self.weights = work.sizes[clients].to(torch.float32)
        self.stats = TrainStats.zeros(len(clients), work.x.device)
        self._phase = 0

    def __len__(self) -> int:
        return len(self.clients)

    def part(self, rows: slice, work: RoundWork) -> Cohort:
        """The chunk's `rows` as a cohort of their own on `work`, on copies of their own values and state."""
        index = self.rows[rows] if torch.is_tensor(self.rows) else slice(self.rows.start + rows.start,
                                                                         self.rows.start + rows.stop)
        own_rows = (lambda values: {n: v[rows] for n, v in values.items()}) if self.shared_per_row else (
            lambda values: values)
        return Cohort(work, self.clients[rows], index, self.cohort_clients, own_rows(self.shared),
                      {n: v[rows].clone() for n, v in self.own.items()}, own_rows(self.personal_init),
                      {n: v[rows].clone() for n, v in self.state.items()}, self.values.rows(rows), self.shared_per_row)

    @property
    def round_key(self) -> tuple[int, int, int]:
        """(seed, stage index, round index): seed an algorithm's own random draws of this round with it."""
        return self.work.seed_key

    @property
    def round(self) -> int:
        """The round index within the stage."""
        return self.work.seed_key[2]

    @property
    def n_clients(self) -> int:
        """All clients of the federation (I), not only this cohort."""
        return len(self.work.sizes)

    @property
    def cohort_size(self) -> int:
        """Clients sampled this round (r), over all chunks."""
        return len(self.cohort_clients)

    @property
    def model(self) -> nn.Module:
        """The stage's model: its modules (e.g. one an algorithm added in prepare_model), not the clients' values,
        which are `shared` and `personal`."""
        return self.work.model

    @property
    def local(self) -> LocalConfig:
        """The stage's `local` block (epochs or steps, batch size, lr, schedule, clipping, weight decay); in a chunk
        of trials that differ in a field, that field is read per row: `value("local.<field>")`."""
        return self.values.local

    @property
    def params(self) -> Any:
        """The algorithm's hyperparameters as these rows have them: its `params` (outside a batch of trials), or a view
        whose attribute is a number where every row has the same value and one per row [K] where this chunk's
        trials differ (shape it with `per_client`). An algorithm that batches trials reads through it what a
        search may vary (`Tunable.batchable`)."""
        return self.values.params

    def value(self, key: str) -> Any:
        """The stage key `key` (`local.lr`, `params.lr_v`, ...) for these rows: a number (or None) where every row has
        the same, else one per row [K] (float32)."""
        return self.values.value(key)

    @property
    def lr_factor(self) -> float:
        """The learning-rate schedule's factor for this round (`local.lr * lr_factor` is the round's client lr)."""
        return self.work.lr_factor

    @property
    def server_state(self) -> Mapping[str, Any]:
        """The server's state (Algorithm.server_state, then each round's aggregate result) as this round started."""
        return MappingProxyType(dict(self.values.server_state))

    @property
    def total_train_samples(self) -> int:
        """Training samples of the whole federation (sum over all clients of N_i)."""
        return int(self.work.sizes.sum())

    @property
    def broadcast(self) -> Tensors:
        """Each row's global model [K, ...]: `shared` expanded (no copy), or one per row in a chunk of trials."""
        if self.shared_per_row:
            return self.shared
        return {n: v.expand(len(self), *v.shape) for n, v in self.shared.items()}

    @property
    def own(self) -> Tensors:
        """The clients' own values the personal bank keeps: personal parameters and constants [K, ...]."""
        return {**self.personal, **self.constants}

    def per_client(self, values: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
        """`values`, one per client of this chunk [K], shaped [K, 1, ...] to broadcast against `like` [K, ...], on
        its device and, for floating-point values, in its dtype (a mask stays boolean, counts integer); a number as it
        is (a hyperparameter from `params` or `value`: one number, or one per row)."""
        if torch.is_tensor(values) and values.shape != (len(self),):
            raise ValueError(f"cohort.per_client: expected one value per client of this chunk, shape ({len(self)},), "
                             f"got {tuple(values.shape)}; for a whole-cohort tensor take cohort.chunk_of(values)")
        return per_client(values, like)

    def chunk_of(self, values: torch.Tensor) -> torch.Tensor:
        """This chunk's rows [K, ...] of `values` given per client of the whole cohort [R, ...] (in the order of
        `cohort_clients`)."""
        if len(values) != self.cohort_size:
            raise ValueError(f"cohort.chunk_of: expected one row per client of the whole cohort ({self.cohort_size}, "
                             f"cohort_clients), got {len(values)}")
        return values[self.rows]

    def train_samples(self, clients: torch.Tensor) -> torch.Tensor:
        """Training sample counts N_i of `clients` (any ids of the federation, e.g. `cohort_clients`)."""
        return self.work.sizes[clients.to(self.work.sizes.device)]

    def train_inputs(self, count: int) -> torch.Tensor:
        """The first `count` training inputs of each client of this chunk [K, count, ...] (a client with fewer
        repeats its last one)."""
        take = torch.arange(count, device=self.work.x.device)
        sizes, starts = self.work.sizes[self.clients], self.work.offsets[self.clients]
        rows = starts[:, None] + torch.minimum(take[None], (sizes[:, None] - 1).clamp_min(0))
        return self.work.data.inputs(self.work.x[rows])

    def gradient(self, part: Part = "shared", *, steps: int | torch.Tensor | None = 1, epochs: float | None = None,
                 shared: Tensors | None = None) -> Tensors:
        """Each client's mean stochastic gradient of its loss over `steps` fresh minibatches (or `epochs`), taken
        at its current parameters, for the `part` parameters [K, ...]; nothing is updated.

        `steps` may be a tensor, one count per client of the whole cohort [R] (see the class docstring).
        `shared` optionally replaces the broadcast with per-client shared parameters [K, ...] (stale models).
        Defaults, lr and budget, are as for `sgd`.
        """
        plan = self._plan(epochs, None if epochs else steps)
        per_client_shared = shared is not None or self.shared_per_row
        params, frozen, fixed = self._assign(part, self.shared if shared is None else shared, per_client_shared)
        work = self.work
        with precision_context(work.precision, work.x.device):
            return work.execution.executor.gradients(work.model, params, frozen, fixed, self._batches(plan), self.stats)

    def _plan(self, epochs: float | None, steps: int | torch.Tensor | None) -> BatchPlan:
        """This chunk's rows of the next local phase's plan for the whole cohort."""
        if torch.is_tensor(steps) and steps.dim() and len(steps) != self.cohort_size:
            raise ValueError(f"cohort.sgd/gradient: a per-client `steps` tensor holds one count per client of the "
                             f"whole cohort ({self.cohort_size}, cohort.cohort_clients), not of this chunk "
                             f"({len(self)}): the round's batch plan is drawn once for every chunk; got {len(steps)}")
        plan = self.work.plan(self.cohort_clients, self._phase, epochs, steps).rows(self.rows)
        self._phase += 1
        return plan

    def _batches(self, plan: BatchPlan, trial_models: bool = False) -> Batches:
        """The plan's batches; with `trial_models` (each row's shared values are its trial's global model), the rows of
        each trial and the names they share."""
        trials = tuple(count for _, count in self.values.parts) if trial_models else None
        return Batches(self.work.x, plan.index, self.work.y[plan.index], plan.weight.to(self.work.x.device),
                       plan.active, self.work.data.inputs, plan.augment, trials,
                       frozenset(self.shared) if trial_models else frozenset())

    def sgd(self, train: Part, lr: Rate | dict[str, Rate | None] | None = None, *, epochs: float | None = None,
            steps: int | torch.Tensor | None = None, shared: Tensors | None = None, prox: Rate = 0.0,
            reference: Tensors | None = None) -> Local:
        """Local SGD of the `train` part for each client, starting from its current parameters.

        Work defaults to the stage's `local` block (epochs or steps); `steps` may be a tensor, one count per client
        of the whole cohort [R] (the batch plan is drawn once for every chunk; see the class docstring).
        `lr` is one value or {"shared": .., "personal": ..} (None: the stage's `local.lr`), each a number or one per
        client of this chunk [K] (a batch of trials' rows); the round's schedule factor multiplies it.
        `shared` optionally replaces the broadcast with per-client shared parameters [K, ...].
        `prox` adds prox/2 * ||w - reference||^2 to each client's loss (reference: the stage's start); a number or
        one per client of this chunk [K].
        """
        local = self.work.local
        if epochs is None and steps is None:
            epochs, steps = local.epochs, local.steps
        plan = self._plan(epochs, steps)
        trial_models = shared is None and self.shared_per_row  # each row its trial's global model
        per_client_shared = shared is not None or self.shared_per_row
        shared = self.shared if shared is None else shared
        trainable, frozen, fixed = self._assign(train, shared, per_client_shared)
        rule = self._rule(trainable, lr, prox, reference)
        with precision_context(self.work.precision, self.work.x.device):
            trainable = self._run(trainable, frozen, fixed, plan, rule, trial_models)
        k = len(self.clients)
        personal = {n: trainable[n] if train != "shared" and n in trainable else v for n, v in self.personal.items()}
        new_shared = {n: trainable[n] if train != "personal" and n in trainable else (
            v if per_client_shared else v.expand(k, *v.shape)) for n, v in shared.items()}
        return Local(shared=new_shared, personal=personal)

    def _assign(self, train: Part, shared: Tensors, per_client_shared: bool) -> tuple[Tensors, Tensors, Tensors]:
        """Split the parameters into trainable [K..], frozen per-client [K..] (with the per-client constants) and
        frozen broadcast [..]; an empty `train` part is an error (no executor runs on empty work).

        With a personal copy (names both shared and personal, Ditto) the trained copy is the whole model: the
        personal part trains the personal copy, the shared part the global one, and `all` is not defined.
        """
        if not {"personal": self.personal, "shared": shared}.get(train, {**shared, **self.personal}):
            raise NothingToTrain(f"the algorithm asked to train the {train!r} part of the model, which this stage's "
                                 "split leaves empty")
        k = len(self.clients)
        batched_shared = shared if per_client_shared else {n: v.expand(k, *v.shape) for n, v in shared.items()}
        if train == "personal":
            trainable, frozen, fixed = dict(self.personal), (batched_shared if per_client_shared else {}), (
                {} if per_client_shared else dict(shared))
        elif train == "shared":
            trainable, frozen, fixed = dict(batched_shared), dict(self.personal), {}
        elif set(shared) & set(self.personal):
            raise ValueError("a personal copy has no joint `all` part: train `personal` or `shared`")
        else:
            trainable, frozen, fixed = {**batched_shared, **self.personal}, {}, {}
        return (trainable, {**{n: v for n, v in frozen.items() if n not in trainable}, **self.constants},
                {n: v for n, v in fixed.items() if n not in trainable})

    def _rule(self, trainable: Tensors, lr: Any, prox: float | torch.Tensor, reference: Tensors | None) -> StepRule:
        base = self.value("local.lr")
        if lr is None or not isinstance(lr, dict):
            rates = dict.fromkeys(trainable, self._per_row(base if lr is None else lr, "lr"))
        else:
            parts = {part: self._per_row(base if lr.get(part) is None else lr[part], f"lr[{part!r}]")
                     for part in ("personal", "shared")}
            rates = {n: parts["personal" if n in self.personal else "shared"] for n in trainable}
        rates = {n: r * self.work.lr_factor for n, r in rates.items()}
        prox = self._per_row(prox, "prox")
        ref = {n: reference[n] for n in trainable} if torch.is_tensor(prox) or prox else {}
        clip = self.value("local.clip_norm")
        return StepRule(rates, clip if clip is None else self._per_row(clip, "local.clip_norm"),
                        self._per_row(self.value("local.weight_decay"), "local.weight_decay"), prox, ref)

    def _per_row(self, value: float | torch.Tensor, name: str) -> float | torch.Tensor:
        """A step's value as the rule takes it: a number, or one value per client of this chunk [K] (float32 on the
        data's device)."""
        if not torch.is_tensor(value):
            return float(value)
        if value.shape != (len(self),):
            raise ValueError(f"cohort.sgd: `{name}` as a tensor holds one value per client of this chunk, shape "
                             f"({len(self)},); got {tuple(value.shape)}")
        return value.to(self.work.x.device, torch.float32)

    def _run(self, trainable: Tensors, frozen: Tensors, fixed: Tensors, plan: BatchPlan, rule: StepRule,
             trial_models: bool = False) -> Tensors:
        """The executor's steps; head-only work on the body's features where the body is one model, or one per trial
        (`trial_models`: `frozen` is each row's trial's global model) and nothing else is frozen per client."""
        work = self.work
        by_trial = trial_models and not self.constants
        if work.execution.head is not None and work.head_only(list(trainable)) and (not frozen or by_trial):
            # the shared body once (once a trial's rows in a chunk of several), then the heads' steps on its features
            executor, split = work.execution.head, work.split
            feats = self._features(self._batches(plan), frozen, fixed)
            index = torch.arange(len(feats), device=feats.device).view(plan.index.shape)
            batches = Batches(feats, index, work.y[plan.index], plan.weight.to(work.x.device), plan.active)
            trained = executor.train(work.model.head, split.in_head(trainable), split.in_head(frozen),
                                     split.in_head(fixed), batches, rule.renamed(split.head), self.stats)
            return split.from_head(trained)
        return work.execution.executor.train(work.model, trainable, frozen, fixed, self._batches(plan, by_trial), rule,
                                             self.stats)

    @torch.no_grad()
    def _features(self, batches: Batches, frozen: Tensors, fixed: Tensors) -> torch.Tensor:
        """The body's features of every planned sample, row after row, flat: the body's parameters are `fixed`, or
        in a chunk of several trials each trial's, its first row's of `frozen` for its rows."""
        body, split = self.work.model.body, self.work.split
        if not frozen:
            inputs = batches.inputs(slice(None), slice(None)).flatten(0, 2)
            return functional_call(body, split.in_body(fixed), (inputs,))
        feats, lo = [], 0
        for _, count in self.values.parts:
            own = {n: v[lo] for n, v in split.in_body(frozen).items()}
            inputs = batches.inputs(slice(lo, lo + count), slice(None)).flatten(0, 2)
            feats.append(functional_call(body, {**split.in_body(fixed), **own}, (inputs,)))
            lo += count
        return torch.cat(feats)


@dataclass
class TimingRun:
    """The local work of the first chunk of a round's rows (`first`), on copies of their rows (what it computes is
    thrown away): `run(plan, steps, clients, per_chunk)` runs its first `clients` rows (None: all) under the execution
    `plan`, `per_chunk` at a time as the rounds would (None: at once), `steps` steps a phase
    (engine.accel.choice.TimingRun)."""

    algorithm: Algorithm
    first: Cohort

    @property
    def clients(self) -> int:
        return len(self.first)

    @property
    def client_bytes(self) -> int:
        """What a chunk holds of each of its clients: its shared parameters (trained, uploaded), its personal values
        and its state."""
        first = self.first
        rows = [v[0] for part in (first.broadcast, first.own, first.state) for v in part.values()]
        return sum(v.numel() * v.element_size() for v in rows)

    def __call__(self, plan: ExecutionPlan, steps: int, clients: int | None = None,
                 per_chunk: int | None = None) -> None:
        work = replace(self.first.work, execution=plan, step_cap=steps)
        count = self.clients if clients is None else clients
        for lo in range(0, count, per_chunk or count):
            self.algorithm.local_update(self.first.part(slice(lo, min(lo + (per_chunk or count), count)), work))
