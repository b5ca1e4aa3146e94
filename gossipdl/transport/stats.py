"""What crossed a peer's network endpoint: the counters its metrics lines report (the real
transport's and the simulated network's)."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TransportStats:
    """Counters of what crossed the sockets; updated by the transport threads."""

    bytes_sent: int = 0
    header_bytes_sent: int = 0  # of bytes_sent, the msgpack headers (frame 0)
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    handshakes_refused: int = 0  # CURVE connections whose key is not on the allow-list
    dropped: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def drop(self, reason: str) -> None:
        """Count one message dropped for ``reason``."""
        with self.lock:
            self.dropped[reason] += 1

    def snapshot(self) -> dict[str, Any]:
        """A consistent copy of the counters as plain JSON-ready values."""
        with self.lock:
            return {
                "bytes_sent": self.bytes_sent,
                "header_bytes_sent": self.header_bytes_sent,
                "bytes_received": self.bytes_received,
                "messages_sent": self.messages_sent,
                "messages_received": self.messages_received,
                "handshakes_refused": self.handshakes_refused,
                "messages_dropped": dict(self.dropped),
            }
