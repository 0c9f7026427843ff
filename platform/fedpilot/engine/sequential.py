"""The plain sequential executor: one client at a time, an eager nn.Module and torch.optim.SGD. It is the reference
the vectorized executors are tested against (tests/, fedpilot.testing, which pin it by its name `sequential`; no
`execution:` value selects it), and shares nothing with them but the batch plan, the task's loss and the algorithm's
way of applying the model.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from fedpilot.engine.executor import Batches, Executor, StepRule, Tensors, TrainStats


class SequentialExecutor(Executor):
    """Eager PyTorch: load a client's parameters into a module copy, loss.backward(), clip, optimizer.step()."""

    name = "sequential"
    uses_features = False

    def _loss(self, net: nn.Module, extra: Tensors, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The task's loss of the client's real samples, through the algorithm's forward on the module itself (with
        the client's `extra` values that are not parameters: its per-client constants)."""
        ones = torch.ones(len(y), device=y.device)
        return self.task.loss(self.forward(net, {**dict(net.named_parameters()), **extra}, x), y, ones)[0]

    @staticmethod
    def _client(module: nn.Module, k: int, trained: Tensors, frozen: Tensors,
                fixed: Tensors) -> tuple[nn.Module, Tensors]:
        """A copy of `module` holding client k's parameters, `trained` ones requiring gradients, and its values
        that are not parameters."""
        net = copy.deepcopy(module)
        values = {**{n: v[k] for n, v in trained.items()}, **{n: v[k] for n, v in frozen.items()}, **fixed}
        for name, param in net.named_parameters():
            param.data.copy_(values.pop(name))
            param.requires_grad_(name in trained)
            param.grad = None
        return net, values

    def train(self, module: nn.Module, trainable: Tensors, frozen: Tensors, fixed: Tensors,
              batches: Batches, rule: StepRule, stats: TrainStats) -> Tensors:
        results = []
        for k in range(batches.index.shape[0]):
            mine = rule.at(k)  # client k's lrs, pull and weight decay as numbers
            net, extra = self._client(module, k, trainable, frozen, fixed)
            groups = [{"params": [p], "lr": mine.lr[n], "name": n} for n, p in net.named_parameters() if n in trainable]
            opt = torch.optim.SGD(groups, lr=1.0, weight_decay=mine.weight_decay)
            for s in range(batches.index.shape[1]):
                if not bool(batches.active[k, s]):
                    continue
                real = batches.weight[k, s] > 0
                x = batches.inputs(k, s)[real]
                y = batches.labels[k, s][real]
                opt.zero_grad()
                loss = self._loss(net, extra, x, y)
                if mine.prox:
                    loss = loss + mine.prox / 2 * sum(
                        (p - _ref(mine.reference[n], k, trainable[n])).pow(2).sum()
                        for n, p in net.named_parameters() if n in trainable)
                loss.backward()
                if mine.clip_norm is not None:
                    nn.utils.clip_grad_norm_([p for p in net.parameters() if p.requires_grad], mine.clip_norm)
                opt.step()
                stats.steps[k] += 1
            results.append({n: p.detach().clone() for n, p in net.named_parameters() if n in trainable})
        return {n: torch.stack([r[n] for r in results]) for n in trainable}

    def gradients(self, module: nn.Module, params: Tensors, frozen: Tensors, fixed: Tensors, batches: Batches,
                  stats: TrainStats) -> Tensors:
        """loss.backward() per active step into .grad, averaged over the client's steps."""
        results = []
        for k in range(batches.index.shape[0]):
            net, extra = self._client(module, k, params, frozen, fixed)
            steps = torch.nonzero(batches.active[k]).flatten().tolist()
            for s in steps:
                real = batches.weight[k, s] > 0
                self._loss(net, extra, batches.inputs(k, s)[real], batches.labels[k, s][real]).backward()
                stats.steps[k] += 1
            results.append({n: p.grad / max(len(steps), 1) if p.grad is not None else torch.zeros_like(p)
                            for n, p in net.named_parameters() if n in params})
        return {n: torch.stack([r[n] for r in results]) for n in params}


def _ref(reference: torch.Tensor, k: int, param: torch.Tensor) -> torch.Tensor:
    return reference[k] if reference.dim() == param.dim() else reference

