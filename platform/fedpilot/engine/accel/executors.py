"""Every executor by its `execution:` name, the candidates a stage times, and `choose`: the one place an
`execution:` value becomes an executor ("auto": the rule of thumb, until a stage has timed the candidates)."""

from __future__ import annotations

import torch
from torch import nn

from fedpilot.engine.accel.bmm import BmmExecutor
from fedpilot.engine.accel.loop import BatchedFirstStepExecutor, ChannelsLastLoopExecutor, LoopExecutor
from fedpilot.engine.accel.vmap import VmapAutogradExecutor, VmapExecutor
from fedpilot.engine.config import AUTO
from fedpilot.engine.config import EXECUTORS as NAMES
from fedpilot.engine.executor import Executor
from fedpilot.engine.sequential import SequentialExecutor

# every executor by its `execution:` name (`sequential`, the tests' reference, is no `execution:` value)
EXECUTORS: dict[str, type[Executor]] = {e.name: e for e in (
    VmapExecutor, VmapAutogradExecutor, LoopExecutor, ChannelsLastLoopExecutor, BatchedFirstStepExecutor,
    BmmExecutor, SequentialExecutor)}
CANDIDATES: tuple[type[Executor], ...] = tuple(EXECUTORS[name] for name in NAMES)  # engine.config's names


def executor_candidates(module: nn.Module, device: torch.device = torch.device("cpu")) -> list[str]:
    """The executors a stage times on its first round, those that support the model: the loop; the two vmaps unless
    the model has recurrent layers (torch.func cannot vmap the fused RNN kernels); for a model of Linear layers
    `bmm` (`linear_graph` applies); with 2-d convolutions the channels-last loop, and the loop with a batched first
    step where the model allows it (`shared_start.batchable`)."""
    return [e.name for e in CANDIDATES if e.supports(module, device)]


def rule_of_thumb(module: nn.Module, device: torch.device) -> type[Executor]:
    """The executor for work no stage has timed (bench/README.md): recurrent layers and, on CPU, convolutions
    (vmap turns conv2d into a grouped convolution) per client, everything else (a model's head alone, a Linear,
    included) vmapped."""
    if not VmapExecutor.supports(module, device) or (Executor.has_layers(module, nn.modules.conv._ConvNd)
                                                      and device.type == "cpu"):
        return LoopExecutor
    return VmapExecutor


def choose(requested: str, module: nn.Module, device: torch.device) -> type[Executor]:
    """The executor for training or evaluating `module`: the one `requested` names (a stage's timed choice, or the
    user's), or for "auto" the rule of thumb."""
    return rule_of_thumb(module, device) if requested == AUTO else EXECUTORS[requested]
