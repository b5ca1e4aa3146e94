"""The models decentralized-learning papers benchmark with: ResNet-20 and VGG-11 for CIFAR,
LeNet-5 and LEAF's CNN for FEMNIST, LEAF's LSTM for Shakespeare.

Normalisation: ResNet-20 and VGG-11 use GroupNorm (2 groups, as Hsieh et al. 2020, "The
Non-IID Data Quagmire", do for decentralized training) instead of BatchNorm. Peers average
parameters; BatchNorm's running mean and variance are buffers that would either stay local
(each peer evaluating with statistics of its own shard, which on non-IID data are not the
averaged model's) or need averaging of their own. GroupNorm normalises each sample by
itself, so all of the model's state is in its parameters and is averaged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn.functional as F
from torch import Tensor, nn

from gossipdl.models.cnn import ImageClassifier

GROUPS = 2  # GroupNorm's groups in ResNet-20 and VGG-11


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(GROUPS, channels)


class _Block(nn.Module):
    """ResNet's basic block: two 3×3 convolutions and a parameter-free shortcut (the
    CIFAR ResNets' option A: subsampled, the extra channels zero)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.norm1 = _norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.norm2 = _norm(c_out)
        self.stride, self.extra = stride, c_out - c_in

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        short = x[:, :, :: self.stride, :: self.stride] if self.stride > 1 else x
        if self.extra:
            half = self.extra // 2
            short = F.pad(short, (0, 0, 0, 0, half, self.extra - half))
        return F.relu(out + short)


class ResNet20(nn.Module):
    """ResNet-20 for 32×32 images (He et al. 2016, section 4.2): a 3×3 convolution, three
    stages of three basic blocks (16, 32, 64 channels), global average pooling and a
    linear head; about 0.27M parameters.

    Example:
        >>> import torch
        >>> ResNet20((3, 32, 32), 10)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        channels = int(input_shape[0])
        self.stem = nn.Sequential(
            nn.Conv2d(channels, 16, 3, 1, 1, bias=False), _norm(16), nn.ReLU()
        )
        blocks: list[nn.Module] = []
        c_in = 16
        for c_out, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(3):
                blocks.append(_Block(c_in, c_out, stride if i == 0 else 1))
                c_in = c_out
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):  # He et al.'s initialisation (the head: torch's)
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: Tensor) -> Tensor:
        features = self.blocks(self.stem(x))
        return self.head(features.mean(dim=(2, 3)))


VGG11_LAYERS = (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M")


class VGG11(nn.Module):
    """VGG-11 for 32×32 images (Simonyan & Zisserman 2015, configuration A, as CHOCO-SGD and
    D-PSGD's CIFAR experiments use it): eight 3×3 convolutions with GroupNorm, five max
    pools and a linear head; about 9.2M parameters.

    Example:
        >>> import torch
        >>> VGG11((3, 32, 32), 10)(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        c_in = int(input_shape[0])
        for entry in VGG11_LAYERS:
            if entry == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c_in, int(entry), 3, padding=1), _norm(int(entry)), nn.ReLU()]
                c_in = int(entry)
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).flatten(1))


class LeNet5(ImageClassifier):
    """LeNet-5 (LeCun et al. 1998) with ReLU and max pooling: two 5×5 convolutions (6 and 16
    channels; the first padded to keep 28×28), then 120, 84 and the classes.

    Example:
        >>> import torch
        >>> LeNet5((1, 28, 28), 62)(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 62])
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__(
            input_shape,
            lambda c_in: nn.Sequential(
                nn.Conv2d(c_in, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
            ),
            lambda size: nn.Sequential(
                nn.Linear(size, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                nn.Linear(84, num_classes),
            ),
        )  # fmt: skip


class LeafCNN(ImageClassifier):
    """LEAF's FEMNIST CNN (Caldas et al. 2018): two 5×5 convolutions (32 and 64 channels,
    same padding), each with a 2×2 max pool, a 2048-unit layer and the classes; about 6.6M
    parameters on 28×28 images.

    Example:
        >>> import torch
        >>> LeafCNN((1, 28, 28), 62)(torch.zeros(2, 1, 28, 28)).shape
        torch.Size([2, 62])
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__(
            input_shape,
            lambda c_in: nn.Sequential(
                nn.Conv2d(c_in, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            ),
            lambda size: nn.Sequential(
                nn.Linear(size, 2048), nn.ReLU(), nn.Linear(2048, num_classes)
            ),
        )  # fmt: skip


class LeafLSTM(nn.Module):
    """LEAF's Shakespeare model: each character (its index, given as a float) embedded in 8
    dimensions, a two-layer LSTM of 256 units, and the next character from its last
    output; about 0.82M parameters for LEAF's 80 characters.

    Example:
        >>> import torch
        >>> LeafLSTM((80,), 80)(torch.zeros(2, 80)).shape
        torch.Size([2, 80])
    """

    def __init__(self, input_shape: Sequence[int], num_classes: int, vocabulary: int = 80) -> None:
        super().__init__()
        self.vocabulary = max(vocabulary, num_classes)
        self.embed = nn.Embedding(self.vocabulary, 8)
        self.lstm = nn.LSTM(8, 256, num_layers=2, batch_first=True)
        self.head = nn.Linear(256, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.long().clamp(0, self.vocabulary - 1)
        out, _ = self.lstm(self.embed(tokens))
        return self.head(out[:, -1])
