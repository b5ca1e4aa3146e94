"""The real engine's requests in flight: the protocol's :class:`Asked` under one lock, shared
by the threads that ask (training, joining) and the receive thread that takes the answers."""

from __future__ import annotations

import threading

from gossipdl.protocol.asked import MAX_ASKED, Asked
from gossipdl.transport.wire import NONCE  # noqa: F401 (the real engine's name for it)


class SharedAsked(Asked):
    """An :class:`Asked` safe to share between threads."""

    def __init__(self, limit: int = MAX_ASKED) -> None:
        super().__init__(limit, guard=threading.Lock())
