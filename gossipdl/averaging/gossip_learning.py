"""Gossip learning (Ormándi, Hegedűs, Jelasity 2013; Hegedűs, Danner, Jelasity 2019): no rounds.

Each model carries its age, the number of local steps behind it. A peer
periodically sends its model to one random neighbour and never waits; a
receiver merges every model that walked in by age-weighted averaging
(:func:`age_weighted_merge`) and keeps training, so fast peers never wait for
slow ones. The model may travel through a value codec (``fp16``,
``uniform:8``, ...); sparsifiers and low-rank codecs would make the receiver
average a whole model with zeros, so they are refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gossipdl.averaging.base import Arrival, Averager, Round
from gossipdl.compression import Codec, Payload, stage_names

_PARTIAL_CODECS = ("topk", "randomk", "threshold", "powersgd")


def age_weighted_merge(
    x: torch.Tensor, age: int, other: torch.Tensor, other_age: int
) -> tuple[torch.Tensor, int]:
    """``(age·x + other_age·other) / (age + other_age)`` and the older age of the two.

    Two models with no steps behind them count equally. One fused
    ``lerp``, so the result is the weighted mean to float rounding.

    Example:
        >>> age_weighted_merge(torch.tensor([0.0]), 1, torch.tensor([4.0]), 3)
        (tensor([3.]), 3)
    """
    total = age + other_age
    w = 0.5 if total == 0 else other_age / total
    return torch.lerp(x, other.to(x.dtype), w), max(age, other_age)


class GossipLearning(Averager):
    """Send the (encoded) model to one neighbour; merge arrivals by age (see the module doc)."""

    name = "gossip-learning"
    arrivals_read_only = True  # merges walks by lerp, never in place
    asynchronous = True
    supports_dynamic = False

    def __init__(self, codec: Codec | str = "none", seed: int = 0) -> None:
        super().__init__(codec, seed)
        partial = [stage for stage in stage_names(self.codec.spec) if stage in _PARTIAL_CODECS]
        if partial:
            raise ValueError(
                f"gossip-learning sends whole models; codec {self.codec.spec!r} sends only part "
                f"of one ({partial[0]}), and the receiver would average the rest with zeros. "
                f"Use a value codec such as fp16, bf16 or uniform:8"
            )

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload:
        """The whole model, encoded."""
        return self.codec.encode(x)[0]

    def merge(
        self, x: torch.Tensor, age: int, other: torch.Tensor, other_age: int
    ) -> tuple[torch.Tensor, int]:
        """Merge one model that walked in (see :func:`age_weighted_merge`)."""
        return age_weighted_merge(x, age, other, other_age)

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Unused: models are merged as they arrive, not per round."""
        return x
