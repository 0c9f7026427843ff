"""Per-client metrics of every client with its own personalized model, vectorized and chunked: `Evaluator`."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.func import functional_call, vmap

from fedpilot.engine.accel.executors import choose
from fedpilot.engine.accel.pooling import MeasuredPooling, has_2d_maps, with_measured_pooling
from fedpilot.engine.accel.threads import for_each_client
from fedpilot.engine.accel.timing import best_time, within_memory
from fedpilot.engine.data import ClientData, client_major_index
from fedpilot.engine.executor import Forward, Tensors, precision_context
from fedpilot.engine.memory import keep_freed_memory, release_freed_memory
from fedpilot.engine.metrics import summarize
from fedpilot.engine.task import Scores, Task
from fedpilot.models.split import ParamSplit

if TYPE_CHECKING:
    from fedpilot.engine.accel.choice import ExecutorChoice

# Samples a chunk of the evaluation holds at once. Resident memory climbs during a chunk's forward passes more than
# its tensors explain (the host allocator; bench/README.md, 2026-11-27) and comes back between chunks: the chunk
# bounds it. A larger one gains nothing on the flat path, which runs the measured forward batch anyway.
CHUNK_SAMPLES = 4096
PersonalOf = Callable[[torch.Tensor], Tensors]  # client ids -> their own values [K, ...] (none: {})
Source = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]  # (start, stop) -> a range's inputs and labels


def no_personal(clients: torch.Tensor) -> Tensors:
    """`PersonalOf` of the global model: nothing of the clients' own."""
    return {}


