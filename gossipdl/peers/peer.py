"""``gossipdl.Peer``: wraps a model and optimizer; ``step()`` = local step + one gossip round.

The peer owns the sockets, the member table and the round counter; it wires
the transport, topology and averaging strategy together and holds none of
their logic. Control messages (join, membership, model requests) are answered
on the receive thread, so a peer busy training or waiting still lets others in.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from typing import Any

import torch

from gossipdl.averaging import build_averager
from gossipdl.averaging.attacks import Attack
from gossipdl.averaging.base import check_graph
from gossipdl.averaging.local_optimizer import LocalOptimizer, current_lr, mask_momentum
from gossipdl.averaging.triggers import check_overlap, check_trigger, parse_trigger
from gossipdl.compression import Payload, build_codec
from gossipdl.compression._kernels import empty_on
from gossipdl.coordinator.buckets import BUCKET_NUMEL, OverlappedGradients
from gossipdl.coordinator.ring import (
    RING_CHECKS_FINITE,
    RING_SEND_HWM,
    AnyRing,
    RingAllReduce,
    SharedRing,
    check_ring_codec,
    check_shared_memory,
)
from gossipdl.coordinator.ring_powersgd import LowRankAllReduce
from gossipdl.coordinator.shared_reduce import on_this_host
from gossipdl.models.parameters import FlatParameters, averaged_parameters, parameter_bytes
from gossipdl.peers.membership import MAX_MEMBERS, Member, Membership, parse_members
from gossipdl.protocol.core import CORE_KINDS, GossipCore, Send, Settings
from gossipdl.protocol.joining import (
    MODEL_WAIT_S,
    RETRY_S,
    Verdict,
    check_welcome,
    late_steps,
    rejoin_retry,
)
from gossipdl.topologies import TopologyError, build_topology
from gossipdl.transport import Message, Transport, TransportError, WireError, encode
from gossipdl.transport.addresses import ResolveError, check_address, resolve
from gossipdl.transport.asked import NONCE, SharedAsked
from gossipdl.transport.curve import Curve
from gossipdl.transport.inbox import received_limit
from gossipdl.transport.key_search import find_key
from gossipdl.transport.probe import CONNECT_WAIT_S, Unreachable, reachable
from gossipdl.transport.ratelimit import DEFAULT_MESSAGE_RATE, RateLimiter
from gossipdl.transport.shaping import MAX_QUEUED_BYTES, LinkProfile
from gossipdl.transport.wire import echoed_nonce

log = logging.getLogger(__name__)

# Limits on what a remote sender can make a peer hold or do (the protocol's own limits are
# in gossipdl.protocol.kinds); each drop is counted by reason.
MAX_ANSWER_RATE = 20.0  # answers to join/info requests per second, all senders together:
#                         a request names its reply address, so this bounds how hard a stream
#                         of requests can make a peer dial a third party (``answer_rate``)
MAX_STRANGER_SOCKETS = 64  # connections beyond one per member (replies to joiners, probes)
EARLY_S = 2.0  # a member table from a sender not known yet waits this long for news of it
MAX_EARLY = 32  # such tables held at once; the oldest is refused beyond it (``unknown_sender``)
MEMBER_KINDS = CORE_KINDS | {"ready", "members", "dropped", "model_request", "chunk"}
"""What a gossip peer takes from a member: the round protocol's kinds, member tables, model
requests and a ring all-reduce's chunks; any other kind is ``unexpected``."""
FORGET_AFTER_S = 600.0  # an ended member silent this long is forgotten: no more heartbeats
GRADIENT_BUCKET_NUMEL = BUCKET_NUMEL  # overlap in a ring: gradient values per all-reduce


def _static(topology: str, peers: Sequence[str] | None) -> bool:
    """Whether ``topology`` keeps one graph from round to round over the ``peers`` given, or
    over 16 when the swarm's size is not known yet (a joiner's); a spec that cannot be built
    fails later, where the swarm builds it, with its own error."""
    try:
        return build_topology(topology, len(peers) if peers else 16).is_static
    except TopologyError:
        return True


class PeerError(RuntimeError):
    """The peer cannot take part in the swarm (no answer, id taken, neighbours missing)."""


def _counted(name: str) -> property:
    """A read-only Peer attribute that is the protocol core's counter ``name``."""

    def read(peer: Peer) -> Any:
        with peer._core:
            return getattr(peer.core.counters, name)

    return property(read, doc=f"The protocol core's count of {name.replace('_', ' ')}.")


