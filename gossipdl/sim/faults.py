"""Fault schedules: what goes wrong in a simulated swarm, and when.

A config's ``faults`` key is a list of events (``[[faults]]`` tables in a file),
each an ``at`` time (virtual seconds from the start: ``"30s"``, ``"250ms"`` or a
number) and one action:

``kill = "2-4"``
    the peers die (kill -9): no more steps, messages or heartbeats.
``leave = "2"``
    the peers stop gracefully at their next round, once its messages are out (a leave
    during a sync): final line, model file, goodbye to every member; they do not come back.
``restart = "2"
    the peers, killed before, start again and rejoin the swarm: from their last
    checkpoint (``checkpoint_every``, kept in memory) as ``gossipdl peer --resume``
    does, keeping that model; without one as a newcomer that gets its old id back
    (it comes back on the same address) and takes a neighbour's model.
``partition = ["0-3", "4-7"]``
    the network splits into these groups (peers in no group form one more);
    a message between groups is dropped. A later partition replaces it.
``heal = true``
    the partition ends.
``clog = "0>1"`` / ``unclog = "0>1"``
    messages from peer 0 to peer 1 wait (in order) until the direction is unclogged.
``clock = {peers = "2", rate = 0.5}``
    the peers' clocks run at ``rate`` times true time from then on (their heartbeats,
    round timeouts and death sentences come late; ``rate = 1`` sets them right again).
``inject = {loss = 0.05, duplicate = 0.01, reorder = "50ms"}``
    from then on, every message is lost with ``loss``, delivered twice with
    ``duplicate`` and delayed by up to ``reorder`` extra (so messages overtake each
    other); a later ``inject`` replaces it, and ``inject = {}`` ends it.

Events at the same time happen in the order they are listed. :func:`parse_faults`
checks a schedule (the config does, once); :func:`schedule` puts it on a
simulation's clock. Faults are simulated only: the real engine refuses them
(:func:`refuse_outside_simulation`).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gossipdl.conditions import ConditionError, parse_duration, parse_peer_ids
from gossipdl.suggest import did_you_mean

if TYPE_CHECKING:
    from gossipdl.config import Config
    from gossipdl.sim.engine import Simulation

log = logging.getLogger(__name__)
ACTIONS = ("kill", "leave", "restart", "partition", "heal", "clog", "unclog", "clock", "inject")
FAULT_KEYS = ("at", *ACTIONS)
INJECT_KEYS = ("loss", "duplicate", "reorder")
EXAMPLE = '{at = "30s", kill = "3"}'
INJECT_EXAMPLE = '{loss = 0.05, duplicate = 0.01, reorder = "50ms"}'
CLOCK_KEYS = ("peers", "rate")
CLOCK_EXAMPLE = '{peers = "2", rate = 0.5}'
_DIRECTION = re.compile(r"(\d+)>(\d+)")


class FaultError(ConditionError):
    """A fault event that cannot be run; the message names the entry and the fix."""


@dataclass(frozen=True)
class Fault:
    """One event of a schedule: something happens at virtual time ``at`` (seconds)."""

    at: float

    @property
    def action(self) -> str:
        """Its key in a ``[[faults]]`` table."""
        return ACTION_OF[type(self)]

    def apply(self, simulation: Simulation) -> None:
        """Make it happen on ``simulation`` now."""
        raise NotImplementedError


@dataclass(frozen=True)
class Kill(Fault):
    """The peers die for good."""

    peers: tuple[int, ...]

    def apply(self, simulation: Simulation) -> None:
        for peer_id in self.peers:
            simulation.kill(peer_id)


@dataclass(frozen=True)
class Leave(Fault):
    """The peers stop gracefully at their next round, after sending its messages."""

    peers: tuple[int, ...]

    def apply(self, simulation: Simulation) -> None:
        for peer_id in self.peers:
            simulation.leave(peer_id)


@dataclass(frozen=True)
class Restart(Fault):
    """The peers, killed before, start again and rejoin."""

    peers: tuple[int, ...]

    def apply(self, simulation: Simulation) -> None:
        for peer_id in self.peers:
            simulation.restart(peer_id)


@dataclass(frozen=True)
class Partition(Fault):
    """The network splits into ``groups`` (peers in none form one more group)."""

    groups: tuple[tuple[int, ...], ...]

    def apply(self, simulation: Simulation) -> None:
        simulation.network.partition(self.groups)


@dataclass(frozen=True)
class Heal(Fault):
    """The partition ends."""

    def apply(self, simulation: Simulation) -> None:
        simulation.network.heal()


@dataclass(frozen=True)
class Clog(Fault):
    """Messages from ``src`` to ``dst`` wait until an :class:`Unclog`."""

    src: int
    dst: int

    def apply(self, simulation: Simulation) -> None:
        simulation.network.clog(self.src, self.dst)


@dataclass(frozen=True)
class Unclog(Fault):
    """What a :class:`Clog` held from ``src`` to ``dst`` goes, in order, as if sent now."""

    src: int
    dst: int

    def apply(self, simulation: Simulation) -> None:
        simulation.network.unclog(self.src, self.dst)


@dataclass(frozen=True)
class ClockRate(Fault):
    """The peers' clocks run at ``rate`` times true time from now on."""

    peers: tuple[int, ...]
    rate: float

    def apply(self, simulation: Simulation) -> None:
        for peer_id in self.peers:
            simulation.set_rate(peer_id, self.rate)


