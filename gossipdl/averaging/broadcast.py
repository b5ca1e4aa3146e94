"""Compressed broadcast with residuals (Strom, Interspeech 2015): every peer applies every update.

Each peer keeps the agreed model x̄ and a residual r (what it has not yet sent).
Per round, after the local step x_i = x̄ + u_i:

1. v = u_i + r                 the local update plus everything held back before
2. q = Q(v),  r ← v − q        send the compressed part (Strom: ±τ where |v| > τ), keep the rest
3. send q to every peer; x̄ ← x̄ + (1/n) Σ_j q_j over all peers, the own q included
4. continue from x_i = x̄

All peers apply the same updates, so their models agree; the residual makes
sure no update is lost, only delayed. Peers start by averaging their models
once (a first round of public copies: a sha256 vouch where the models are one,
else dense), and a lost update is repaired the same way, by the whole swarm in
one round (``resyncs_together``: a peer asked for a resync takes part in it), so
every peer averages the same copies and ends on the same x̄. A resync round
carries no update (it waits in the residual). Use the complete topology; meant
for small swarms, as every update reaches every peer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gossipdl.averaging.base import Arrival, Averager, Round, dense_payload, mix
from gossipdl.compression import Payload
from gossipdl.compression.sparse import SparseCodec


class Broadcast(Averager):
    """Strom-style compressed broadcast; a natural codec is ``threshold:auto+sign``."""

    name = "broadcast"
    arrivals_read_only = True  # x̄ += q_j reads q_j
    uses_public_copies = True
    resyncs_together = True  # a peer that resynced alone would miss that round's updates

    def __init__(self, codec: str = "threshold:auto+sign", seed: int = 0) -> None:
        super().__init__(codec, seed)
        self.shared: torch.Tensor | None = None
        self.residual: torch.Tensor | None = None
        self._own: torch.Tensor | None = None

    accepts_late = True  # a late update is still added: a sum does not care about order
    supports_dynamic = False  # every peer must apply every update to stay on one model

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload:
        """Steps 1–2: compress the update plus the residual, keep what was not sent. A resync
        round (the first one, too) sends no update: its neighbours get the dense x̄ instead,
        and the update waits in the residual."""
        if self.shared is None:  # first round: the dense average below sets x̄
            self.shared = self.start_copy(x)
            self.residual = torch.zeros_like(x)
        assert self.residual is not None
        v = (x - self.shared).add_(self.residual)
        if rnd.resync:
            self.residual, self._own = v, torch.zeros_like(x)
            return self.codec.encode(self._own)[0]
        payload, self._own = self.codec.encode(v)
        self.residual = v.sub_(self._own)
        return payload

    def sent_mask(self) -> torch.Tensor | None:
        """With a sparsifying codec, where the last update was sent (DGC's momentum factor
        masking, Lin et al. 2018: the momentum that built up there has been sent, so it
        must not push again; the residual already holds zero there). None for dense
        quantizers, which send every coordinate."""
        if self._own is None or not isinstance(self.codec, SparseCodec):
            return None
        return self._own != 0

    def public_copy(self) -> Payload:
        """The dense agreed model x̄, for a peer that is resyncing."""
        assert self.shared is not None, "public_copy before the first outgoing"
        return dense_payload(self.shared)

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Step 3, or in a resync round the average of the dense x̄ (:func:`mix`)."""
        assert self.shared is not None and self._own is not None
        dense = self.vouched({j: a for j, a in arrived.items() if a.dense}, self.shared)
        self.shared.add_(self._own, alpha=rnd.self_weight)
        if rnd.resync:  # every peer mixes the same copies, in one order: one x̄
            self.needs_resync = set(dense) != set(rnd.weights)
            self.shared = mix(self.shared, rnd, [dense[j] for j in sorted(dense)])
        updates = [a for a in arrived.values() if not a.dense] + [a for _, a in late if not a.dense]
        for arrival in updates:
            self.shared.add_(arrival.value, alpha=arrival.weight)
        return self.shared.clone()
