"""2-d pooling in the memory layout measured fastest for each input, inside eager forward passes.

torch's CPU max pooling of an NCHW tensor is much slower than of the same tensor channels-last (bench/README.md),
while convolutions are often faster NCHW. `MeasuredPooling` runs each pooling call of an NCHW-contiguous input in
whichever layout a timing of that call's shape measured faster (once per process and shape), and hands the output
back NCHW, so the layers around it keep their layout. The values are the same: only where the pooling reads and
writes changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from fedpilot.engine.accel.timing import fastest

POOLINGS = frozenset({F.max_pool2d, F.max_pool2d_with_indices, F.avg_pool2d, F.adaptive_max_pool2d,
                      F.adaptive_avg_pool2d, F.lp_pool2d, torch.max_pool2d})
_channels_last_faster: dict[tuple, bool] = {}  # the measured choice per call signature, for the process


def _is_plain_nchw(x: Any) -> bool:
    """An ordinary (not vmapped, not functorch-wrapped) 4-d tensor, contiguous in NCHW order."""
    return (isinstance(x, torch.Tensor) and not torch._C._functorch.is_functorch_wrapped_tensor(x)
            and x.dim() == 4 and x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last))


def _nchw(out: Any) -> Any:
    return tuple(_nchw(o) for o in out) if isinstance(out, tuple) else out.contiguous()


class _NchwGradient(torch.autograd.Function):
    """The identity, whose gradient goes back NCHW-contiguous: the pooling's backward writes it channels-last,
    and the NCHW layers before it (a ReLU's backward) are slower on a gradient of the other layout."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _run_channels_last(func: Callable, args: tuple, kwargs: dict) -> Any:
    x = _NchwGradient.apply(args[0]) if args[0].requires_grad else args[0]
    return _nchw(func(x.contiguous(memory_format=torch.channels_last), *args[1:], **kwargs))


def channels_last_is_faster(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether `func(*args, **kwargs)` measured faster with its input channels-last (conversions included)."""
    x = args[0]
    key = (func, tuple(x.shape), x.dtype, x.device, repr(args[1:]), repr(sorted(kwargs.items())))
    if key not in _channels_last_faster:
        sample = (x.detach(), *args[1:])
        runs = {"nchw": lambda: func(*sample, **kwargs),
                "channels_last": lambda: _run_channels_last(func, sample, kwargs)}
        with torch.no_grad():
            choice = fastest(list(runs), lambda name: runs[name](), x.device).choice
        _channels_last_faster[key] = choice == "channels_last"
    return _channels_last_faster[key]


class MeasuredPooling(TorchFunctionMode):
    """Pooling calls on NCHW inputs run in the layout measured faster for them; everything else as called.
    A mode is thread-local: enter it in the thread that runs the forward pass (`with_measured_pooling`)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in POOLINGS and args and _is_plain_nchw(args[0]) and channels_last_is_faster(func, args, kwargs):
            return _run_channels_last(func, args, kwargs)
        return func(*args, **kwargs)


MAP_LAYERS = (nn.Conv2d, nn.ConvTranspose2d, nn.MaxPool2d, nn.AvgPool2d, nn.AdaptiveMaxPool2d,
              nn.AdaptiveAvgPool2d, nn.LPPool2d)


def has_2d_maps(module: nn.Module) -> bool:
    """Whether the module works on 2-d feature maps (where pooling is worth measuring; elsewhere the mode would
    only add its per-operation cost)."""
    return any(isinstance(m, MAP_LAYERS) for m in module.modules())


def with_measured_pooling(apply: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`apply` run under `MeasuredPooling`, in whichever thread calls it."""

    def pooled(*args: Any) -> torch.Tensor:
        with MeasuredPooling():
            return apply(*args)

    return pooled
