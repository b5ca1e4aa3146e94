"""Dense gossip averaging (D-PSGD, Lian et al. 2017): x_i <- sum_j W_ij x_j."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gossipdl.averaging.base import Arrival, Averager, Round
from gossipdl.compression import Payload


class DenseGossip(Averager):
    """Send the model (through the codec, lossless by default); average what arrived.

    A neighbour that missed the round is left out and the remaining weights
    (including the peer's own) are scaled to sum to one, so a late neighbour
    slows nobody and never biases the average towards zero. With a lossy codec
    this is naive compressed gossip (the model itself quantized), which is why
    CHOCO is the default as soon as the codec is lossy.
    """

    name = "dense"
    arrivals_read_only = True  # the average reads what arrived

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload:
        """The whole parameter vector, encoded."""
        payload, _ = self.codec.encode(x)
        return payload

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Weighted average of ``x`` and the arrived vectors."""
        total = rnd.self_weight + sum(a.weight for a in arrived.values())
        out = x * (rnd.self_weight / total)
        for arrival in arrived.values():
            out.add_(arrival.value, alpha=arrival.weight / total)
        return out
