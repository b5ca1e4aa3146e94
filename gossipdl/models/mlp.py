"""Fully connected reference models: multinomial logistic regression and an MLP."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from torch import Tensor, nn


class MLP(nn.Module):
    """Flatten, then ``Linear → ReLU`` for each width in ``hidden``, then a linear head.

    With ``hidden=[]`` this is multinomial logistic regression.

    Example:
        >>> import torch
        >>> MLP((40,), 10, [64])(torch.zeros(2, 40)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, hidden: Sequence[int] = (256, 256)
    ) -> None:
        super().__init__()
        widths = [math.prod(input_shape), *hidden]
        layers: list[nn.Module] = [nn.Flatten()]
        for w_in, w_out in itertools.pairwise(widths):
            layers += [nn.Linear(w_in, w_out), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
