"""What a Byzantine peer sends in place of its model: the attacks robust gossip is tested
against, as pure functions of what the attacker can see.

In gossip an attacker sends models, so every attack here returns a model. The ones that
aim at a neighbour (the "victim") use what a colluding attacker is assumed to know: the
victim's model and the models of the victim's honest neighbours, as in the
decentralized evaluation of He, Karimireddy and Jaggi (2022), whose definitions these
follow.

- :func:`sign_flip`, :func:`scaled`, :func:`gaussian`: a broken or crude peer.
- :func:`alie`: "A little is enough" (Baruch, Baruch and Goldberg 2019).
- :func:`inner_product_manipulation`: Xie, Koyejo and Gupta (2020).
- :func:`dissensus`: He, Karimireddy and Jaggi (2022), made against gossip.
- :func:`flip_labels`: poisoned data (the peer trains honestly on wrong labels).

(A crashed peer that sends a stale model forever needs no function: it keeps the model
of the round it crashed in.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import TypeVar

import numpy as np
import torch

from gossipdl.compression._kernels import beside

Labels = TypeVar("Labels", torch.Tensor, np.ndarray)


def sign_flip(own: torch.Tensor) -> torch.Tensor:
    """The peer's model negated (a bit-flipping worker)."""
    return -own


def scaled(own: torch.Tensor, factor: float) -> torch.Tensor:
    """The peer's model times ``factor`` (e.g. 100: a model blown up)."""
    return own * factor


def gaussian(own: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """The peer's model plus independent N(0, σ²) noise in every coordinate."""
    noise = torch.randn(own.shape, generator=generator, dtype=own.dtype)
    return own + sigma * noise.to(own.device)


def alie_z(peers: int, byzantine: int) -> float:
    """ALIE's z: with ``s = ⌊n/2 + 1⌋ − f`` honest supporters needed for a majority, the
    largest z with ``Φ(z) < (n − s)/n`` (Baruch et al. 2019, §4): the step that still
    looks like one of the crowd to a median or trimmed mean. Small swarms get a small z,
    0 for 8 peers with one liar, which then sends the crowd's mean (no attack): ``alie:Z``
    sets one.

    >>> round(alie_z(16, 2), 3), alie_z(8, 1)
    (0.157, 0.0)"""
    if not 0 <= byzantine < peers:
        raise ValueError(f"{byzantine} Byzantine of {peers} peers; ALIE needs 0 <= f < n")
    supporters = math.floor(peers / 2 + 1) - byzantine
    share = (peers - supporters) / peers
    return NormalDist().inv_cdf(min(max(share, 1e-12), 1 - 1e-12))


def in_swarm(attack: Attack, peers: int, byzantine: int) -> Attack:
    """``attack`` as a swarm of ``peers`` with ``byzantine`` liars runs it: ALIE's z, unless
    given, from n and f (:func:`alie_z`); any other attack as it is."""
    if attack.name == "alie" and attack.param is None:
        return Attack("alie", alie_z(peers, byzantine))
    return attack


def alie(victim: torch.Tensor, honest: torch.Tensor, z: float) -> torch.Tensor:
    """ "A little is enough": ``μ − z·σ``, coordinate by coordinate, over the victim's model
    and its honest neighbours' (``honest``, ``[k, n]``): a model just inside the honest
    spread in every coordinate, all of them pushed the same way."""
    models = torch.cat([victim.unsqueeze(0), honest])
    return models.mean(0) - z * models.std(0)


def inner_product_manipulation(
    victim: torch.Tensor, honest: torch.Tensor, epsilon: float = 0.1
) -> torch.Tensor:
    """``−ε`` times the mean of the victim's and its honest neighbours' models: a model
    whose inner product with the honest mean is negative, so an average that lets it in
    moves backwards (Xie et al. 2020; ε = 0.1 as they and He et al. use)."""
    models = torch.cat([victim.unsqueeze(0), honest])
    return models.mean(0) * -epsilon


def dissensus(
    victim: torch.Tensor,
    honest: torch.Tensor,
    honest_weights: torch.Tensor,
    byzantine_weight: float,
    epsilon: float = 1.5,
) -> torch.Tensor:
    """``x_v − ε Σ_k W_vk (x_k − x_v) / W_byz``: the model that, given the Byzantine
    neighbours' total weight ``byzantine_weight`` in the victim's row, cancels the pull of
    its honest neighbours (ε = 1) or reverses it (ε > 1), so the victim drifts away from
    consensus while sending nothing unusually large (He et al. 2022, §5)."""
    if byzantine_weight <= 0:
        raise ValueError("dissensus needs the Byzantine neighbours' weight in the row (> 0)")
    pull = ((honest - victim) * beside(honest_weights, victim).unsqueeze(1)).sum(0)
    return victim - pull * (epsilon / byzantine_weight)


def flip_labels(labels: Labels, classes: int) -> Labels:
    """Label ``l`` becomes ``classes − 1 − l`` (a tensor's or a numpy array's): a peer that
    trains on poisoned data."""
    return classes - 1 - labels


ATTACKS = (
    "sign-flip, scaled[:FACTOR], gaussian[:SIGMA], alie[:Z], ipm[:EPSILON], "
    "dissensus[:EPSILON], stale, label-flip"
)
_DEFAULTS: dict[str, float | None] = {
    "sign-flip": None,
    "scaled": 100.0,
    "gaussian": 1.0,
    "alie": None,  # z from the swarm's size and how many are Byzantine (alie_z)
    "ipm": 0.1,
    "dissensus": 1.5,
    "stale": None,
    "label-flip": None,
}


@dataclass(frozen=True)
class Attack:
    """What a Byzantine peer does (a profile's ``byzantine`` key): the attack's name and its
    number, if it takes one (``scaled``: the factor, ``gaussian``: σ, ``alie``: z,
    ``ipm`` and ``dissensus``: ε)."""

    name: str
    param: float | None = None


def parse_attack(spec: str) -> Attack:
    """``spec`` as an :class:`Attack`; ValueError naming the forms.

    Example:
        >>> parse_attack("scaled"), parse_attack("ipm:0.5")
        (Attack(name='scaled', param=100.0), Attack(name='ipm', param=0.5))
    """
    name, _, arg = str(spec).partition(":")
    usage = f"byzantine = {spec!r}; use one of {ATTACKS}"
    if name not in _DEFAULTS:
        raise ValueError(usage)
    takes = name in ("scaled", "gaussian", "alie", "ipm", "dissensus")
    if arg and not takes:
        raise ValueError(f"{usage} ({name} takes no number)")
    try:
        param = float(arg) if arg else _DEFAULTS[name]
    except ValueError:
        raise ValueError(usage) from None
    if param is not None and not math.isfinite(param):
        raise ValueError(f"{usage} (its number must be finite)")
    no_attack = {
        "ipm": "ε <= 0 sends a positive multiple of the honest mean (0: a zero model)",
        "dissensus": "ε 0 sends the victim its own model, ε < 0 pulls it towards consensus",
        "gaussian": "σ 0 sends the model unchanged, and σ is a standard deviation",
    }
    if name in no_attack and param is not None and param <= 0:
        symbol = "σ" if name == "gaussian" else "ε"
        raise ValueError(
            f"{usage} ({name}'s {symbol} is {param:g}; give one above 0, e.g. the default "
            f"{name}:{_DEFAULTS[name]:g}: {no_attack[name]})"
        )
    return Attack(name, param)
