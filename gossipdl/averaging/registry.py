"""Spec string -> Averager. New algorithms are one file and one line here."""

from __future__ import annotations

from collections.abc import Callable

from gossipdl.averaging.attacks import Attack
from gossipdl.averaging.base import Averager
from gossipdl.averaging.beer import Beer
from gossipdl.averaging.broadcast import Broadcast
from gossipdl.averaging.byzantine import ByzantineBeer, ByzantineChoco, ByzantineGossip
from gossipdl.averaging.choco import Choco
from gossipdl.averaging.dense import DenseGossip
from gossipdl.averaging.gossip_learning import GossipLearning
from gossipdl.averaging.power_gossip import PowerGossip
from gossipdl.averaging.robust import parse_defence
from gossipdl.compression import build_codec

ROBUST_ALGORITHMS = ("dense", "choco", "beer")
"""The algorithms that take a defence and Byzantine peers: what they mix are models (dense
gossip's) or replicas of models (CHOCO's and BEER's public copies), which a robust rule
can judge (BEER's trackers follow its verdict on the models)."""

AveragerFactory = Callable[[str, int, "float | None"], Averager]

_ALGORITHMS: dict[str, AveragerFactory] = {
    "dense": lambda codec, seed, gamma: DenseGossip(codec, seed),
    "choco": lambda codec, seed, gamma: Choco(codec, seed, gamma),
    "broadcast": lambda codec, seed, gamma: Broadcast(codec, seed),
    "gossip-learning": lambda codec, seed, gamma: GossipLearning(codec, seed),
    "powergossip": lambda codec, seed, gamma: PowerGossip(codec, seed, gamma),
    "beer": lambda codec, seed, gamma: Beer(codec, seed, gamma),
}


def available_algorithms() -> list[str]:
    """Names accepted by ``build_averager`` (plus ``auto``)."""
    return ["auto", *sorted(_ALGORITHMS)]


def register_algorithm(name: str, factory: AveragerFactory) -> None:
    """Make ``name`` buildable: ``factory(codec_spec, seed, gamma) -> Averager``."""
    _ALGORITHMS[name] = factory


def resolve_algorithm(name: str, codec: str) -> str:
    """``auto`` means dense gossip for a lossless codec and CHOCO for a lossy one."""
    if name != "auto":
        return name
    return "choco" if build_codec(codec).lossy else "dense"


def build_averager(
    name: str = "auto",
    codec: str = "none",
    seed: int = 0,
    gamma: float | None = None,
    defence: str = "none",
    attack: Attack | None = None,
    peer: int | None = None,
) -> Averager:
    """The averaging strategy ``name`` with codec ``codec`` (dense gossip, CHOCO and BEER: and
    ``defence``, a Byzantine-robust rule, :func:`~gossipdl.averaging.robust.parse_defence`;
    a Byzantine peer's ``attack``, :mod:`gossipdl.averaging.byzantine`),
    for peer ``peer`` of a swarm seeded ``seed``: its codec draws its own random numbers
    (:meth:`~gossipdl.averaging.Averager.own_draws`); None: the swarm's seed's."""
    averager = _build(name, codec, seed, gamma, defence, attack)
    if gamma is not None and not averager.takes_gamma:
        raise ValueError(
            f"gamma = {gamma}: algorithm {averager.name!r} takes no consensus step (choco, "
            "beer and powergossip do); leave gamma unset"
        )
    if peer is not None:
        averager.own_draws(peer)
    return averager


def _build(
    name: str,
    codec: str,
    seed: int,
    gamma: float | None,
    defence: str,
    attack: Attack | None,
) -> Averager:
    """The averager :func:`build_averager` makes, before its own draws."""
    name = resolve_algorithm(name, codec)
    rule = parse_defence(defence)
    if (rule is not None or attack is not None) and name not in ROBUST_ALGORITHMS:
        what = f"defence = {defence!r}" if attack is None else f"byzantine {attack.name!r}"
        raise ValueError(
            f"{what} works on the models dense gossip sends and on CHOCO's and BEER's public "
            f"copies; algorithm {name!r} sends something else: use algorithm dense, choco "
            "or beer"
        )
    if attack is not None:
        if name == "choco":
            return ByzantineChoco(attack, codec, seed, gamma, rule)
        if name == "beer":
            return ByzantineBeer(attack, codec, seed, gamma, rule)
        return ByzantineGossip(attack, codec, seed, rule)
    if rule is not None:
        if name == "choco":
            return Choco(codec, seed, gamma, rule)
        if name == "beer":
            return Beer(codec, seed, gamma, rule)
        return DenseGossip(codec, seed, rule)
    try:
        factory = _ALGORITHMS[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; choose one of {', '.join(available_algorithms())}"
        ) from None
    return factory(codec, seed, gamma)
