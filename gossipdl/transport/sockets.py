"""ZeroMQ endpoint of one peer: a ROUTER for everything inbound, a DEALER per destination.

Sending and receiving each run on their own background thread, so the training
thread only enqueues outgoing messages and reads validated ones. ZeroMQ
sockets are not thread-safe: the ROUTER belongs to the receive thread and the
DEALERs to the send thread. Every byte counted here is a byte of a frame handed
to or taken from a socket.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from gossipdl.transport.ratelimit import DEFAULT_MESSAGE_RATE, RateLimiter
from gossipdl.transport.wire import MAX_HEADER_BYTES, Message, WireError, decode

log = logging.getLogger(__name__)

_POLL_MS = 50


class TransportError(RuntimeError):
    """The endpoint could not be set up (e.g. the listen port is taken)."""


@dataclass
class TransportStats:
    """Counters of what crossed the sockets; updated by the transport threads."""

    bytes_sent: int = 0
    header_bytes_sent: int = 0  # of bytes_sent, the msgpack headers (frame 0)
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
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
                "messages_dropped": dict(self.dropped),
            }


def _bind_spec(address: str) -> str:
    """Accept ``:0`` as "any free port" (ZeroMQ spells it ``:*``)."""
    return address[:-2] + ":*" if address.endswith(":0") else address


def advertised_address(bound: str) -> str:
    """The address other peers should dial: a wildcard host becomes this host's IP."""
    host_port = bound.removeprefix("tcp://")
    host, _, port = host_port.rpartition(":")
    if host in ("0.0.0.0", "*", "[::]", "::"):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"tcp://{host}:{port}"


class Transport:
    """Bind ``listen``, deliver every validated inbound message to ``on_message``.

    ``on_message`` runs on the receive thread; it may raise WireError to have
    the message counted as dropped. ``send`` never blocks: a full queue to a
    slow or dead destination drops the message and counts it.
    """

    def __init__(
        self,
        listen: str,
        on_message: Callable[[Message], None],
        *,
        max_message_bytes: int = 1 << 30,
        name: str = "peer",
        send_hwm: int = 64,
        finite_checked_by: frozenset[str] = frozenset(),
        max_message_rate: float = DEFAULT_MESSAGE_RATE,
    ) -> None:
        self.stats = TransportStats()
        self._on_message = on_message
        self._max_message_bytes = max_message_bytes
        self._name = name
        self._send_hwm = send_hwm
        self._finite_checked_by = finite_checked_by
        self._limiter = RateLimiter(max_message_rate)
        self._ctx: zmq.Context = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, 10000)
        # A frame larger than any legitimate one (a header, or an array of a message
        # within the limit) cuts the connection before it is buffered; a message
        # over the limit but with smaller frames is counted as oversize in ``decode``.
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + MAX_HEADER_BYTES)
        try:
            self._router.bind(_bind_spec(listen))
        except zmq.ZMQError as exc:
            self._router.close()
            self._ctx.term()
            raise TransportError(
                f"cannot listen on {listen}: {exc.strerror}. Pick a free port "
                "(e.g. --listen tcp://127.0.0.1:0 for any free one) or stop the program using it."
            ) from None
        self.address = advertised_address(self._router.getsockopt_string(zmq.LAST_ENDPOINT))
        self._outbox: queue.SimpleQueue[tuple[str, list[Any]] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._recv_thread = threading.Thread(
            target=self._recv_loop, name=f"{name}-recv", daemon=True
        )
        self._send_thread = threading.Thread(
            target=self._send_loop, name=f"{name}-send", daemon=True
        )
        self._recv_thread.start()
        self._send_thread.start()

    def send(self, address: str, frames: list[Any]) -> None:
        """Queue one message (header frame + buffer frames) for ``address``."""
        self._outbox.put((address, frames))

    def close(self, flush_timeout: float = 5.0) -> None:
        """Send what is queued (up to ``flush_timeout``), then stop both threads."""
        self._outbox.put(None)
        self._send_thread.join(flush_timeout)
        self._stop.set()
        self._recv_thread.join(2.0)
        self._ctx.term()

    def _send_loop(self) -> None:
        dealers: dict[str, zmq.Socket] = {}
        try:
            while True:
                item = self._outbox.get()
                if item is None:
                    break
                address, frames = item
                dealer = dealers.get(address)
                if dealer is None:
                    dealer = dealers[address] = self._connect(address)
                try:
                    dealer.send_multipart(frames, copy=False, flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.stats.drop("send_queue_full")
                    log.warning(
                        "%s: send queue to %s is full; message dropped", self._name, address
                    )
                    continue
                size = sum(len(f) for f in frames)
                with self.stats.lock:
                    self.stats.bytes_sent += size
                    self.stats.header_bytes_sent += len(frames[0])
                    self.stats.messages_sent += 1
            # Give queued messages a moment to leave before the sockets close.
            for dealer in dealers.values():
                dealer.setsockopt(zmq.LINGER, 2000)
        finally:
            for dealer in dealers.values():
                dealer.close()

    def _connect(self, address: str) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, self._send_hwm)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        return dealer

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(_POLL_MS):
                    continue
                while True:
                    try:
                        frames = self._router.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    # frames[0] is the ROUTER's routing id: one per connection
                    if self._limiter.allow(frames[0].bytes, time.monotonic()):
                        self._handle(frames[1:])
                    else:
                        self._count_received(frames[1:])
                        self.stats.drop("rate_limited")
        finally:
            self._router.close()

    def _count_received(self, frames: list[zmq.Frame]) -> None:
        with self.stats.lock:
            self.stats.bytes_received += sum(len(f) for f in frames)
            self.stats.messages_received += 1

    def _handle(self, frames: list[zmq.Frame]) -> None:
        self._count_received(frames)
        message = None
        try:
            message = decode(frames, self._max_message_bytes, self._finite_checked_by)
            self._on_message(message)
        except WireError as exc:
            if exc.sender is None and message is not None:
                exc.sender = message.sender
            self.stats.drop(exc.reason)
            who = f"peer {exc.sender}" if exc.sender is not None else "an unidentified sender"
            log.warning("%s: dropped a message from %s: %s", self._name, who, exc)
        except Exception:  # a handler bug must not kill the receive thread
            self.stats.drop("handler_error")
            log.exception("%s: error while handling a message; dropped", self._name)
