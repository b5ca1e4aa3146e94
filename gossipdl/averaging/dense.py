"""Dense gossip averaging (D-PSGD, Lian et al. 2017): x_i <- sum_j W_ij x_j."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import torch

from gossipdl.averaging.base import Arrival, Averager, Round, mix
from gossipdl.averaging.judging import Judge
from gossipdl.averaging.robust import Defence, nearest_to_rest
from gossipdl.compression import Payload
from gossipdl.compression.powersgd import PowerSGD
from gossipdl.compression.sparse import SparseCodec

LATE_ROUNDS = 4
"""Rounds a peer keeps its own model of, while a neighbour's model for it is missing, so a
late one still pairs up exactly (one model-sized copy per such round)."""


class DenseGossip(Averager):
    """Send the model (through the codec, lossless by default); average what arrived.

    A neighbour that missed the round leaves its weight with the peer (:func:`mix`), so a
    late neighbour slows nobody. When the loss is one-sided, the neighbour whose model
    did arrive applied the edge ``W_ij (x_i − x_j)`` and this peer did not; its model
    still counts when it comes late (up to :data:`LATE_ROUNDS` rounds later), as
    ``W_ij (x_j^t − x_i^t)`` with this peer's own model of that round, so the two halves
    of the edge cancel and the swarm's average is kept exactly. A model lost for good
    leaves the edge applied at one end only (no acknowledgement over a lossy link can
    make both ends agree), and moves the average once by ``W_ij (x_i − x_j) / n``.
    With a lossy codec this is naive compressed gossip (the model itself quantized),
    which is why CHOCO is the default as soon as the codec is lossy; a sparsifier is
    refused (it would send zeros for most of the model).

    With a ``defence`` (:mod:`gossipdl.averaging.robust`) the arrived models are combined
    by that rule instead (:class:`~gossipdl.averaging.judging.Judge`, which also sets a
    stale or contrary neighbour aside and keeps the statistics a report shows), and a
    late model is not paired up: a robust rule judges the models of one round together.
    """

    name = "dense"
    arrivals_read_only = True  # the average reads what arrived
    accepts_late = True  # a late model pairs up with the own model of its round

    def __init__(self, codec: str = "none", seed: int = 0, defence: Defence | None = None):
        super().__init__(codec, seed)
        if isinstance(self.codec, SparseCodec | PowerSGD):
            what = "a sparsifier" if isinstance(self.codec, SparseCodec) else "a low-rank codec"
            raise ValueError(
                f"codec {codec!r}: dense gossip sends the model itself, and {what} would "
                "send a part of it (a few values and zeros for the rest, or its top singular "
                "directions), which every average pulls the models towards; use algorithm "
                "choco (or auto), which sends compressed differences, or a quantizer such as "
                "fp16 or qsgd:16"
            )
        self.judge = None if defence is None else Judge(defence)
        # round -> (own model of that round, neighbours whose model is still missing)
        self._held: OrderedDict[int, tuple[torch.Tensor, set[int]]] = OrderedDict()

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload | Mapping[int, Payload]:
        """The whole parameter vector, encoded (:meth:`encoded`)."""
        return self.encoded(x)

    def sends_memory_of(self, x: torch.Tensor) -> bool:
        """Uncompressed on a CPU, the payload is ``x``'s own memory: no copy, no estimate."""
        return self.codec.spec == "none" and x.device.type == "cpu"

    def encoded(self, x: torch.Tensor) -> Payload:
        """``x`` as sent (:meth:`sends_memory_of`: its own memory, which nobody writes)."""
        if self.sends_memory_of(x):
            return Payload((x.detach().numpy(),), {})
        payload, _ = self.codec.encode(x)
        return payload

    def catch_up(self, arrived: Mapping[int, Arrival]) -> torch.Tensor | None:
        """Its neighbours' models of the round, weighted as the round weighs them; with a
        defence the one nearest the rest (a liar among them moves a mean anywhere)."""
        if not arrived:
            return None
        values = [a.value for a in arrived.values()]
        if self.judge is not None:
            return values[nearest_to_rest(torch.stack(values))[0]].clone()
        total = sum(a.weight for a in arrived.values())
        mean = torch.zeros_like(values[0])
        for a in arrived.values():
            mean.add_(a.value, alpha=a.weight / total)
        return mean

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Weighted average of ``x`` and the arrived vectors, plus the late ones' edges (or
        the defence's combination of the arrived ones)."""
        if self.judge is not None and arrived:
            return self.judge.judge(x, rnd, arrived)
        out = mix(x, rnd, list(arrived.values()))
        for j, arrival in late:
            held = self._held.get(arrival.round)
            if held is not None and j in held[1]:
                own, waiting = held
                out.add_(arrival.value - own, alpha=arrival.weight)
                waiting.discard(j)
                if not waiting:
                    del self._held[arrival.round]
        if missing and self.judge is None:
            self._held[rnd.index] = (x.clone(), set(missing))
            while len(self._held) > LATE_ROUNDS:
                self._held.popitem(last=False)
        return out
