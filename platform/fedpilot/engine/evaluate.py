"""Per-client metrics of every client with its own personalized model, vectorized and chunked."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn
from torch.func import functional_call, vmap

from fedpilot.engine.accel import choose
from fedpilot.engine.accel.pooling import MeasuredPooling, has_2d_maps, with_measured_pooling
from fedpilot.engine.accel.threads import for_each_client
from fedpilot.engine.accel.timing import best_time, within_memory
from fedpilot.engine.data import ClientData, client_major_index
from fedpilot.engine.executor import Forward, Params, precision_context
from fedpilot.engine.memory import keep_freed_memory, release_freed_memory
from fedpilot.engine.task import Scores, Task
from fedpilot.models.split import ParamSplit

# Samples a chunk of the evaluation holds at once. Resident memory climbs during a chunk's forward passes more than
# its tensors explain (the host allocator; bench/README.md, 2026-11-27) and comes back between chunks: the chunk
# bounds it. A larger one gains nothing on the flat path, which runs the measured forward batch anyway.
CHUNK_SAMPLES = 4096


@torch.no_grad()
def evaluate_clients(model: nn.Module, split: ParamSplit, forward: Forward, task: Task, shared: Params,
                     personal_of: Callable[[torch.Tensor], Params], data: ClientData, part: str, execution: str,
                     clients: torch.Tensor | None = None, max_samples: int = CHUNK_SAMPLES,
                     precision: str = "32-true") -> dict[str, torch.Tensor]:
    """Each of the task's metrics per client of `clients` (default: every client) on the data's split `part`;
    NaN for a client with no samples there.

    With no personal parameters the model runs over the clients' samples as one flat sequence in large batches
    (no padding) and the metrics are summed per client; when only the head is personal, the shared body runs
    that way and the personal heads run batched on its features. Forward passes run in the stage's `precision`.
    Data kept on the host (a federation larger than the device's budget) travels to the model's device batch by
    batch.
    """
    device = next(model.parameters()).device
    keep_freed_memory(device)
    ids = torch.arange(data.n_clients) if clients is None else clients.cpu()
    sizes = data.sizes[part].cpu()[ids]
    index = client_major_index(data.offsets[part].cpu()[ids], sizes)
    first = int(index[0]) if len(index) else 0
    in_order = bool((index == torch.arange(first, first + len(index))).all())  # one stored range: slices, no copy
    index = index.to(data.x.device)

    def rows_at(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model inputs and labels of the samples index[start:stop], on the model's device: a chunk's, so the host
        allocator first hands back what the last chunk freed (it keeps freed memory for the rounds,
        keep_freed_memory, and chunk after chunk would not reuse all of it)."""
        release_freed_memory()
        rows = slice(first + start, first + min(stop, len(index))) if in_order else index[start:stop]
        return data.inputs(data.x[rows].to(device, non_blocking=True)), data.y[rows].to(device, non_blocking=True)

    sizes = sizes.to(device)
    personal_of = (lambda of: lambda rows: of(ids[rows.cpu()].to(device)))(personal_of)  # rows -> their params
    pooling = MeasuredPooling() if has_2d_maps(model) else nullcontext()  # threads enter it in `_scores`'s `apply`
    with precision_context(precision, device), pooling:
        if not personal_of(torch.arange(0)):
            return _flat(model, lambda inputs: forward(model, shared, inputs), task, rows_at, len(index), sizes,
                         max_samples)
        if split.head_only(split.personal_names):  # the shared body once per sample, the heads on its features
            body = split.in_body(shared)

            def features_at(start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
                inputs, labels = rows_at(start, stop)
                return in_batches(model.body, lambda x: functional_call(model.body, body, (x,)), inputs), labels

            return _per_client(model.head, _plain, task, split.in_head(shared),
                               lambda rows: split.in_head(personal_of(rows)), features_at, sizes, execution,
                               max_samples)
        return _per_client(model, forward, task, shared, personal_of, rows_at, sizes, execution, max_samples)


def _flat(model: nn.Module, apply: Callable[[torch.Tensor], torch.Tensor], task: Task,
          rows_at: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], count: int, sizes: torch.Tensor,
          max_samples: int) -> dict[str, torch.Tensor]:
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


def _plain(module: nn.Module, params: Params, x: torch.Tensor) -> torch.Tensor:
    return functional_call(module, params, (x,))


def _per_client(module: nn.Module, forward: Forward, task: Task, fixed: Params,
                personal_of: Callable[[torch.Tensor], Params],
                source_at: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], sizes: torch.Tensor,
                execution: str, max_samples: int) -> dict[str, torch.Tensor]:
    """Metric sums over each client's samples divided by its units, chunk of clients by chunk: a chunk's samples
    are one contiguous range, whose inputs (or body features) and labels `source_at(start, stop)` gives."""
    starts = torch.cumsum(sizes, 0) - sizes
    results = {m: torch.full((len(sizes),), float("nan"), device=sizes.device) for m in task.metrics}
    for clients in _chunks(sizes, max_samples):
        first, last = int(starts[clients[0]]), int(starts[clients[-1]] + sizes[clients[-1]])
        if last == first:  # none of these clients has samples in the split: NaN
            continue
        source, labels = source_at(first, last)
        scores = _scores(module, forward, task, personal_of(clients), fixed, source, labels,
                         starts[clients] - first, sizes[clients], execution)
        for metric, (total, units) in scores.items():
            results[metric][clients] = total.sum(1) / units.sum(1)
    return results


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


def _scores(module: nn.Module, forward: Forward, task: Task, personal: Params, fixed: Params, source: torch.Tensor,
            labels: torch.Tensor, starts: torch.Tensor, sizes: torch.Tensor, execution: str) -> Scores:
    """The task's per-sample metric sums and units [K, n_max] of K clients (0 on padding)."""
    width = max(int(sizes.max()), 1)
    pos = torch.arange(width, device=source.device)
    mask = pos[None] < sizes[:, None]
    idx = torch.where(mask, starts[:, None] + pos[None], torch.zeros_like(pos[None]))
    xb, yb = source[idx], labels[idx]

    def apply(params: Params, inputs: torch.Tensor, net: nn.Module = module) -> torch.Tensor:
        return forward(net, {**fixed, **params}, inputs)  # a personal copy wins over the global

    apply = with_measured_pooling(apply) if has_2d_maps(module) else apply

    if not personal:  # one model for every client: one batch
        outputs = apply({}, xb.flatten(0, 1)).unflatten(0, xb.shape[:2])
    elif choose(execution, module, source.device).batched:
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
