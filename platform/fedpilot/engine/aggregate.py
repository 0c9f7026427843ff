"""Server-side combination of client uploads into one pseudo-gradient, chunk by chunk."""

from __future__ import annotations

import torch

from fedpilot.engine.cohort import Upload
from fedpilot.engine.local import Params


class WeightedMean:
    """Weighted mean of client deltas (broadcast - new shared) or gradients, streamed over chunks.

    With a mask, each entry is averaged over the clients that sent it (per-index aggregation);
    an entry nobody sent gets a zero pseudo-gradient.
    """

    def __init__(self) -> None:
        self.total: Params = {}
        self.weight: Params = {}
        self.upload_bytes = 0

    def add(self, upload: Upload, broadcast: Params, default_weight: torch.Tensor) -> None:
        weight = upload.weight if upload.weight is not None else default_weight
        values = upload.grad if upload.grad is not None else upload.shared
        for name, value in values.items():
            w = weight.to(value.dtype)
            mask = upload.mask.get(name) if upload.mask is not None else None
            if mask is None:
                total, w_sum = torch.tensordot(w, value, dims=1), w.sum()  # no [K, ...] temporaries
                self.upload_bytes += value.numel() * value.element_size()
            else:
                w = w.view(-1, *[1] * (value.dim() - 1)) * mask.to(value.dtype)
                total, w_sum = (w * value).sum(0), w.sum(0)
                self.upload_bytes += int(mask.sum()) * value.element_size()
            if upload.grad is None:  # deltas: sum_k w_k (broadcast - shared_k)
                total = w_sum * broadcast[name] - total
            self.total[name] = self.total.get(name, 0) + total
            self.weight[name] = self.weight.get(name, 0) + w_sum

    def result(self) -> Params:
        return {n: t / torch.as_tensor(self.weight[n]).clamp_min(1e-12) for n, t in self.total.items()}
