"""Which allow-list key a CURVE peer at a bootstrap address has, found by handshakes alone.

A joiner knows a member's address, not its key, and CURVE needs the server's key
before the first byte: only a connection made with the right one completes the
handshake. Trying the keys one after another costs a wait per key (a joiner with a
hundred keys on its list took longer than its timeout), so the search opens one
ZeroMQ connection per key, many at once, and watches their handshakes: the one that
succeeds names the key. Nothing is sent over them. A member that knows the right key
but not ours refuses us in its ZAP check, and that refusal comes back at once
(``HANDSHAKE_FAILED_AUTH``): we say so instead of waiting out a timeout.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from gossipdl.transport.curve import Curve
from gossipdl.transport.sockets import TransportError

MAX_OPEN = 64  # connections open at once: two per key with the monitors, well under fd limits
HOLD_S = 2.0  # how long a key's connection may take to finish its handshake before it yields
_RECONNECT_MS = 1000  # a wrong key's connection retries this often, not ZeroMQ's 10 per second
_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class KeyNotFound(TransportError):
    """No allow-list key completed a handshake with the address in time."""


class NotAllowed(TransportError):
    """The peer at the address refused our public key: it is not on its allow-list."""


@dataclass
class _Try:
    """One key's connection and the monitor that reports its handshake."""

    key: str
    dealer: zmq.Socket
    monitor: zmq.Socket
    opened: float

    def close(self) -> None:
        self.dealer.disable_monitor()
        self.monitor.close(linger=0)
        self.dealer.close(linger=0)


def find_key(address: str, curve: Curve, timeout: float) -> str:
    """The key of ``curve.allowed`` the peer listening at ``address`` holds.

    Up to ``MAX_OPEN`` keys are tried at once (each for ``HOLD_S`` at least while others
    wait their turn), so a search takes about a round trip per batch, not a wait per key.
    KeyNotFound after ``timeout`` seconds; NotAllowed as soon as the peer refuses our key.
    """
    ctx = zmq.Context()
    waiting = deque(sorted(curve.allowed))
    trying: dict[zmq.Socket, _Try] = {}
    poller = zmq.Poller()
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            _rotate(ctx, address, curve, waiting, trying, poller)
            for monitor, _ in poller.poll(int(min(left, HOLD_S / 4) * 1000) + 1):
                event = recv_monitor_message(monitor)
                if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return trying[monitor].key
                raise NotAllowed(
                    f"{address} refused our public key {curve.public} (ZAP status "
                    f"{event['value']}): it is not on that peer's allow-list. Ask its owner to "
                    f"add the line '{curve.public}  # NAME' to its --allow file"
                )
    finally:
        for attempt in trying.values():
            attempt.close()
        ctx.destroy(linger=0)
    raise KeyNotFound(
        f"no key of our allow-list ({len(curve.allowed)} keys) completed a CURVE handshake "
        f"with {address} within {timeout:.0f}s: add that peer's public key (its .key file's "
        "public-key line) to our --allow file"
    )


def _rotate(
    ctx: zmq.Context,
    address: str,
    curve: Curve,
    waiting: deque[str],
    trying: dict[zmq.Socket, _Try],
    poller: zmq.Poller,
) -> None:
    """Let keys tried for ``HOLD_S`` yield to waiting ones, then open up to ``MAX_OPEN``."""
    now = time.monotonic()
    for monitor, attempt in list(trying.items()):
        if waiting and now - attempt.opened >= HOLD_S:
            poller.unregister(monitor)
            attempt.close()
            del trying[monitor]
            waiting.append(attempt.key)
    while waiting and len(trying) < MAX_OPEN:
        key = waiting.popleft()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RECONNECT_IVL, _RECONNECT_MS)
        dealer.curve_secretkey = curve.secret.encode()
        dealer.curve_publickey = curve.public.encode()
        dealer.curve_serverkey = key.encode()
        monitor = dealer.get_monitor_socket(_EVENTS)
        dealer.connect(address)
        trying[monitor] = _Try(key, dealer, monitor, now)
        poller.register(monitor, zmq.POLLIN)
