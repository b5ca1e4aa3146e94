"""The peer's local optimizer: gossipdl's own SGD, and what the averagers need of any
optimizer, in both engines: DGC's momentum factor masking (Lin et al. 2018) after a send,
and the learning rate a round's tracking scales by."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import torch


def sgd_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    buffer: torch.Tensor | None,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> torch.Tensor | None:
    """One step of ``torch.optim.SGD`` (dampening 0, no Nesterov) on ``param``, in place, with
    torch's operations in torch's order (the same bits): ``d = g + λp``; with momentum
    ``b = d`` at the first step (``buffer`` None), then ``b = μb + d``, and ``d = b``;
    ``p −= lr·d``. Returns the momentum buffer (None without momentum). A stacked matrix
    of peers' parameters steps in one call as a single tensor does."""
    d = grad.add(param, alpha=weight_decay) if weight_decay else grad
    if momentum:
        if buffer is None:
            buffer = d.clone()
        else:
            buffer.mul_(momentum).add_(d)
        d = buffer
    param.add_(d, alpha=-lr)
    return buffer


class SGD:
    """``torch.optim.SGD`` (momentum with dampening 0, weight decay, no Nesterov) without
    ``torch.optim``, whose ``step`` imports ``torch._dynamo`` on its first call: 1.1–1.6 s of
    every process's start, more than torch itself, for nothing a peer does. The same bits
    as ``torch.optim.SGD``; ``state``, ``param_groups`` (one group), ``zero_grad`` and a
    ``state_dict`` in torch's format, so checkpoints load into either.

    Example:
        >>> p = torch.nn.Parameter(torch.ones(2))
        >>> opt = SGD([p], lr=0.5, momentum=0.9)
        >>> p.grad = torch.ones(2)
        >>> opt.step(), opt.step()
        (None, None)
        >>> p.tolist(), opt.state[p]["momentum_buffer"].tolist()
        ([-0.44999998807907104, -0.44999998807907104], [1.899999976158142, 1.899999976158142])
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
    ) -> None:
        listed = list(params)
        if not listed:
            raise ValueError("SGD got an empty parameter list: the model has nothing to train")
        self.param_groups: list[dict[str, Any]] = [
            {"params": listed, "lr": lr, "momentum": momentum, "dampening": 0,
             "weight_decay": weight_decay, "nesterov": False, "maximize": False,
             "foreach": None, "differentiable": False, "fused": None}
        ]  # fmt: skip
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    @torch.no_grad()
    def step(self) -> None:
        """One step of every parameter with a gradient."""
        group = self.param_groups[0]
        for p in group["params"]:
            if p.grad is None:
                continue
            held = self.state.get(p, {}).get("momentum_buffer")
            buffer = sgd_update_(p, p.grad, held, group["lr"], group["momentum"],
                                 group["weight_decay"])  # fmt: skip
            if buffer is not None:
                self.state.setdefault(p, {})["momentum_buffer"] = buffer

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient."""
        for p in self.param_groups[0]["params"]:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """``torch.optim.SGD``'s format: state by parameter index, the group's settings."""
        params = self.param_groups[0]["params"]
        index = {id(p): i for i, p in enumerate(params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {
            "state": {index[id(p)]: dict(state) for p, state in self.state.items()},
            "param_groups": [{**group, "params": list(range(len(params)))}],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take a :meth:`state_dict` (or ``torch.optim.SGD``'s) of the same parameters;
        ValueError naming what does not fit."""
        params = self.param_groups[0]["params"]
        groups = state_dict.get("param_groups")
        if not (isinstance(groups, list) and len(groups) == 1 and isinstance(groups[0], dict)):
            raise ValueError("an SGD state has one parameter group; this one does not")
        if len(groups[0].get("params", ())) != len(params):
            raise ValueError(
                f"the saved state is of {len(groups[0].get('params', ()))} parameters, "
                f"this optimizer has {len(params)}"
            )
        for key, plain in (("nesterov", False), ("maximize", False), ("dampening", 0)):
            if groups[0].get(key, plain) != plain:
                raise ValueError(
                    f"the saved state has {key} = {groups[0][key]!r}, which gossipdl's SGD does "
                    f"not do (it steps with {key} = {plain!r}); train on with torch.optim.SGD"
                )
        for key in ("lr", "momentum", "weight_decay"):
            self.param_groups[0][key] = float(groups[0][key])
        self.state = {}
        for i, state in state_dict.get("state", {}).items():
            if not (isinstance(i, int) and 0 <= i < len(params) and isinstance(state, dict)):
                raise ValueError(f"the saved state has an entry {i!r} of no parameter here")
            buffer = state.get("momentum_buffer")
            if buffer is not None:
                p = params[i]
                if not (isinstance(buffer, torch.Tensor) and buffer.shape == p.shape):
                    shape = tuple(buffer.shape) if isinstance(buffer, torch.Tensor) else buffer
                    raise ValueError(
                        f"the saved momentum of parameter {i} is {shape!r}, "
                        f"the parameter {tuple(p.shape)}"
                    )
                self.state[p] = {"momentum_buffer": buffer.to(p.device, p.dtype).clone()}


LocalOptimizer: TypeAlias = torch.optim.Optimizer | SGD
"""What a peer steps with: gossipdl's :class:`SGD`, or any ``torch.optim`` optimizer."""


def mask_momentum(
    optimizer: LocalOptimizer | None,
    params: Sequence[torch.Tensor],
    mask: torch.Tensor | None,
) -> None:
    """Zero the optimizer's momentum where ``mask`` (a flat bool vector over ``params``, in
    order: ``Averager.sent_mask``) is set: what built up there has been sent and must not
    push again. Nothing without a mask, an optimizer or momentum.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(3))
        >>> opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
        >>> p.grad = torch.ones(3)
        >>> opt.step()
        >>> mask_momentum(opt, [p], torch.tensor([True, False, True]))
        >>> opt.state[p]["momentum_buffer"].tolist()
        [0.0, 1.0, 0.0]
    """
    if mask is None or optimizer is None:
        return
    offset = 0
    for p in params:
        n = p.numel()
        buffer = optimizer.state.get(p, {}).get("momentum_buffer")
        if buffer is not None:
            buffer.view(-1).masked_fill_(mask[offset : offset + n].to(buffer.device), 0.0)
        offset += n


def current_lr(optimizer: LocalOptimizer | None) -> float:
    """The learning rate of the optimizer's latest step (its first parameter group's); 1.0
    without an optimizer (a peer driven step by step, whose updates are its own)."""
    return 1.0 if optimizer is None else float(optimizer.param_groups[0]["lr"])