class Evaluator:
    """The task's metrics of each client of `data` with the stage's model, run the way the stage's chosen executor
    runs (its forward passes batched over clients, or a client at a time), in the stage's `precision`; chunks of
    clients hold at most `max_samples` samples."""

    def __init__(self, choice: ExecutorChoice, split: ParamSplit, data: ClientData, precision: str = "32-true",
                 max_samples: int = CHUNK_SAMPLES):
        self.choice, self.split, self.data, self.precision, self.max_samples = (choice, split, data, precision,
                                                                                max_samples)

    def scores(self, part: str, shared: Tensors, personal_of: PersonalOf = no_personal,
               clients: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Each metric per client of `clients` (default: every client) on the data's split `part`, with the shared
        parameters `shared` and each client's own values `personal_of(ids)`, on the CPU; NaN for a client with no
        samples there."""
        return {m: v.cpu() for m, v in self._scores(part, shared, personal_of, clients).items()}

    def summary(self, part: str, scores: dict[str, torch.Tensor], clients: torch.Tensor | None = None,
                name: str | None = None) -> dict[str, float]:
        """`{name}_{metric}_{stat}` (name: default `part`) of the `scores` of `clients` (default: every client) on
        `part`, weighted by their samples there (engine.metrics.summarize)."""
        weights = self.data.sizes[part].cpu().double()
        weights = weights if clients is None else weights[clients.cpu()]
        return summarize(name or part, scores, weights, self.choice.task.distributions)

    @torch.no_grad()
    def _scores(self, part: str, shared: Tensors, personal_of: PersonalOf,
                clients: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """`scores` on the model's device.

        With no values of the clients' own the model runs over their samples as one flat sequence in large batches
        (no padding) and the metrics are summed per client; when only the head is personal, the shared body runs
        that way and the personal heads run batched on its features. Data kept on the host (a federation larger
        than the device's budget) travels to the model's device batch by batch.
        """
        model, data = self.choice.model, self.data
        device = next(model.parameters()).device
        keep_freed_memory(device)
        ids = torch.arange(data.n_clients) if clients is None else clients.cpu()
        sizes = data.sizes[part].cpu()[ids]
        samples = _Samples(data, client_major_index(data.offsets[part].cpu()[ids], sizes), device)
        sizes = sizes.to(device)

        def own(rows: torch.Tensor) -> Tensors:  # the values of the clients at `rows` of `ids`
            return personal_of(ids[rows.cpu()].to(device))

        pooling = MeasuredPooling() if has_2d_maps(model) else nullcontext()  # threads enter it in `_scores`
        names = list(own(torch.arange(0)))
        with precision_context(self.precision, device), pooling:
            if not names:
                forward = self.choice.forward
                return _flat(model, lambda inputs: forward(model, shared, inputs), self.choice.task, samples,
                             len(samples.index), sizes, self.max_samples)
            if self.split.head_only(names):  # the shared body once, the heads on its features
                return self._heads(shared, own, samples, sizes)
            return self._per_client(model, self.choice.forward, shared, own, samples, sizes)

    def _heads(self, shared: Tensors, own: PersonalOf, samples: Source, sizes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Personal heads only: the shared body over the samples in large batches, each client's head on its
        features."""
        model, split = self.choice.model, self.split
        body = split.in_body(shared)

        def features_at(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
            inputs, labels = samples(start, stop)
            return in_batches(model.body, lambda x: functional_call(model.body, body, (x,)), inputs), labels

        return self._per_client(model.head, _plain, split.in_head(shared), lambda rows: split.in_head(own(rows)),
                                features_at, sizes)

    def _per_client(self, module: nn.Module, forward: Forward, fixed: Tensors, own: PersonalOf, source_at: Source,
                    sizes: torch.Tensor) -> dict[str, torch.Tensor]:
        """Metric sums over each client's samples divided by its units, chunk of clients by chunk: a chunk's samples
        are one contiguous range, whose inputs (or body features) and labels `source_at(start, stop)` gives; its
        forward passes vmapped over the clients where the chosen executor's are batched."""
        task = self.choice.task
        batched = choose(self.choice.name, module, sizes.device).batched
        starts = torch.cumsum(sizes, 0) - sizes
        results = {m: torch.full((len(sizes),), float("nan"), device=sizes.device) for m in task.metrics}
        for clients in _chunks(sizes, self.max_samples):
            first, last = int(starts[clients[0]]), int(starts[clients[-1]] + sizes[clients[-1]])
            if last == first:  # none of these clients has samples in the split: NaN
                continue
            source, labels = source_at(first, last)
            scores = _scores(module, forward, task, own(clients), fixed, source, labels,
                             starts[clients] - first, sizes[clients], batched)
            for metric, (total, units) in scores.items():
                results[metric][clients] = total.sum(1) / units.sum(1)
        return results


class _Samples:
    """Model inputs and labels of a split's samples `index` (client after client) by range, on `device`: a chunk's,
    so the host allocator first hands back what the last chunk freed (it keeps freed memory for the rounds,
    keep_freed_memory, and chunk after chunk would not reuse all of it)."""

    def __init__(self, data: ClientData, index: torch.Tensor, device: torch.device):
        self.data, self.device = data, device
        self.first = int(index[0]) if len(index) else 0
        # one stored range: slices, no copy
        self.in_order = bool((index == torch.arange(self.first, self.first + len(index))).all())
        self.index = index.to(data.x.device)

    def __call__(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        release_freed_memory()
        rows = slice(self.first + start, self.first + min(stop, len(self.index))) if self.in_order else \
            self.index[start:stop]
        data, device = self.data, self.device
        return data.inputs(data.x[rows].to(device, non_blocking=True)), data.y[rows].to(device, non_blocking=True)


def _flat(model: nn.Module, apply: Callable[[torch.Tensor], torch.Tensor], task: Task, rows_at: Source, count: int,
          sizes: torch.Tensor, max_samples: int) -> dict[str, torch.Tensor]:
    """One model for every client: its `count` samples (client after client) in batches of `max_samples`, each
    metric's sums and units added up per client; the model runs in `in_batches`."""
    owner = torch.repeat_interleave(torch.arange(len(sizes), device=sizes.device), sizes)
    sums = {m: (torch.zeros(len(sizes), dtype=torch.float64, device=sizes.device),
                torch.zeros(len(sizes), dtype=torch.float64, device=sizes.device)) for m in task.metrics}
    for i in range(0, count, max_samples):
        inputs, labels = rows_at(i, i + max_samples)
        for metric, (total, units) in task.scores(in_batches(model, apply, inputs), labels).items():  # per sample
            sums[metric][0].index_add_(0, owner[i : i + max_samples], total.double())
            sums[metric][1].index_add_(0, owner[i : i + max_samples], units.double())
    return {m: (total / units).float() for m, (total, units) in sums.items()}


FORWARD_BATCHES = tuple(2**i for i in range(4, 15))  # 16 ... 16384
TIMED_SAMPLES = 256  # each smaller candidate batch is timed over this many samples
GAIN = 0.95  # a larger batch is tried only while each one costs at least 5% less per sample than the best
_forward_batch: dict[tuple, tuple[int, float]] = {}  # per architecture and input: (batch, largest batch tried)


def in_batches(module: nn.Module, apply: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> torch.Tensor:
    """apply(inputs) (the forward pass of `module`) in batches of the size measured fastest per sample for this
    architecture and input shape: very large batches leave the caches, very small ones pay per-call costs
    (bench/README.md has the measurements)."""
    batch = _measured_batch(module, apply, inputs)
    if batch >= len(inputs):
        return apply(inputs)
    return torch.cat([apply(inputs[i : i + batch]) for i in range(0, len(inputs), batch)])


def _measured_batch(module: nn.Module, apply: Callable[[torch.Tensor], torch.Tensor], inputs: torch.Tensor) -> int:
    """The batch of FORWARD_BATCHES with the least seconds per sample (over max(batch, TIMED_SAMPLES) samples),
    tried from the smallest up until one is not GAIN faster than the best (a flat per-sample cost would otherwise
    take the search, and the activations' memory, to the largest batch), runs out of memory, or the inputs run out;
    measured once per process for an architecture and input shape (again only when later inputs allow larger
    batches than an unfinished search could try)."""
    key = (type(module), tuple((n, tuple(p.shape)) for n, p in module.named_parameters()),
           tuple(inputs.shape[1:]), inputs.dtype, inputs.device, torch.is_autocast_enabled(inputs.device.type))
    if key in _forward_batch and _forward_batch[key][1] >= len(inputs):
        return _forward_batch[key][0]
    best, best_rate, tried = len(inputs), float("inf"), 0.0
    for size in (s for s in FORWARD_BATCHES if s <= len(inputs)):
        timed = inputs[: max(size, TIMED_SAMPLES)]

        def run(size: int = size, timed: torch.Tensor = timed) -> None:
            for i in range(0, len(timed), size):
                apply(timed[i : i + size])

        fits, seconds = within_memory(lambda run=run: best_time(run, inputs.device, repeats=2), inputs.device)
        if not fits and best_rate == float("inf"):
            seconds = best_time(run, inputs.device, repeats=2)  # the smallest batch: raises the genuine error
        elif not fits:
            tried = FORWARD_BATCHES[-1]  # no larger batch is tried again
            break
        rate, tried = seconds / len(timed), size
        if rate >= GAIN * best_rate:  # past the knee: larger batches only cost memory (and the search's time)
            break
        best, best_rate = size, rate
    finished = tried == FORWARD_BATCHES[-1] or best < tried
    _forward_batch[key] = (best, float("inf") if finished else tried)
    return best


def _plain(module: nn.Module, params: Tensors, x: torch.Tensor) -> torch.Tensor:
    return functional_call(module, params, (x,))


def _chunks(sizes: torch.Tensor, max_samples: int) -> list[torch.Tensor]:
    """Groups of client ids whose padded batch [K, n_max] stays within max_samples."""
    groups, current, widest = [], [], 0
    for c, n in enumerate(sizes.tolist()):
        widest_next = max(widest, n)
        if current and widest_next * (len(current) + 1) > max_samples:
            groups.append(current)
            current, widest_next = [], n
        current.append(c)
        widest = widest_next
    if current:
        groups.append(current)
    return [torch.tensor(g, device=sizes.device) for g in groups]


def _scores(module: nn.Module, forward: Forward, task: Task, personal: Tensors, fixed: Tensors, source: torch.Tensor,
            labels: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor, batched: bool) -> Scores:
    """The task's per-sample metric sums and units [K, n_max] of K clients (0 on padding)."""
    width = max(int(sizes.max()), 1)
    pos = torch.arange(width, device=source.device)
    mask = pos[None] < sizes[:, None]
    idx = torch.where(mask, starts[:, None] + pos[None], torch.zeros_like(pos[None]))
    xb, yb = source[idx], labels[idx]

    def apply(params: Tensors, inputs: torch.Tensor, net: nn.Module = module) -> torch.Tensor:
        return forward(net, {**fixed, **params}, inputs)  # a personal copy wins over the global

    apply = with_measured_pooling(apply) if has_2d_maps(module) else apply

    if not personal:  # one model for every client: one batch
        outputs = apply({}, xb.flatten(0, 1)).unflatten(0, xb.shape[:2])
    elif batched:
        outputs = vmap(apply)(personal, xb)
    else:
        per_client: list[torch.Tensor | None] = [None] * len(sizes)
        counts = sizes.tolist()

        def client(k: int, net: nn.Module) -> None:  # its own samples only: no forward pass over the padding
            if counts[k]:
                per_client[k] = apply({n: v[k] for n, v in personal.items()}, xb[k, : counts[k]], net)

        for_each_client(module, client, len(sizes), source.device)
        some = next(o for o in per_client if o is not None)
        outputs = torch.zeros(len(sizes), width, *some.shape[1:], dtype=some.dtype, device=source.device)
        for k, out in enumerate(per_client):
            if out is not None:
                outputs[k, : len(out)] = out
    shape = yb.shape[:2]
    return {m: (total.view(shape) * mask, units.view(shape) * mask)
            for m, (total, units) in task.scores(outputs.flatten(0, 1), yb.flatten(0, 1)).items()}
