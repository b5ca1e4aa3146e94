"""A Byzantine peer's averaging: dense gossip that sends an attacked model, CHOCO whose
public copy follows one, or BEER whose public copies of model and tracker follow attacked
ones (issue 26's attacks, :mod:`gossipdl.averaging.attacks`, in both engines: they share
these classes).

The attacker knows what a member knows: its own model and the models its neighbours
sent it in the last round. ALIE and inner-product manipulation use those as the honest
crowd; dissensus sends each neighbour its own message, built from that neighbour's last
model and the attacker's other neighbours' as the honest pull, with the attacker's row of
the (symmetric) mixing matrix as the victim's weights: the paper's formula with what the
attacker sees, not the victim's own neighbourhood (:func:`dissensus_for` says where they
differ). The attacker itself averages honestly, so the
models it perturbs stay plausible. A stale peer sends the model of its first round
forever; a label-flipping one sends honestly and poisons its data instead
(:func:`gossipdl.training.peer_sampler`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gossipdl.averaging import attacks
from gossipdl.averaging.base import Arrival, Round
from gossipdl.averaging.beer import Beer
from gossipdl.averaging.choco import Choco, PublicCopies, choco_step
from gossipdl.averaging.dense import DenseGossip
from gossipdl.averaging.robust import Defence
from gossipdl.compression import Payload


class Attacker:
    """The model a Byzantine peer running ``attack`` puts in place of its own ``x``, from
    what it saw of its neighbours (``seen``, ``[k, n]``: their last models or public
    copies). Dissensus, which aims a model at each neighbour, is :func:`dissensus_for`."""

    def __init__(self, attack: attacks.Attack, seed: int) -> None:
        if attack.name == "alie" and attack.param is None:
            raise ValueError(
                "byzantine 'alie' has no z here (it would send the crowd's plain mean): give "
                "one, Attack('alie', Z) or parse_attack('alie:Z'), or the swarm's own, "
                "Attack('alie', alie_z(peers, byzantine)); simulate and launch work it out"
            )
        self.attack = attack
        self._frozen: torch.Tensor | None = None
        self._noise = torch.Generator().manual_seed(seed + 104729)

    def target(self, x: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The attacked model (a new tensor, but for ``stale``'s, which callers only read)."""
        name, p = self.attack.name, float(self.attack.param or 0.0)
        if name == "sign-flip":
            return attacks.sign_flip(x)
        if name == "scaled":
            return attacks.scaled(x, p)
        if name == "gaussian":
            return attacks.gaussian(x, p, self._noise)
        if name == "alie":
            return attacks.alie(x, seen, p)
        if name == "ipm":
            return attacks.inner_product_manipulation(x, seen, p)
        if name == "stale":
            if self._frozen is None:
                self._frozen = x.clone()
            return self._frozen  # never written: the senders read it
        if name == "dissensus":
            raise ValueError("dissensus aims a model at each neighbour: use dissensus_for")
        return x.clone()  # label-flip: the data is poisoned, the model sent as it is


def crowd(copies: Mapping[int, torch.Tensor] | None, own: torch.Tensor) -> torch.Tensor:
    """What an attacker saw of its neighbours, stacked (``[k, n]``): its copies of their public
    copies, or its own ``own`` alone before it holds any."""
    return torch.stack(list(copies.values())) if copies else own.unsqueeze(0)


def refuse_dissensus(attack: attacks.Attack, algorithm: str) -> None:
    """ValueError for dissensus on a public-copy ``algorithm``: it aims a model at each
    neighbour, and every neighbour holds the one public copy of the sender."""
    if attack.name == "dissensus":
        raise ValueError(
            f"byzantine 'dissensus' sends each neighbour a model of its own; {algorithm}'s "
            "neighbours all hold one public copy of the sender: use algorithm dense"
        )


