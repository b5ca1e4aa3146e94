"""An endless, seeded mini-batch sampler over in-memory arrays.

A peer's shard is small (thousands of samples), so it is copied to the peer's
device once and batches are gathered by index there: no DataLoader, no worker
processes, no per-step host-to-device copy of the data.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from gossipdl.data.datasets import DataError, Dataset, Pixels


def to_tensors(
    x: np.ndarray, y: np.ndarray, device: torch.device | str = "cpu", pixels: Pixels | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as a float32 tensor (uint8 with ``pixels``: still pixels, see
    :func:`standardise`) and ``y`` as an int64 tensor on ``device``.

    Example:
        >>> import numpy as np
        >>> xt, yt = to_tensors(np.zeros((3, 2)), np.array([0, 1, 2]))
        >>> xt.dtype, yt.dtype, tuple(xt.shape)
        (torch.float32, torch.int64, (3, 2))
    """
    if len(x) != len(y):
        raise DataError(f"x has {len(x)} samples but y has {len(y)}")
    dtype = torch.float32 if pixels is None else torch.uint8
    xt = torch.as_tensor(np.asarray(x), dtype=dtype).to(device)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64).to(device)
    return xt, yt


def standardise(x: torch.Tensor, pixels: Pixels | None) -> torch.Tensor:
    """A model's input from stored samples ``x`` (``[N, C, H, W]`` uint8 with ``pixels``):
    ``(x / 255 − mean) / std`` per channel in float32; without ``pixels``, ``x`` itself.

    Example:
        >>> import torch
        >>> from gossipdl.data.datasets import Pixels
        >>> x = torch.full((1, 2, 1, 1), 255, dtype=torch.uint8)
        >>> standardise(x, Pixels((0.5, 0.0), (0.5, 2.0))).flatten().tolist()
        [1.0, 0.5]
    """
    if pixels is None:
        return x
    mean, std = _channel_stats(pixels, x.device)
    return (x.float() / 255.0 - mean) / std


