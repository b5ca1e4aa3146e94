"""An in-memory network on virtual time: real encoded frames, device links, injected faults.

Each node (a virtual peer) has the same :class:`~gossipdl.transport.shaping.Link`
the real transport emulates: a message occupies the sender's uplink for its
size over the bandwidth, travels ``latency`` ± ``jitter``, is lost with the
link's ``loss``, and then occupies the receiver's downlink. What travels is
the list of frames the real wire encoder made, copied when sent (as bytes on
a wire are fixed once sent), so every byte is counted as in a real run.

A sender holds at most ``max_queued_bytes`` per destination that have not arrived there
yet (the real transport's ``max_queued_mb``); a message past it is dropped
(``send_queue_full``). A receiver holds at most ``max_received_bytes`` that reached its
downlink and are not read yet (the real transport's inbox; a simulated peer handles a message
the moment it is read, so only the downlink holds them); a message past it is dropped
(``receive_queue_full``), having taken its downlink time as a real one does. A killed sender's
messages that had not reached the receiver's downlink die with it (``dead``), as a real
process's emulated link holds them.

Faults a schedule injects: partitions between groups of nodes, a clogged
direction between two nodes (messages wait until it is unclogged), a dead
node, random drops, duplicates and extra delay that reorders. Every message
sent ends in exactly one place of :attr:`SimNetwork.ledger`: ``delivered``,
or dropped under a named reason, or still in flight; duplicates are counted
apart. Deterministic: the same seed and the same sends give the same
deliveries at the same instants.
"""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from gossipdl.sim.clock import Scheduler
from gossipdl.transport.inbox import MAX_RECEIVED_BYTES
from gossipdl.transport.shaping import MAX_QUEUED_BYTES, Link, LinkProfile
from gossipdl.transport.stats import TransportStats

Handler = Callable[[int, list[bytes]], None]  # (sender, frames)
# Why a message did not arrive; each is a key of the ledger.
DROP_REASONS = (
    "link_loss",
    "offline",
    "partition",
    "dead",
    "injected_loss",
    "send_queue_full",
    "receive_queue_full",
)


def _online(link: Link, now: float) -> bool:
    """``link.online(now)``, without the call for a link that has no offline windows."""
    return not link.profile.offline or link.online(now)


def _nbytes(frames: list[bytes]) -> int:
    """Bytes of a message's copied frames (``wire.frames_size`` of them, for bytes alone)."""
    return sum(map(len, frames))


class NetworkError(ValueError):
    """A send between nodes that were never attached, or a fault setting out of range."""


@dataclass
class _Held:
    """What a sender's link holds for one destination until it arrives there: the real
    transport's queue for it (arrivals at one destination keep their order); or what a
    receiver's downlink holds until it is read: the real transport's inbox."""

    arrivals: deque[tuple[float, int]] = field(default_factory=deque)  # (arrival, bytes)
    nbytes: int = 0

    def at(self, now: float) -> int:
        """Bytes still held at ``now``."""
        while self.arrivals and self.arrivals[0][0] <= now:
            self.nbytes -= self.arrivals.popleft()[1]
        return self.nbytes


@dataclass
class _Node:
    handler: Handler
    link: Link
    stats: TransportStats = field(default_factory=TransportStats)  # the real counters
    alive: bool = True
    life: int = 0  # kills so far: what its links held dies with the process
    held: dict[int, _Held] = field(default_factory=dict)  # per destination
    downlink: _Held = field(default_factory=_Held)  # arrived, not read yet


