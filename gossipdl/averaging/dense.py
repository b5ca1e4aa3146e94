"""Dense gossip averaging (D-PSGD, Lian et al. 2017): x_i <- sum_j W_ij x_j."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from gossipdl.averaging.base import Arrival, Averager, check_flat_vector


class DenseGossip(Averager):
    """Send the full model; average with the neighbours that arrived, weights renormalised.

    A neighbour that missed the round is left out and the remaining weights
    (including the peer's own) are scaled to sum to one, so a late neighbour
    slows nobody and never biases the average towards zero.
    """

    name = "dense"

    def outgoing(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The whole parameter vector."""
        return [x]

    def check(self, arrays: Sequence[np.ndarray], numel: int) -> None:
        """One float32 vector of the model's size."""
        check_flat_vector(arrays, numel)

    def incoming(
        self,
        x: torch.Tensor,
        self_weight: float,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
    ) -> torch.Tensor:
        """Weighted average of ``x`` and the arrived vectors."""
        total = self_weight + sum(a.weight for a in arrived.values())
        out = x * (self_weight / total)
        for arrival in arrived.values():
            out.add_(arrival.tensors[0], alpha=arrival.weight / total)
        return out
