"""ZeroMQ transport: wire format (msgpack header + raw frames) and the peer endpoint."""

from gossipdl.transport.sockets import Transport, TransportError, TransportStats
from gossipdl.transport.wire import PROTOCOL_VERSION, Message, WireError, decode, encode

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
