"""Models made of Linear layers: every client's layers as batched matrix products (engine/accel/linear_graph.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedpilot.engine.accel.linear_graph import NotBatched, linear_graph, output_grads, sgd_, weight_grads
from fedpilot.engine.accel.vmap import VmapAutogradExecutor
from fedpilot.engine.executor import StepRule, Tensors


class BmmExecutor(VmapAutogradExecutor):
    """Models made of Linear layers: every client's layers as batched matrix products in the model's traced graph,
    plain SGD fused into the weight gradients (engine/linear_graph.py); steps the graph does not cover (another
    forward, a model it does not apply to) as `vmap_autograd`. A candidate the stage times."""

    name = "bmm"

    @classmethod
    def supports(cls, module: nn.Module, device: torch.device) -> bool:
        return super().supports(module, device) and linear_graph(module) is not None

    def graph(self, module: nn.Module) -> Callable | None:
        return linear_graph(module) if self.models_forward else None

    def outputs(self, graph: Callable, trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w) -> tuple:
        """The trained layers' inputs and output gradients, and the clients' (loss, metric), of one pass."""
        return output_grads(graph, self.task, {**trainable, **frozen, **fixed}, list(trainable), x, y, w)

    def step_grad(self, module: nn.Module) -> Callable[..., tuple[Tensors, tuple]]:
        graph, vmapped = self.graph(module), super().step_grad
        if graph is None:
            return vmapped(module)

        def step(trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w):
            try:
                seen, loss, metric = self.outputs(graph, trainable, frozen, fixed, x, y, w)
            except NotBatched:
                return vmapped(module)(trainable, frozen, fixed, x, y, w)
            return weight_grads(seen, trainable), (loss, metric)

        return step

    def stepper(self, module: nn.Module, rule: StepRule) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        graph, gradient_step = self.graph(module), super().stepper(module, rule)
        if graph is None or not rule.plain:
            return gradient_step

        def step(trainable: Tensors, frozen: Tensors, fixed: Tensors, x, y, w, active):
            try:
                seen, loss, metric = self.outputs(graph, trainable, frozen, fixed, x, y, w)
            except NotBatched:
                return gradient_step(trainable, frozen, fixed, x, y, w, active)
            sgd_(seen, trainable, rule.lr, active)
            return loss, metric

        return step
