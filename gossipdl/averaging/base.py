"""The averaging strategy seam: what a peer sends each round and how it merges what arrived.

The peer loop is fixed; an Averager decides the payload and the merge rule. It
receives what arrived, what arrived late, and which neighbours did not make it,
so a partial round is a designed case rather than an exception path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gossipdl.compression import Codec, Payload, build_codec


@dataclass(frozen=True)
class Round:
    """One round as a peer sees it: its number and its row of the mixing matrix.

    ``resync`` marks a round in which this peer rebuilds its view of every
    neighbour from their dense public copies (the first round, and the round a
    topology changes or a lost message was detected). ``mix`` is False in a
    round this peer sat out (dynamic trigger): take in what arrived, but keep
    the model.
    """

    index: int
    weights: Mapping[int, float]
    self_weight: float
    resync: bool = False
    mix: bool = True


@dataclass(frozen=True)
class Arrival:
    """One neighbour's decoded contribution: its weight, the round it was for, dense or not."""

    weight: float
    value: torch.Tensor
    round: int
    dense: bool = False


class Averager(ABC):
    """Strategy for one gossip round over a flat parameter vector ``x``.

    ``codec`` compresses what is sent; ``decode`` runs on the receive thread
    and must raise ``CodecError`` for anything it cannot use.
    """

    name: str = "averager"
    # True when neighbours keep a view of this peer's public copy that a lost
    # message or a topology change breaks, so the peer loop must run resyncs.
    uses_public_copies: bool = False
    # Set by ``incoming`` when the peer's view of its neighbours is broken.
    needs_resync: bool = False
    # True when a message that arrives after its round still counts (a sum of updates).
    accepts_late: bool = False
    # True when a peer may skip a round while its neighbours sync (the dynamic trigger).
    supports_dynamic: bool = True
    # True for gossip learning: no rounds to wait for, models walk and are merged on arrival.
    asynchronous: bool = False

    def __init__(self, codec: Codec | str = "none", seed: int = 0) -> None:
        self.codec = build_codec(codec, seed) if isinstance(codec, str) else codec
        self._dense = build_codec("none")  # resync copies and model replies travel uncompressed

    @abstractmethod
    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload:
        """The payload every neighbour gets this round."""

    def public_copy(self) -> Payload:
        """The dense payload a resyncing neighbour gets instead (averagers with public copies)."""
        raise NotImplementedError

    def decode(self, payload: Payload, dense: bool, numel: int, device: torch.device) -> Any:
        """Decode a received payload (codec-compressed, or a dense fp32 vector)."""
        return (self._dense if dense else self.codec).decode(payload, numel, device)

    @abstractmethod
    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """The new parameter vector from ``x`` and what the neighbours sent."""


def dense_payload(t: torch.Tensor) -> Payload:
    """A dense float32 copy of ``t`` on the host, as sent for a resync."""
    return Payload((t.detach().cpu().numpy().copy(),), {})