class Peer:
    """One member of a gossip swarm around a local model.

    Call ``step()`` where you would call ``optimizer.step()``: it applies the
    local update, sends the model to this round's neighbours, waits for theirs
    (at most ``round_timeout`` seconds) and replaces the parameters by the
    weighted average. The model's parameters become views of one flat vector
    (:class:`~gossipdl.models.parameters.FlatParameters`, ``peer.flat_params``), which a round
    reads without gathering it. Peers find each other either from a fixed address list
    (``peers`` + ``rank``) or by joining through any member (``bootstrap``);
    a peer with neither founds a swarm that others join. Training starts once
    ``min_peers`` members are known and every neighbour has said it is ready.

    ``codec`` (e.g. ``"topk:0.01+fp16"``) compresses what is sent; with a lossy
    codec ``algorithm="auto"`` is CHOCO-SGD with the codec's default ``gamma``.
    A lost message (a gap in a neighbour's sequence numbers) triggers a dense
    resync of the public copies two rounds later. ``loss`` drops that fraction
    of this peer's model messages on purpose, to test exactly that. ``defence``
    (dense gossip: ``clip[:BAD]``, ``trimmed[:TRIM]``, ``median``, ``balance[:GAMMA[:RHO]]``,
    each with an optional ``+descent[:TAU]``) combines the neighbours' models by a
    Byzantine-robust rule instead of averaging;
    with ``evict_after`` > 0 a neighbour it sets aside that many rounds in a row is
    accused, and one that most of its neighbours accuse is evicted
    (:mod:`~gossipdl.protocol.eviction`); ``attack``
    (:func:`~gossipdl.averaging.attacks.parse_attack`) makes this peer a Byzantine one
    that sends attacked models (for testing defences). ALIE needs its z here
    (``Attack("alie", Z)``, e.g. ``alie_z(peers, byzantine)``; without one it is refused),
    and ``label-flip`` changes nothing here: it poisons the data, which your training
    loop feeds, so flip the labels yourself
    (:func:`~gossipdl.averaging.attacks.flip_labels`).

    ``trigger`` says when to talk: ``"always"`` (every step), ``"periodic:H"``
    (local SGD, every H steps) or ``"dynamic:DELTA[%][:B]"`` (every B steps,
    but only a peer whose model moved more than Δ from the last agreed one
    sends it). ``algorithm="gossip-learning"`` drops rounds altogether: each
    step's model walks to one random neighbour and is merged there by age.
    ``overlap=True`` runs each round in the background while the caller computes the
    next gradients (D-PSGD's order: ``x ← mix(x) − lr·g(x)``, the gradient at the
    model that was sent rather than at the merged one): ``step()`` first takes the
    round started by the step before, so a round's messages travel while the next
    forward and backward pass run. :meth:`settle` takes it earlier (before evaluating
    or saving the model). In a ring all-reduce of gradients, ``overlap=True`` sends them
    in buckets while backward runs (:class:`~gossipdl.coordinator.buckets.OverlappedGradients`).
    ``algorithm="allreduce"`` is the ring all-reduce baseline: with trigger
    ``always`` and an optimizer, gradients are averaged exactly before every
    local step (synchronous SGD); otherwise parameters are, every round.
    ``shared_memory=True`` (every member on this host) averages them through shared
    memory instead of the TCP ring, GPU tensors on the GPU (:class:`~gossipdl.coordinator.
    ring.SharedRing`); nothing then crosses the network, so the byte counts stay at 0.

    A member silent for ``dead_after`` seconds (heartbeats go out every
    ``heartbeat``) is declared dead and the topology is rebuilt over the live
    members at a round every peer agrees on; a peer told it was dropped
    rejoins. ``resume_step`` restarts a peer from its own checkpointed model at
    that step and rejoins through ``bootstrap``; ``restarted`` without it: a new life of
    ``rank`` (its process died before any checkpoint) that takes a neighbour's model. ``curve`` (see
    :func:`gossipdl.transport.curve.load_curve`) encrypts every connection and
    admits only the allow-listed keys. ``link`` emulates a slow access link
    (bandwidth, latency, jitter, loss, offline windows counted from the swarm's
    start, the clock of its metrics' ``time``) in user space.

    ``address`` is what others dial: ``advertise`` if given, else ``listen``
    with a wildcard host replaced by the IP of the interface that routes to
    ``bootstrap`` (a founder: the first interface that is not loopback). A
    join first checks that a ZeroMQ peer with the same security listens at
    ``bootstrap``, trying for ``connect_wait`` seconds, and fails naming what
    it found otherwise. ``swarm_id`` and ``swarm_start`` (unix time) come from
    the founder (``swarm_start`` if given, else the moment it started) with the
    welcome: every peer of one swarm reports the same ones.

    Nothing a remote sender says can grow the peer without bound: the member
    table holds at most ``max_members`` entries, an ended member silent for
    ``forget_after`` seconds is forgotten, at most ``max_queued_bytes`` wait
    to go to any one destination, at most ``max_received_bytes`` that arrived
    wait for this peer to take them (while a long merge holds it; by default
    :func:`received_limit`'s), and the
    module's ``MAX_*`` limits bound the rest; each refused message is counted
    by its reason in ``stats()``.

    Example (run once per rank, e.g. ``python train.py 0`` .. ``python train.py 3``)::

        addresses = [f"tcp://127.0.0.1:{5550 + i}" for i in range(4)]
        torch.manual_seed(0)  # same initial model on every peer
        model = torch.nn.Linear(40, 10)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with gossipdl.Peer(model, opt, rank=rank, peers=addresses, topology="ring") as peer:
            for x, y in batches:
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                peer.step()
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: LocalOptimizer | None = None,
        *,
        rank: int | None = None,
        peers: Sequence[str] | None = None,
        listen: str | None = None,
        bootstrap: str | None = None,
        topology: str = "ring",
        algorithm: str = "auto",
        codec: str = "none",
        trigger: str = "always",
        gamma: float | None = None,
        defence: str = "none",
        evict_after: int = 0,
        attack: Attack | None = None,
        loss: float = 0.0,
        min_peers: int | None = None,
        seed: int = 0,
        round_timeout: float = 10.0,
        startup_timeout: float = 120.0,
        max_message_bytes: int = 1 << 30,
        max_message_rate: float = DEFAULT_MESSAGE_RATE,
        join_margin_rounds: int = 20,
        heartbeat: float = 1.0,
        dead_after: float = 5.0,
        resume_step: int | None = None,
        restarted: bool = False,
        curve: Curve | None = None,
        link: LinkProfile | None = None,
        swarm_config: dict[str, Any] | None = None,
        on_members: Callable[[list[Member]], None] | None = None,
        on_listening: Callable[[str], None] | None = None,
        max_members: int = MAX_MEMBERS,
        forget_after: float = FORGET_AFTER_S,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
        max_received_bytes: int | None = None,
        advertise: str | None = None,
        swarm_start: float | None = None,
        connect_wait: float = CONNECT_WAIT_S,
        overlap: bool = False,
        shared_memory: bool = False,
    ) -> None:
        if peers is not None and (rank is None or not 0 <= rank < len(peers)):
            raise ValueError(f"rank must be in 0..{len(peers) - 1} when peers is given, got {rank}")
        if peers is not None and bootstrap is not None:
            raise ValueError("give either peers (a fixed address list) or bootstrap, not both")
        if curve is not None and peers is not None:
            raise ValueError(
                "with CURVE peers learn each other's keys when they join: give bootstrap "
                "(or nothing, to found the swarm), not a fixed address list"
            )
        if not 0 < heartbeat < dead_after:
            raise ValueError(
                f"heartbeat = {heartbeat}s, dead_after = {dead_after}s: a peer is declared dead "
                "after several missed heartbeats, so 0 < heartbeat < dead_after"
            )
        if max_members < 1 or forget_after <= 0:
            raise ValueError(
                f"max_members = {max_members}, forget_after = {forget_after}s; "
                "both must be positive"
            )
        try:  # the user's host names, once, here: peers take only IPs from the wire
            if bootstrap is not None:
                bootstrap = ",".join(
                    resolve(a.strip(), "--bootstrap") for a in bootstrap.split(",") if a.strip()
                )
            if peers is not None:
                peers = [resolve(a, "peers") for a in peers]
        except ResolveError as exc:
            raise PeerError(str(exc)) from None
        self.model = model
        self.optimizer = optimizer
        self.params = averaged_parameters(model)
        self.flat_params = FlatParameters(self.params)  # the parameters become views of one vector
        self.numel = self.flat_params.numel
        self.device = self.flat_params.device
        ring = algorithm == "allreduce"
        if ring:
            check_ring_codec(codec)
        self.averager = build_averager(  # a ring averages no models: its codec is the ring's
            "dense" if ring else algorithm,
            "none" if ring else codec,
            seed,
            gamma,
            "none" if ring else defence,
            None if ring else attack,
            peer=rank if rank is not None else secrets.randbits(31),  # its own codec draws
        )
        self.averager.bind_layout([tuple(p.shape) for p in self.params])
        self.trigger = parse_trigger(trigger)
        check_trigger(self.trigger, self.averager)
        if ring and self.trigger.dynamic:
            raise ValueError(
                "a ring all-reduce has every peer in every round; use always or "
                "periodic:H, not a dynamic trigger"
            )
        self.codec = build_codec(codec).spec if ring else self.averager.codec.spec
        self.topology_spec = "ring" if ring else topology
        check_graph(self.averager, topology, ring or _static(topology, peers))
        self.ring = ring
        check_shared_memory(shared_memory, ring, codec)
        self.shared_memory = shared_memory
        self._shared_rings: list[SharedRing] = []  # closed with the peer
        self.overlap = overlap
        # overlap: the round started by the last step runs here (one worker thread), and
        # the training thread takes its model in settle(). On a GPU the round and the
        # receive thread queue their work on a stream of their own: on training's, the
        # payload's copy to the host would wait for the next step's kernels.
        self._rounds = ThreadPoolExecutor(1, "round") if overlap and not ring else None
        self._pending: Future[tuple[torch.Tensor, torch.cuda.Event | None]] | None = None
        on_gpu = overlap and self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._reduce: AnyRing | LowRankAllReduce | None = None  # built by _reducer
        self._ring_lock = threading.Lock()
        self.reduces_gradients = ring and optimizer is not None and self.trigger.period == 1
        check_overlap(overlap, ring, self.reduces_gradients, self.averager.asynchronous, codec)
        # overlap in a ring: gradients go out in buckets while backward runs
        self._gradients = (
            OverlappedGradients(self.params, self._bucket_ring, GRADIENT_BUCKET_NUMEL)
            if overlap and ring
            else None
        )
        self.seed = seed
        self.startup_timeout = startup_timeout
        self.connect_wait = connect_wait
        self.curve = curve
        self._key = curve.public if curve is not None else ""
        # this process, to the members: a join from a restarted one is a new life
        self.incarnation = secrets.randbits(62) + 1
        self.swarm_config = swarm_config or {}
        self._on_members = on_members
        self._publishing = threading.Lock()  # one report of the table at a time
        # Who owns what. Four threads touch a peer: training (step, gossip, forming), receive
        # (the transport's, running _on_message), watch (heartbeats, deaths) and send (the
        # transport's, owning the sockets). With overlap a fifth runs what training would:
        # the rounds (settle() hands each one back) or, in a ring, the gradients' buckets
        # (OverlappedGradients.wait hands them back). The protocol core (rounds, mailboxes,
        # resyncs, failure detection, sequence numbers, counters) is guarded by ``_core``, a
        # condition that also wakes a round waiting for messages. Every other field is owned
        # by one thread, guarded by the lock named next to it, or an object with a lock of its
        # own (Membership, SharedAsked, the transport's stats). References other threads only read
        # (started) are written whole by their owner.
        self.membership = Membership(limit=max_members)  # own lock
        self._asked = SharedAsked()  # own lock: nonces of our requests and their answers
        self._core = threading.Condition(threading.RLock())
        settings = Settings(
            topology=self.topology_spec,
            round_timeout=round_timeout,
            heartbeat=heartbeat,
            dead_after=dead_after,
            forget_after=forget_after,
            join_margin_rounds=join_margin_rounds,
            loss=loss,
            evict_after=evict_after,
            max_message_bytes=max_message_bytes,
            seed=seed,
        )
        self.core = GossipCore(
            -1,
            self.membership,
            averager=self.averager,
            trigger=self.trigger,
            settings=settings,
            model=self.flat_params.copy(),
            stream=rank or 0,
        )
        self.core.behind = self._rounds is not None  # idle: a step's wait in settle()
        # -- written by the training thread (others read) --
        self.steps = resume_step or 0
        self.core.age = self.steps
        self.started = False
        self._aligning = False  # let in, waiting for a member's model (:meth:`_start_late`)
        # The swarm's identity and clock: a founder's, which a welcome hands on (a fixed
        # address list names its swarm by the list). Run directories of one swarm written on
        # several machines carry the same id; every peer's metrics time counts from the start.
        self.swarm_id = (
            hashlib.sha256(f"{seed}|{','.join(peers)}".encode()).hexdigest()[:16]
            if peers is not None
            else secrets.token_hex(8)
        )
        self.swarm_start = time.time() if swarm_start is None else swarm_start
        # -- training thread only --
        self._first_wait = 0.0
        self._alone_until = -1  # a late start trains alone to this step (:meth:`_start_at`)
        self.rejoins = 0
        self._wanted_id = rank  # the id asked for (None: any); asked again if ours goes to another
        self._resuming = resume_step is not None  # with its own model
        self._restarted = restarted or self._resuming  # a new life of its rank: a rejoin
        # -- receive thread only --
        self._answer_budget = RateLimiter(MAX_ANSWER_RATE)
        # -- guarded by _lock (written by several threads) --
        self._lock = threading.Lock()
        self._early: deque[tuple[float, Message]] = deque()  # tables from senders not known yet
        # -- handoffs: set once by the receive thread, acted on by the training thread --
        self._failure: BaseException | None = None  # why the receive thread stopped: stop too
        # -- guarded by the lock next to them --
        self._ready_from: set[int] = set()  # _changed, which also wakes waits on the table
        self._unanswered: set[int] = set()  # whose ready came before we were in (_changed)
        self._changed = threading.Condition()
        self._closed = False
        self._watch_stop = threading.Event()
        if listen is None:
            listen = peers[rank] if peers is not None and rank is not None else "tcp://127.0.0.1:0"
        self.transport = Transport(
            listen,
            self._receive,
            max_message_bytes=max_message_bytes,
            name="peer",
            send_hwm=RING_SEND_HWM if ring else 64,
            finite_checked_by=RING_CHECKS_FINITE if ring else frozenset(),
            max_message_rate=max_message_rate,
            curve=curve,
            link=link,
            seed=seed * 7919 + (rank or 0),
            max_queued_bytes=max_queued_bytes,
            max_received_bytes=received_limit(max_received_bytes, parameter_bytes(self.params)),
            max_sockets=max_members + MAX_STRANGER_SOCKETS,
            on_failure=self._stop_on_failure,
            advertise=advertise,
            toward=bootstrap.split(",")[0].strip() if bootstrap else None,
        )
        self.address = self.transport.address
        self._entry_address = self.address  # ours in the member table (a given list may differ)
        self._watcher = threading.Thread(target=self._watch, name="peer-watch", daemon=True)
        self._watcher.start()
        try:
            if on_listening is not None:
                on_listening(self.address)
            self._form(rank, peers, bootstrap, min_peers)
            self.transport.start_link_clock(time.time() - self.swarm_start)  # the swarm's clock
        except BaseException:
            self._stop_helpers()
            self.transport.close(flush_timeout=0.5)
            raise

    # ----------------------------------------------------------------- public API
    def step(self) -> None:
        """Local optimizer step (if an optimizer was given), then a gossip round if one is due.

        With the default trigger ``always`` every step ends a round; with
        ``periodic:H`` or ``dynamic:DELTA:B`` every H-th (B-th) step does.
        """
        self._check_failure()
        self.settle()
        if self.reduces_gradients:
            self._allreduce_gradients()
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps += 1
        with self._core:
            self.core.age += 1
        if not self.trigger.ends_round(self.steps):
            return
        if self._rounds is None:
            self._gossip(stepped=True)
        else:
            self._start_round(stepped=True)

    def _start_round(self, stepped: bool = False) -> None:
        """Start this step's round on the round thread (``overlap``); ``stepped``: after a
        local step (see :meth:`_round_due`)."""
        assert self._rounds is not None
        if not self._round_due(stepped):
            return
        x, ready = self.flat_params.copy(), None  # training goes on beside the round
        if self._stream is not None:  # the round's stream starts once x is written
            ready = torch.cuda.Event()  # on x's device, which need not be the current one
            ready.record(torch.cuda.current_stream(x.device))
            x.record_stream(self._stream)
        self._pending = self._rounds.submit(self._round_behind, x, ready)

    def settle(self) -> None:
        """Wait for the round running in the background (``overlap``) and take its model;
        nothing to do without one. Its error, if it failed, is raised here."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        waited = time.monotonic()
        new, done = pending.result()
        with self._core:
            self.core.counters.idle_s += time.monotonic() - waited
        if done is not None:  # training's stream goes on once the round's work is done
            training = torch.cuda.current_stream(new.device)
            training.wait_event(done)
            new.record_stream(training)
        self.flat_params.load_(new)

    def _round_behind(
        self, x: torch.Tensor, ready: torch.cuda.Event | None
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The round of ``x`` on the round thread (on a GPU: on the gossip stream, after
        ``ready``); its model, and on a GPU the event that marks its work done."""
        with torch.no_grad(), self._gossip_stream():  # a thread's own modes
            if ready is None:
                return self._core_round(x), None
            assert self._stream is not None  # a GPU's round: its own stream, named (the
            self._stream.wait_event(ready)  # current device need not be the model's)
            new = self._core_round(x)
            done = torch.cuda.Event()
            done.record(self._stream)
            return new, done

    def _gossip_stream(self) -> AbstractContextManager[Any]:
        """The CUDA stream the round and receive threads queue their work on (overlap on a
        GPU); elsewhere nothing to enter (a ``torch.cuda.stream(None)`` costs 8 µs a message)."""
        return nullcontext() if self._stream is None else torch.cuda.stream(self._stream)

    def sync_at_step(self, step: int) -> None:
        """Make the round that ends by local step ``step`` a sync of the whole swarm (dynamic
        trigger; other triggers sync every round anyway). Every peer must ask for the same
        step: the runner asks for the last one, so a swarm ends on an agreed model. A join
        that would start after that round is refused: the newcomer would train no step."""
        with self._core:
            self.core.sync_at_step(step)

    def gossip(self) -> None:
        """One gossip round: synchronous with this round's neighbours, or one step of a walk."""
        self._gossip(stepped=False)

    @torch.no_grad()
    def _gossip(self, stepped: bool) -> None:
        """:meth:`gossip`; ``stepped``: after a local step (:meth:`step`; see
        :meth:`_round_due`)."""
        self.settle()
        if self._rounds is not None:  # overlap: the round thread runs it, taken at once
            self._start_round(stepped)
            self.settle()
            return
        if not self._round_due(stepped):
            return
        if not self.reduces_gradients:  # gradients were averaged before the local step
            x = self._round_model()
            new = self._ring_round(x) if self.ring else self._core_round(x)
            self.flat_params.load_(new)
        if self.ring:
            with self._core:
                self.core.advance(time.monotonic())
                if not self.reduces_gradients:  # the core's rounds published theirs
                    self.core.published = (self.round, new)

    def _round_due(self, stepped: bool) -> bool:
        """Before a round: back in first if we were dropped (:meth:`_rejoin_if_dropped`), then
        whether the round runs. After a local step (``stepped``) a peer let in late trains
        alone to its first round (:meth:`_start_at`); a caller of :meth:`gossip` alone counts
        no steps, so its rounds go on at once."""
        self._rejoin_if_dropped()
        return not (stepped and self.steps <= self._alone_until)

    def _rejoin_if_dropped(self) -> None:
        """Before a round: back in with a new id if ours was lost, or through the member
        that said we were dropped."""
        self._check_failure()
        if self._lost_id():
            self._join_again()
        elif self.core.rejoin_via is not None:
            self._rejoin()

    def _core_round(self, x: torch.Tensor) -> torch.Tensor:
        """Run the protocol core's round with model ``x``: send, wait for the messages it
        needs (woken by each arrival, up to its deadline), send what it asks, merge."""
        first_wait, self._first_wait = self._first_wait, 0.0
        with self._core:
            sends = self.core.open_round(
                time.monotonic(), x, first_wait or None, current_lr(self.optimizer)
            )
            mask_momentum(self.optimizer, self.params, self.averager.sent_mask())
            evicted = self.core.counters.evicted
        self._carry_out(sends)
        while True:
            with self._core:
                progress = self.core.poll(time.monotonic(), online=not self._away())
                if progress.model is None and not progress.sends:
                    deadline = self.core.deadline or time.monotonic()
                    self._core.wait(max(0.0, min(0.5, deadline - time.monotonic())))
                    continue
            self._carry_out(progress.sends)
            if progress.model is not None:
                if self.core.counters.evicted != evicted:  # our accusation made a quorum
                    self._members_changed()
                self._check_failure()
                return progress.model

    def _away(self) -> bool:
        """Whether this peer waits for nobody: it must rejoin, is offline or broke."""
        return (
            self.core.rejoin_via is not None
            or self._lost_id()
            or not self.transport.online
            or self._failure is not None
            or self._closed
        )

    def _carry_out(self, sends: list[Send]) -> None:
        """Send what the core asked for; count what it dropped and log what it noted."""
        with self._core:
            dropped, notes = self.core.reports()
        for error in dropped:
            self.transport.stats.drop(error.reason)
        for note in notes:
            log.info("peer %d: %s", self.id, note)
        for send in sends:
            member = self.membership.get(send.to)
            address = send.address or (member.address if member is not None else "")
            if address:
                self.transport.send(address, send.frames)

    def _allreduce_gradients(self) -> None:
        """Replace every gradient by its mean over the ring (a missing one counts as zero):
        with overlap, the buckets backward already sent, and the rest."""
        if self._gradients is not None:
            self._gradients.wait()
            return
        grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        mean = self._reducer().allreduce_mean_(self._flat_gradients(grads))
        at = 0
        for p, grad in zip(self.params, grads, strict=True):
            if p.requires_grad:  # frozen: zeros in the ring, no gradient (weight decay)
                p.grad = grad  # of its own dtype: Adam refuses another
                grad.copy_(mean[at : at + grad.numel()].view_as(grad))
            at += grad.numel()

    def _ring_round(self, x: torch.Tensor) -> torch.Tensor:
        """The mean of the parameters; low-rank: the mean change since the last round."""
        reducer = self._reducer()
        if not isinstance(reducer, LowRankAllReduce):
            return reducer.allreduce_mean_(x)
        with self._core:
            reference = self.core.reference
        reference += reducer.allreduce_mean_(x - reference)
        return reference.clone()

    def _reducer(self) -> AnyRing | LowRankAllReduce:
        """The ring over the members the swarm formed with (built once, by either thread),
        behind PowerSGD when the codec asks for it."""
        with self._ring_lock:
            if self._reduce is None:
                if self.codec.startswith("powersgd:"):
                    rank = int(self.codec.split(":")[1])
                    shapes = [p.shape for p in self.params]
                    self._reduce = LowRankAllReduce(
                        shapes, rank, self._make_ring, seed=self.seed, device=self.device
                    )
                else:  # the whole vector, or one bucket of it
                    buckets = self._gradients
                    self._reduce = self._make_ring(self.numel if buckets is None else buckets.size)
            return self._reduce

    def _bucket_ring(self) -> AnyRing:
        """The ring the gradients' buckets go through (overlap; never low-rank)."""
        ring = self._reducer()
        assert not isinstance(ring, LowRankAllReduce)
        return ring

    def _make_ring(self, numel: int) -> AnyRing:
        """An all-reduce of ``numel`` values over the members the swarm formed with."""
        members = self.membership.active(0)
        if self.shared_memory:
            addresses = [m.address if (m := self.membership.get(i)) else "" for i in members]
            if not on_this_host(addresses):
                raise PeerError(
                    f"peer {self.id}: shared_memory averages members on this host; the swarm's "
                    f"addresses are {addresses}: run the TCP ring (shared_memory off)"
                )
            ring = SharedRing(
                members.index(self.id),
                addresses,
                numel,
                timeout=self.core.settings.round_timeout,
                names=[f"peer {i}" for i in members],
            )
            self._shared_rings.append(ring)
            return ring
        return RingAllReduce(
            self.id,
            members,
            numel,
            self._send_chunk,
            codec="fp16" if self.codec == "fp16" else "none",
            timeout=self.core.settings.round_timeout,
            gone=self.membership.why_left,
        )

    def _send_chunk(self, peer_id: int, frames: list[Any]) -> None:
        member = self.membership.get(peer_id)
        if member is None:
            raise PeerError(f"peer {self.id}: peer {peer_id} is not a member")
        with self._core:
            self.core.counters.model_messages_sent += 1
        self.transport.send(member.address, frames)

    def neighbours(self, round: int | None = None) -> list[int]:
        """Ids of the neighbours in ``round`` (default: the next round)."""
        with self._core:
            return self.core.neighbours(round)

    @property
    def id(self) -> int:
        """This peer's id in the swarm (-1 until it has one)."""
        return self.core.id

    @id.setter
    def id(self, value: int) -> None:
        self.core.id = value

    @property
    def round(self) -> int:
        """The round this peer is in (the next one it runs)."""
        return self.core.round

    @property
    def age(self) -> int:
        """Gossip learning: how many steps the model has taken (merges average it)."""
        return self.core.age

    @property
    def dead_after(self) -> float:
        """Seconds of silence after which this peer declares a member dead."""
        return self.core.detector.dead_after

    @dead_after.setter
    def dead_after(self, seconds: float) -> None:
        with self._core:
            self.core.detector.dead_after = seconds

    syncs = _counted("syncs")
    resyncs = _counted("resyncs")
    declared_dead = _counted("declared_dead")
    neighbour_misses = _counted("neighbour_misses")
    model_messages_sent = _counted("model_messages_sent")
    idle_s = _counted("idle_s")

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: bytes and messages from the sockets, misses, idle time."""
        with self._core:
            counted = self.core.metrics()
        return {
            **self.transport.stats.snapshot(),
            **counted,
            "rejoins": self.rejoins,
            "online": self.transport.online,
            "sockets": self.transport.open_sockets,
        }

    def _stop_on_failure(self, exc: BaseException) -> None:
        """The receive thread met an error that is not a bad message (a bug, memory ran out):
        wake every wait, so the training thread stops with it (``_check_failure``)."""
        self._failure = exc
        self._wake()

    def _check_failure(self) -> None:
        """Raise PeerError if the receive thread stopped on an error (traceback logged)."""
        if self._failure is not None:
            raise PeerError(
                f"peer {self.id}: stopped, because handling a message failed with "
                f"{type(self._failure).__name__}: {self._failure} (traceback in the log above)"
            )

    def close(self, reason: str = "") -> None:
        """Tell the swarm this peer stopped (and why, e.g. an error), flush queued messages
        and close the sockets."""
        if self._closed:
            return
        self._closed = True  # a round in the background stops waiting (_away)
        self._stop_helpers()
        with self._core:
            sends = self.core.leave(reason)
        self._carry_out(sends)
        self.transport.close()

    def _stop_helpers(self) -> None:
        """Stop what runs beside training: the round thread, the gradient hooks on the
        user's model, shared-memory rings and the watcher (a failed start too: the model
        must be free to train, or to be handed to another peer)."""
        if self._rounds is not None:
            self._wake()
            self._rounds.shutdown(wait=True)
        if self._gradients is not None:
            self._gradients.close()
        for ring in self._shared_rings:
            ring.close()
        self._watch_stop.set()
        self._watcher.join(2.0)

    def __enter__(self) -> Peer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- forming the swarm
    def _form(
        self,
        rank: int | None,
        peers: Sequence[str] | None,
        bootstrap: str | None,
        min_peers: int | None,
    ) -> None:
        if peers is not None:
            assert rank is not None
            self.id, self._entry_address = rank, peers[rank]
            self._merge([Member(i, a, 0) for i, a in enumerate(peers)])
            min_peers = len(peers)
        elif bootstrap is None:
            self.id = rank or 0
            self._merge(
                [Member(self.id, self.address, key=self._key, incarnation=self.incarnation)]
            )
        else:
            via, rejoin = bootstrap, self._restarted
            while True:  # again if our id goes to another newcomer meanwhile, or we are dropped
                self.id, self.started = -1, False
                me = self._take_welcome(self._join(via, rank, rejoin=rejoin))
                if me.since == 0:
                    self._await_formation(min_peers or 2)
                else:
                    self._start_late(me.since, take_model=not self._resuming)
                if self.core.rejoin_via is not None and not self.started:  # dropped, let in:
                    via, rejoin = self._rejoin_addresses(), True  # the welcome ends it
                    continue
                if not self._lost_id():
                    return
        self._await_formation(min_peers or 2)

    def _await_formation(self, min_peers: int) -> None:
        """Wait until ``min_peers`` members are in and our neighbours say they are ready;
        returns early if our id went to another newcomer let in at the same moment."""
        deadline = time.monotonic() + self.startup_timeout
        with self._changed:
            while len(self.membership.active(0)) < min_peers:
                if self._lost_id():
                    return
                if not self._changed.wait(max(0.0, deadline - time.monotonic())):
                    raise PeerError(
                        f"only {len(self.membership.active(0))} of {min_peers} peers joined within "
                        f"{self.startup_timeout:.0f}s; start the others with "
                        f"--bootstrap {self.address}"
                    )
            self.started = True
        neighbours = set(self.neighbours(0))
        # Said again every second to the neighbours not ready yet, which answer with theirs:
        # one that did not know us when ours came dropped it (only members speak for the
        # swarm), and so did we with one that came before we knew its sender. Said at once
        # to those whose word came before we were in: we did not answer it then, and they
        # wait for ours.
        with self._changed:
            unanswered = sorted(self._unanswered & neighbours)
        for j in unanswered:
            self._send(j, "ready", meta={"members": self.membership.wire()})
        while True:
            with self._changed:
                absent = self._unready(neighbours)
            if not absent or self._lost_id():
                break
            left = deadline - time.monotonic()
            if left <= 0:
                where = ", ".join(f"{j} at {self.membership.get(j)}" for j in absent)
                raise PeerError(
                    f"peer {self.id}: neighbours never reported ready within "
                    f"{self.startup_timeout:.0f}s: {where}"
                )
            for j in absent:
                self._send(j, "ready", meta={"members": self.membership.wire()})
            with self._changed:
                self._changed.wait_for(
                    lambda: not self._unready(neighbours) or self._failure is not None,
                    min(RETRY_S, left),
                )
            self._check_failure()
        if self._lost_id():
            return
        log.info(
            "peer %d: swarm of %d formed; neighbours %s", self.id, min_peers, sorted(neighbours)
        )

    def _unready(self, neighbours: set[int]) -> list[int]:
        """The neighbours that have not said they are ready and are still in: one that
        already left (a short run done before our word reached it) never will, and nobody
        waits for it (``_changed`` held)."""
        return sorted(j for j in neighbours - self._ready_from if not self.membership.gone(j))

    def _adopt_swarm(self, welcome: Message) -> None:
        """Take the swarm's id and start time from a welcome (checked with it)."""
        if "swarm" in welcome.meta:
            self.swarm_id = welcome.meta["swarm"]
            self.swarm_start = float(welcome.meta["swarm_start"])

    def _join(
        self,
        addresses: str,
        want_id: int | None,
        timeout: float | None = None,
        rejoin: bool = False,
        give_up: Callable[[], bool] = lambda: False,
    ) -> Message:
        """Ask a member (the first of the comma-separated ``addresses`` that answers) to let
        us in, or back in (``rejoin``) after a restart or after we were dropped; returns its
        welcome. ``give_up()`` true stops asking (PeerError)."""
        meta: dict[str, Any] = {
            "address": self.address,
            "want_id": want_id,
            "key": self._key,
            "incarnation": self.incarnation,
        }
        if rejoin:
            meta["rejoin"] = True
        candidates = [a.strip() for a in addresses.split(",") if a.strip()]
        try:  # fail in seconds, saying why, where nothing (or a plain/CURVE mismatch) answers
            candidates = reachable(
                candidates, secure=self.curve is not None, wait=self.connect_wait
            )
        except Unreachable as exc:
            raise PeerError(str(exc)) from None
        each = (timeout or self.startup_timeout) / max(1, len(candidates))
        # a rejoin asks REJOIN_TRIES times within its share at least, never more than RETRY_S
        # apart (a restart's share of the startup timeout is long: one lost try cost 30 s)
        retry = min(RETRY_S, rejoin_retry(each, 1)) if rejoin else RETRY_S
        for address in candidates:
            try:
                began = time.monotonic()
                key = self._key_of(address, each)
                left = each - (time.monotonic() - began)  # the search came out of its share
                welcome = self._request(
                    address, "join", meta, "welcome", left, key=key, retry=retry, give_up=give_up
                )
            except PeerError as exc:
                error = exc
                continue
            with self._core:
                refused = self.core.refusal(welcome)
            if refused is not None:
                raise PeerError(f"{address} refused to let us join: {refused}")
            return welcome
        raise error if candidates else PeerError(f"no address to join in {addresses!r}")

    def _rejoin(self) -> None:
        """Back into the swarm after a live member said we were dropped (a partition, or a
        pause longer than ``dead_after``): its table, its round and step count, our own model."""
        address = self._rejoin_addresses()  # set until welcomed: notices meanwhile are ignored
        with self._core:
            self.core.sent_round = -1  # our heartbeats no longer vouch for rounds counted anew
        try:
            timeout = self.core.settings.round_timeout
            welcome = self._join(address, self.id, timeout, rejoin=True, give_up=self._yielded)
        except PeerError as exc:
            if self._yielded():  # our side stays the swarm
                return
            log.warning("peer %d: could not rejoin through %s: %s", self.id, address, exc)
            with self._core:
                self.core.rejoin_failed(time.monotonic())
            self._carry_out([])  # log what the refusal told the core (evicted: for good)
            return
        self._start_again(welcome)

    def _yielded(self) -> bool:
        """Whether our rejoin ended as we let in a member that rejoined through us
        (:meth:`GossipCore.yields_to`): a cycle of rejoins, broken on our side."""
        return self.core.rejoin_via is None

    def _join_again(self) -> None:
        """Our id went to another newcomer let in at the same moment by another member: ask
        the members for an id again (the one we asked for first, or any); our own model.
        A PeerError (that id is taken for good) ends this peer."""
        members = self.membership.members()
        via = ",".join(m.address for m in members if m.until is None and m.id != self.id)
        with self._core:
            self.id, self.core.sent_round = -1, -1  # a newcomer again
        welcome = self._join(via, self._wanted_id, timeout=self.startup_timeout)
        self._start_again(welcome)

    def _start_again(self, welcome: Message) -> None:
        """Take up the id, table, round and step count a member's welcome gives a peer that
        trained before; it keeps its model."""
        me = self._take_welcome(welcome)
        self.rejoins += 1
        self._start_late(me.since, take_model=False)

    def _take_welcome(self, welcome: Message) -> Member:
        """Take up the id, table and round a member's welcome gives
        (:meth:`GossipCore.welcomed`, as the simulator does), the swarm's id and clock, and
        the members' keys; returns our entry."""
        try:
            with self._core:
                me = self.core.welcomed(time.monotonic(), welcome)
        except WireError as exc:
            raise PeerError(f"peer {self.id}: a welcome we cannot use: {exc}") from None
        self._adopt_swarm(welcome)
        self._learn_keys(self.membership.members())
        self._members_changed()
        return me

    def _start_late(self, since: int, take_model: bool = True) -> None:
        """Start at round ``since`` of a running swarm, aligned with a neighbour's round (or,
        if none answers, another member's); a newcomer takes that model, a restarted peer
        keeps its own. Let in, we are a member: the silent are declared dead meanwhile, and
        a source is asked until it answers, refuses, is declared dead or ``MODEL_WAIT_S``
        pass, then the next (in turn, again). With no member left to align with (dead or
        finished) we start at ``since`` with the model we have; nobody answering within
        ``MODEL_WAIT_S`` per neighbour ends a newcomer (a peer that keeps its model
        starts). A table that says we were dropped meanwhile (``rejoin_via``) returns a
        newcomer unstarted, to join again; one that keeps its model starts, and rejoins
        from there as a started peer does (the simulator's ``sim.joins`` does the same)."""
        with self._core:
            neighbours = len(self.core.neighbours(since))
        deadline = time.monotonic() + MODEL_WAIT_S * max(1, neighbours)
        asked: set[int] = set()
        self._aligning = True
        try:
            while True:
                dropped = self.core.rejoin_via is not None
                if dropped and take_model:
                    return
                with self._core:  # again each time: a member may have been declared dead since
                    sources = self.core.model_sources(since)
                fresh = [j for j in sources if j not in asked]
                if sources and not fresh:  # each asked once: in turn again
                    asked, fresh = set(), sources
                late = time.monotonic() >= deadline
                if late and take_model:
                    raise PeerError(f"peer {self.id}: no member answered with its model")
                if dropped or late or not fresh:
                    why = (
                        "dropped meanwhile; rejoins from its first round"
                        if dropped
                        else "no member left to align with"
                        if not fresh
                        else "no member answered"
                    )
                    log.warning(
                        "peer %d: %s; in at round %d with its own model", self.id, why, since
                    )
                    self._start_at(since, None, None)
                    return
                j = fresh[0]
                asked.add(j)
                if self._take_model_of(j, since, take_model, deadline):
                    return
        finally:
            self._aligning = False

    def _take_model_of(self, j: int, since: int, take_model: bool, deadline: float) -> bool:
        """Ask member ``j`` for its model (and round) and start with it (:meth:`_start_late`):
        True once started, or once our id went to another newcomer (the caller asks for
        another); False if ``j`` did not answer with a model (ask the next)."""
        member = self.membership.get(j)
        assert member is not None

        def give_up() -> bool:  # declared dead, or we were dropped: ask it no longer
            return self.membership.gone(j) or self.core.rejoin_via is not None

        wait = min(MODEL_WAIT_S, deadline - time.monotonic())
        try:
            reply = self._request(
                member.address, "model_request", {}, "model", wait, key=member.key, give_up=give_up
            )
            refused = self.core.model_refused(reply)
            if refused is not None:
                log.info("peer %d: neighbour %d has no model yet: %s", self.id, j, refused)
                return False
            model = self.core.decode_model(reply) if take_model else None
        except PeerError as exc:
            if self._lost_id():
                return True  # the caller asks for another id
            log.warning("peer %d: neighbour %d did not send its model: %s", self.id, j, exc)
            return False
        except WireError as exc:
            exc.sender = j
            self.transport.refused(exc)
            return False
        self._start_at(max(since, reply.round), model, reply.round)
        log.info(
            "peer %d: %s at round %d %s peer %d (round %d)",
            self.id,
            "joined" if take_model else "back in",
            self.round,
            "with the model of" if take_model else "keeping its model, aligned with",
            j,
            reply.round,
        )
        return True

    def _start_at(self, start: int, model: torch.Tensor | None, aligned: int | None) -> None:
        """Start at round ``start`` of the running swarm, with ``model`` if we take one, from
        the step count :func:`late_steps` gives (``aligned``: the answering member's round);
        until that count reaches ``start``'s, :meth:`step` trains alone."""
        if model is not None:
            self.flat_params.load_(model)
        self.steps, self._alone_until = late_steps(
            self.steps, model is not None, self.started, start, aligned, self.trigger.period
        )
        with self._core:
            self.core.start_at(start, self.flat_params.copy(), model is not None, aligned)
            if model is not None:
                self.core.age = self.steps
        self.started = True
        # The swarm may reach our first round only after a while (a join sets it ahead).
        self._first_wait = self.startup_timeout

    def _key_of(self, address: str, timeout: float) -> str:
        """The CURVE key of the member at ``address`` we join through ("" without CURVE):
        found already (the config's request found it), our table's for a member we know (a
        rejoin, whose round timeout leaves no time for a search), else among the allow-list's
        keys."""
        if self.curve is None:
            return ""
        member = self.membership.by_address(address)
        key = self.curve.key_of(address) or (member.key if member is not None else "")
        if not key:
            try:
                key = find_key(address, self.curve, timeout)
            except TransportError as exc:
                raise PeerError(str(exc)) from None
        self.transport.set_key(address, key)
        return key

    def _request(
        self,
        address: str,
        kind: str,
        meta: dict[str, Any],
        reply: str,
        timeout: float | None = None,
        key: str = "",
        retry: float = RETRY_S,
        give_up: Callable[[], bool] = lambda: False,
    ) -> Message:
        """Send ``kind`` to ``address`` every ``retry`` seconds until a ``reply`` arrives over
        ``key`` (the member's CURVE key, "" without CURVE). Each try carries a fresh nonce;
        only a reply that echoes one of ours counts (:class:`Asked`). ``give_up()`` true ends
        the wait early (PeerError), as the timeout does."""
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        nonces: list[str] = []

        def done() -> bool:
            answered = self._asked.answer(nonces) is not None
            return answered or self._lost_id() or self._failure is not None or give_up()

        try:
            while time.monotonic() < deadline and not give_up():
                nonces.append(self._asked.ask(reply, key))
                frames = encode(kind, self.id, 0, self.round, meta={**meta, NONCE: nonces[-1]})
                self.transport.send(address, frames)
                with self._changed:
                    self._changed.wait_for(done, min(retry, deadline - time.monotonic()))
                answer = self._asked.answer(nonces)
                if answer is not None:
                    return answer
                self._check_failure()
                if self._lost_id():
                    raise PeerError(f"peer {self.id}: our id went to another newcomer")
        finally:
            self._asked.close(nonces)
        if give_up():
            raise PeerError(f"no {reply!r} from {address} yet; asked no longer")
        raise PeerError(
            f"no {reply!r} from {address} within the timeout; is a gossipdl peer listening there?"
        )

    # ----------------------------------------------------------------- helpers
    def _round_model(self) -> torch.Tensor:
        """The model a synchronous round starts from (:meth:`FlatParameters.round_input`);
        a ring all-reduce, which reduces into the vector it is given, gets a copy."""
        if self.ring:
            return self.flat_params.copy()
        return self.flat_params.round_input(self.averager.sends_memory_of)

    def _flat_gradients(self, grads: Sequence[torch.Tensor]) -> torch.Tensor:
        """A copy of the gradients as one vector, in recycled memory on a CPU (a fresh
        43 MB vector every step pays its page faults)."""
        with torch.no_grad():
            views = [g.reshape(-1) for g in grads]
            return torch.cat(views, out=empty_on(self.device, self.numel))

    def _send(
        self,
        peer_id: int,
        kind: str,
        round: int | None = None,
        payload: Payload | None = None,
        meta: dict[str, Any] | None = None,
    ) -> None:
        """Send one message through the core (which numbers it and may drop a model message
        on purpose, ``loss``), ``meta`` next to the payload's own."""
        if self._lost_id():
            return
        with self._core:
            sends = self.core.send(peer_id, kind, round, payload, meta or {})
        self._carry_out(sends)

    def _merge(self, members: list[Member]) -> None:
        """Merge entries into the member table (:meth:`GossipCore.merge`); learn the new
        members' keys, and tell the owner of a live entry another address took."""
        before = {m.id: self.membership.get(m.id) for m in members}
        with self._core:
            changed = self.core.merge(members, time.monotonic())
        self._learn_keys(changed)
        for member in changed:
            old = before[member.id]
            if old is not None and old.until is None and old.address != member.address:
                self._lost_to(old, member)
        if changed:
            self._members_changed()

    def _lost_id(self) -> bool:
        """Whether our id went to another newcomer let in at the same moment by another
        member (the smaller address keeps it): we send nothing as that id and join again."""
        me = self.membership.get(self.id) if self.id >= 0 else None
        return me is not None and me.address != self._entry_address

    def _lost_to(self, old: Member, new: Member) -> None:
        """``new`` took the id of ``old``, a live entry at another address: if ``old`` is
        us, say so; else tell it (its member may not have heard of ``new``)."""
        if old.address == self._entry_address:
            log.warning(
                "peer %d: id %d went to %s, let in at the same moment; asking for an id again",
                self.id,
                new.id,
                new.address,
            )
        elif new.since == old.since:  # not a later life of the same peer
            self._reply(old.address, "members", members=self.membership.wire())

    def _learn_keys(self, members: list[Member]) -> None:
        """Tell the transport each member's public key, so CURVE can connect to it."""
        for member in members:
            if member.key:
                self.transport.set_key(member.address, member.key)

    def _members_changed(self) -> None:
        """Wake whoever waits on the member table (formation, rounds) and report it; only
        members' addresses keep member keys (CURVE: :meth:`Transport.retain_keys`)."""
        self.transport.retain_keys({m.address for m in self.membership.members()})
        self._wake()
        if self._on_members is not None:
            # Threads report in turn, each the table as it is then: a thread that read the
            # table before another's change cannot write its older view last.
            with self._publishing:
                self._on_members(self.membership.members())

    def _wake(self) -> None:
        """Wake every wait (formation, requests, a round) to look again."""
        with self._changed:
            self._changed.notify_all()
        with self._core:
            self._core.notify_all()

    def _announce(self) -> None:
        """Send the member table to every member still in the swarm."""
        with self._core:
            sends = self.core.announce()
        self._carry_out(sends)

    # ----------------------------------------------------------------- watch thread
    def _watch(self) -> None:
        """Every half heartbeat: a heartbeat to each member that heard nothing from us for a
        while, and a death sentence for each member silent past ``dead_after``."""
        while not self._watch_stop.wait(self.core.detector.heartbeat / 2):
            try:
                self._watch_once()
            except Exception:  # a bug in one pass must not end heartbeats and death sentences
                log.exception("peer %d: error in the heartbeat thread; carrying on", self.id)

    def _watch_once(self) -> None:
        """One pass of the watch thread: the core's heartbeats, forgotten members and death
        sentences, carried out (sockets closed, logged, the table reported)."""
        now = time.monotonic()
        self._expire_early(now)
        if self.id < 0 or self._lost_id():
            return
        with self._core:
            tick = self.core.tick(
                now,
                online=self.transport.online,  # away (churn): silence is ours
                # let in, a member judges silence (a ring names its dead on its timeout)
                sentence=(self.started or self._aligning) and not self.ring,
            )
        for member, silent in tick.forgotten:
            self.transport.forget(member.address)
            log.info(
                "peer %d: forgot peer %d (out since round %s, silent for %.0fs)",
                self.id,
                member.id,
                member.until,
                silent,
            )
        for peer_id, silent, until in tick.dead:
            log.warning(
                "peer %d: no word from peer %d for %.1fs; declared dead, out of the topology "
                "from round %d",
                self.id,
                peer_id,
                silent,
                until,
            )
        if tick.dead:
            self._members_changed()
        self._carry_out(tick.sends)

    def _hear_table(self, sender: int, members: list[Member]) -> None:
        """Take in a member table from ``sender`` as the core judges it
        (:meth:`GossipCore.judge_table`): merge it, or rejoin through the sender (at the
        next round, or now while we align: :meth:`_start_late`)."""
        let_in = (self.started or self._aligning) and not self._closed
        with self._core:
            was = self.core.rejoin_via
            verdict = self.core.judge_table(time.monotonic(), sender, members, let_in)
            rejoining = was is None and self.core.rejoin_via is not None
        if verdict is Verdict.MERGE:
            self._merge(members)
        elif rejoining:  # the core's note is logged once the message is handled
            self._wake()  # a round waiting on our old side ends now

    def _rejoin_addresses(self) -> str:
        """The addresses a rejoin asks in turn (:meth:`GossipCore.rejoin_order`)."""
        with self._core:
            return ",".join(m.address for m in self.core.rejoin_order())

    # ----------------------------------------------------------------- receive thread
    def _receive(self, msg: Message) -> None:
        """Handle one message; then the member tables that came early from senders we now
        know (a newcomer's ``ready`` can overtake the news of it)."""
        with self._gossip_stream():
            try:
                self._on_message(msg)
            finally:
                with self._lock:
                    known = [e for e in self._early if self.membership.get(e[1].sender) is not None]
                    for item in known:
                        self._early.remove(item)
                for _, early in known:
                    try:
                        self._on_message(early)
                    except WireError as exc:
                        exc.sender = early.sender
                        self.transport.refused(exc)

    def _hold_early(self, msg: Message) -> None:
        """Keep a member table from a sender we do not know yet, for ``EARLY_S`` seconds and
        at most ``MAX_EARLY`` of them: news of the sender may be on its way. Only a valid
        table is held (WireError now for one that is not), and of the rest of the header only
        its scalars: its other maps and lists could be 25 MiB parsed each."""
        parse_members(msg.meta.get("members"), self.membership.limit)
        meta = {
            k: v for k, v in msg.meta.items() if k == "members" or not isinstance(v, list | dict)
        }
        with self._lock:
            self._early.append((time.monotonic(), replace(msg, meta=meta)))
        self._expire_early(time.monotonic())

    def _expire_early(self, now: float) -> None:
        """Refuse the early tables whose sender stayed unknown (``unknown_sender``)."""
        with self._lock:
            expired = []
            while self._early and (
                len(self._early) > MAX_EARLY or now - self._early[0][0] > EARLY_S
            ):
                expired.append(self._early.popleft()[1])
        for msg in expired:
            detail = f"{msg.kind} from id {msg.sender}, not a member"
            self.transport.refused(WireError("unknown_sender", detail, msg.sender))

    def _on_message(self, msg: Message) -> None:
        """Validate ``msg`` against the swarm state and act on it; WireError drops it.

        Joins and info requests come from strangers by nature; welcomes and models must
        answer a request of ours (:class:`Asked`); everything else, member tables included,
        must come from a member, over that member's key when CURVE is on."""
        if msg.kind in ("join", "info_request") and self.id < 0:
            # Not a member yet (a founder that has not founded, a joiner not yet welcomed):
            # an answer now would hand out a table without us in it. The asker retries.
            raise WireError("not_member_yet", f"{msg.kind} before this peer is in a swarm")
        with self._core:  # it may end our rejoin (GossipCore.yields_to)
            refuses = msg.kind == "join" and self.core.refuses_join(time.monotonic(), msg)
        if refuses:
            # Told we were dropped: our table is the cut-off side's, and a joiner let in by
            # it would be lost when we take the swarm's table back; after a failed rejoin,
            # the swarm's members are not let into it (GossipCore.refuses_join). The asker
            # retries.
            raise WireError("not_member_yet", "a join while this peer rejoins the swarm")
        if msg.kind == "join" and self._aligning and not self.started:
            # Let in, not at our round yet: we could not say from which round the joiner is
            # in (the simulator's core refuses the same). The asker asks the next member.
            raise WireError("not_member_yet", "a join while this peer aligns with the swarm")
        if msg.kind == "join":
            self._on_join(msg)
            return
        if msg.kind == "info_request":
            nonce = self._answer_token(msg)  # over the answer rate, nothing is kept for it
            address = self._reply_address(msg, "reply address")
            members = self.membership.wire()
            self._reply(address, "info", members=members, config=self.swarm_config, nonce=nonce)
            return
        if msg.kind in ("welcome", "model"):
            table = check_welcome(msg, self.membership.limit) if msg.kind == "welcome" else []
            if self._asked.take(msg):
                # The member we asked speaks for the swarm: its table is ours before anything
                # its members send us next (they may announce us before we read the welcome).
                self._merge(table)
                with self._changed:
                    self._changed.notify_all()
            return
        sender = self.membership.get(msg.sender)
        if sender is None and msg.kind in ("ready", "members", "dropped"):
            if msg.arrays:  # a table is all meta: held, a payload would be memory for nothing
                raise WireError("bad_payload", f"a {msg.kind} table carries no arrays")
            self._hold_early(msg)
            return
        if sender is None:
            raise WireError("unknown_sender", f"{msg.kind} from id {msg.sender}, not a member")
        if sender.key != msg.key:  # CURVE: the connection's key must be the member's
            raise WireError("wrong_key", f"{msg.kind} claims to be peer {msg.sender}")
        if msg.kind not in MEMBER_KINDS:  # a parameter server's, say: nothing here takes it
            raise WireError("unexpected", f"a {msg.kind!r} message, which gossip peers do not send")
        if msg.kind in ("ready", "members", "dropped"):
            table = parse_members(msg.meta.get("members"), self.membership.limit)
            self._hear_table(msg.sender, table)
        sends: list[Send] = []
        with self._core:
            self.core.detector.heard(msg.sender, time.monotonic())
            if msg.kind in CORE_KINDS:  # the round protocol's own: the core takes them in
                self.core.check_seq(msg, sender)
                sends = self.core.take(time.monotonic(), msg, sender)
                self._core.notify_all()
            tables = self.core.tell_table(msg) if self.started else []  # if it lacks ours
        self._carry_out(sends + tables)
        if msg.kind == "leave" or sends:  # a peer left, or an accusation evicted one
            self._members_changed()
        elif msg.kind == "chunk":
            if not self.ring:
                raise WireError("unexpected", "a chunk, but this swarm does not all-reduce")
            reducer = self._reducer()  # a low-rank reducer's factors travel on its ring
            (reducer.ring if isinstance(reducer, LowRankAllReduce) else reducer).deliver(msg)
        elif msg.kind == "ready":
            with self._changed:
                self._ready_from.add(msg.sender)
                if not self.started:
                    self._unanswered.add(msg.sender)
                self._changed.notify_all()
            if self.started and msg.meta.get("answer") is not True:  # it may not have ours:
                # we may have said it before we knew the sender, and been dropped then
                meta = {"members": self.membership.wire(), "answer": True}
                self._send(msg.sender, "ready", meta=meta)
        elif msg.kind == "model_request":
            if self.reduces_gradients:
                raise WireError("unexpected", "a ring all-reduce of gradients sends no models")
            if not self._lost_id():  # nothing goes out under an id another newcomer took
                with self._core:
                    sends = self.core.answer_model_request(msg, self.started)
                self._carry_out(sends)
        with self._core:
            self.core.track_seq(msg)  # only messages accepted: a dropped one leaves a gap
        self._carry_out([])  # what the core noted (lost messages, departures) goes to the log

    def _reply(self, address: str, kind: str, **meta: Any) -> None:
        """Answer someone who is not a member yet: straight to its address, no sequence number."""
        self.transport.send(address, encode(kind, self.id, 0, self.round, meta=meta))

    def _reply_address(self, msg: Message, what: str) -> str:
        """The address a request asks us to answer at, checked like any member's address,
        with the key the request came over (CURVE) to reach it."""
        address = check_address(msg.meta.get("address"), what)
        if msg.key:
            self.transport.set_reply_key(address, msg.key)
        return address

    def _answer_token(self, msg: Message) -> str:
        """The nonce to answer request ``msg`` with, before anything is done for it; at most
        ``MAX_ANSWER_RATE`` requests a second are answered, all senders together
        (``answer_rate``), so requests that name a third party's address cannot make this
        peer flood it, nor grow its member table fast."""
        nonce = echoed_nonce(msg.meta)
        if not self._answer_budget.allow(b"", time.monotonic()):
            raise WireError(
                "answer_rate", f"over {MAX_ANSWER_RATE:g} answers a second; {msg.kind} ignored"
            )
        return nonce

    def _on_join(self, msg: Message) -> None:
        """Let a newcomer in, or a member back in (``rejoin``: restarted, or dropped while
        it was away), as the core decides (:meth:`GossipCore.answer_join`); our welcome
        also hands on the swarm's config, id and clock."""
        self._answer_token(msg)  # over the answer rate, nothing is done for it
        welcome = {
            "config": self.swarm_config,
            "swarm": self.swarm_id,
            "swarm_start": self.swarm_start,
        }
        with self._core:
            answer = self.core.answer_join(time.monotonic(), msg, self.started, self.ring, welcome)
        self._reply_address(msg, "joiner address")  # its key, to reach it (CURVE)
        if answer.admitted is not None:
            self._learn_keys([answer.admitted])
            self._members_changed()
        self._carry_out(answer.sends)
