"""Virtual time: a queue of events, each run at its instant, in one deterministic order.

The simulated engine never sleeps and never reads the wall clock. Everything
that happens (a message arriving, a timer firing, a step finishing) is an
event at a virtual instant; :meth:`Scheduler.run` pops them in time order,
and events at the same instant in the order they were scheduled. The same
schedule therefore always runs the same way, whatever the host's load.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

Event = Callable[[], None]


class ClockError(ValueError):
    """An event scheduled in the past or at a time that is not a number."""


# A queued event: ``[at, order, event]``, ``event`` None once cancelled. A list, not a
# dataclass: the heap then compares entries in C (``order`` is unique, so the event is never
# compared), which a swarm of hundreds of peers, with millions of events, notices.
_Entry = list[Any]


class Timer:
    """A handle on a scheduled event; ``cancel`` keeps it from running."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    @property
    def at(self) -> float:
        """The virtual instant it runs at."""
        return float(self._entry[0])

    def cancel(self) -> None:
        """Do not run it (a no-op once it ran)."""
        self._entry[2] = None


class Scheduler:
    """The virtual clock and its event queue; ``now`` moves only when an event runs.

    Example:
        >>> clock, seen = Scheduler(), []
        >>> _ = clock.after(2.0, lambda: seen.append(("b", clock.now)))
        >>> _ = clock.at(1.0, lambda: seen.append(("a", clock.now)))
        >>> clock.run()
        2
        >>> seen
        [('a', 1.0), ('b', 2.0)]
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = start
        self._queue: list[_Entry] = []
        self._order = itertools.count()

    def at(self, when: float, event: Event) -> Timer:
        """Run ``event`` at virtual time ``when`` (not before now)."""
        if not math.isfinite(when) or when < self.now:
            raise ClockError(f"cannot schedule an event at {when} (now is {self.now})")
        entry = [when, next(self._order), event]
        heapq.heappush(self._queue, entry)
        return Timer(entry)

    def after(self, delay: float, event: Event) -> Timer:
        """Run ``event`` ``delay`` seconds of virtual time from now."""
        if not delay >= 0:
            raise ClockError(f"delay {delay} must be a non-negative number of seconds")
        return self.at(self.now + delay, event)

    @property
    def pending(self) -> int:
        """Events still queued (cancelled ones included until their time comes)."""
        return len(self._queue)

    def run(self, until: float = math.inf, max_events: int | None = None) -> int:
        """Run events in order until the queue is empty, the next one is after ``until``
        (the clock then stands at ``until``, if finite) or ``max_events`` ran; returns how
        many ran."""
        ran = 0
        queue, pop = self._queue, heapq.heappop
        limit = math.inf if max_events is None else max_events
        while queue and queue[0][0] <= until:
            if ran >= limit:
                return ran
            when, _, event = pop(queue)
            if event is None:  # cancelled
                continue
            self.now = when
            event()
            ran += 1
        if math.isfinite(until) and until > self.now:
            self.now = until
        return ran