@dataclass(frozen=True)
class Inject(Fault):
    """Network-wide loss, duplication and reordering delay from now on (zeros: none)."""

    loss: float = 0.0
    duplicate: float = 0.0
    reorder_s: float = 0.0

    def apply(self, simulation: Simulation) -> None:
        simulation.network.inject(self.loss, self.duplicate, self.reorder_s)


ACTION_OF: dict[type[Fault], str] = {
    Kill: "kill",
    Leave: "leave",
    Restart: "restart",
    Partition: "partition",
    Heal: "heal",
    Clog: "clog",
    Unclog: "unclog",
    ClockRate: "clock",
    Inject: "inject",
}
# Faults only a gossip swarm simulates: a ring or ps swarm cannot take a peer back, and has no
# member table for a leave or a slow clock to disturb.
GOSSIP_ONLY = (Leave, Restart, ClockRate)


def parse_faults(value: Any, peers: int) -> list[Fault]:
    """The fault events a config's ``faults`` lists, for a swarm of ``peers``, in order.

    Example:
        >>> parse_faults([{"at": "1.5s", "kill": "2-3"}, {"at": 3, "clog": "0>1"}], 4)
        [Kill(at=1.5, peers=(2, 3)), Clog(at=3.0, src=0, dst=1)]
        >>> parse_faults([{"at": "1s", "kill": "7"}], 4)
        Traceback (most recent call last):
        ...
        gossipdl.sim.faults.FaultError: faults[0] (at 1s): kill = '7' names peer 7, but ...
    """
    if not isinstance(value, list | tuple):
        raise FaultError(
            f"faults = {value!r}: write a list of events, [[faults]] tables in a file or "
            f"--set 'faults=[{EXAMPLE}]'"
        )
    faults = [_parse_one(index, entry, peers) for index, entry in enumerate(value)]
    down: set[int] = set()  # killed, not restarted since (in time order; ties: as listed)
    left: set[int] = set()  # left for good
    for index, fault in sorted(enumerate(faults), key=lambda item: (item[1].at, item[0])):
        if isinstance(fault, Kill):
            down.update(fault.peers)
        elif isinstance(fault, Leave):
            left.update(fault.peers)
        elif isinstance(fault, Restart):
            alive = sorted(set(fault.peers) - down)
            if alive:
                raise FaultError(
                    f"faults[{index}] (at {fault.at:g}s): restart = {alive} names peers not "
                    "killed before then; kill them first (a kill event at an earlier time)"
                )
            down.difference_update(fault.peers)
        if peers and len(down | left) == peers:
            raise FaultError(
                f"faults: the kills and leaves end every peer of the swarm ({peers}) at "
                f"{fault.at:g}s; leave at least one alive (a restarted peer rejoins through a "
                "live one)"
            )
    return faults


