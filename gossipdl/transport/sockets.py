"""ZeroMQ endpoint of one peer: a ROUTER for everything inbound, a DEALER per destination.

Sending runs on a background thread, so the training thread only enqueues
outgoing messages. Receiving runs on two: the read thread drains the ROUTER into
an :class:`~gossipdl.transport.inbox.Inbox` bounded in bytes and never waits, so
ZeroMQ never piles up what a busy peer has not taken yet; the receive thread
hands the messages, in order, to the owner, which may wait for its own locks.
ZeroMQ sockets are not thread-safe: the ROUTER belongs to the read thread and the
DEALERs to the send thread. Every byte counted here is a byte of a frame handed
to or taken from a socket. With an emulated link (``link``, see ``shaping``) the
send thread holds each message until the link would have delivered it, and the
receive thread waits out a message's downlink time before handing it over (it is
in the inbox meanwhile); inside an offline window the send and read threads drop
what they see (reason ``offline``) without counting it.
"""

from __future__ import annotations

import errno
import heapq
import itertools
import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from gossipdl.transport.address_syntax import host_port, names_a_host
from gossipdl.transport.addresses import (
    ResolveError,
    address_problem,
    advertised_address,
    is_loopback,
    resolve,
)
from gossipdl.transport.curve import Curve
from gossipdl.transport.fdlimit import OUT_OF_FDS, fd_limit, out_of_fds, raise_fd_limit
from gossipdl.transport.inbox import MAX_RECEIVED_BYTES, Inbox
from gossipdl.transport.ratelimit import DEFAULT_MESSAGE_RATE, RateLimiter
from gossipdl.transport.shaping import MAX_QUEUED_BYTES, Link, LinkProfile
from gossipdl.transport.stats import TransportStats
from gossipdl.transport.wire import MAX_HEADER_BYTES, Message, WireError, decode, frames_size

log = logging.getLogger(__name__)

_POLL_MS = 50
# A connection whose other end stops answering ZeroMQ's pings (a cut link) is dropped after
# _LINK_TIMEOUT_MS and dialled again every _CONNECT_TIMEOUT_MS, so traffic resumes within a
# second or two of the link coming back instead of after TCP's retransmission back-off.
_PING_MS, _LINK_TIMEOUT_MS, _CONNECT_TIMEOUT_MS = 1000, 3000, 1000
_SWEEP_S = 1.0  # how often the send thread looks for idle connections to close
_warned_plain = False  # the "no CURVE on a network address" warning goes out once
# Outgoing connections open at once; beyond it the least recently used one is closed, and what
# it still queued is dropped (reason ``too_many_sockets``). ZeroMQ allows 1023 sockets per context.
MAX_SOCKETS = 768
IDLE_SOCKET_S = 30.0  # a connection unused this long is closed: nobody is dialled forever
SOCKET_FREE_S = 0.5  # a full context is waited on this long for closed sockets' slots
# Refused CURVE keys remembered, so a refused peer's retries are logged once; beyond it the
# oldest is forgotten (a stranger trying fresh keys cannot grow the set), and a new key is
# logged at most once per REFUSED_LOG_S. Every refusal counts in ``handshakes_refused``.
MAX_REFUSED_KEYS = 1024
REFUSED_LOG_S = 1.0
# Messages ZeroMQ reads ahead of the read thread per connection (its default is 1000); beyond
# them it stops reading that connection and TCP holds the rest back at the sender. The read
# thread keeps up (it only checks and queues), so this bounds what a starved one leaves there.
RECEIVE_HWM = 64
# A connection to the ROUTER that has not finished ZeroMQ's handshake (greeting, CURVE) this
# long after it was accepted is dropped (libzmq's default: 30 s). libzmq has no cap on the
# connections a listening socket accepts, so this, with the file descriptor limit raised
# to the hard one (:mod:`~gossipdl.transport.fdlimit`), is what bounds a stranger's idle
# connects: each holds a descriptor for HANDSHAKE_S at most.
HANDSHAKE_S = 3.0
# What a failed bind means, by errno, and what to do about it.
_BIND_ADVICE = {
    errno.EADDRINUSE: "Pick a free port (e.g. --listen tcp://127.0.0.1:0 for any free one) or "
    "stop the program using it.",
    errno.EADDRNOTAVAIL: "That IP is not one of this machine's: listen on one of its own "
    "(`ip addr` lists them) or on tcp://0.0.0.0:PORT, and give --advertise for what others dial.",
    errno.ENODEV: "No interface has that name or address: listen on one of this machine's IPs "
    "or on tcp://0.0.0.0:PORT.",
    errno.EACCES: "Ports below 1024 need privileges: pick a port above 1023.",
}


