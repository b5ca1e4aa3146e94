"""The real engine's mailbox: the protocol's :class:`Mailbox` behind a lock, filled by the
receive thread, with a blocking wait for the training thread."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from gossipdl.protocol.mailbox import Mailbox


class Inbox:
    """A :class:`Mailbox` shared by threads: every call under one condition."""

    def __init__(self, max_pending: int = 8, keep_late: bool = False) -> None:
        self._cond = threading.Condition()
        self._box = Mailbox(max_pending, keep_late)

    def admit(self, sender: int, round: int) -> None:
        """See :meth:`Mailbox.admit`."""
        with self._cond:
            self._box.admit(sender, round)

    def put(self, sender: int, round: int, payload: Any) -> None:
        """See :meth:`Mailbox.put`; wakes the wait."""
        with self._cond:
            self._box.put(sender, round, payload)
            self._cond.notify_all()

    def wait(self, round: int, expected: Callable[[], set[int]], timeout: float) -> dict[int, Any]:
        """Block until every id in ``expected()`` has sent ``round`` or ``timeout`` passes.

        ``expected`` is re-evaluated on every wake-up so that peers which leave
        meanwhile are no longer waited for, and a sender already heard from for
        a later round is not waited for either. Returns what arrived.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                remaining = deadline - time.monotonic()
                if self._box.complete(round, expected()) or remaining <= 0:
                    return self._box.take(round)
                self._cond.wait(min(remaining, 0.5))

    def sent(self, sender: int, round: int) -> None:
        """See :meth:`Mailbox.sent`; wakes the wait when it is news."""
        with self._cond:
            if self._box.sent(sender, round):
                self._cond.notify_all()

    def advance(self, round: int) -> None:
        """See :meth:`Mailbox.advance`."""
        with self._cond:
            self._box.advance(round)

    def forget(self, sender: int) -> None:
        """See :meth:`Mailbox.forget`."""
        with self._cond:
            self._box.forget(sender)

    def move_to(self, round: int) -> None:
        """See :meth:`Mailbox.move_to`."""
        with self._cond:
            self._box.move_to(round)

    def drain_late(self) -> list[tuple[int, int, Any]]:
        """See :meth:`Mailbox.drain_late`."""
        with self._cond:
            return self._box.drain_late()

    def notify(self) -> None:
        """Wake waiters so they re-check who they are waiting for."""
        with self._cond:
            self._cond.notify_all()