@functools.lru_cache(maxsize=8)
def _channel_stats(pixels: Pixels, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``pixels``' mean and std as ``[1, C, 1, 1]`` tensors on ``device``, made once: every
    batch reads them, and on a GPU each new one would be a copy from the host."""
    mean, std = (
        torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1)
        for v in (pixels.mean, pixels.std)
    )
    return mean, std


def evaluation_inputs(dataset: Dataset, device: torch.device | str = "cpu") -> torch.Tensor:
    """The test split's inputs as the model takes them (float32, standardised pixels), on
    ``device``: what every evaluation reads."""
    x, _ = to_tensors(dataset.x_test, dataset.y_test, device, dataset.pixels)
    return standardise(x, dataset.pixels)


class IndexStream:
    """Endless batches of indices into ``count`` samples, drawn without replacement, epoch by
    epoch.

    Each epoch visits every index exactly once in a fresh order drawn from ``seed``. Every
    batch has exactly ``batch_size`` indices: a batch that crosses an epoch boundary takes
    the rest of the old order and the start of the new one, so no sample is dropped and
    shards smaller than a batch work. The simulator's stacked peers draw theirs from one
    stream each and gather every peer's batch in one indexing operation.

    Attributes:
        epoch: number of completed passes over the data.
        step: number of batches returned so far.

    Example:
        >>> s = IndexStream(3, 2, seed=0)
        >>> sorted(s.next().tolist() + s.next().tolist()[:1]), s.epoch
        ([0, 1, 2], 1)
    """

    def __init__(
        self, count: int, batch_size: int, seed: int, device: torch.device | str = "cpu"
    ) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        if count == 0:
            raise DataError("cannot sample batches from an empty dataset")
        self.count = count
        self.batch_size = int(batch_size)
        self.device = torch.device(device)
        self.epoch = 0
        self.step = 0
        self._rng = np.random.default_rng(seed)
        self._order = self._new_order()
        self._pos = 0

    def _new_order(self) -> torch.Tensor:
        return torch.from_numpy(self._rng.permutation(self.count)).to(self.device)

    def next(self) -> torch.Tensor:
        """Indices (on the device) of the next batch; advances the stream."""
        pieces = []
        need = self.batch_size
        while need > 0:
            take = min(need, len(self._order) - self._pos)
            pieces.append(self._order[self._pos : self._pos + take])
            self._pos += take
            need -= take
            if self._pos == len(self._order):  # epoch finished: count it, reshuffle
                self._order = self._new_order()
                self._pos = 0
                self.epoch += 1
        self.step += 1
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def crop_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """CIFAR's augmentation, as the ResNet and VGG papers train: each image of ``x``
    (``[B, C, H, W]``) cropped back to its size at a random offset from a copy padded
    with ``pad`` zero pixels on every side, and mirrored left to right with probability
    1/2; the draws come from ``generator`` (on ``x``'s device).

    Example:
        >>> import torch
        >>> out = crop_flip(torch.ones(2, 3, 8, 8), torch.Generator().manual_seed(0))
        >>> tuple(out.shape), float(out.max())
        ((2, 3, 8, 8), 1.0)
    """
    b, _, h, w = x.shape
    padded = torch.nn.functional.pad(x, (pad, pad, pad, pad))
    offsets = torch.randint(0, 2 * pad + 1, (2, b), generator=generator, device=x.device)
    rows = (offsets[0, :, None] + torch.arange(h, device=x.device))[:, None, :, None]
    cols = (offsets[1, :, None] + torch.arange(w, device=x.device))[:, None, None, :]
    mirrored = torch.rand(b, generator=generator, device=x.device) < 0.5
    cols = torch.where(mirrored[:, None, None, None], cols.flip(-1), cols)
    batch = torch.arange(b, device=x.device)[:, None, None, None]
    channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def augment_draws(seed: int, device: torch.device | str) -> torch.Generator:
    """The generator of :func:`crop_flip`'s draws for a sampler seeded ``seed``: a stream of
    its own beside the batch order's, so both engines crop a peer's batches alike."""
    return torch.Generator(device=device).manual_seed(seed + 7)


class BatchSampler:
    """Endless mini-batches of ``(x, y)`` from an :class:`IndexStream` over them, augmented
    as the data set asks (``augment``: ``crop-flip`` for CIFAR), then standardised where
    ``x`` holds pixels (``pixels``), so a crop's padding is black, as in the papers.

    Example:
        >>> import numpy as np
        >>> s = BatchSampler(np.zeros((10, 4), np.float32), np.arange(10), 4, seed=0)
        >>> xb, yb = s.next()
        >>> tuple(xb.shape), tuple(yb.shape), s.epoch
        ((4, 4), (4,), 0)
    """

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        batch_size: int,
        seed: int,
        device: torch.device | str = "cpu",
        augment: str = "",
        pixels: Pixels | None = None,
    ) -> None:
        self.x, self.y = to_tensors(x, y, device, pixels)
        self.pixels = pixels  # uint8 images, standardised batch by batch (after augmenting)
        self.device = self.x.device
        self.stream = IndexStream(len(self.y), batch_size, seed, self.device)
        self.batch_size = self.stream.batch_size
        if augment not in ("", "crop-flip"):
            raise DataError(f"augment = {augment!r}; use '' or 'crop-flip'")
        self.augment = augment  # "crop-flip": :func:`crop_flip` on every batch
        self._draws = augment_draws(seed, self.device)

    @property
    def epoch(self) -> int:
        """Completed passes over the data."""
        return self.stream.epoch

    @property
    def step(self) -> int:
        """Batches returned so far."""
        return self.stream.step

    def __len__(self) -> int:
        """Number of samples (not batches)."""
        return len(self.y)

    def next_indices(self) -> torch.Tensor:
        """Indices (on the device) of the next batch; advances the sampler."""
        return self.stream.next()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``(x, y)``, shaped ``(batch_size, *input_shape)`` and ``(batch_size,)``."""
        idx = self.stream.next()
        x = self.x.index_select(0, idx)
        if self.augment:
            x = crop_flip(x, self._draws)
        return standardise(x, self.pixels), self.y.index_select(0, idx)

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()
