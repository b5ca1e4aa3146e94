"""Small convolutional reference models for 1-D signals and 2-D images.

Each convolution has stride 2 and ``padding = kernel // 2``, so every layer
halves the length (rounding up) and never reaches zero; a linear head reads the
flattened feature map, keeping the position information MNIST-1D needs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn


def _conv_stack(
    conv: type[nn.Conv1d] | type[nn.Conv2d], in_channels: int, channels: Sequence[int]
) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, c_out in enumerate(channels):
        kernel = 5 if i == 0 else 3
        layers += [conv(in_channels, c_out, kernel, stride=2, padding=kernel // 2), nn.ReLU()]
        in_channels = c_out
    return nn.Sequential(*layers)


def _flat_size(features: nn.Module, sample_shape: tuple[int, ...]) -> int:
    with torch.no_grad():
        return math.prod(features(torch.zeros(1, *sample_shape)).shape[1:])


class CNN1d(nn.Module):
    """``Conv1d(stride 2) → ReLU`` per entry of ``channels`` (kernel 5, then 3), then a linear head.

    Takes ``(B, L)`` signals (one channel) or ``(B, C, L)``.

    Example:
        >>> import torch
        >>> CNN1d((40,), 10)(torch.zeros(2, 40)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (32, 32, 32)
    ) -> None:
        super().__init__()
        self.sample_shape = (1, *input_shape) if len(input_shape) == 1 else tuple(input_shape)
        self.features = _conv_stack(nn.Conv1d, self.sample_shape[0], channels)
        self.head = nn.Linear(_flat_size(self.features, self.sample_shape), num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], *self.sample_shape)
        return self.head(self.features(x).flatten(1))


class ImageClassifier(nn.Module):
    """``features(channels)`` over ``(B, H, W)`` images (one channel) or ``(B, C, H, W)``,
    then ``head(size)`` on their flattened output: what the 2-D models share."""

    def __init__(
        self,
        input_shape: Sequence[int],
        features: Callable[[int], nn.Module],
        head: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        self.sample_shape = (1, *input_shape) if len(input_shape) == 2 else tuple(input_shape)
        self.features = features(self.sample_shape[0])
        self.head = head(_flat_size(self.features, self.sample_shape))

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], *self.sample_shape)
        return self.head(self.features(x).flatten(1))


class CNN2d(ImageClassifier):
    """``Conv2d(stride 2) → ReLU`` per entry of ``channels`` (kernel 5, then 3), then a linear head.

    Takes ``(B, H, W)`` images (one channel) or ``(B, C, H, W)``.

    Example:
        >>> import torch
        >>> CNN2d((8, 8), 10)(torch.zeros(2, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, input_shape: Sequence[int], num_classes: int, channels: Sequence[int] = (32, 64)
    ) -> None:
        super().__init__(
            input_shape,
            lambda c_in: _conv_stack(nn.Conv2d, c_in, channels),
            lambda size: nn.Linear(size, num_classes),
        )
