"""PowerSGD over the threaded ring all-reduce (Vogels, Karimireddy, Jaggi 2019, Algorithm 1).

The steps and their state are :class:`~gossipdl.protocol.ring_powersgd.LowRankMean`
(no I/O; the simulator runs the same one); here its two means are two all-reduces
of one :class:`~gossipdl.coordinator.ring.RingAllReduce`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gossipdl.coordinator.ring import AnyRing
from gossipdl.protocol.ring_powersgd import LowRankMean


class LowRankAllReduce:
    """Rank-``rank`` PowerSGD mean, over the ring ``make_ring`` builds, of a flat vector made
    of tensors of ``shapes`` (in order). ``make_ring(length)`` returns the ring for P and Q."""

    def __init__(
        self,
        shapes: Sequence[torch.Size | tuple[int, ...]],
        rank: int,
        make_ring: Callable[[int], AnyRing],
        *,
        seed: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.state = LowRankMean(shapes, rank, seed=seed, device=device)
        self.numel = self.state.numel
        self.ring = make_ring(self.state.length)

    @property
    def error(self) -> torch.Tensor:
        """What earlier rounds did not carry (error feedback), flat."""
        return self.state.error

    @torch.no_grad()
    def allreduce_mean_(self, x: torch.Tensor) -> torch.Tensor:
        """Replace ``x`` by the PowerSGD estimate of its mean over the ring."""
        p = self.state.first(x)
        self.ring.allreduce_mean_(p)
        q = self.state.second(p)
        self.ring.allreduce_mean_(q)
        return self.state.finish(q, x)
