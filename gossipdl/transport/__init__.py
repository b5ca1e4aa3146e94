"""ZeroMQ transport: wire format (msgpack header + raw frames) and the peer endpoint.

The sockets load on first use, so the wire format (which the protocol core and the
simulator use) never imports ZeroMQ or threads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gossipdl.transport.wire import PROTOCOL_VERSION, Message, WireError, decode, encode

if TYPE_CHECKING:
    from gossipdl.transport.sockets import Transport, TransportError
    from gossipdl.transport.stats import TransportStats

_LAZY = {"Transport": "sockets", "TransportError": "sockets", "TransportStats": "stats"}


def __getattr__(name: str) -> Any:
    """``Transport``, ``TransportError`` and ``TransportStats``, imported when first named."""
    if name in _LAZY:
        module = importlib.import_module(f"gossipdl.transport.{_LAZY[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PROTOCOL_VERSION",
    "Message",
    "Transport",
    "TransportError",
    "TransportStats",
    "WireError",
    "decode",
    "encode",
]
