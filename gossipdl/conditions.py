"""Experimental conditions a peer imposes on itself: slower compute, and data that drifts.

``slowdown`` (``PEER:FACTOR[,PEER:FACTOR...]``) makes the named peers' local
steps take FACTOR times as long, by sleeping after each step for (FACTOR − 1)
times what the step took: a straggler on the same hardware.

``drift`` (``STEP:permute[:FRACTION]``) changes the concept to learn at step
STEP: on the first FRACTION of the peers (default all) the labels of the
training and the test data go through one fixed permutation, the same on
every affected peer, so they must unlearn the old mapping (Kamp et al. 2018
study how averaging triggers react to such drift).

Device profiles (the ``[profiles.NAME]`` tables of an experiment file) give
named groups of peers an access link (bandwidth, latency, jitter, loss and
offline windows, emulated by ``transport.shaping``), a slowdown and a
``step_time`` (the least time one step takes: a step done sooner waits out
the rest, so a fast host can stand in for a slow device): phones,
sensor boards or cars on bad links, next to better-connected peers. Inside an
offline window the device is away: the link drops everything and the training
loop takes no steps (``peers.runner``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from gossipdl.numerals import is_decimal
from gossipdl.suggest import did_you_mean
from gossipdl.transport.shaping import LinkError, LinkProfile, parse_link, parse_windows

LINK_KEYS = ("up", "down", "latency", "jitter", "loss")
PROFILE_KEYS = ("peers", *LINK_KEYS, "slowdown", "step_time", "offline", "byzantine")
_DURATION = re.compile(r"([0-9]*\.?[0-9]+)(ms|s)")  # a string names its unit


class ConditionError(ValueError):
    """A slowdown or drift spec that cannot be parsed."""


def parse_slowdown(spec: str, peers: int | None = None) -> dict[int, float]:
    """``"3:4,5:2"`` as ``{3: 4.0, 5: 2.0}``; ``""`` as no slowdown. With ``peers`` (the
    swarm's size) every peer id must be below it.

    Example:
        >>> parse_slowdown("3:4")
        {3: 4.0}
        >>> parse_slowdown("9:4", peers=4)
        Traceback (most recent call last):
        ...
        gossipdl.conditions.ConditionError: slowdown '9:4' names peer 9, but ...
    """
    result: dict[int, float] = {}
    for item in filter(None, spec.replace(" ", "").split(",")):
        peer, _, factor = item.partition(":")
        try:
            peer_id, value = int(peer), float(factor)
        except ValueError:
            peer_id, value = -1, 0.0
        if peer_id < 0 or not 1 <= value < math.inf:
            raise ConditionError(
                f"slowdown {item!r}: use PEER:FACTOR with a peer id >= 0 and FACTOR >= 1, "
                f"e.g. 3:4 (peer 3 computes 4x slower)"
            )
        if peers is not None and peer_id >= peers:
            raise ConditionError(
                f"slowdown {item!r} names peer {peer_id}, but {_swarm(peers)}; name a peer "
                "in that range or raise peers"
            )
        result[peer_id] = value
    return result


def _swarm(peers: int) -> str:
    """The peer ids a swarm of ``peers`` has, for messages about an id out of range."""
    return f"the swarm has peers 0..{peers - 1} (peers = {peers})"


@dataclass(frozen=True)
class Drift:
    """At ``step``, the first ``fraction`` of the peers switch to permuted labels."""

    step: int
    fraction: float = 1.0

    def affects(self, peer_id: int, peers: int) -> bool:
        """Whether ``peer_id`` (of ``peers``) drifts."""
        return peer_id % peers < round(self.fraction * peers)

    @staticmethod
    def permutation(num_classes: int, seed: int) -> np.ndarray:
        """The new label of each old label: a derangement, so every class changes meaning."""
        rng = np.random.default_rng(seed + 7777)
        while True:
            perm = rng.permutation(num_classes)
            if num_classes < 2 or not np.any(perm == np.arange(num_classes)):
                return perm


def parse_drift(spec: str) -> Drift | None:
    """``"STEP:permute[:FRACTION]"`` as a :class:`Drift`; ``""`` as none.

    Example:
        >>> parse_drift("750:permute:0.5")
        Drift(step=750, fraction=0.5)
    """
    if not spec:
        return None
    parts = spec.replace(" ", "").split(":")
    usage = f"drift {spec!r}: use STEP:permute[:FRACTION], e.g. 750:permute or 750:permute:0.5"
    if len(parts) not in (2, 3) or parts[1] != "permute" or not is_decimal(parts[0]):
        raise ConditionError(usage)
    try:
        fraction = float(parts[2]) if len(parts) == 3 else 1.0
    except ValueError:
        raise ConditionError(usage) from None
    if not 0 < fraction <= 1:
        raise ConditionError(f"{usage} (FRACTION in (0, 1])")
    return Drift(int(parts[0]), fraction)


@dataclass(frozen=True)
class DeviceProfile:
    """One kind of device: its access link (with its offline windows), how much slower it
    computes than the machine it is emulated on, and the least time one of its training steps
    takes (``step_time``, seconds; 0: as fast as the host), which the simulator also uses."""

    name: str
    peers: tuple[int, ...]
    link: LinkProfile = dataclasses.field(default_factory=LinkProfile)
    slowdown: float = 1.0
    step_time: float = 0.0
    byzantine: str = ""  # an attack (gossipdl.averaging.attacks.parse_attack): its peers lie

    @property
    def needs_host(self) -> bool:
        """Whether a simulated step's time depends on the host's: a ``step_time`` alone
        fixes it (so a run is the same on every host), a ``slowdown`` scales the host's."""
        return not self.step_time or self.slowdown != 1

    def step_s(self, host: float | None) -> float:
        """A simulated step's seconds given the host's (``needs_host``): ``slowdown`` times
        it, at least ``step_time``, as the real runner's ``_take_as_long`` waits."""
        if not self.needs_host:
            return self.step_time
        assert host is not None, "this profile's step time needs the host's"
        return max(self.step_time, host * self.slowdown)


def parse_peer_ids(value: Any, peers: int, what: str, key: str = "peers") -> tuple[int, ...]:
    """Peer ids from ``"0-5"``, ``"6,7"``, ``"*"`` (all), an int or a list of ints; errors
    name ``what`` and the setting ``key`` that held them.

    Example:
        >>> parse_peer_ids("0-2,5", 8, "profile phone")
        (0, 1, 2, 5)
    """
    usage = f'{what}: {key} = {value!r}; use e.g. "0-5", "6,7", "*" or [0, 1] with ids < {peers}'
    if value == "*":
        return tuple(range(peers))
    items = value if isinstance(value, list) else str(value).replace(" ", "").split(",")
    ids: set[int] = set()
    for item in items:
        first, _, last = str(item).partition("-")
        if isinstance(item, bool) or not is_decimal(first) or not is_decimal(last or first):
            raise ConditionError(usage)
        low, high = int(first), int(last or first)
        if low > high:
            raise ConditionError(usage)
        if high >= peers:
            raise ConditionError(
                f"{what}: {key} = {value!r} names peer {high}, but {_swarm(peers)}; "
                f"use ids < {peers} or raise peers"
            )
        ids.update(range(low, high + 1))
    if not ids:
        raise ConditionError(usage)
    return tuple(sorted(ids))


def parse_profile(name: str, table: Mapping[str, Any], peers: int) -> DeviceProfile:
    """One ``[profiles.NAME]`` table as a :class:`DeviceProfile`.

    Example:
        >>> parse_profile("phone", {"peers": "0-1", "up": "10mbit", "slowdown": 2}, 4).slowdown
        2.0
    """
    what = f"profile {name!r}"
    if not isinstance(table, Mapping):
        raise ConditionError(f"{what} must be a table ([profiles.{name}]) of {PROFILE_KEYS}")
    unknown = sorted(set(table) - set(PROFILE_KEYS))
    if unknown:
        raise ConditionError(
            "; ".join(
                f"{what}: unknown key {key!r}; {did_you_mean(key, PROFILE_KEYS)}" for key in unknown
            )
        )
    if "peers" not in table:
        raise ConditionError(f'{what} names no peers; add e.g. peers = "0-3"')
    slowdown = table.get("slowdown", 1.0)
    if (
        isinstance(slowdown, bool)
        or not isinstance(slowdown, int | float)
        or not (1 <= slowdown < math.inf)
    ):
        raise ConditionError(f"{what}: slowdown = {slowdown!r}; use a number >= 1 (2: 2x slower)")
    step_time = parse_duration(table.get("step_time", 0), f"{what}: step_time")
    for key in LINK_KEYS:  # one value each: a comma would smuggle in another key
        if key in table and not (
            isinstance(table[key], str | int | float) and "," not in str(table[key])
        ):
            raise ConditionError(f"{what}: {key} = {table[key]!r}; give one value, e.g. 10mbit")
    try:
        link = parse_link(",".join(f"{k}={table[k]}" for k in LINK_KEYS if k in table))
        offline = parse_windows(table.get("offline", []))
    except LinkError as exc:
        raise ConditionError(f"{what}: {exc}") from None
    byzantine = str(table.get("byzantine", ""))
    if byzantine:
        from gossipdl.averaging.attacks import parse_attack

        try:
            parse_attack(byzantine)
        except ValueError as exc:
            raise ConditionError(f"{what}: {exc}") from None
    return DeviceProfile(
        name,
        parse_peer_ids(table["peers"], peers, what),
        dataclasses.replace(link, offline=offline),
        float(slowdown),
        step_time,
        byzantine,
    )


def parse_profiles(tables: Mapping[str, Any], peers: int) -> dict[int, DeviceProfile]:
    """The device profile of every peer that has one; a peer in two profiles is an error."""
    by_peer: dict[int, DeviceProfile] = {}
    for name, table in tables.items():
        profile = parse_profile(name, table, peers)
        for peer_id in profile.peers:
            if peer_id in by_peer:
                raise ConditionError(
                    f"peer {peer_id} is in profiles {by_peer[peer_id].name!r} and {name!r}; "
                    "give each peer one profile"
                )
            by_peer[peer_id] = profile
    return by_peer


def device_of(
    peer_id: int | None, peers: int, profiles: Mapping[str, Any], link: str, slowdown: str
) -> DeviceProfile:
    """A peer's device: its profile, else one made of the swarm-wide ``link`` and
    ``slowdown`` specs (a peer without a rank yet gets the swarm-wide link)."""
    profile = parse_profiles(profiles, peers).get(peer_id) if peer_id is not None else None
    if profile is not None:
        return profile
    factor = parse_slowdown(slowdown).get(peer_id, 1.0) if peer_id is not None else 1.0
    ids = () if peer_id is None else (peer_id,)
    return DeviceProfile("", ids, parse_link(link), factor)


def parse_duration(value: Any, what: str) -> float:
    """Seconds from ``"250ms"``, ``"1.5s"`` (a string names its unit) or a number of seconds
    (>= 0).

    Example:
        >>> parse_duration("250ms", "step_time"), parse_duration(2, "step_time")
        (0.25, 2.0)
    """
    usage = f'{what} = {value!r}; use a duration such as "250ms" or "1.5s" (0: no minimum)'
    if isinstance(value, bool):
        raise ConditionError(usage)
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(str(value).replace(" ", ""))
        if match is None:
            raise ConditionError(usage)
        seconds = float(match[1]) * (1e-3 if match[2] == "ms" else 1.0)
    if not 0 <= seconds < math.inf:
        raise ConditionError(usage)
    return seconds
