"""An endless, seeded mini-batch sampler over in-memory arrays.

A peer's shard is small (thousands of samples), so it is copied to the peer's
device once and batches are gathered by index there: no DataLoader, no worker
processes, no per-step host-to-device copy of the data.
"""

from __future__ import annotations

import numpy as np
import torch

from gossipdl.data.datasets import DataError


def to_tensors(
    x: np.ndarray, y: np.ndarray, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` as a float32 tensor and ``y`` as an int64 tensor on ``device``.

    Example:
        >>> import numpy as np
        >>> xt, yt = to_tensors(np.zeros((3, 2)), np.array([0, 1, 2]))
        >>> xt.dtype, yt.dtype, tuple(xt.shape)
        (torch.float32, torch.int64, (3, 2))
    """
    if len(x) != len(y):
        raise DataError(f"x has {len(x)} samples but y has {len(y)}")
    xt = torch.as_tensor(np.asarray(x), dtype=torch.float32).to(device)
    yt = torch.as_tensor(np.asarray(y), dtype=torch.int64).to(device)
    return xt, yt


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


class BatchSampler:
    """Endless mini-batches of ``(x, y)`` from an :class:`IndexStream` over them.

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
    ) -> None:
        self.x, self.y = to_tensors(x, y, device)
        self.device = self.x.device
        self.stream = IndexStream(len(self.y), batch_size, seed, self.device)
        self.batch_size = self.stream.batch_size

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
        return self.x.index_select(0, idx), self.y.index_select(0, idx)

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next()
