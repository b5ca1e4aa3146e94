"""Many peers' copies of one model as one batched computation (the simulator at scale).

A Python loop over N small models costs N times the interpreter's overhead although the
models have one shape. Here the N copies are one ``[N, numel]`` buffer, each parameter a
``[N, *shape]`` view into it, so gossip reads and writes the models as rows of a matrix
without copying; one ``vmap`` of ``grad`` over ``functional_call`` gives every peer's
loss and gradients, and :class:`StackedSGD` steps all of them as ``torch.optim.SGD``
steps each (the same formula, so one batched step equals the per-peer loop up to float
reordering).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

EVAL_CHUNK = 8192
"""Test samples per batched forward in :meth:`StackedModels.evaluate` (bounds its memory:
``peers × chunk × classes`` logits)."""


class StackedModels:
    """``count`` copies of ``template`` (its architecture and starting parameters) as one
    ``[count, numel]`` float buffer ``flat``; ``params`` maps each parameter's name to its
    ``[count, *shape]`` view into ``flat``.

    Example:
        >>> models = StackedModels(nn.Linear(3, 2), 4)
        >>> tuple(models.flat.shape), tuple(models.params["weight"].shape)
        ((4, 8), (4, 2, 3))
        >>> losses, grads = models.gradients(torch.zeros(4, 5, 3), torch.zeros(4, 5).long())
        >>> tuple(losses.shape), tuple(grads.shape)
        ((4,), (4, 8))
    """

    def __init__(self, template: nn.Module, count: int) -> None:
        if count < 1:
            raise ValueError(f"count = {count}; StackedModels needs at least one copy")
        if any(True for _ in template.buffers()):
            raise ValueError(
                f"{type(template).__name__} has buffers (running statistics): stacked peers "
                "average parameters only; use a model without them"
            )
        named = [(name, p.detach()) for name, p in template.named_parameters()]
        if not named:
            raise ValueError(f"{type(template).__name__} has no parameters to train")
        self.count = count
        self.shapes = [tuple(p.shape) for _, p in named]
        start = torch.cat([p.reshape(-1) for _, p in named])
        self.numel = start.numel()
        self.flat = start.to(torch.float32).repeat(count, 1)
        self.params: dict[str, torch.Tensor] = {}
        offset = 0
        for name, p in named:
            n = p.numel()
            self.params[name] = self.flat[:, offset : offset + n].view(count, *p.shape)
            offset += n
        self._module = copy.deepcopy(template).requires_grad_(False)
        self._step = vmap(grad_and_value(self._loss))

    def _loss(self, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> Any:
        return F.cross_entropy(functional_call(self._module, params, (x,)), y)

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every copy's mean cross-entropy on its own batch (``x`` is ``[count, B, ...]``,
        ``y`` ``[count, B]``) and its gradients as a ``[count, numel]`` matrix (the layout
        of ``flat``)."""
        grads, losses = self._step(self.params, x, y)
        flat = torch.cat([grads[name].reshape(self.count, -1) for name in self.params], dim=1)
        return losses, flat

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every copy's accuracy and mean cross-entropy on the held-out set ``(x, y)``."""
        forward = vmap(lambda params, xs: functional_call(self._module, params, (xs,)),
                       in_dims=(0, None))  # fmt: skip
        correct = torch.zeros(self.count)
        loss = torch.zeros(self.count, dtype=torch.float64)
        for a in range(0, len(y), EVAL_CHUNK):
            logits = forward(self.params, x[a : a + EVAL_CHUNK])  # [count, chunk, classes]
            labels = y[a : a + EVAL_CHUNK]
            correct += (logits.argmax(-1) == labels).sum(1)
            loss += F.cross_entropy(
                logits.transpose(1, 2), labels.expand(self.count, -1), reduction="none"
            ).sum(1, dtype=torch.float64)
        return correct / len(y), (loss / len(y)).float()

    def model(self, i: int) -> nn.Module:
        """A standalone copy of peer ``i``'s model (for checks and checkpoints)."""
        module = copy.deepcopy(self._module).requires_grad_(True)
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(self.params[name][i])
        return module


class StackedSGD:
    """``torch.optim.SGD``'s update (momentum with dampening 0, weight decay, no Nesterov)
    for every row of a ``[count, numel]`` parameter matrix at once.

    Per row, as torch does: ``d = g + λp``; with momentum ``b = d`` at the first step, then
    ``b = μb + d``, and ``d = b``; ``p −= lr·d``.
    """

    def __init__(self, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.buffer: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, flat: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        """Step the rows of ``flat`` in place along ``grads`` (same shape)."""
        d = grads.add(flat, alpha=self.weight_decay) if self.weight_decay else grads
        if self.momentum:
            if self.buffer is None:
                self.buffer = d.clone()
            else:
                self.buffer.mul_(self.momentum).add_(d)
            d = self.buffer
        flat.add_(d, alpha=-lr)
