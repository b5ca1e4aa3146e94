"""User-space link emulation: bandwidth, latency, jitter and loss on one peer's traffic.

A :class:`Link` models the peer's access link the way a slow device sees it:
every outgoing message occupies the uplink for ``size / uplink`` seconds after
the previous one (a link serialises; there are no free bursts), then arrives
``latency`` ± ``jitter`` seconds later, unless it is lost. Incoming messages
occupy the downlink the same way before the peer may read them. The timing is
pure arithmetic on a clock the caller passes in, so it is testable without
sleeping; the transport does the waiting. Works anywhere, no root needed.

A profile may also take the link down for windows of time (``offline``,
counted from :meth:`Link.start`): a device that is away sends and receives
nothing (its training loop pauses as well, see ``peers.runner``).
"""

from __future__ import annotations

import itertools
import math
import random
import re
from dataclasses import dataclass

MAX_LINK_DELAY_S = 3600.0
"""The longest latency a link may have: a message an hour on its way is no link, and times
past it (``1e999s`` read as infinity) broke both engines' clocks."""
_SPEC = re.compile(r"^(up|down|latency|jitter|loss)=([0-9.eE+-]+)(mbit|kbit|ms|s|%)?$")
_WINDOW = re.compile(r"^([0-9.]+)s?-([0-9.]+)s?$")
Window = tuple[float, float]
# Bytes a sender queues for one destination and not yet on the wire (handed to ZeroMQ, or held
# by an emulated link; the simulator's links hold them too): a slow or stalled receiver cannot
# grow the sender's memory beyond this. One message always fits, however large. Drop reason
# ``send_queue_full``.
MAX_QUEUED_BYTES = 256 * 2**20


class LinkError(ValueError):
    """A link spec that cannot be used; the message shows the expected form."""


@dataclass(frozen=True)
class LinkProfile:
    """Rates in bits per second (0: unlimited), times in seconds, loss as a fraction."""

    uplink_bps: float = 0.0
    downlink_bps: float = 0.0
    latency_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    offline: tuple[Window, ...] = ()  # (start, end) seconds after Link.start, sorted

    def __post_init__(self) -> None:
        for name in ("uplink_bps", "downlink_bps", "latency_s", "jitter_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise LinkError(
                    f"link {name} = {getattr(self, name)}; must be a finite number >= 0"
                )
        if self.latency_s > MAX_LINK_DELAY_S:
            raise LinkError(f"link latency {self.latency_s:g} s; at most {MAX_LINK_DELAY_S:g} s")
        if self.jitter_s > self.latency_s:
            raise LinkError(
                f"link jitter {self.jitter_s * 1e3:g} ms exceeds latency "
                f"{self.latency_s * 1e3:g} ms; a message cannot arrive before it was sent"
            )
        if not 0 <= self.loss < 1:
            raise LinkError(f"link loss = {self.loss}; must be in [0, 1)")

    @property
    def shaped(self) -> bool:
        """Whether the profile changes anything at all."""
        return any((self.uplink_bps, self.downlink_bps, self.latency_s, self.loss, self.offline))


def parse_windows(spec: str | list[str]) -> tuple[Window, ...]:
    """Offline windows ``"20s-40s,70s-80s"`` (or a list of them) as sorted (start, end) pairs.

    Example:
        >>> parse_windows(["20s-40s", "5-10"])
        ((5.0, 10.0), (20.0, 40.0))
    """
    if not isinstance(spec, str | list):
        raise LinkError(f'offline windows {spec!r}: give "START-END" text or a list of them')
    parts = spec.split(",") if isinstance(spec, str) else list(spec)
    windows = []
    for part in parts:
        match = _WINDOW.match(str(part).replace(" ", ""))
        try:
            start, end = (float(match[1]), float(match[2])) if match else (0.0, -1.0)
        except ValueError:  # "1.2.3s": digits and dots, no number
            start, end = 0.0, -1.0
        if not 0 <= start < end < math.inf:
            raise LinkError(
                f"offline window {part!r}: use START-END in seconds after the swarm's start, "
                'START < END, e.g. "20s-40s"'
            )
        windows.append((start, end))
    windows.sort()
    for (_, end), (start, _) in itertools.pairwise(windows):
        if start < end:
            raise LinkError(f"offline windows {sorted(windows)} overlap; merge them into one")
    return tuple(windows)


