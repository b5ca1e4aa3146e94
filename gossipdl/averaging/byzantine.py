"""A Byzantine peer's averaging: dense gossip that sends an attacked model (issue 26's
attacks, :mod:`gossipdl.averaging.attacks`, in both engines: they share this class).

The attacker knows what a member knows: its own model and the models its neighbours
sent it in the last round. ALIE and inner-product manipulation use those as the honest
crowd; dissensus sends each neighbour its own message, built from that neighbour's last
model and the others' as the honest pull, with the attacker's row of the (symmetric)
mixing matrix as the victim's weights. The attacker itself averages honestly, so the
models it perturbs stay plausible. A stale peer sends the model of its first round
forever; a label-flipping one sends honestly and poisons its data instead
(:func:`gossipdl.training.peer_sampler`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gossipdl.averaging import attacks
from gossipdl.averaging.base import Arrival, Round
from gossipdl.averaging.dense import DenseGossip
from gossipdl.averaging.robust import Defence
from gossipdl.compression import Payload


class ByzantineGossip(DenseGossip):
    """Dense gossip, but what it sends is ``attack`` applied to its model."""

    def __init__(
        self,
        attack: attacks.Attack,
        codec: str = "none",
        seed: int = 0,
        defence: Defence | None = None,
    ) -> None:
        super().__init__(codec, seed, defence)
        self.attack = attack
        self._seen: dict[int, torch.Tensor] = {}  # neighbour -> the model it sent last
        self._frozen: torch.Tensor | None = None
        self._noise = torch.Generator().manual_seed(seed + 104729)

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload | Mapping[int, Payload]:
        """The attacked model (dissensus: one per neighbour)."""
        attack, p = self.attack, self.attack.param
        if attack.name == "dissensus":
            return {v: self.encoded(self._dissensus(x, v, rnd)) for v in rnd.weights}
        seen = torch.stack(list(self._seen.values())) if self._seen else x.unsqueeze(0)
        if attack.name == "sign-flip":
            sent = attacks.sign_flip(x)
        elif attack.name == "scaled":
            sent = attacks.scaled(x, float(p or 0.0))
        elif attack.name == "gaussian":
            sent = attacks.gaussian(x, float(p or 0.0), self._noise)
        elif attack.name == "alie":
            sent = attacks.alie(x, seen, float(p or 0.0))
        elif attack.name == "ipm":
            sent = attacks.inner_product_manipulation(x, seen, float(p or 0.0))
        elif attack.name == "stale":
            if self._frozen is None:
                self._frozen = x.clone()
            sent = self._frozen
        else:  # label-flip: the data is poisoned, the model sent as it is
            sent = x.clone()
        return self.encoded(sent)

    def _dissensus(self, x: torch.Tensor, victim: int, rnd: Round) -> torch.Tensor:
        """What neighbour ``victim`` gets: its last model pushed against the others' pull."""
        own = self._seen.get(victim, x)
        others = [j for j in self._seen if j != victim]
        honest = torch.stack([self._seen[j] for j in others]) if others else x.unsqueeze(0)
        weights = torch.tensor([rnd.weights.get(j, 0.0) for j in others] or [1.0])
        epsilon = self.attack.param or 0.0
        return attacks.dissensus(own, honest, weights, rnd.weights.get(victim) or 1.0, epsilon)

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Remember what the neighbours sent (the next attack's crowd); average honestly."""
        self._seen = {j: a.value for j, a in arrived.items()}
        return super().incoming(x, rnd, arrived, missing, late)
