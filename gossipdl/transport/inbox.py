"""What a peer has read off the network and not handled yet, bounded in bytes.

The transport's read thread drains ZeroMQ into an :class:`Inbox` and never
waits; its receive thread takes the messages out in order and hands them to
the peer, which may wait for its core lock behind a long merge. Without a
bound in bytes, whatever arrived meanwhile (a stranger's flood of large
messages included) would pile up in memory before any membership check.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

# Bytes a peer holds that it read and has not handled yet (waiting for its emulated downlink,
# or for the peer to take them), from all senders together: a busy peer cannot be made to
# hold more. One message always fits, however large. Drop reason ``receive_queue_full``.
MAX_RECEIVED_BYTES = 256 * 2**20
RECEIVED_MODELS = 4  # models' worth a peer holds read and not handled, at the least

T = TypeVar("T")


def received_limit(given: int | None, model_bytes: int) -> int:
    """The bytes a peer of a model of ``model_bytes`` holds read and not handled yet:
    ``given``, else the larger of ``MAX_RECEIVED_BYTES`` and ``RECEIVED_MODELS`` models. A
    model of 100 MB would otherwise see the dense models of three neighbours, or a ring
    all-reduce's pieces in flight, dropped while it merges; a stranger can make a peer hold
    no more than that.

    Example:
        >>> received_limit(None, 2**20) == MAX_RECEIVED_BYTES, received_limit(None, 2**30) >> 30
        (True, 4)
    """
    return given if given is not None else max(MAX_RECEIVED_BYTES, RECEIVED_MODELS * model_bytes)


class Inbox(Generic[T]):
    """A FIFO queue of items that hold at most ``max_bytes`` together (one item always fits
    an empty inbox). :meth:`put` never waits; :meth:`get` does, until an item or
    :meth:`close`. An item's bytes count until :meth:`done` says it was handled.

    Example:
        >>> inbox = Inbox[str](max_bytes=10)
        >>> inbox.put("a", 6), inbox.put("b", 6), inbox.get(), inbox.held
        (True, False, 'a', 6)
        >>> inbox.done(6); inbox.held
        0
    """

    def __init__(self, max_bytes: int = MAX_RECEIVED_BYTES) -> None:
        if max_bytes < 1:
            raise ValueError(f"an inbox of {max_bytes} bytes holds nothing; give at least 1")
        self.max_bytes = max_bytes
        self._items: deque[tuple[T, int]] = deque()
        self._held = 0  # bytes of the queued items and of those taken but not done
        self._closed = False
        self._changed = threading.Condition()

    @property
    def held(self) -> int:
        """Bytes queued or taken and not handled yet."""
        return self._held

    def put(self, item: T, size: int) -> bool:
        """Queue ``item`` of ``size`` bytes if it fits; False (nothing queued) if not."""
        with self._changed:
            if self._closed or (self._held and self._held + size > self.max_bytes):
                return False
            self._items.append((item, size))
            self._held += size
            self._changed.notify()
            return True

    def get(self) -> T | None:
        """The oldest item, once there is one; None once the inbox is closed."""
        with self._changed:
            while not self._items and not self._closed:
                self._changed.wait()
            return None if self._closed else self._items.popleft()[0]

    def done(self, size: int) -> None:
        """An item of ``size`` bytes taken by :meth:`get` was handled: its bytes are free."""
        with self._changed:
            self._held -= size

    def close(self) -> None:
        """Let go of every queued item and wake :meth:`get` with None, now and from now on."""
        with self._changed:
            self._closed = True
            self._held -= sum(size for _, size in self._items)
            self._items.clear()
            self._changed.notify_all()