def _parse_one(index: int, entry: Any, peers: int) -> Fault:
    """Entry ``index`` of ``faults``: a table with ``at`` and one action."""
    where = f"faults[{index}]"
    if not isinstance(entry, Mapping):
        raise FaultError(f"{where} = {entry!r}: write a table with a time and one action, "
                         f"e.g. {EXAMPLE}")  # fmt: skip
    if "at" in entry:
        where = f"{where} (at {entry['at']})"
    unknown = sorted(set(entry) - set(FAULT_KEYS))
    if unknown:
        raise FaultError(
            "; ".join(f"{where}: unknown key {k!r}; {did_you_mean(k, FAULT_KEYS)}" for k in unknown)
        )
    actions = [key for key in ACTIONS if key in entry]
    if len(actions) != 1:
        named = f"names {len(actions)} actions ({', '.join(actions)})" if actions else "names none"
        raise FaultError(
            f"{where} {named}; give each event exactly one of {', '.join(ACTIONS)} "
            f"(one table per event), e.g. {EXAMPLE}"
        )
    action = actions[0]
    value = entry[action]
    if "at" not in entry:
        raise FaultError(f'{where} ({action} = {value!r}) has no time; add at = "30s"')
    at = _seconds(entry["at"], f"{where}: at")
    what = f"{where}: {action}"
    if action == "kill":
        return Kill(at, _peer_ids(value, peers, where, "kill"))
    if action == "leave":
        return Leave(at, _peer_ids(value, peers, where, "leave"))
    if action == "restart":
        return Restart(at, _peer_ids(value, peers, where, "restart"))
    if action == "clock":
        return _clock(at, value, peers, where)
    if action == "partition":
        return Partition(at, _groups(value, peers, where))
    if action == "heal":
        if value is not True:
            raise FaultError(f"{what} = {value!r}; write heal = true (it ends the partition)")
        return Heal(at)
    if action in ("clog", "unclog"):
        src, dst = _direction(value, peers, what)
        return Clog(at, src, dst) if action == "clog" else Unclog(at, src, dst)
    return _inject(at, value, what)


def _seconds(value: Any, what: str) -> float:
    try:
        return parse_duration(value, what)
    except ConditionError:
        raise FaultError(
            f'{what} = {value!r}; use a time from the start such as "30s", "250ms" or 1.5'
        ) from None


def _peer_ids(value: Any, peers: int, where: str, key: str) -> tuple[int, ...]:
    try:
        return parse_peer_ids(value, peers, where, key)
    except ConditionError as exc:
        raise FaultError(str(exc)) from None


def _groups(value: Any, peers: int, where: str) -> tuple[tuple[int, ...], ...]:
    """A partition's groups: disjoint, and splitting the swarm in at least two sides."""
    usage = f'{where}: partition = {value!r}; use a list of peer groups, e.g. ["0-3", "4-7"]'
    if not isinstance(value, list | tuple) or not value:
        raise FaultError(usage)
    groups = tuple(_peer_ids(group, peers, where, "partition") for group in value)
    seen: dict[int, int] = {}
    for k, group in enumerate(groups):
        for peer_id in group:
            if peer_id in seen:
                raise FaultError(
                    f"{where}: partition = {value!r} puts peer {peer_id} in groups {seen[peer_id]} "
                    f"and {k}; give each peer one group"
                )
            seen[peer_id] = k
    if len(groups) == 1 and len(seen) == peers:
        raise FaultError(
            f"{usage}: one group of every peer splits nothing (peers in no group form one more)"
        )
    return groups


