"""Accuracy and loss of every client with its own personalized model, vectorized and chunked."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from fedpilot.engine.local import Params, choose_execution, for_each_client, precision_context


def client_major_index(offsets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """Indices of all samples of one split, client after client."""
    starts = torch.cumsum(sizes, 0) - sizes
    within = torch.arange(int(sizes.sum()), device=sizes.device) - starts.repeat_interleave(sizes)
    return offsets.repeat_interleave(sizes) + within


@torch.no_grad()
def evaluate_clients(model: nn.Module, shared: Params, personal_of: Callable[[torch.Tensor], Params],
                     x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor,
                     head_only: bool, execution: str, max_samples: int = 16384,
                     precision: str = "32-true") -> tuple[torch.Tensor, torch.Tensor]:
    """(accuracy [n_clients], loss [n_clients]) on one split; NaN for a client with no samples there.

    When only the head is personal, the shared body runs once over all samples of the split and the
    personal heads run batched on its features. Forward passes run in the stage's `precision`.
    """
    with precision_context(precision, x.device):
        return _evaluate(model, shared, personal_of, x, y, offsets, sizes, head_only, execution, max_samples)


def _evaluate(model: nn.Module, shared: Params, personal_of: Callable[[torch.Tensor], Params], x: torch.Tensor,
              y: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor, head_only: bool, execution: str,
              max_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = client_major_index(offsets, sizes)
    labels = y[index]
    if head_only:
        body = {n[5:]: v for n, v in shared.items() if n.startswith("body.")}
        source = torch.cat([functional_call(model.body, body, (x[index[i : i + max_samples]],))
                            for i in range(0, len(index), max_samples)]) if len(index) else x[:0]
        module, fixed, strip = model.head, {n[5:]: v for n, v in shared.items() if n.startswith("head.")}, 5
    else:
        source, module, fixed, strip = x[index], model, shared, 0
    starts = torch.cumsum(sizes, 0) - sizes
    acc = torch.full((len(sizes),), float("nan"), device=x.device)
    loss = acc.clone()
    for clients in _chunks(sizes, max_samples):
        personal = {n[strip:]: v for n, v in personal_of(clients).items()}
        hits, losses, mask = _scores(module, personal, fixed, source, labels, starts[clients], sizes[clients],
                                     execution)
        count = mask.sum(1)
        acc[clients] = (hits * mask).sum(1) / count
        loss[clients] = (losses * mask).sum(1) / count
    return acc, loss


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


def _scores(module: nn.Module, personal: Params, fixed: Params, source: torch.Tensor, labels: torch.Tensor,
            starts: torch.Tensor, sizes: torch.Tensor, execution: str):
    """Per-sample hits and losses [K, n_max] of K clients, and the mask of real samples."""
    width = max(int(sizes.max()), 1)
    pos = torch.arange(width, device=source.device)
    mask = pos[None] < sizes[:, None]
    idx = torch.where(mask, starts[:, None] + pos[None], torch.zeros_like(pos[None]))
    xb, yb = source[idx], labels[idx]

    def forward(params: Params, inputs: torch.Tensor, net: nn.Module = module) -> torch.Tensor:
        return functional_call(net, {**fixed, **params}, (inputs,))  # a personal copy wins over the global

    if choose_execution(execution, module, source.device) == "vmap" or not personal:
        logits = vmap(forward, in_dims=(0 if personal else None, 0))(personal, xb)
    else:
        per_client: list[torch.Tensor | None] = [None] * len(sizes)

        def client(k: int, net: nn.Module) -> None:
            per_client[k] = forward({n: v[k] for n, v in personal.items()}, xb[k], net)

        for_each_client(module, client, len(sizes), source.device)
        logits = torch.stack(per_client)
    losses = F.cross_entropy(logits.float().flatten(0, -2), yb.flatten(), reduction="none").view(yb.shape)
    hits = (logits.argmax(-1) == yb).float()
    if yb.dim() > 2:
        losses, hits = losses.flatten(2).mean(2), hits.flatten(2).mean(2)
    return hits, losses, mask.float()
