"""A round of the trials of a stage: one stage alone (`FederatedStage`), or a batch of K trials of it that differ only
in values used in arithmetic (engine/trials.py). The round's cohort is the same for every trial; its rows are K x C,
trial after trial, cut into chunks that may span trials. Each chunk is one `Cohort` whose rows carry their trial's
values and global model; the algorithm's `local_update` trains it at once; its rows go back to their trial's banks and
its upload to their trial's aggregate. Each trial then ends the round alone: its server step, its records.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from fedpilot.engine.cohort import Cohort, RoundWork, TimingRun
from fedpilot.engine.ddp import process_rows
from fedpilot.engine.executor import Tensors
from fedpilot.engine.protocol import Aggregator, Algorithm, RoundInfo, Upload
from fedpilot.engine.values import RowValues, TrialValues
from fedpilot.errors import Diverged

if TYPE_CHECKING:
    from fedpilot.engine.stage import FederatedStage


@dataclass
class TrialRound:
    """One trial's part of a round: its stage and values, the global model its clients receive (`shared`) and the
    start of a client without a row of its own (`start`; `fresh`: every client starts there, novel clients); in a
    training round, what its server knows (`info`) and where its clients' uploads and training sums (loss, metric,
    steps) go."""

    stage: FederatedStage
    values: TrialValues
    shared: Tensors
    start: Tensors
    fresh: bool = False
    info: RoundInfo | None = None
    aggregate: Aggregator | None = None
    sums: torch.Tensor | None = None


@dataclass(frozen=True)
class Piece:
    """A trial's rows in a chunk: the clients `rows` of the round's cohort, at rows `at` of the chunk."""

    part: TrialRound
    rows: slice
    at: slice

    def __len__(self) -> int:
        return self.rows.stop - self.rows.start


def chunks(parts: Sequence[TrialRound], work: RoundWork, clients: torch.Tensor, rows: slice,
           size: int) -> Iterator[tuple[Cohort, list[Piece]]]:
    """The `rows` of the cohort `clients` of every trial of `parts`, trial after trial, in chunks of `size` rows: each
    chunk's cohort and its pieces. A chunk spans trials only where the plan's executor batches its forward passes
    over clients (the vmaps, bmm), and at most the plan's `span` of them: elsewhere (the loops: a client at a time)
    it would gain nothing and cost a copy of each row's global model, so chunks end where trials do."""
    count = rows.stop - rows.start
    span = (work.execution.span or len(parts)) if work.execution.executor.batched else 1
    ends = [min(k + span, len(parts)) * count for k in range(0, len(parts), span)]
    begin = 0
    for end in ends:
        for lo in range(begin, end, size):
            hi = min(lo + size, end)
            pieces = []
            for k in range(lo // count, (hi - 1) // count + 1):
                first, last = max(lo, k * count) - k * count, min(hi, (k + 1) * count) - k * count
                at = k * count + first - lo
                pieces.append(Piece(parts[k], slice(rows.start + first, rows.start + last),
                                    slice(at, at + last - first)))
            yield cohort_of(work, clients, pieces), pieces
        begin = end


def cohort_of(work: RoundWork, clients: torch.Tensor, pieces: list[Piece]) -> Cohort:
    """One cohort of the pieces' rows: their clients' rows from their trials' banks, their values and, where they
    belong to several trials, the global model and starting values of each row's trial."""
    rows = [piece.part.stage.client_rows(clients[piece.rows], piece.part.start, piece.part.fresh) for piece in pieces]
    values = RowValues([(piece.part.values, len(piece)) for piece in pieces], clients.device)
    if len(pieces) == 1:
        piece = pieces[0]
        return Cohort(work, clients[piece.rows], piece.rows, clients, piece.part.shared, rows[0][0], piece.part.start,
                      rows[0][1], values)
    index = torch.cat([torch.arange(piece.rows.start, piece.rows.stop) for piece in pieces]).to(clients.device)

    def per_row(of: str) -> Tensors:
        first = getattr(pieces[0].part, of)
        return {n: torch.cat([getattr(p.part, of)[n].expand(len(p), *first[n].shape) for p in pieces]) for n in first}

    return Cohort(work, clients[index], index, clients, per_row("shared"), _joined([own for own, _ in rows]),
                  per_row("start"), _joined([state for _, state in rows]), values, shared_per_row=True)


def _joined(parts: list[Tensors]) -> Tensors:
    return {n: torch.cat([part[n] for part in parts]) for n in parts[0]}


def train_chunk(cohort: Cohort, pieces: list[Piece], algorithm: Algorithm) -> None:
    """One chunk's local work: each piece's rows written back to its trial's banks, its share of the upload added to
    its trial's aggregate and its training stats to its trial's sums (on the device: read once a round)."""
    upload = algorithm.local_update(cohort)
    sent = upload.shared is not None or upload.grad is not None
    for piece in pieces:
        part, at = piece.part, piece.at
        part.stage.keep_rows(cohort.clients[at], {n: v[at] for n, v in cohort.own.items()},
                             {n: v[at] for n, v in cohort.state.items()})
        stats = cohort.stats.rows(at)
        part.sums += torch.stack([stats.loss.sum(), stats.metric.sum(), stats.steps.sum()]).double()
        if sent:
            part.aggregate.add(rows_of(upload, at, cohort.weights, len(pieces) == 1), part.info)


def rows_of(upload: Upload, at: slice, weights: torch.Tensor, whole: bool) -> Upload:
    """The rows `at` of a chunk's upload (an algorithm's subclass of Upload too: each of its fields that holds a
    tensor, or tensors by name, per row), the clients' sample counts as weights unless it has its own; `whole`: the
    chunk's whole upload."""
    filled = replace(upload, weight=weights if upload.weight is None else upload.weight)
    if whole:
        return filled

    def cut(value: Any) -> Any:
        if isinstance(value, dict):
            return {n: v[at] for n, v in value.items()}
        return value[at] if torch.is_tensor(value) else value

    return replace(filled, **{f.name: cut(getattr(filled, f.name)) for f in fields(filled)})


def run_round(stages: Sequence[FederatedStage], round_idx: int, algorithm: Algorithm, optimizer: Any,
              chunk: int | None = None) -> list[dict[str, float] | Diverged]:
    """Round `round_idx` of every trial of `stages` (their cohort, the same for each; under DDP this process's share of
    it), in chunks of `chunk` rows (by default as the executor choice says), each trial's aggregate the gradient of its
    shared parameters, then one step of the server `optimizer` (a parameter group per trial; None: the caller steps
    it, once for a batch's groups): each trial's round stats, or the Diverged error that stopped it (its parameters
    have no gradient: its server did not step)."""
    lead = stages[0]
    clients = lead.sample_cohort(round_idx).to(lead.device)
    work = lead.round_work(round_idx, clients, trials=len(stages))
    parts = [stage.round_part(work, clients) for stage in stages]
    mine = process_rows(len(clients))
    size = chunk or work.execution.chunk or lead.config.max_parallel_clients
    for cohort, pieces in chunks(parts, work, clients, mine, size):
        train_chunk(cohort, pieces, algorithm)
    results: list[dict[str, float] | Diverged] = []
    for part in parts:
        try:
            results.append(part.stage.end_round(part, round_idx, clients, mine))
        except Diverged as err:
            results.append(err)
    if optimizer is not None:
        lead.server_step(optimizer)
    return results


def timing_run(stages: Sequence[FederatedStage], round_idx: int, algorithm: Algorithm) -> TimingRun:
    """The executor candidates' timing run: the local work of the first chunk of round `round_idx`'s rows (at most
    `max_parallel_clients` of them), on copies of their rows."""
    lead = stages[0]
    clients = lead.sample_cohort(round_idx).to(lead.device)
    work = lead.round_work(round_idx, clients, trials=len(stages))
    parts = [stage.round_part(work, clients) for stage in stages]
    first, _ = next(chunks(parts, work, clients, slice(0, len(clients)), lead.config.max_parallel_clients))
    return TimingRun(algorithm, first)


@contextmanager
def begin_round(stages: Sequence[FederatedStage], round_idx: int, algorithm: Algorithm) -> Iterator[None]:
    """Round `round_idx` of `stages` begins: each checks that it trains a new round of its own; under `execution:
    auto` the first round first times the candidates (on its first chunk of rows); a round that asks for work the
    stage cannot do fails it, named (RoundGuard.round)."""
    lead = stages[0]
    for stage in stages:
        stage.guard.check_progress(round_idx, stage.n_rounds)
    with lead.guard.round(round_idx):
        if lead.executor_choice.pending:
            spanned = f" {lead.executor_choice.span} at a time" if lead.executor_choice.span else ""
            lead.executor_choice.time(partial(timing_run, stages, round_idx, algorithm), lead.device,
                                      f"{len(stages)} trials{spanned} of {lead.workload()}")
        yield
