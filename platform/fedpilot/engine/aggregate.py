"""Server-side combination of client uploads into one pseudo-gradient, chunk by chunk (and process by process)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fedpilot.engine.protocol import ReducibleAggregator, RoundInfo, Upload

if TYPE_CHECKING:
    import torch

    from fedpilot.engine.config import ServerConfig
    from fedpilot.engine.executor import Tensors


class WeightedMean(ReducibleAggregator):
    """Weighted mean of client deltas (broadcast - new shared) or gradients, streamed over chunks.

    With a mask, each entry is averaged over the clients that sent it (per-index aggregation);
    an entry nobody sent gets a zero pseudo-gradient. The state is sums, so DDP processes that each aggregated
    a slice of the cohort combine by `all_reduce`; a subclass whose `result` is not a function of these sums
    must derive from Aggregator instead.
    """

    def __init__(self) -> None:
        self.sums: Tensors = {}
        self.weight: Tensors = {}
        self.upload_bytes = 0
        self.broadcast_weight: Tensors = {}  # per name: the summed weight of deltas whose broadcast term is yet to add
        self.broadcast: Tensors = {}

    @property
    def total(self) -> Tensors:
        """The weighted sums by name: of gradients, or of deltas, sum_k w_k (broadcast - shared_k). A chunk of deltas
        adds -sum_k w_k shared_k alone; the broadcast's share of every chunk is added here at once, when the sums are
        read (one pass over the parameters a round, not one a chunk)."""
        for name, weight in self.broadcast_weight.items():
            self.sums[name].addcmul_(self.broadcast[name], weight)
        self.broadcast_weight.clear()
        return self.sums

    def add(self, upload: Upload, info: RoundInfo) -> None:
        import torch

        from fedpilot.engine.executor import per_client

        values = upload.grad if upload.grad is not None else upload.shared
        deltas = upload.grad is None  # sum_k w_k (broadcast - shared_k)
        for name, value in values.items():
            w = upload.weight.to(value.dtype)
            mask = upload.mask.get(name) if upload.mask is not None else None
            if mask is None:
                w_sum = w.sum()
                self.upload_bytes += value.numel() * value.element_size()
                if name not in self.sums:
                    self.sums[name] = torch.zeros_like(value[0])
                # into the running sum in one pass over the chunk's rows: no [K, ...] or parameter-sized temporaries
                self.sums[name].view(-1).addmv_(value.reshape(len(w), -1).T, w, alpha=-1 if deltas else 1)
                if deltas:
                    self.broadcast_weight[name] = self.broadcast_weight.get(name, 0) + w_sum
                    self.broadcast[name] = info.broadcast[name]
            else:
                w = per_client(w, value) * mask.to(value.dtype)
                total, w_sum = (w * value).sum(0), w.sum(0)
                self.upload_bytes += int(mask.sum()) * value.element_size()
                total = w_sum * info.broadcast[name] - total if deltas else total
                self.sums[name] = self.sums.get(name, 0) + total
            self.weight[name] = self.weight.get(name, 0) + w_sum

    def result(self, info: RoundInfo, state: dict[str, Any]) -> tuple[Tensors, dict[str, Any]]:
        return self.normalized(), state

    def normalized(self) -> Tensors:
        """The weighted sums divided by their weights."""
        import torch

        return {n: t / torch.as_tensor(self.weight[n]).clamp_min(1e-12) for n, t in self.total.items()}

    def all_reduce(self, info: RoundInfo, device: torch.device) -> None:
        """Sum the totals, weights and upload bytes of every DDP process into each, so that `result()` is the
        whole cohort's everywhere. Weights are expanded to their parameter's shape (a process may hold none)."""
        import torch
        import torch.distributed as dist

        names = list(info.broadcast)
        counts = [float(name in self.total) for name in names] + [float(self.upload_bytes)]
        sent = torch.tensor(counts, dtype=torch.float64, device=device)
        dist.all_reduce(sent)
        self.upload_bytes = int(sent[-1])
        for i, name in enumerate(names):
            if sent[i] == 0:  # no process got this parameter from any client
                continue
            total = self.total.get(name, torch.zeros_like(info.broadcast[name]))
            weight = torch.as_tensor(self.weight.get(name, 0.0), dtype=total.dtype, device=total.device)
            weight = weight.expand_as(total).contiguous()
            dist.all_reduce(total)
            dist.all_reduce(weight)
            self.total[name], self.weight[name] = total, weight


def server_optimizer(groups: Sequence[tuple[ServerConfig, list[torch.nn.Parameter]]]) -> torch.optim.Optimizer:
    """The torch optimizer of the shared parameters, which steps on the aggregate (their pseudo-gradient): one
    parameter group per trial (`groups`: a batch of trials' servers and parameters; a stage alone is one), each with
    its server's numbers; its kind is the first's (a batch's trials share it)."""
    import torch

    if groups[0][0].optimizer == "adam":
        return torch.optim.Adam([{"params": params, "lr": server.lr, "betas": server.betas, "eps": server.eps}
                                 for server, params in groups])
    return torch.optim.SGD([{"params": params, "lr": server.lr, "momentum": server.momentum}
                            for server, params in groups])
