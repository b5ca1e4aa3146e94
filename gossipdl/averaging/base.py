"""The averaging strategy seam: what a peer sends each round and how it merges what arrived.

The peer loop is fixed; an Averager decides the payload and the merge rule. It
receives what arrived and which neighbours did not make it, so a partial round
is a designed case rather than an exception path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from gossipdl.transport.wire import WireError


@dataclass(frozen=True)
class Arrival:
    """One neighbour's contribution to a round: its mixing weight and its payload tensors."""

    weight: float
    tensors: list[torch.Tensor]


class Averager(ABC):
    """Strategy for one gossip round over a flat parameter vector ``x``."""

    name: str = "averager"

    @abstractmethod
    def outgoing(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The tensors to send to every neighbour this round (on ``x``'s device)."""

    @abstractmethod
    def check(self, arrays: Sequence[np.ndarray], numel: int) -> None:
        """Validate a received payload for a model of ``numel`` parameters; raise WireError."""

    @abstractmethod
    def incoming(
        self,
        x: torch.Tensor,
        self_weight: float,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
    ) -> torch.Tensor:
        """The new parameter vector from ``x`` and the neighbours' payloads."""


def check_flat_vector(arrays: Sequence[np.ndarray], numel: int, dtype: str = "float32") -> None:
    """Require exactly one 1-D array of ``numel`` values of ``dtype``."""
    if len(arrays) != 1:
        raise WireError("bad_shape", f"expected 1 array, got {len(arrays)}")
    array = arrays[0]
    if array.dtype.name != dtype:
        raise WireError("bad_dtype", f"expected {dtype}, got {array.dtype.name}")
    if array.shape != (numel,):
        raise WireError("bad_shape", f"expected shape ({numel},), got {array.shape}")