class TransportError(RuntimeError):
    """The endpoint could not be set up (e.g. the listen port is taken)."""


@dataclass
class _Destination:
    """What the send thread keeps per address: its DEALER (opened on first send, with the
    server key it was opened for), when it was last used, and the bytes queued for it that
    are not on the wire yet: held by an emulated link, or handed to ZeroMQ and not sent."""

    socket: zmq.Socket | None = None
    key: str = ""
    used: float = 0.0
    held: int = 0
    in_zmq: deque[tuple[zmq.MessageTracker, int]] = field(default_factory=deque)
    in_zmq_bytes: int = 0
    warned: bool = False  # said its queue is full; again only after a message got through

    def queued(self) -> int:
        """Bytes not on the wire yet (ZeroMQ's finished messages are let go first)."""
        while self.in_zmq and self.in_zmq[0][0].done:
            self.in_zmq_bytes -= self.in_zmq.popleft()[1]
        return self.held + self.in_zmq_bytes


def _is_ipv6(address: str) -> bool:
    """Whether ``tcp://HOST:PORT`` names an IPv6 host (``tcp://[::1]:5555``)."""
    return ":" in host_port(address)[0]


def _bind_spec(address: str) -> str:
    """Accept ``:0`` as "any free port" (ZeroMQ spells it ``:*``)."""
    return address[:-2] + ":*" if address.endswith(":0") else address


class _AllowList:
    """ZAP credentials check: a connection's public key must be on the list."""

    def __init__(self, allowed: frozenset[str], stats: TransportStats, name: str) -> None:
        self._allowed = allowed
        self._stats = stats
        self._name = name
        self._refused: OrderedDict[str, None] = OrderedDict()  # at most MAX_REFUSED_KEYS
        self._logged = -math.inf  # when a refusal was last logged

    def callback(self, domain: str, key: bytes) -> bool:
        text = key.decode("ascii", "replace")
        if text in self._allowed:
            return True
        with self._stats.lock:
            self._stats.handshakes_refused += 1
        if text in self._refused:  # a refused peer retries; say it once
            self._refused.move_to_end(text)
            return False
        self._refused[text] = None
        if len(self._refused) > MAX_REFUSED_KEYS:
            self._refused.popitem(last=False)
        now = time.monotonic()
        if now - self._logged >= REFUSED_LOG_S:
            self._logged = now
            log.warning(
                "%s: refused a connection from key %s: not on the allow-list (%d refused so far)",
                self._name, text, self._stats.handshakes_refused,
            )  # fmt: skip
        return False