class SimNetwork:
    """Nodes by integer id, their links, and the faults currently injected."""

    def __init__(
        self,
        clock: Scheduler,
        seed: int = 0,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        max_received_bytes: int = MAX_RECEIVED_BYTES,
    ) -> None:
        self.clock = clock
        self.seed = seed
        self.max_queued_bytes = max_queued_bytes
        self.max_received_bytes = max_received_bytes
        self.ledger: Counter[str] = Counter()
        self._nodes: dict[int, _Node] = {}
        self._rng = random.Random(seed)
        self._groups: dict[int, int] | None = None  # node -> its side of a partition
        self._rest = 0  # the side of every node named in no group
        self._clogged: dict[tuple[int, int], list[tuple[int, list[bytes]]]] = {}
        self._loss = self._duplicate = self._reorder_s = 0.0
        self._in_flight = 0

    # ----------------------------------------------------------------- nodes
    def attach(self, node: int, handler: Handler, link: LinkProfile | None = None) -> None:
        """Add (or bring back, after :meth:`kill`) ``node``, whose messages go to ``handler``."""
        profile = link or LinkProfile()
        self._nodes[node] = _Node(handler, self._link(profile, node, life=0))

    def kill(self, node: int) -> None:
        """The node is gone: what it would receive is dropped as ``dead``, even if in flight
        or already on its downlink (held by the process that died), and so is what it sent
        that has not reached its receiver's downlink (held by its emulated uplink)."""
        dead = self._node(node)
        dead.alive = False
        dead.life += 1
        dead.held.clear()
        dead.downlink = _Held()

    def revive(self, node: int) -> None:
        """The node, dead before, is back (a restart): messages reach it again, over a link
        of its new process (nothing queued on it; its offline windows still on the swarm's
        clock, as a real restart's)."""
        back = self._node(node)
        back.alive = True
        origin = back.link.origin
        back.link = self._link(back.link.profile, node, back.life)
        back.link.start(origin)

    def _link(self, profile: LinkProfile, node: int, life: int) -> Link:
        """The link of ``node``'s process in life ``life``: its loss draws seeded by both."""
        return Link(profile, self.seed * 7919 + node + 104_729 * life)

    def start_link(self, node: int) -> None:
        """Start the node's offline-window clock now (the swarm's start, when it starts
        training)."""
        self._node(node).link.start(self.clock.now)

    def stats(self, node: int) -> TransportStats:
        """The node's byte and message counters, the same object a real peer's transport
        keeps (``snapshot()`` gives the same metrics keys)."""
        return self._node(node).stats

    def online(self, node: int) -> bool:
        """Whether the node's link is up now (outside its offline windows)."""
        return _online(self._node(node).link, self.clock.now)

    def next_offline(self, node: int) -> float:
        """When the node's next offline window starts (inf: none is to come)."""
        return self._node(node).link.next_offline(self.clock.now)

    @property
    def in_flight(self) -> int:
        """Messages sent and neither delivered nor dropped yet (clogged ones included)."""
        return self._in_flight

    def _node(self, node: int) -> _Node:
        try:
            return self._nodes[node]
        except KeyError:
            raise NetworkError(f"node {node} is not attached to the network") from None

    # ----------------------------------------------------------------- faults
    def partition(self, groups: Sequence[Collection[int]]) -> None:
        """Split the nodes: a message between two groups is dropped (``partition``); nodes
        in no group form one more group."""
        self._groups = {node: k for k, group in enumerate(groups) for node in group}
        self._rest = len(groups)

    def heal(self) -> None:
        """End the partition."""
        self._groups = None

    def clog(self, src: int, dst: int) -> None:
        """Hold every message from ``src`` to ``dst`` until :meth:`unclog`."""
        self._clogged.setdefault((src, dst), [])

    def unclog(self, src: int, dst: int) -> None:
        """Release what the clog held, in order, as if sent now: across a partition made
        since, or from a sender offline now, it is dropped as a message sent now would be."""
        for sender, frames in self._clogged.pop((src, dst), []):
            self._in_flight -= 1
            if self._offline(sender):
                continue
            if self._cut(sender, dst):
                self.ledger["partition"] += 1
            else:
                self._travel(sender, dst, frames)

    def inject(self, loss: float = 0.0, duplicate: float = 0.0, reorder_s: float = 0.0) -> None:
        """From now on drop a fraction ``loss`` of messages (``injected_loss``), deliver a
        fraction ``duplicate`` twice, and delay each by up to ``reorder_s`` extra seconds
        (messages overtake each other)."""
        if not (0 <= loss < 1 and 0 <= duplicate < 1 and reorder_s >= 0):
            raise NetworkError(
                f"loss = {loss}, duplicate = {duplicate}, reorder_s = {reorder_s}: rates must "
                "be in [0, 1) and the delay non-negative"
            )
        self._loss, self._duplicate, self._reorder_s = loss, duplicate, reorder_s

    # ----------------------------------------------------------------- traffic
    def send(self, src: int, dst: int, frames: Sequence[Any]) -> None:
        """Send one message (header frame first) from ``src`` to ``dst``."""
        sender = self._node(src)
        self._node(dst)  # attached (it may die before the message arrives)
        # bytes are immutable: a header the encoder made as bytes goes as it is
        copied = [f if type(f) is bytes else bytes(memoryview(f)) for f in frames]
        stats = sender.stats
        self.ledger["sent"] += 1
        if not self._has_room(sender, dst, _nbytes(copied)):
            return
        if self._offline(src):  # as the real transport: counted, no bytes sent
            return
        stats.bytes_sent += _nbytes(copied)
        stats.header_bytes_sent += len(copied[0])
        stats.messages_sent += 1
        if self._cut(src, dst):
            self.ledger["partition"] += 1
            return
        if (src, dst) in self._clogged:
            self._clogged[(src, dst)].append((src, copied))
            self._in_flight += 1
            return
        self._travel(src, dst, copied)

    def _offline(self, node: int) -> bool:
        """Whether ``node``'s link is down now: a message it sends or would receive is then
        dropped, counted ``offline``."""
        if _online(self._nodes[node].link, self.clock.now):
            return False
        self.ledger["offline"] += 1
        self._nodes[node].stats.drop("offline")
        return True

    def _has_room(self, sender: _Node, dst: int, size: int) -> bool:
        """Whether ``size`` more bytes fit what ``sender`` holds for ``dst`` (one message
        always does), as the real transport checks first; else dropped, ``send_queue_full``."""
        held = sender.held.get(dst)
        queued = held.at(self.clock.now) if held is not None else 0
        if not queued or queued + size <= self.max_queued_bytes:
            return True
        self.ledger["send_queue_full"] += 1
        sender.stats.drop("send_queue_full")
        return False

    def _cut(self, src: int, dst: int) -> bool:
        """Whether a partition separates ``src`` from ``dst`` now."""
        return self._groups is not None and self._side(src) != self._side(dst)

    def _side(self, node: int) -> int:
        assert self._groups is not None
        return self._groups.get(node, self._rest)

    def _travel(self, src: int, dst: int, frames: list[bytes]) -> None:
        """Put a message on ``src``'s uplink; schedule its arrival (and a duplicate's)."""
        if self._loss and self._rng.random() < self._loss:
            self.ledger["injected_loss"] += 1
            return
        size = _nbytes(frames)
        sender = self._nodes[src]
        arrival = sender.link.send(size, self.clock.now, str(dst))
        if arrival is None:
            self.ledger["link_loss"] += 1
            sender.stats.drop("link_loss")
            return
        held = sender.held.setdefault(dst, _Held())
        held.arrivals.append((arrival, size))
        held.nbytes += size
        copies = 2 if self._duplicate and self._rng.random() < self._duplicate else 1
        self.ledger["duplicated"] += copies - 1
        for _ in range(copies):
            extra = self._rng.uniform(0, self._reorder_s) if self._reorder_s else 0.0
            self._in_flight += 1
            self.clock.at(
                arrival + extra, partial(self._arrive, src, dst, frames, size, sender.life)
            )

    def _arrive(self, src: int, dst: int, frames: list[bytes], size: int, sent: int) -> None:
        """At the receiver's downlink, from the sender's life ``sent`` (one killed since lost
        it): dropped there if the receiver is offline, as the real one drops it unread, or
        after taking its downlink time if the downlink holds ``max_received_bytes`` already
        (counted as read, as the real one counts it); else read once the downlink has
        carried it, by the process that took it in (one that dies meanwhile loses it)."""
        node = self._nodes[dst]
        if self._nodes[src].life != sent:
            self._in_flight -= 1
            self.ledger["dead"] += 1
        elif not node.alive or not node.link.profile.downlink_bps:
            self._deliver(src, dst, frames, size)  # an unshaped downlink reads it at once
        elif self._offline(dst):
            self._in_flight -= 1
        else:
            ready = node.link.receive(size, self.clock.now)
            held = node.downlink.at(self.clock.now)
            if held and held + size > self.max_received_bytes:  # one message always fits
                self._in_flight -= 1
                self.ledger["receive_queue_full"] += 1
                node.stats.bytes_received += size
                node.stats.messages_received += 1
                node.stats.drop("receive_queue_full")
                return
            node.downlink.arrivals.append((ready, size))
            node.downlink.nbytes += size
            self.clock.at(ready, partial(self._deliver, src, dst, frames, size, node.life))

    def _deliver(
        self, src: int, dst: int, frames: list[bytes], size: int, life: int | None = None
    ) -> None:
        self._in_flight -= 1
        node = self._nodes[dst]
        if not node.alive or life not in (None, node.life):
            self.ledger["dead"] += 1
            return
        if self._offline(dst):
            return
        self.ledger["delivered"] += 1
        node.stats.bytes_received += size
        node.stats.messages_received += 1
        node.handler(src, frames)

    def balanced(self) -> bool:
        """Whether every message sent is accounted for: delivered, dropped under a named
        reason, or in flight (duplicates are extra deliveries, counted apart)."""
        settled = sum(self.ledger[r] for r in ("delivered", *DROP_REASONS))
        return self.ledger["sent"] + self.ledger["duplicated"] == settled + self._in_flight
