"""Per-round mailbox of model messages, filled by the receive thread, drained by training.

A message for a round the peer has finished is late and dropped. Messages for
future rounds are kept (a neighbour may be a round or many ahead, e.g. a
newcomer waiting at its first round), but at most ``max_pending`` rounds per
sender, so a runaway sender cannot grow memory without bound.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from gossipdl.transport.wire import WireError


class Inbox:
    """Holds ``{round: {sender: payload}}`` for the current and future rounds."""

    def __init__(self, max_pending: int = 8) -> None:
        self._cond = threading.Condition()
        self._rounds: dict[int, dict[int, Any]] = {}
        self._pending: Counter[int] = Counter()
        self._floor = 0
        self._max_pending = max_pending

    def put(self, sender: int, round: int, payload: Any) -> None:
        """Store a payload; raises WireError('late' / 'too_many_pending' / 'duplicate')."""
        with self._cond:
            if round < self._floor:
                raise WireError("late", f"round {round} arrived after round {self._floor} began")
            slot = self._rounds.setdefault(round, {})
            if sender in slot:
                raise WireError("duplicate", f"second message for round {round}")
            if self._pending[sender] >= self._max_pending:
                raise WireError(
                    "too_many_pending",
                    f"already {self._max_pending} future rounds queued (this peer is at "
                    f"{self._floor}, the message is for {round})",
                )
            slot[sender] = payload
            self._pending[sender] += 1
            self._cond.notify_all()

    def wait(self, round: int, expected: Callable[[], set[int]], timeout: float) -> dict[int, Any]:
        """Block until every id in ``expected()`` has sent ``round`` or ``timeout`` passes.

        ``expected`` is re-evaluated on every wake-up so that peers which leave
        meanwhile are no longer waited for. Returns what arrived.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                slot = self._rounds.get(round, {})
                remaining = deadline - time.monotonic()
                if expected() <= slot.keys() or remaining <= 0:
                    return dict(slot)
                self._cond.wait(min(remaining, 0.5))

    def advance(self, round: int) -> None:
        """Forget every round below ``round``; later arrivals for them are late."""
        with self._cond:
            self._floor = max(self._floor, round)
            for r in [r for r in self._rounds if r < self._floor]:
                for sender in self._rounds.pop(r):
                    self._pending[sender] -= 1

    def notify(self) -> None:
        """Wake waiters so they re-check who they are waiting for."""
        with self._cond:
            self._cond.notify_all()