def dissensus_for(
    attack: attacks.Attack,
    x: torch.Tensor,
    seen: Mapping[int, torch.Tensor],
    victim: int,
    rnd: Round,
) -> torch.Tensor:
    """What neighbour ``victim`` gets under dissensus: its last model (``seen``, by id) pushed
    against the pull of the attacker's *other* neighbours, with the attacker's row of the
    (symmetric) mixing matrix as their weights, divided by the attacker's own weight in the
    victim's row.

    Not the paper's formula (He, Karimireddy & Jaggi 2022: the pull of the victim's honest
    neighbours with the victim's weights, over all Byzantine neighbours' weight), which
    needs the models of the victim's neighbours; an attacker here knows only its own.
    Where the two neighbourhoods overlap it cancels (ε = 1) or reverses the victim's pull
    as the paper's does; where they do not it may strengthen it (a ring: the attacker's
    other neighbour sits on the far side), and each liar next to the victim pushes as if
    it were the only one."""
    own = seen.get(victim, x)
    others = [j for j in seen if j != victim]
    honest = torch.stack([seen[j] for j in others]) if others else x.unsqueeze(0)
    weights = torch.tensor([rnd.weights.get(j, 0.0) for j in others] or [1.0])
    epsilon = attack.param or 0.0
    return attacks.dissensus(own, honest, weights, rnd.weights.get(victim) or 1.0, epsilon)


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
        self.attacker = Attacker(attack, seed)
        self._seen: dict[int, torch.Tensor] = {}  # neighbour -> the model it sent last

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload | Mapping[int, Payload]:
        """The attacked model (dissensus: one per neighbour)."""
        if self.attack.name == "dissensus":
            return {
                v: self.encoded(dissensus_for(self.attack, x, self._seen, v, rnd))
                for v in rnd.weights
            }
        seen = torch.stack(list(self._seen.values())) if self._seen else x.unsqueeze(0)
        return self.encoded(self.attacker.target(x, seen))

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


class AttacksPublicCopies(PublicCopies):
    """CHOCO's and BEER's Byzantine half: the copies of the neighbours kept apart (its crowd),
    an :class:`Attacker`, and dissensus refused (a sender has one public copy). Listed
    before the algorithm's class, as in ``ByzantineChoco(AttacksPublicCopies, Choco)``."""

    def __init__(
        self,
        attack: attacks.Attack,
        codec: str = "topk:0.01",
        seed: int = 0,
        gamma: float | None = None,
        defence: Defence | None = None,
    ) -> None:
        refuse_dissensus(attack, self.name.upper())
        super().__init__(codec, seed, gamma, defence, keep_copies=True)
        self.attack = attack
        self.attacker = Attacker(attack, seed)


class ByzantineChoco(AttacksPublicCopies, Choco):
    """CHOCO whose public copy follows ``attack`` applied to its model: what it compresses
    and sends each round is ``Q(a(x_i) − x̂_i)``, so its neighbours' copies of it converge
    to the attacked model, within the codec's contraction, as an honest copy converges
    to the model. Its crowd (ALIE, IPM) is its copies of its neighbours' public copies,
    what a CHOCO member knows of them. Its own model mixes honestly with those copies,
    ``x_i + γ Σ_j W_ij (x̂_j − x_i)`` (its public copy is the attacked one), so the
    models it perturbs stay plausible. Dissensus is refused: it aims a model at each
    neighbour, and a CHOCO sender has one public copy."""

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload:
        """CHOCO's update towards the attacked model (the first round as an honest one's)."""
        if self.x_hat is None:
            return super().outgoing(x, rnd)
        return super().outgoing(self.attacker.target(x, crowd(self.copies, x)), rnd)

    def gossip_step(self, x: torch.Tensor, rnd: Round) -> torch.Tensor:
        """An honest pull towards the neighbours' copies, centred at its own model."""
        return choco_step(x, self.neighbourhood(x, rnd), x, self.step_size(rnd))


class ByzantineBeer(AttacksPublicCopies, Beer):
    """BEER whose public copies follow ``attack`` applied to its next model and, with a second
    attacker, to its tracker: its neighbours' copies of it converge to the attacked model
    and tracker as honest copies converge to the real ones. Its crowds (ALIE, IPM) are its
    copies of its neighbours' public copies, h_j for the model and g_j for the tracker.
    Its own model and tracker mix honestly with those copies, centred at themselves (its
    public copies are the attacked ones), so what it perturbs stays plausible. Dissensus
    is refused, as for CHOCO."""

    def __init__(
        self,
        attack: attacks.Attack,
        codec: str = "topk:0.01",
        seed: int = 0,
        gamma: float | None = None,
        defence: Defence | None = None,
    ) -> None:
        super().__init__(attack, codec, seed, gamma, defence)
        self.tracker_attacker = Attacker(attack, seed + 1)

    def centres(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Its own model and tracker: their pulls are honest."""
        assert self._last is not None and self.v is not None
        return self._last, self.v

    def targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The attacked next model and tracker."""
        model, tracker = super().targets()
        assert self.models is not None and self.trackers is not None
        return (
            self.attacker.target(model, crowd(self.models.copies, model)),
            self.tracker_attacker.target(tracker, crowd(self.trackers.copies, tracker)),
        )