class Transport:
    """Bind ``listen``, deliver every validated inbound message to ``on_message``.

    ``on_message`` runs on the receive thread, one message at a time in the
    order they were read; it may wait (for a lock held by a long merge): what
    arrives meanwhile waits in an inbox of at most ``max_received_bytes``
    (one message always fits), and what does not fit is dropped and counted
    (``receive_queue_full``). It may raise WireError to have the message
    counted as dropped. Any other exception is not a bad message
    but a bug or an exhausted resource (out of memory): it is logged with its
    traceback, kept as ``failure``, reported to ``on_failure``, and the
    endpoint stops receiving, so its owner stops with a clear error instead
    of running on half-broken.

    ``send`` never blocks: a message for a destination that already has
    ``max_queued_bytes`` not on the wire yet (a slow or stalled receiver) is
    dropped and counted, as is one that meets a full ZeroMQ queue. At most
    ``max_sockets`` outgoing connections are open; one unused for
    ``IDLE_SOCKET_S`` is closed.

    ``address`` is what others dial: ``advertise`` if given, else the bound
    address with a wildcard host (``tcp://0.0.0.0:5555``) replaced by this
    machine's IP on the interface that routes to ``toward`` (the member we
    join), or its first one that is not loopback.
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
        curve: Curve | None = None,
        link: LinkProfile | None = None,
        seed: int = 0,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        max_received_bytes: int = MAX_RECEIVED_BYTES,
        max_sockets: int = MAX_SOCKETS,
        on_failure: Callable[[BaseException], None] | None = None,
        advertise: str | None = None,
        toward: str | None = None,
    ) -> None:
        if advertise and (problem := address_problem(advertise)) is not None:
            raise TransportError(
                f"cannot advertise {advertise!r}: {problem}; give the tcp://HOST:PORT other "
                "machines dial to reach this one"
            )
        if advertise:
            try:  # peers take only IPs from the wire: a host name is advertised as its IP
                advertise = resolve(advertise, "--advertise")
            except ResolveError as exc:
                raise TransportError(str(exc)) from None
        if min(max_queued_bytes, max_received_bytes, max_sockets) < 1:
            raise ValueError(
                f"max_queued_bytes = {max_queued_bytes}, max_received_bytes = "
                f"{max_received_bytes}, max_sockets = {max_sockets}; each must be at least 1"
            )
        self.stats = TransportStats()
        self.failure: BaseException | None = None  # set by the receive thread, then it stops
        self._on_failure = on_failure
        self._link = Link(link, seed) if link is not None and link.shaped else None
        self._curve = curve
        self._keys: dict[str, str] = {}  # address -> its public key (CURVE)
        # the same for addresses answered once (a joiner's, a prober's): the newest max_sockets
        self._reply_keys: OrderedDict[str, str] = OrderedDict()
        self._keys_lock = threading.Lock()
        self._on_message = on_message
        self._max_message_bytes = max_message_bytes
        self._max_queued_bytes = max_queued_bytes
        self._max_sockets = max_sockets
        self._name = name
        self._send_hwm = send_hwm
        self._finite_checked_by = finite_checked_by
        self._limiter = RateLimiter(max_message_rate)
        raise_fd_limit()
        self._ctx: zmq.Context = zmq.Context()
        # ours, the ROUTER and CURVE's own, and as many again (slots of closed sockets are
        # freed later: :meth:`_connect_when_free`)
        self._ctx.set(zmq.MAX_SOCKETS, min(2 * max_sockets + 64, self._ctx.get(zmq.SOCKET_LIMIT)))
        self._auth: ThreadAuthenticator | None = None
        if curve is not None:
            self._auth = ThreadAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowList(curve.allowed, self.stats, name))
        self._router = self._ctx.socket(zmq.ROUTER)
        if curve is not None:
            self._router.curve_secretkey = curve.secret.encode()
            self._router.curve_publickey = curve.public.encode()
            self._router.curve_server = True
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._router.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))
        if _is_ipv6(listen):  # ZeroMQ binds IPv6 only when told (IPv4 stays IPv4: with the
            self._router.setsockopt(zmq.IPV6, 1)  # option, its endpoint reads [::ffff:IP])
        # A frame larger than any legitimate one (a header, or an array of a message
        # within the limit) cuts the connection before it is buffered; a message
        # over the limit but with smaller frames is counted as oversize in ``decode``.
        self._router.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + MAX_HEADER_BYTES)
        try:
            self._router.bind(_bind_spec(listen))
        except zmq.ZMQError as exc:
            self._router.close()
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()
            advice = _BIND_ADVICE.get(exc.errno or 0, "Check the address: tcp://IP:PORT.")
            raise TransportError(f"cannot listen on {listen}: {exc.strerror}. {advice}") from None
        self.address = advertised_address(
            self._router.getsockopt_string(zmq.LAST_ENDPOINT), advertise, toward
        )
        global _warned_plain
        if curve is None and not is_loopback(listen) and not _warned_plain:
            _warned_plain = True
            log.warning(
                "%s: listening on %s without encryption or authentication: anyone who can "
                "reach it can join and send models. Use --secure --keys DIR --allow FILE.",
                name,
                self.address,
            )
        # A message, (address, None) to close its connection, an Event to set once everything
        # queued before it went (flush), or None to stop.
        self._outbox: queue.SimpleQueue[tuple[str, list[Any] | None] | threading.Event | None] = (
            queue.SimpleQueue()
        )
        self._open_sockets = 0  # outgoing connections open now (the send thread's count)
        # Read and not handled yet: (frames, their bytes, when the downlink has carried them).
        self._inbox: Inbox[tuple[list[zmq.Frame], int, float]] = Inbox(max_received_bytes)
        self._inbox_warned = False  # said the inbox is full; again only after a message fit
        self._stop = threading.Event()
        loops = {"read": self._read_loop, "recv": self._recv_loop, "send": self._send_loop}
        self._threads = [
            threading.Thread(target=loop, name=f"{name}-{role}", daemon=True)
            for role, loop in loops.items()
        ]
        for thread in self._threads:
            thread.start()

    def set_key(self, address: str, key: str) -> None:
        """The public key of the peer listening at ``address`` (CURVE needs it to connect)."""
        with self._keys_lock:
            self._keys[address] = key

    def set_reply_key(self, address: str, key: str) -> None:
        """The public key to answer a request at ``address`` with (CURVE), kept among the
        newest ``max_sockets`` such keys: requests that name fresh addresses do not grow
        this peer's memory (a member's key is :meth:`set_key`'s)."""
        with self._keys_lock:
            self._keep_reply_key(address, key)

    def _keep_reply_key(self, address: str, key: str) -> None:
        """Keep ``key`` for ``address`` among the newest ``max_sockets`` reply keys (the keys
        lock held)."""
        self._reply_keys[address] = key
        self._reply_keys.move_to_end(address)
        while len(self._reply_keys) > self._max_sockets:
            self._reply_keys.popitem(last=False)

    def retain_keys(self, addresses: set[str]) -> None:
        """Only ``addresses`` (the members') hold member keys: any other's key (an earlier
        life's address, one a join tried) joins the reply keys, where it still reaches that
        address until newer ones push it out. Rejoins from fresh addresses grew the member
        keys for good."""
        with self._keys_lock:
            for address in [a for a in self._keys if a not in addresses]:
                self._keep_reply_key(address, self._keys.pop(address))

    def forget(self, address: str) -> None:
        """Close the connection to ``address`` and forget its key (its member was forgotten):
        what was queued for it still goes first."""
        with self._keys_lock:
            self._keys.pop(address, None)
        self._outbox.put((address, None))

    def start_link_clock(self, elapsed: float = 0.0) -> None:
        """Count the emulated link's offline windows from ``elapsed`` seconds ago (the
        swarm's start, which the metrics' ``time`` counts from; now by default)."""
        if self._link is not None:
            self._link.start(time.monotonic() - elapsed)

    @property
    def online(self) -> bool:
        """Whether the emulated link is up now (always, without offline windows)."""
        return self._link is None or self._link.online(time.monotonic())

    @property
    def keys_held(self) -> int:
        """Public keys held (CURVE): members' and the newest reply addresses'."""
        with self._keys_lock:
            return len(self._keys) + len(self._reply_keys)

    @property
    def open_sockets(self) -> int:
        """Outgoing connections open now (at most ``max_sockets``)."""
        return self._open_sockets

    def send(self, address: str, frames: list[Any]) -> None:
        """Queue one message (header frame + buffer frames) for ``address``."""
        self._outbox.put((address, frames))

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every message queued so far has been handed to its socket (through an
        emulated link: delivered), so the byte counters include it; False on timeout."""
        sent = threading.Event()
        self._outbox.put(sent)
        return sent.wait(timeout)

    def close(self, flush_timeout: float = 5.0) -> None:
        """Send what is queued (up to ``flush_timeout``), then stop the threads; what was
        read and not handled yet is let go."""
        read, recv, send = self._threads
        self._outbox.put(None)
        send.join(flush_timeout)
        self._stop.set()
        self._inbox.close()
        deadline = time.monotonic() + 2.0
        for thread in (read, recv):
            thread.join(max(0.0, deadline - time.monotonic()))
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ----------------------------------------------------------------- send thread
    def _send_loop(self) -> None:
        """Send what is queued; through an emulated link, hold each message until the link
        would have delivered it. Every destination's state belongs to this thread."""
        destinations: OrderedDict[str, _Destination] = OrderedDict()  # least recent first
        held: list[tuple[float, int, str, list[Any]]] = []  # (arrival, order, address, frames)
        flushes: list[tuple[int, threading.Event]] = []  # set once held has no older message
        order = itertools.count()
        swept = time.monotonic()
        try:
            while True:
                while held and held[0][0] <= time.monotonic():
                    _, _, address, frames = heapq.heappop(held)
                    size = frames_size(frames)
                    destination = destinations[address]
                    destination.held -= size
                    self._send_now(destinations, address, frames, size)
                if flushes:  # rare (a peer's last line): keep the per-message path bare
                    oldest = min((o for _, o, _, _ in held), default=math.inf)
                    for flush in [f for f in flushes if f[0] < oldest]:
                        flushes.remove(flush)
                        flush[1].set()
                if time.monotonic() - swept >= _SWEEP_S:
                    swept = time.monotonic()
                    self._close_idle(destinations, swept)
                wait = max(0.0, held[0][0] - time.monotonic()) if held else _SWEEP_S
                try:
                    item = self._outbox.get(timeout=min(wait, _SWEEP_S))
                except queue.Empty:
                    continue
                if item is None:
                    break
                if isinstance(item, threading.Event):
                    flushes.append((next(order), item))
                    continue
                address, message = item
                if message is None:
                    self._forget(destinations, address)
                    continue
                frames = message
                size = frames_size(frames)
                destination = destinations.setdefault(address, _Destination())
                destinations.move_to_end(address)
                if not self._has_room(destination, address, size):
                    continue
                if self._link is None:
                    self._send_now(destinations, address, frames, size)
                    continue
                if not self._link.online(time.monotonic()):
                    self.stats.drop("offline")
                    continue
                arrival = self._link.send(size, time.monotonic(), address)
                if arrival is None:  # it used the uplink, then the link lost it
                    with self.stats.lock:
                        self._count_sent(frames)
                    self.stats.drop("link_loss")
                    continue
                destination.held += size
                heapq.heappush(held, (arrival, next(order), address, frames))
            for _, _, address, frames in sorted(held):  # closing: what is held goes now
                self._send_now(destinations, address, frames, frames_size(frames))
            # Give queued messages a moment to leave before the sockets close.
            for destination in destinations.values():
                if destination.socket is not None:
                    destination.socket.setsockopt(zmq.LINGER, 2000)
        finally:
            for destination in destinations.values():
                if destination.socket is not None:
                    destination.socket.close()

    def _has_room(self, destination: _Destination, address: str, size: int) -> bool:
        """Whether ``size`` more bytes fit the destination's queue (one message always does);
        a message that does not is dropped and counted."""
        queued = destination.queued()
        if not queued or queued + size <= self._max_queued_bytes:
            return True
        self.stats.drop("send_queue_full")
        if not destination.warned:
            destination.warned = True
            log.warning(
                "%s: %d bytes queued for %s are not on the wire yet (limit %d); dropping "
                "messages to it until it reads them",
                self._name,
                queued,
                address,
                self._max_queued_bytes,
            )
        return False

    def _send_now(
        self,
        destinations: OrderedDict[str, _Destination],
        address: str,
        frames: list[Any],
        size: int,
    ) -> None:
        """Hand one message to the DEALER for ``address`` (connected on first use)."""
        with self._keys_lock:
            key = self._keys.get(address) or self._reply_keys.get(address, "")
        if self._curve is not None and not key:
            self.stats.drop("no_key")
            log.warning("%s: no public key known for %s; message dropped", self._name, address)
            return
        if names_a_host(address):
            self.stats.drop("bad_address")
            log.warning(
                "%s: not dialling %s: a host name (resolving it would stall every connection "
                "while DNS answers); give its IP address",
                self._name,
                address,
            )
            return
        destination = destinations.setdefault(address, _Destination())
        if destination.socket is None or destination.key != key:  # new, or the key changed
            self._close_socket(destination)
            self._make_room(destinations, address)
            try:
                destination.socket, destination.key = self._connect_when_free(address, key), key
            except zmq.ZMQError as exc:
                self._connect_failed(address, exc)
                return
            self._open_sockets += 1
        destination.used = time.monotonic()
        # counted under the stats lock it is handed over in: whoever has seen the message
        # arrive (or its answer) reads counters that include it
        with self.stats.lock:
            try:
                tracker = _send_tracked(destination.socket, frames)
            except zmq.Again:
                tracker = None
            else:
                self._count_sent(frames)
        if tracker is None:
            self.stats.drop("send_queue_full")
            if not destination.warned:
                destination.warned = True
                log.warning("%s: send queue to %s is full; message dropped", self._name, address)
            return
        destination.warned = False
        if not tracker.done:
            destination.in_zmq.append((tracker, size))
            destination.in_zmq_bytes += size

    def _connect_failed(self, address: str, exc: zmq.ZMQError) -> None:
        """Count and log a connection ZeroMQ refused: this process out of file descriptors
        (``out_of_file_descriptors``), else the context out of sockets (``too_many_sockets``)."""
        if exc.errno == errno.EMFILE and out_of_fds():
            self.stats.drop(OUT_OF_FDS)
            log.warning(
                "%s: cannot connect to %s: this process is out of file descriptors (limit %s); "
                "raise it (ulimit -n) or run fewer peers in this process",
                self._name,
                address,
                fd_limit(),
            )
            return
        self.stats.drop("too_many_sockets")
        log.warning("%s: cannot connect to %s: %s", self._name, address, exc.strerror)

    def _make_room(self, destinations: OrderedDict[str, _Destination], keep: str) -> None:
        """Close the least recently used connections until one more fits ``max_sockets``."""
        for address in list(destinations):
            if self._open_sockets < self._max_sockets:
                return
            destination = destinations[address]
            if address != keep and destination.socket is not None:
                for _ in range(sum(1 for tracker, _ in destination.in_zmq if not tracker.done)):
                    self.stats.drop("too_many_sockets")
                self._close_socket(destination)
                if not destination.held:
                    del destinations[address]

    def _close_idle(self, destinations: OrderedDict[str, _Destination], now: float) -> None:
        """Close the connections nothing was sent on for ``IDLE_SOCKET_S`` and that have
        nothing left to send (a stranger's reply address is not dialled forever)."""
        for address, destination in list(destinations.items()):
            if now - destination.used > IDLE_SOCKET_S and not destination.queued():
                self._close_socket(destination)
                del destinations[address]

    def _forget(self, destinations: OrderedDict[str, _Destination], address: str) -> None:
        """Close the connection to ``address`` once nothing waits to go there."""
        destination = destinations.get(address)
        if destination is not None and not destination.held:
            self._close_socket(destination, linger=True)
            del destinations[address]

    def _close_socket(self, destination: _Destination, linger: bool = False) -> None:
        if destination.socket is not None:
            destination.socket.close(linger=1000 if linger else 0)
            destination.socket = None
            destination.in_zmq.clear()
            destination.in_zmq_bytes = 0
            self._open_sockets -= 1

    def _count_sent(self, frames: list[Any]) -> None:
        """Count one message sent (the caller holds the stats lock)."""
        self.stats.bytes_sent += frames_size(frames)
        self.stats.header_bytes_sent += len(frames[0])
        self.stats.messages_sent += 1

    def _connect_when_free(self, address: str, server_key: str) -> zmq.Socket:
        """:meth:`_connect`, waiting up to ``SOCKET_FREE_S`` while the context is full: ZeroMQ
        frees a closed socket's slot later, on its own thread, so under churn the slots of
        sockets just closed below the cap are not free yet (ZMQError EMFILE after that)."""
        deadline = time.monotonic() + SOCKET_FREE_S
        while True:
            try:
                return self._connect(address, server_key)
            except zmq.ZMQError as exc:
                if exc.errno != errno.EMFILE or time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    def _connect(self, address: str, server_key: str) -> zmq.Socket:
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.SNDHWM, self._send_hwm)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.HEARTBEAT_IVL, _PING_MS)
        dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, _LINK_TIMEOUT_MS)
        dealer.setsockopt(zmq.CONNECT_TIMEOUT, _CONNECT_TIMEOUT_MS)
        if _is_ipv6(address):  # ZeroMQ dials IPv6 only when told
            dealer.setsockopt(zmq.IPV6, 1)
        if self._curve is not None:
            dealer.curve_secretkey = self._curve.secret.encode()
            dealer.curve_publickey = self._curve.public.encode()
            dealer.curve_serverkey = server_key.encode()
        dealer.connect(address)
        return dealer

    # ----------------------------------------------------------------- read thread
    def _read_loop(self) -> None:
        """Drain the ROUTER into the inbox as fast as messages come; never wait on the owner."""
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        try:
            while not self._stop.is_set() and self.failure is None:
                if not poller.poll(_POLL_MS):
                    continue
                while self.failure is None and not self._stop.is_set():  # a stream stops too
                    try:
                        frames = self._router.recv_multipart(copy=False, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._take_in(frames)
        except zmq.ContextTerminated:  # closed while the read thread was still reading
            pass
        finally:
            self._router.close()

    def _take_in(self, frames: list[zmq.Frame]) -> None:
        """Queue one message read off the ROUTER for the receive thread, unless its link is
        offline, its connection over its rate, or the inbox full (each dropped and counted)."""
        now = time.monotonic()
        if self._link is not None and not self._link.online(now):
            self.stats.drop("offline")
            return
        message = frames[1:]  # frames[0] is the ROUTER's routing id: one per connection
        size = frames_size(message)
        ready = now  # when the emulated downlink has carried it (it is in the inbox meanwhile)
        if self._link is not None and self._link.profile.downlink_bps:
            ready = self._link.receive(size, now)
        if not self._limiter.allow(frames[0].bytes, now):
            self._count_received(size)
            self.stats.drop("rate_limited")
        elif self._inbox.put((message, size, ready), size):
            self._inbox_warned = False
        else:
            self._count_received(size)
            self.stats.drop("receive_queue_full")
            if not self._inbox_warned:
                self._inbox_warned = True
                log.warning(
                    "%s: %d bytes read wait for the peer to take them (max_received_bytes "
                    "%d); dropping what arrives meanwhile (a larger limit holds more)",
                    self._name,
                    self._inbox.held,
                    self._inbox.max_bytes,
                )

    # ----------------------------------------------------------------- receive thread
    def _recv_loop(self) -> None:
        """Hand each message in the inbox to the owner, in order, once its downlink time is
        over; stop at close or at the first failure (what is left in the inbox is let go)."""
        try:
            while self.failure is None and (item := self._inbox.get()) is not None:
                message, size, ready = item
                try:
                    wait = ready - time.monotonic()
                    if wait > 0 and self._stop.wait(wait):
                        return  # closing: a slow link's message is not waited out
                    if self._link is not None and not self._link.online(time.monotonic()):
                        self.stats.drop("offline")  # went offline as its downlink carried it
                        continue
                    self._handle(message, size)
                finally:
                    self._inbox.done(size)
        finally:
            self._inbox.close()

    def refused(self, exc: WireError) -> None:
        """Count a refused message by its reason and log one line naming its sender (the
        owner calls this too, for a message it held and refused later)."""
        self.stats.drop(exc.reason)
        who = f"peer {exc.sender}" if exc.sender is not None else "an unidentified sender"
        log.warning("%s: dropped a message from %s: %s", self._name, who, exc)

    def _count_received(self, size: int) -> None:
        """Count one message of ``size`` bytes (its frames') as received."""
        with self.stats.lock:
            self.stats.bytes_received += size
            self.stats.messages_received += 1

    def _handle(self, frames: list[zmq.Frame], size: int) -> None:
        self._count_received(size)
        message = None
        try:
            message = decode(frames, self._max_message_bytes, self._finite_checked_by)
            if self._curve is not None:  # ZAP set the connection's User-Id to its public key
                message = replace(message, key=str(frames[0].get("User-Id") or ""))
            self._on_message(message)
        except WireError as exc:
            if exc.sender is None and message is not None:
                exc.sender = message.sender
            self.refused(exc)
        except Exception as exc:  # not a bad message: a bug, or memory ran out
            kind = message.kind if message is not None else "malformed"
            log.exception(
                "%s: handling a %s message failed; this endpoint stops receiving", self._name, kind
            )
            self.failure = exc
            if self._on_failure is not None:
                self._on_failure(exc)


def _send_tracked(dealer: zmq.Socket, frames: list[Any]) -> zmq.MessageTracker:
    """Send one multipart message without copying its large frames; the tracker says when
    ZeroMQ let go of all of them (small frames are copied and done at once). Raises
    ``zmq.Again`` if the socket's queue is full; ZeroMQ queues a multipart message whole
    or not at all, so only the first frame can."""
    last = len(frames) - 1
    trackers = [
        dealer.send(frame, zmq.NOBLOCK | (zmq.SNDMORE if i < last else 0), copy=False, track=True)
        for i, frame in enumerate(frames)
    ]
    return zmq.MessageTracker(*(t for t in trackers if t is not None and not t.done))
