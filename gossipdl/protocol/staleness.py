"""How an asynchronous parameter server treats stale updates: pure rules, no sockets.

An update's staleness τ is how many updates the server applied between the
worker's last pull and this push (0: it was computed on the current model).

* ``none``    apply every update as it is (Downpour, Dean et al. 2012);
* ``scale``   apply it scaled by 1/max(1, τ) (staleness-aware step, Zhang et al. 2016);
* ``soft:S``  buffer updates and apply the mean once S are in (soft sync, Zhang et al. 2016);
* ``ssp:S``   apply as they come, but a worker more than S steps ahead of the slowest
              live worker gets its reply only once the slowest catches up (stale
              synchronous parallel, Ho et al. 2013).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_SPEC = re.compile(r"^(none|scale|soft:(\d+)|ssp:(\d+))$")


@dataclass(frozen=True)
class Staleness:
    """A parsed staleness rule: its kind and its bound S (soft sync size or SSP slack)."""

    kind: str
    bound: int = 0

    def weight(self, tau: int) -> float:
        """The factor an update of staleness ``tau`` is applied with.

        Example:
            >>> Staleness("scale").weight(4), Staleness("none").weight(4)
            (0.25, 1.0)
        """
        return 1.0 / max(1, tau) if self.kind == "scale" else 1.0

    def holds(self, clock: int, slowest: int) -> bool:
        """Whether a worker at ``clock`` must wait for the slowest live worker at ``slowest``.

        Example:
            >>> Staleness("ssp", 2).holds(5, 2), Staleness("ssp", 2).holds(4, 2)
            (True, False)
        """
        return self.kind == "ssp" and clock - slowest > self.bound


@dataclass
class StalenessTally:
    """Running count, mean and maximum of the staleness of applied updates (no list kept)."""

    count: int = 0
    total: int = 0
    max: int = 0

    def add(self, tau: int) -> None:
        """Record one update of staleness ``tau``."""
        self.count += 1
        self.total += tau
        self.max = max(self.max, tau)

    def metrics(self) -> dict[str, Any]:
        """``staleness_mean`` and ``staleness_max``, as written to metrics."""
        mean = self.total / self.count if self.count else 0.0
        return {"staleness_mean": round(mean, 3), "staleness_max": self.max}


def parse_staleness(spec: str) -> Staleness:
    """``none``, ``scale``, ``soft:S`` or ``ssp:S``; ValueError naming the choices otherwise."""
    match = _SPEC.match(spec)
    if match is None:
        raise ValueError(f"staleness {spec!r}; use none, scale, soft:S (S >= 1) or ssp:S (S >= 0)")
    if match.group(2) is not None:
        if int(match.group(2)) < 1:
            raise ValueError(f"staleness {spec!r}: soft sync needs S >= 1 updates")
        return Staleness("soft", int(match.group(2)))
    if match.group(3) is not None:
        return Staleness("ssp", int(match.group(3)))
    return Staleness(spec)
