"""What the averagers need of the peer's local optimizer, in both engines: DGC's momentum
factor masking (Lin et al. 2018) after a send, and the learning rate a round's tracking
scales by."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mask_momentum(
    optimizer: torch.optim.Optimizer | None,
    params: Sequence[torch.nn.Parameter],
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


def current_lr(optimizer: torch.optim.Optimizer | None) -> float:
    """The learning rate of the optimizer's latest step (its first parameter group's); 1.0
    without an optimizer (a peer driven step by step, whose updates are its own)."""
    return 1.0 if optimizer is None else float(optimizer.param_groups[0]["lr"])