def parse_link(spec: str) -> LinkProfile:
    """``up=10mbit,down=20mbit,latency=20ms,jitter=5ms,loss=1%`` (any subset; "" = none).

    Example:
        >>> parse_link("up=10mbit,latency=20ms").uplink_bps
        10000000.0
    """
    values: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        match = _SPEC.match(part)
        if match is None:
            raise LinkError(
                f"link part {part!r} is not KEY=NUMBER[UNIT] with KEY one of up, down, "
                "latency, jitter, loss; use e.g. up=10mbit,down=10mbit,latency=20ms,jitter=5ms,"
                "loss=1% (offline windows go in a [profiles.NAME] table)"
            )
        key, number, unit = match.groups()
        try:
            value = float(number)
        except ValueError:  # ".", "1.2.3": the pattern's digits and dots, no number
            value = math.nan
        if not math.isfinite(value):
            raise LinkError(f"link part {part!r}: {number!r} is not a finite number")
        scale = {"mbit": 1e6, "kbit": 1e3, "ms": 1e-3, "s": 1.0, "%": 0.01, None: 1.0}[unit]
        units = {"up": ("mbit", "kbit"), "down": ("mbit", "kbit"), "loss": ("%", None)}
        allowed = units.get(key, ("ms", "s"))
        if unit not in allowed:
            names = " or ".join("a fraction" if u is None else u for u in allowed)
            raise LinkError(f"link part {part!r}: {key} is given in {names}")
        values[key] = value * scale
    return LinkProfile(
        uplink_bps=values.get("up", 0.0),
        downlink_bps=values.get("down", 0.0),
        latency_s=values.get("latency", 0.0),
        jitter_s=values.get("jitter", 0.0),
        loss=values.get("loss", 0.0),
    )


ARRIVALS_KEPT = 256  # destinations' last arrivals held before the past ones are forgotten


class Link:
    """The state of one emulated access link: when its up and down directions are free."""

    def __init__(self, profile: LinkProfile, seed: int = 0) -> None:
        self.profile = profile
        self._rng = random.Random(seed)
        self._up_free = 0.0
        self._down_free = 0.0
        self._last_arrival: dict[str, float] = {}  # per destination, while it can matter
        self._prune_at = ARRIVALS_KEPT
        self.origin = math.inf  # offline windows count from here (see start): none before

    def start(self, now: float) -> None:
        """Count the offline windows from ``now`` (the swarm's start: metrics' ``time`` 0)."""
        self.origin = now

    def online(self, now: float) -> bool:
        """Whether the link is up at ``now``: outside every offline window."""
        t = now - self.origin
        return not any(start <= t < end for start, end in self.profile.offline)

    def next_offline(self, now: float) -> float:
        """When the next offline window starts after ``now`` (inf: none): a peer waiting in a
        round stops waiting then."""
        starts = (self.origin + start for start, _ in self.profile.offline)
        return min((t for t in starts if t > now), default=math.inf)

    def send(self, nbytes: int, now: float, to: str = "") -> float | None:
        """When a message of ``nbytes`` sent at ``now`` to ``to`` arrives (None: lost). All
        destinations share the uplink; arrivals at one keep their order, as on TCP."""
        p = self.profile
        start = max(now, self._up_free)
        done = start + (8 * nbytes / p.uplink_bps if p.uplink_bps else 0.0)
        self._up_free = done
        if p.loss and self._rng.random() < p.loss:
            return None
        jitter = self._rng.uniform(-p.jitter_s, p.jitter_s) if p.jitter_s else 0.0
        arrival = max(self._last_arrival.get(to, 0.0), done + p.latency_s + jitter)
        self._last_arrival[to] = arrival
        if len(self._last_arrival) > self._prune_at:
            self._forget_arrivals(now)
        return arrival

    def _forget_arrivals(self, now: float) -> None:
        """Forget the destinations whose last arrival is before anything sent from ``now`` on
        can arrive (``now − jitter``): nothing later can be ordered behind it. What is left
        sets the next pruning, so each send costs O(1) amortised."""
        floor = now - self.profile.jitter_s
        self._last_arrival = {to: t for to, t in self._last_arrival.items() if t >= floor}
        self._prune_at = max(ARRIVALS_KEPT, 2 * len(self._last_arrival))

    def receive(self, nbytes: int, now: float) -> float:
        """When a message of ``nbytes`` that reached the downlink at ``now`` is fully in."""
        rate = self.profile.downlink_bps
        start = max(now, self._down_free)
        self._down_free = start + (8 * nbytes / rate if rate else 0.0)
        return self._down_free