def _direction(value: Any, peers: int, what: str) -> tuple[int, int]:
    """``"A>B"``: messages from peer A to peer B."""
    match = _DIRECTION.fullmatch(value.replace(" ", "")) if isinstance(value, str) else None
    if match is None or match[1] == match[2]:
        raise FaultError(
            f'{what} = {value!r}; name one direction between two peers, e.g. "0>1" '
            "(messages from 0 to 1)"
        )
    src, dst = int(match[1]), int(match[2])
    if max(src, dst) >= peers:
        raise FaultError(
            f"{what} = {value!r} names peer {max(src, dst)}, but the swarm has peers "
            f"0..{peers - 1} (peers = {peers}); use ids < {peers} or raise peers"
        )
    return src, dst


def _inject(at: float, value: Any, what: str) -> Inject:
    """``{loss = 0.05, duplicate = 0.01, reorder = "50ms"}``, each optional (0: none)."""
    if not isinstance(value, Mapping):
        raise FaultError(
            f"{what} = {value!r}; write a table, e.g. {INJECT_EXAMPLE} (inject = {{}} ends an "
            "injection)"
        )
    unknown = sorted(set(value) - set(INJECT_KEYS))
    if unknown:
        raise FaultError(
            "; ".join(f"{what}: unknown key {k!r}; {did_you_mean(k, INJECT_KEYS)}" for k in unknown)
        )
    return Inject(
        at,
        loss=_rate(value.get("loss", 0.0), f"{what}.loss"),
        duplicate=_rate(value.get("duplicate", 0.0), f"{what}.duplicate"),
        reorder_s=_seconds(value.get("reorder", 0.0), f"{what}.reorder"),
    )


def _clock(at: float, value: Any, peers: int, where: str) -> ClockRate:
    """``{peers = "2", rate = 0.5}``: both keys needed, the rate in [0.1, 10]."""
    what = f"{where}: clock"
    if not isinstance(value, Mapping) or set(value) != set(CLOCK_KEYS):
        raise FaultError(
            f"{what} = {value!r}; write a table with the peers and their clock's rate, e.g. "
            f"{CLOCK_EXAMPLE} (rate = 1 sets the clocks right again)"
        )
    rate = value["rate"]
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0.1 <= rate <= 10:
        raise FaultError(
            f"{what}.rate = {rate!r}; use a number from 0.1 (a clock at a tenth of true speed) "
            "to 10"
        )
    return ClockRate(at, _peer_ids(value["peers"], peers, where, "clock"), float(rate))


def _rate(value: Any, what: str) -> float:
    """A share of messages: ``0.05`` or ``"5%"``, in [0, 1)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        rate = float(value[:-1]) / 100 if isinstance(value, str) and value.endswith("%") else value
        if not isinstance(rate, int | float) or not 0 <= rate < 1:
            raise ValueError
    except ValueError:
        raise FaultError(f'{what} = {value!r}; use a share in [0, 1), e.g. 0.05 or "5%"') from None
    return float(rate)


def schedule(faults: Sequence[Fault], simulation: Simulation) -> None:
    """Put every fault on ``simulation``'s clock, at its time (same time: listed order)."""
    for fault in faults:
        simulation.clock.at(fault.at, functools.partial(_apply, fault, simulation))


def _apply(fault: Fault, simulation: Simulation) -> None:
    log.info("fault at %.3fs: %s", simulation.clock.now, fault)
    fault.apply(simulation)


def refuse_outside_simulation(config: Config) -> None:
    """The real engine's answer to a config with ``faults`` or ``batched``: a ConfigError
    saying where they run (it cannot kill peers or split its network on a schedule, and
    its peers are processes)."""
    from gossipdl.config import ConfigError  # here: the config's checks import this module

    if config.batched:
        raise ConfigError(
            "batched = true is a simulator setting: run this config with `gossipdl simulate`, "
            "or set batched = false to run it for real"
        )
    if config.faults:
        raise ConfigError(
            f"faults ({len(config.faults)} event(s)) are simulated only: run this config with "
            "`gossipdl simulate`, or remove its [[faults]] tables to run it for real (real churn: "
            "offline windows in a device profile)"
        )
