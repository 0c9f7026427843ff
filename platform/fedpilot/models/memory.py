"""The estimate of the device memory one client needs to train of Pillutla et al., ICML 2022 (App. B.4).

A device in round t holds the broadcast shared model u (to compute the delta it sends back), its current iterate
of u and of its personal part v, their gradients, and the buffers backpropagation needs:

    Memory = 3 size(u) + 2 size(v) + size(backprop),   backprop buffers for a batch of 1.

With full personalization (Ditto's personal copy) u and v are both the whole model. The paper does not say how it
sized the backprop buffers; we count twice the output of every module of one forward pass of one sample (the
activation and its gradient, the convention of torchsummary's "forward/backward pass size"), skipping modules that
hand their input through unchanged (nn.Identity, an empty Sequential). This reproduces the EMNIST column of the
paper's Table 10 (ResNet-18 with GroupNorm on 28x28 images: 142 MB without, with input-layer and with output-layer
personalization, 232 MB with full personalization; tests/test_memory_model.py). Bytes are the parameters' own
dtype (float32 in the paper).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn


def backprop_bytes(model: nn.Module, forward: Callable[[], Any]) -> int:
    """size(backprop): twice the bytes of every leaf module's output while `forward()` runs one sample through
    `model` (modules returning their input unchanged add nothing)."""
    total = 0

    def count(module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        nonlocal total
        if not (inputs and output is inputs[0]):
            total += sum(t.numel() * t.element_size() for t in _tensors(output))

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return 2 * total


def estimated_training_bytes(shared_bytes: int, personal_bytes: int, backprop: int) -> int:
    """App. B.4: 3 size(u) + 2 size(v) + size(backprop)."""
    return 3 * shared_bytes + 2 * personal_bytes + backprop


def _tensors(value: Any) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []
