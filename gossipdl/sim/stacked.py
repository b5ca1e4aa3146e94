"""Many peers' copies of one model as one batched computation (the simulator at scale).

A Python loop over N small models costs N times the interpreter's overhead although the
models have one shape. Here the N copies are one ``[N, numel]`` buffer, each parameter a
``[N, *shape]`` view into it, so gossip reads and writes the models as rows of a matrix
without copying; one batched forward and backward (the built-in models' batched matrix
products, :mod:`gossipdl.sim.stacked_layers`, or ``vmap`` over ``functional_call`` for any
other) gives every peer's loss and gradients, and :class:`StackedSGD` steps all of them
as ``torch.optim.SGD`` steps each (the same formula, so one batched step equals the
per-peer loop up to float reordering).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from gossipdl.averaging.local_optimizer import sgd_update_
from gossipdl.sim.stacked_layers import stacked_forward

CPU_CHUNK_PARAMS = 1 << 18
"""Parameters of the peers in one batched forward and backward on a CPU (32 copies of
the 8k-parameter 1-D CNN, 794 of the 330-parameter logistic regression): a chunk's
activations stay in cache (the 1-D CNN at 1,000 peers: 0.16 ms per peer-step in chunks
of 32, 0.52 in one pass) and the interpreter's cost per chunk stays small. On a GPU
every peer is in one chunk."""
EVAL_SAMPLES = 1 << 14
"""Peer-samples per batched forward in :meth:`StackedModels.evaluate` (bounds its
activations' memory however many peers and test samples there are)."""


def unstackable(template: nn.Module) -> str | None:
    """Why copies of ``template`` cannot run stacked, as a phrase after its name (None: they
    can): buffers (running statistics stay each peer's), or, where ``torch.func.vmap`` runs
    the model, a recurrent layer (no batching rule) or dropout (random draws, which vmap
    refuses)."""
    if any(True for _ in template.buffers()):
        return (
            "has buffers (running statistics): stacked peers average parameters only; use a "
            "model without them"
        )
    if stacked_forward(template) is not None:
        return None
    for module in template.modules():
        if isinstance(module, nn.RNNBase):
            return (
                f"has a recurrent layer ({type(module).__name__}), which torch.func.vmap "
                "cannot stack"
            )
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return "has dropout, whose random draws torch.func.vmap refuses"
    return None


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
        problem = unstackable(template)
        if problem is not None:
            raise ValueError(f"{type(template).__name__} {problem}")
        named = [(name, p.detach()) for name, p in template.named_parameters()]
        if not named:
            raise ValueError(f"{type(template).__name__} has no parameters to train")
        self.count = count
        self.shapes = [tuple(p.shape) for _, p in named]
        start = torch.cat([p.reshape(-1) for _, p in named])
        self.numel = start.numel()
        self._names = [name for name, _ in named]
        self._bind(start.to(torch.float32).repeat(count, 1))
        self._module = copy.deepcopy(template).requires_grad_(False)
        self._forward = stacked_forward(self._module) or vmap(self._call)

    def _call(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> Any:
        return functional_call(self._module, params, (x,))

    def _bind(self, flat: torch.Tensor) -> None:
        """Make ``flat`` the stacked parameters and ``params`` its views."""
        self.flat = flat
        self.params = {}
        offset = 0
        for name, shape in zip(self._names, self.shapes, strict=True):
            n = math.prod(shape)
            self.params[name] = flat[:, offset : offset + n].view(self.count, *shape)
            offset += n
        self.chunk = self.count if flat.is_cuda else max(1, CPU_CHUNK_PARAMS // self.numel)

    def to(self, device: torch.device | str) -> StackedModels:
        """Move the stacked parameters to ``device`` (``params`` follow); returns self."""
        self._bind(self.flat.to(device))
        return self

    def _chunks(self) -> list[tuple[int, int, dict[str, torch.Tensor]]]:
        """``(first peer, peers, their parameters)`` of each chunk."""
        return [
            (
                a,
                min(self.chunk, self.count - a),
                {n: p[a : a + self.chunk] for n, p in self.params.items()},
            )
            for a in range(0, self.count, self.chunk)
        ]

    def gradients(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every copy's mean cross-entropy on its own batch (``x`` is ``[count, B, ...]``,
        ``y`` ``[count, B]``) and its gradients as a ``[count, numel]`` matrix (the layout
        of ``flat``)."""
        losses = torch.empty(self.count, device=self.flat.device)
        grads = torch.empty_like(self.flat)
        for a, n, chunk in self._chunks():
            params = {name: p.detach().requires_grad_(True) for name, p in chunk.items()}
            logits = self._forward(params, x[a : a + n])
            batch = logits.shape[1]
            loss = (
                F.cross_entropy(
                    logits.reshape(n * batch, -1), y[a : a + n].reshape(-1), reduction="none"
                )
                .view(n, batch)
                .mean(1)
            )
            found = torch.autograd.grad(loss.sum(), list(params.values()))
            torch.cat([g.reshape(n, -1) for g in found], dim=1, out=grads[a : a + n])
            losses[a : a + n] = loss.detach()
        return losses, grads

    @torch.no_grad()
    def evaluate(
        self, x: torch.Tensor, y: torch.Tensor, own: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every copy's accuracy and mean cross-entropy on the held-out set ``(x, y)``, and
        with ``own`` (``[count, len(y)]``, each copy's own samples: a natural split's) its
        accuracy on those alone (NaN for a copy with none)."""
        correct = torch.zeros(self.count, device=self.flat.device)
        loss = torch.zeros(self.count, dtype=torch.float64, device=self.flat.device)
        mine = torch.zeros(self.count, device=self.flat.device)
        for a, n, params in self._chunks():
            step = max(1, EVAL_SAMPLES // n)
            for b in range(0, len(y), step):
                xs, labels = x[b : b + step], y[b : b + step]
                logits = self._forward(params, xs.expand(n, *xs.shape))  # [n, chunk, classes]
                right = logits.argmax(-1) == labels
                correct[a : a + n] += right.sum(1)
                if own is not None:
                    mine[a : a + n] += (right & own[a : a + n, b : b + step]).sum(1)
                loss[a : a + n] += F.cross_entropy(
                    logits.transpose(1, 2), labels.expand(n, -1), reduction="none"
                ).sum(1, dtype=torch.float64)
        own_accuracy = None if own is None else (mine / own.sum(1)).cpu()
        return (correct / len(y)).cpu(), (loss / len(y)).float().cpu(), own_accuracy

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
        self.buffer = sgd_update_(flat, grads, self.buffer, lr, self.momentum, self.weight_decay)
