"""One gossip peer as a state machine: events in, actions out, no I/O (h11's way).

The engine says what happened: a member's message arrived (:meth:`GossipCore.take`,
or :meth:`GossipCore.receive` with its raw frames), the local steps of a round are
done (:meth:`GossipCore.open_round`), time is now t (:meth:`GossipCore.poll`,
:meth:`GossipCore.tick`). The core answers with :class:`Send` actions (frames the
real wire encoder made, for a member) and, once a round is over, the model to
continue from; ``deadline`` says when it next wants a poll. It never blocks,
sleeps, reads a clock or opens a socket, and its random generators are seeded
from the swarm's seed, so the same events give the same answers.

Both engines drive it: :class:`gossipdl.Peer` from its threads (every call under
one lock, a round's wait on a condition the receive thread notifies) and the
simulator from a virtual clock (:mod:`gossipdl.sim.engine`).

What it runs: synchronous rounds of any averager (dense gossip, CHOCO,
broadcast) under the ``always``/``periodic`` trigger, the two-phase rounds of the
dynamic trigger, gossip learning's walks, CHOCO's resyncs after a lost message or
a topology change, heartbeats that say which round a member last sent, death
sentences announced to the swarm (a member out of the topology a few rounds
ahead), graceful leaves, sequence numbers and their gaps; and the member's side
of joining (:mod:`gossipdl.protocol.joining` decides): letting a newcomer or a
restarted peer in, answering a model request, telling a member we declared dead
that it was dropped, taking a welcome, and a member table that says we must
rejoin (``rejoin_via``). The joiner's side is the engine's choice of whom to ask and
when to try again (and, for real, CURVE keys): it draws each request's nonce, sends
what :meth:`GossipCore.ask` makes and takes the answers the core kept (``answers``).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from gossipdl.averaging import Arrival, Averager, Round, SharedDecodes
from gossipdl.averaging.base import dense_payload
from gossipdl.averaging.gossip_learning import GossipLearning
from gossipdl.averaging.triggers import Trigger
from gossipdl.compression import CodecError, Payload, build_codec
from gossipdl.protocol.asked import Asked
from gossipdl.protocol.eviction import GRACE_ROUNDS, WINDOW_ROUNDS, Evictions
from gossipdl.protocol.failure import FailureDetector
from gossipdl.protocol.joining import (
    Admission,
    Refusal,
    SwarmState,
    Verdict,
    admit,
    check_welcome,
    hear_table,
    join_incarnation,
)
from gossipdl.protocol.kinds import (
    COMPRESSED_KINDS,
    LOSSY_KINDS,
    MAX_ALARMS,
    MAX_RESYNC_AHEAD,
    MAX_RESYNCS_PER_SENDER,
    MAX_WALKS,
    MODEL_KINDS,
    PEER_META,
    RESYNC_LEAD,
    SYNC_AT,
    TABLE,
    TABLE_KINDS,
    WALK_AGE,
)
from gossipdl.protocol.mailbox import Mailbox
from gossipdl.protocol.membership import Member, MemberTable, parse_members
from gossipdl.protocol.rounds import Topologies, arrivals, topology_changes
from gossipdl.protocol.sequence import Sequences
from gossipdl.transport.address_syntax import check_address
from gossipdl.transport.wire import (
    NONCE,
    Message,
    WireError,
    decode,
    echoed_nonce,
    encode,
    meta_int,
    meta_text,
)

ROUND_TIMES_KEPT = 32  # rounds whose end times set the join margin
REJOIN_BACKOFF = 2.0  # round timeouts a failed rejoin holds the next back, at most (drawn)
YIELD_AFTER = 0.5  # round timeouts a rejoin waits for a welcome before it may yield to a cycle
MAX_ASKED = 64  # requests of ours awaiting an answer (join, model_request); the oldest go beyond
_MODEL = build_codec("none")  # how a ``model`` answer travels, whatever the averager
MODEL_ERROR = "error"  # meta key of a model answer without a model: why
REPLY_TO = {"join": "welcome", "model_request": "model"}  # a request's kind -> its answer's
# The round protocol's messages, which the core takes in from a member (:meth:`GossipCore.take`);
# :meth:`GossipCore.receive` also dispatches member tables and joins.
CORE_KINDS = frozenset(
    {"params", "public", "quiet", "reply", "walk", "alive", "resync_request", "leave", "accuse"}
)


@dataclass(frozen=True)
class Send:
    """Send ``frames`` (header first, as the wire encoder made them) to member ``to``, or to
    ``address`` when it is set (an answer to a joiner, not a member yet)."""

    to: int
    kind: str
    frames: list[Any]
    address: str = ""


@dataclass
class Progress:
    """What a poll moved: messages to send now, and the model once the round is over."""

    sends: list[Send] = field(default_factory=list)
    model: torch.Tensor | None = None


@dataclass
class Tick:
    """What a watch pass decided and did: heartbeats and announcements to send, members
    forgotten (their entries) and declared dead (id, seconds silent, round out)."""

    sends: list[Send] = field(default_factory=list)
    forgotten: list[tuple[Member, float]] = field(default_factory=list)
    dead: list[tuple[int, float, int]] = field(default_factory=list)


@dataclass
class JoinAnswer:
    """What a join made a member do: the welcome or refusal, then (for a new entry) the new
    table to every member; and the entry it let in, if new."""

    sends: list[Send]
    admitted: Member | None = None


@dataclass
class Counters:
    """What a peer counts for its metrics lines (the real engine's names)."""

    model_messages_sent: int = 0
    neighbour_misses: int = 0
    resyncs: int = 0
    syncs: int = 0
    declared_dead: int = 0
    evicted: int = 0
    idle_s: float = 0.0


class JoinRefused(RuntimeError):
    """A member refused to let us in; the message is its reason."""


REFUSED = "refused"
"""A refusal's welcome meta key: the drop reason it was counted under (``evicted``, a limit's),
so the joiner can tell a refusal for good from one that may pass."""


class _Phase(Enum):
    IDLE = "idle"  # training: no round open
    FIRST = "first"  # waiting for the round's messages
    ANSWERS = "answers"  # dynamic trigger: waiting for the quiet neighbours' replies


@dataclass(frozen=True)
class Settings:
    """The swarm's protocol settings (one :class:`~gossipdl.config.Config`'s worth)."""

    topology: str = "ring"
    round_timeout: float = 10.0
    heartbeat: float = 1.0
    dead_after: float = 5.0
    forget_after: float = 600.0
    join_margin_rounds: int = 20
    loss: float = 0.0  # model messages dropped on purpose (an emulated lossy peer)
    max_message_bytes: int = 1 << 30
    seed: int = 0
    evict_after: int = 0  # judged rounds in a row that make a suspect (0: nobody is evicted)


def _earliest(alarms: Iterable[int]) -> list[int]:
    """The earliest ``MAX_ALARMS`` sync alarms, sorted: as many as a member takes in one
    message (its own and those it heard alike)."""
    return sorted(alarms)[:MAX_ALARMS]


def addressed(payload: Payload | Mapping[int, Payload], neighbour: int) -> Payload:
    """What ``neighbour`` gets of an averager's ``outgoing``: the one payload, or its own."""
    return payload[neighbour] if isinstance(payload, Mapping) else payload


class GossipCore:
    """The protocol of peer ``me`` (-1 until it has an id) over the member table ``members``
    (the engine's: the real one shares it with its join handling, behind a lock)."""

    # The simulator's swarm shares the decodes of one broadcast among its receivers (an
    # engine sets it); None: every message is decoded for this peer alone.
    decodes: SharedDecodes | None = None

    def __init__(
        self,
        me: int,
        members: MemberTable,
        *,
        averager: Averager,
        trigger: Trigger,
        settings: Settings,
        model: torch.Tensor,
        stream: int | None = None,
    ) -> None:
        """``model``: the flat parameters it starts from; ``stream``: which of the seed's
        random streams it draws from (default ``me``)."""
        self.id = me
        self.averager = averager
        self.trigger = trigger
        self.settings = settings
        self.codec = averager.codec.spec
        self.numel = model.numel()
        self.device = model.device
        self.membership = members
        self.topologies = Topologies(settings.topology, settings.seed)
        self.detector = FailureDetector(
            settings.heartbeat, settings.dead_after, settings.forget_after
        )
        self.counters = Counters()
        self.evictions = Evictions(settings.evict_after)
        self.loss = settings.loss  # model messages dropped on purpose (a test may change it)
        self.dropped: list[WireError] = []  # refused messages, for the engine to count
        self.notes: list[str] = []  # what a log would say, for the engine to log
        self.round = 0
        self.first_round = 0  # the round this peer started at (it resyncs there)
        self.sent_round = -1  # the last round whose messages all went out (heartbeats say it)
        self._inbox = Mailbox(keep_late=averager.accepts_late)
        self._answers = Mailbox(keep_late=averager.accepts_late)  # dynamic, phase 2
        self._seq: dict[int, int] = {}  # per-member sequence numbers of what we sent
        self._numbered = 0  # numbered sends to anyone: a member's numbers start above it
        self._numbers = Sequences()  # the sequence numbers taken per sender: gaps, repeats
        self._gap = False  # a message was lost: resync
        self._resync_at: set[int] = set()
        self._dense_for: dict[int, set[int]] = {}  # round -> who asked for our public copy
        self._last_ids: tuple[int, ...] | None = None
        self._alarms: set[int] = set()  # dynamic trigger: rounds the swarm syncs
        self.final_round: int | None = None
        self.reference = model.clone()  # the model agreed at the last sync (dynamic trigger)
        # (round, model at its start): what a model request gets, a tensor nobody writes to
        self.published: tuple[int, torch.Tensor] = (0, self.reference.clone())
        self._catch_up = False  # our model missed the swarm's averaging (start_at)
        self.rejoin_via: int | None = None  # a member whose table says we were dropped
        self.rejoin_through: list[Member] = []  # it, then the rest of its swarm: whom to ask
        self.rejoin_since = 0.0  # when the rejoin began (:meth:`yields_to`)
        self.rejoin_held_until = 0.0  # after a rejoin nobody answered (rejoin_failed)
        self._held_from: frozenset[str] = frozenset()  # addresses of the swarm it asked
        self.evicted: str | None = None  # why the swarm refuses us back for good (refusal)
        self._asked = Asked(MAX_ASKED)  # requests of ours, kept as the real peer keeps them
        self._told: dict[int, float] = {}  # member -> when it last got our table (tell_table)
        self.answers: list[Message] = []  # answers to our requests, for the engine to take
        self._walks: deque[tuple[torch.Tensor, int]] = deque()
        self.age = 0  # gossip learning: steps behind the walking model
        # overlap: the open round runs behind the next step's compute, so its time is not
        # idle (the engine counts the time a step waits for it); set by the engine
        self.behind = False
        self._round_times: deque[float] = deque(maxlen=ROUND_TIMES_KEPT)
        stream = me if stream is None else stream
        self._walk_rng = random.Random(settings.seed * 104729 + stream)
        self._loss_rng = random.Random(settings.seed * 7919 + stream)
        self._rejoin_rng = random.Random(settings.seed * 15485863 + stream)
        self._phase = _Phase.IDLE
        self._open: tuple[Round, torch.Tensor, float] | None = None  # round, x, its start
        self._sync = True  # dynamic trigger: this peer syncs in the open round
        self._kept: dict[int, Any] = {}  # dynamic: the updates phase 1 brought
        self._quiet: set[int] = set()  # dynamic: the quiet neighbours phase 2 waits for
        self._now = 0.0  # the time of the event being handled
        self.deadline: float | None = None  # when the open wait gives up (a timer to set)

    # ----------------------------------------------------------------- rounds
    def sync_at_step(self, step: int) -> None:
        """The round ending by local step ``step`` syncs the whole swarm (the last one)."""
        last = step // self.trigger.period - 1
        self.final_round = last
        if self.trigger.dynamic and last >= self.round:
            self._alarms.add(last)

    @property
    def waiting(self) -> bool:
        """Whether a round is open (the engine polls it instead of training)."""
        return self._phase is not _Phase.IDLE

    def open_round(
        self, now: float, x: torch.Tensor, timeout: float | None = None, lr: float = 1.0
    ) -> list[Send]:
        """The local steps of a round are done with model ``x``, the last at learning rate
        ``lr``: send what the round sends. Its messages are waited for ``timeout`` seconds
        (default ``round_timeout``). ``x`` stays the engine's: it may be the live model,
        which training writes once the round is over, so nothing keeps it past the round
        (a round that leaves the model as it was publishes a copy)."""
        assert self._phase is _Phase.IDLE, "a round is already open"
        self._now = now
        t = self.round
        if self.averager.asynchronous:
            return self._walk(x, t, now)
        changes = topology_changes(self.membership.spans(), self.first_round)
        if t == self.first_round:
            self.averager.begin(self.reference)  # the model it started from, before any step
        rnd, sends = self._round_view(t, changes, lr)
        dense_to = self._dense_destinations(rnd, changes)
        tag: dict[str, Any] = {}
        sync = True
        if self.trigger.dynamic:
            alarms = self._pending_alarms(x, t)
            tag = {SYNC_AT: alarms}
            sync = rnd.resync or bool(dense_to) or t in alarms
        payload = self.averager.outgoing(x, rnd) if sync else None
        public = None
        if dense_to:  # the swarm's first round: a founder vouches for its copy instead
            # (a newcomer's copy is a model its neighbours do not hold: they need it dense)
            founding = t == self.first_round == 0
            public = self.averager.vouch() if founding else self.averager.public_copy()
        for j in self.live(rnd.weights):
            if public is not None and j in dense_to:
                sends += self.send(j, "public", t, public, tag)
            elif payload is not None:
                sends += self.send(j, "params", t, addressed(payload, j), tag)
            else:
                sends += self.send(j, "quiet", t, None, tag)
        self.sent_round = t
        self._open = (rnd, x, now)
        self._sync = sync
        self._phase = _Phase.FIRST
        self.deadline = now + (timeout or self.settings.round_timeout)
        return sends

    def poll(self, now: float, online: bool = True) -> Progress:
        """Move the open round on if its messages are in or its wait timed out (``online``:
        False while this device is away, when it waits for nobody)."""
        if self._open is None:
            return Progress()
        self._now = now
        rnd, x, opened = self._open
        if self.averager.asynchronous:  # a walk waits for nothing: over when it began
            return self._end(opened, x)
        first = self._phase is _Phase.FIRST
        box = self._inbox if first else self._answers
        ids = rnd.weights if first else self._quiet
        # still waiting for a member in the swarm? (asks who left only about who has not sent)
        waiting = online and now < (self.deadline or 0.0)
        if waiting and any(self._awaited(j, rnd.index) for j in box.waiting_for(rnd.index, ids)):
            return Progress()
        expected = set(self.live(ids))
        got = box.take(rnd.index)
        missed = sorted(j for j in expected if j not in got)
        self.counters.neighbour_misses += len(missed)
        if missed:
            self.notes.append(f"round {rnd.index}: no model from {missed}; its weight stays here")
        if not self.trigger.dynamic:
            return self._end(now, self._merge(x, rnd, got))
        if not first:
            return self._end_dynamic(now, {**self._kept, **got}, took_part=True)
        synced = {j for j, (value, _) in got.items() if value is not None}
        self._kept = {j: v for j, v in got.items() if j in synced}
        if self._sync:  # the quiet neighbours answer with their update next
            self._quiet = {j for j in got if j not in synced}
            if not self._quiet:
                return self._end_dynamic(now, self._kept, took_part=True)
            self._phase = _Phase.ANSWERS
            self.deadline = now + self.settings.round_timeout
            return self.poll(now, online)  # the answers may be in already
        if not synced:
            return self._end_dynamic(now, {}, took_part=False)
        payload = self.averager.outgoing(x, rnd)
        answer = rnd.weights if self.averager.uses_public_copies else synced
        tag = {SYNC_AT: sorted(self._alarms)}
        sends = [
            s
            for j in self.live(answer)
            for s in self.send(j, "reply", rnd.index, addressed(payload, j), tag)
        ]
        progress = self._end_dynamic(now, self._kept, took_part=True)
        progress.sends[:0] = sends
        return progress

    def _end_dynamic(self, now: float, got: dict[int, Any], took_part: bool) -> Progress:
        """Merge a dynamic round (``Peer._dynamic_round``): a silent edge is a missing
        neighbour, whose weight stays with the peer (``averaging.base.mix``); CHOCO keeps
        its weights and mixes only if it took part. An edge carries models iff one of its
        ends synced."""
        assert self._open is not None
        rnd, x, _ = self._open
        if self.averager.uses_public_copies:
            rnd = replace(rnd, mix=took_part)
        new = self._merge(x, rnd, got)
        if took_part:
            self.reference = new.clone()
        return self._end(now, new, synced=took_part)

    def _end(self, now: float, new: torch.Tensor, synced: bool = True) -> Progress:
        """Close the round (``synced``: this peer took part in it): the next one begins; a
        resync is asked for if one is due."""
        assert self._open is not None
        if not self.behind:
            self.counters.idle_s += now - self._open[2]
        if new.data_ptr() == self._open[1].data_ptr():  # x is the engine's (its live model)
            new = new.clone()
        self.advance(now, synced)
        self.published = (self.round, new)
        self._phase, self._open, self.deadline = _Phase.IDLE, None, None
        self._kept, self._quiet = {}, set()
        sends: list[Send] = []
        if self.averager.uses_public_copies and (self._gap or self.averager.needs_resync):
            sends = self._request_resync()
        if self.settings.evict_after:
            sends += self._accuse()
        return Progress(sends, new)

    def advance(self, now: float, synced: bool = True) -> None:
        """The next round begins at ``now`` (a round of the ring all-reduce calls it too);
        ``synced``: this peer took part in the one that ended (the ``syncs`` it counts)."""
        if synced:
            self.counters.syncs += 1
        self.round += 1
        self._inbox.advance(self.round)
        self._answers.advance(self.round)
        self._round_times.append(now)

    def forget_rounds(self, peer: int) -> None:
        """``peer`` is new or back: the rounds it said it sent count no more."""
        self._inbox.forget(peer)

    def start_at(
        self, round: int, model: torch.Tensor, took_model: bool = False, aligned: int | None = None
    ) -> None:
        """Start at ``round`` of a running swarm with ``model`` (a newcomer or a peer back):
        it resyncs there, its mailboxes wait for that round, heartbeats vouch for none.
        ``took_model``: a neighbour's, a join margin ago. That one, or a checkpoint's this
        process resumed (it ran no round yet), missed the swarm's averaging for a join
        margin at least, so the first round that brings neighbours' models catches up
        (:meth:`~gossipdl.averaging.base.Averager.catch_up`): with a defence, such a stale
        model and the swarm's rejected each other for good (fault seeds 19122, 31140). A
        peer back after a drop keeps its own: it averaged until it was cut off.
        ``aligned``: the round of the member that answered (None: nobody did); a model
        request gets ``model`` as of that round, not ``round``, which the swarm has not
        reached (a peer aligning with this one would take up steps nobody trained)."""
        self._catch_up = took_model or not self._round_times
        self.round = self.first_round = round
        self.reference = model.clone()
        self.published = (round if aligned is None else aligned, self.reference.clone())
        self._last_ids = None
        self.move_to(round)
        self.sent_round = round - 1

    def move_to(self, round: int) -> None:
        """Keep what arrives for ``round`` on (a rejoin may go back to the swarm's round)."""
        self._inbox.move_to(round)
        self._answers.move_to(round)

    def _merge(self, x: torch.Tensor, rnd: Round, got: dict[int, Any]) -> torch.Tensor:
        """Hand what arrived in round ``rnd`` (and late for earlier ones) to the averager."""
        arrived, missing = arrivals(rnd, got)
        if self._catch_up and arrived:  # the first round that brought neighbours' models
            self._catch_up = False
            fresh = self.averager.catch_up(arrived)
            x = x if fresh is None else fresh
        return self.averager.incoming(x, rnd, arrived, missing, self._late_arrivals())

    def _late_arrivals(self) -> list[tuple[int, Arrival]]:
        """Updates that came after their round (CHOCO and broadcast still count them)."""
        return [
            (j, Arrival(self.mixing(r)[0].get(j, 0.0), value, r, dense))
            for box in (self._inbox, self._answers)
            for j, r, (value, dense) in box.drain_late()
            if value is not None
        ]

    def _walk(self, x: torch.Tensor, t: int, now: float) -> list[Send]:
        """Gossip learning: merge the models that walked in, send ours on to one neighbour;
        the round is over at once (:meth:`poll` hands the merged model back)."""
        assert isinstance(self.averager, GossipLearning)
        while self._walks:
            value, age = self._walks.popleft()
            x, self.age = self.averager.merge(x, self.age, value, age)
        self._open = (Round(t, {}, 1.0), x, now)
        self._phase = _Phase.FIRST
        neighbours = self.live(self.mixing(t)[0])
        if not neighbours:
            return []
        payload = self.averager.outgoing(x, Round(t, {}, 1.0))
        target = self._walk_rng.choice(sorted(neighbours))
        return self.send(target, "walk", t, payload, {WALK_AGE: self.age})

    def _round_view(self, t: int, changes: set[int], lr: float) -> tuple[Round, list[Send]]:
        """This peer's view of round ``t`` (mixing weights, whether it resyncs, ``lr`` the
        learning rate of its last local step), and the resync requests due when the topology
        changed (at the rounds ``changes``) and we learnt it too late."""
        weights, self_weight = self.mixing(t)
        resync, sends = False, []
        if self.averager.uses_public_copies:
            ids = tuple(self.membership.active(t))
            if self._last_ids not in (None, ids) and t not in changes:
                sends = self._request_resync()
            self._last_ids = ids
            resync = t == self.first_round or t in changes or t in self._resync_at
        rnd = Round(
            t,
            weights,
            self_weight,
            resync,
            lr=lr,
            reshaped=t in changes,
            period=self.trigger.period,
        )
        return rnd, sends

    def reports(self) -> tuple[list[WireError], list[str]]:
        """What the engine must count (messages dropped on purpose) and log since it last
        asked."""
        reports = (self.dropped, self.notes)
        self.dropped, self.notes = [], []
        return reports

    def metrics(self) -> dict[str, Any]:
        """The protocol's part of a metrics line (the run directory's keys)."""
        counters = self.counters
        return {
            "round": self.round,
            "model_messages_sent": counters.model_messages_sent,
            "syncs": counters.syncs,
            "neighbour_misses": counters.neighbour_misses,
            "resyncs": counters.resyncs,
            "idle_s": round(counters.idle_s, 4),
            "members": len(self.membership.in_swarm()),
            "declared_dead": counters.declared_dead,
            **({"evicted": counters.evicted} if self.settings.evict_after else {}),
            **self.averager.metrics(),
        }

    def neighbours(self, round: int | None = None) -> list[int]:
        """Ids of the neighbours in ``round`` (default: the next round)."""
        return sorted(self.mixing(self.round if round is None else round)[0])

    def model_sources(self, since: int) -> list[int]:
        """Whom a peer joining at round ``since`` asks for a model, in order: its neighbours
        of that round, then any other member still in (a neighbour may die as we join); the
        members in before that round first (one let in with us has only the model it
        started the process with until its own join is done)."""
        first = [j for j in self.neighbours(since) if j != self.id]
        rest = [j for j in self.membership.in_swarm() if j != self.id and j not in first]

        def newcomer(j: int) -> bool:
            member = self.membership.get(j)
            return member is None or member.since >= since

        live = [j for j in first + rest if not self.membership.gone(j)]
        return sorted(live, key=newcomer)  # stable: neighbours first within each group

    def mixing(self, round: int) -> tuple[dict[int, float], float]:
        """Neighbour id -> weight, and the self weight, in ``round``."""
        return self.topologies.mixing(self.membership.active(round), self.id, round)

    def _awaited(self, j: int, round: int) -> bool:
        """Whether member ``j``'s message for ``round`` may still come: it is not gone, and
        its current life takes part in that round. A later life, let in from a round after
        it, replaced one that died (a restart) or was dropped (a rejoin: the process ran no
        round while it asked, and took up the later round): nothing comes for the rounds
        between, and waiting a round timeout in each of them slowed the swarm."""
        member = self.membership.get(j)
        return not self.membership.gone(j) and (member is None or member.since <= round)

    def live(self, ids: Any) -> list[int]:
        """The ids nobody should wait for removed: they left or were declared dead."""
        return [j for j in ids if not self.membership.gone(j)]

    def _dense_destinations(self, rnd: Round, changes: set[int]) -> set[int]:
        """Neighbours that get the dense public copy this round instead of the update."""
        if not self.averager.uses_public_copies:
            return set()
        due = [r for r in self._dense_for if r <= rnd.index]
        asked = set().union(*(self._dense_for.pop(r) for r in due))
        if rnd.index == self.first_round or rnd.index in changes:
            return set(rnd.weights)
        if rnd.resync and self.averager.resyncs_together:
            return set(rnd.weights)
        return asked & set(rnd.weights)

    def _pending_alarms(self, x: torch.Tensor, t: int) -> list[int]:
        """The sync rounds at or after ``t`` this peer knows of, after raising one for
        ``t + spread`` if the local condition fails and no sync comes sooner."""
        ids = self.membership.active(t)
        horizon = t + (self.topologies.over(ids).spread_rounds(t) if len(ids) > 1 else 0)
        covered = any(t <= a <= horizon for a in self._alarms)
        violated = not covered and self.trigger.violated(x, self.reference)
        pending = _earliest(
            {a for a in self._alarms if a >= t} | ({horizon} if violated else set())
        )
        self._alarms = set(pending)
        return pending

    def _request_resync(self) -> list[Send]:
        """Ask every neighbour for its dense public copy ``RESYNC_LEAD`` rounds from now."""
        target = self.round + RESYNC_LEAD
        self._gap = False
        self.averager.needs_resync = False
        self._resync_at = {r for r in self._resync_at if r >= self.round} | {target}
        self.counters.resyncs += 1
        self.notes.append(f"resync with its neighbours at round {target}")
        sends: list[Send] = []
        for j in self.mixing(target)[0]:
            sends += self.send(j, "resync_request", None, None, {"round": target})
        return sends

    # ----------------------------------------------------------------- time
    def tick(self, now: float, online: bool = True, sentence: bool = True) -> Tick:
        """Heartbeats due, members forgotten and death sentences at ``now`` (the engine calls
        it every half heartbeat). ``sentence``: silence may be punished (the swarm formed)."""
        self._now = now
        if not online:
            self.detector.away(now)
        me = self.membership.get(self.id)
        life = me.since if me is not None else 0  # which of our lives the heartbeat speaks for
        verdicts = self.detector.check(
            now,
            self.id,
            self.membership.members(),
            self.round,
            sentence=sentence,
            left=lambda j: self.membership.why_left(j) is not None,
        )
        tick = Tick()
        for j, silent in verdicts.forget:
            member = self.membership.forget(j)
            if member is not None:
                self.detector.forget(j)
                self._told.pop(j, None)
                self._numbers.forget(j)
                self._seq.pop(j, None)
                self._inbox.forget(j)
                self._answers.forget(j)
                tick.forgotten.append((member, silent))
        for j in verdicts.heartbeats:
            meta = {"sent": self.sent_round, "life": life, TABLE: self.membership.digest()}
            tick.sends.append(Send(j, "alive", encode("alive", self.id, 0, self.round, meta=meta)))
        for j, silent in verdicts.dead:
            until = self._end_soon(j)
            if until is not None:
                self.counters.declared_dead += 1
                tick.dead.append((j, silent, until))
                tick.sends += self.announce()
        for j, silent in verdicts.overdue:  # an end far ahead does not hold its place for good
            until = self._end_soon(j)
            if until is not None:
                self.notes.append(
                    f"peer {j}, silent {silent:.1f} s, ends before its announced round: out of "
                    f"the topology from round {until}"
                )
                tick.sends += self.announce()
        return tick

    def _end_soon(self, j: int) -> int | None:
        """End member ``j`` a join margin from now (the notice a change gets); the round it is
        out from, or None if it was out by then already."""
        until = self.round + self.join_margin()
        return until if self.membership.end(j, until) is not None else None

    def leave(self, reason: str = "") -> list[Send]:
        """This peer stops: every member still in drops it from the same round (ours plus
        the notice a newcomer gets), knowing why."""
        meta: dict[str, Any] = {"until": self.round + self.join_margin()}
        if reason:
            meta["reason"] = reason[:500]
        return [
            m
            for member in self.membership.members()
            if member.id != self.id and not self.membership.gone(member.id)
            for m in self.send(member.id, "leave", self.round, None, meta)
        ]

    def announce(self) -> list[Send]:
        """The member table, to every member still in the swarm."""
        sends: list[Send] = []
        for j in self.membership.in_swarm():
            if j != self.id:
                sends += self.send(j, "members", None, None, {"members": self.membership.wire()})
        return sends

    def join_margin(self) -> int:
        """Rounds of notice a change gets: ``join_margin_rounds``, or 0.5 s of rounds if more
        (the announcement must reach every member before they get there)."""
        times = list(self._round_times)
        if len(times) < 2 or times[-1] <= times[0]:
            return self.settings.join_margin_rounds
        rate = (len(times) - 1) / (times[-1] - times[0])
        return max(self.settings.join_margin_rounds, math.ceil(0.5 * rate))

    # ----------------------------------------------------------------- messages
    def send(
        self, j: int, kind: str, round: int | None, payload: Payload | None, meta: dict[str, Any]
    ) -> list[Send]:
        """One message to member ``j`` (none if it is not one); model messages may be dropped
        on purpose (``loss``), counted like the real engine's ``injected_loss``."""
        if self.membership.get(j) is None:
            return []
        # from where our count stands, not 1: numbers to a member forgotten and back in
        # (its entry dropped with the others) still rise, so none reads as a duplicate
        self._seq[j] = self._seq.get(j, self._numbered) + 1
        self._numbered += 1
        if kind in MODEL_KINDS:
            self.counters.model_messages_sent += 1
        self.detector.sent(j, self._now)
        if kind in LOSSY_KINDS and self.loss and self._loss_rng.random() < self.loss:
            self.dropped.append(WireError("injected_loss", f"{kind} to {j} dropped on purpose"))
            return []
        codec = self.codec if kind in COMPRESSED_KINDS else "none"
        arrays = payload.arrays if payload is not None else ()
        meta = {**(payload.meta if payload is not None else {}), **meta}
        if kind in TABLE_KINDS:
            meta[TABLE] = self.membership.digest()
        frames = encode(
            kind, self.id, self._seq[j], self.round if round is None else round, arrays, meta, codec
        )
        return [Send(j, kind, frames)]

    def receive(
        self, now: float, frames: Sequence[Any], started: bool = True, aligning: bool = False
    ) -> list[Send]:
        """The simulator's way in: a message's frames arrived; decode, check and take it in,
        and return what it answers. ``started``: this peer is in a formed swarm (it lets
        others in and tells the dropped); ``aligning``: let in, it waits for a member's
        model (a table that says it was dropped sends it back to join). A message the
        protocol refuses raises :class:`WireError` (the engine counts it)."""
        msg = decode(frames, self.settings.max_message_bytes)
        self._now = now
        if msg.kind == "join":
            if self.id < 0 or not started:
                raise WireError("not_member_yet", "a join before this peer is in a swarm")
            if self.refuses_join(now, msg):  # the asker retries
                raise WireError("not_member_yet", "a join while this peer rejoins the swarm")
            return self.answer_join(now, msg, started).sends
        if msg.kind in ("welcome", "model"):
            if self._asked.take(msg):  # a repeat (a retry's, or duplicated) is ignored
                self._asked.close([msg.meta[NONCE]])  # taken: the engine holds it now
                self.answers.append(msg)
            return []
        sender = self.membership.get(msg.sender)
        if sender is None:
            raise WireError("unknown_sender", f"{msg.kind} from id {msg.sender}, not a member")
        self.detector.heard(msg.sender, now)
        sends: list[Send] = []
        if msg.kind in ("members", "dropped", "ready"):
            members = parse_members(msg.meta.get("members"), self.membership.limit)
            self.hear_table(msg.sender, members, started or aligning)
        elif msg.kind == "model_request":
            sends = self.answer_model_request(msg, started)
        else:
            self.check_seq(msg, sender)
            sends = self.take(now, msg, sender)
        if started:  # a peer done or not in yet speaks for no table
            sends += self.tell_table(msg)
        self.track_seq(msg)
        return sends

    def take(self, now: float, msg: Message, sender: Member) -> list[Send]:
        """Take in a round-protocol message (a kind in ``CORE_KINDS``) from member ``sender``,
        checked by the engine, and return what it makes us send (an eviction's new table);
        :class:`WireError` if it cannot be used."""
        self._now = now
        if msg.kind in ("params", "public"):
            dense = msg.kind == "public"
            self._hear_alarms(msg)
            self._inbox.put(msg.sender, msg.round, (self.decode(msg, dense, self._inbox), dense))
        elif msg.kind in ("quiet", "reply") and not self.trigger.dynamic:
            raise WireError("unexpected", f"a {msg.kind!r} message, but the trigger is not dynamic")
        elif msg.kind == "walk" and not self.averager.asynchronous:
            raise WireError("unexpected", "a walking model, but this swarm does not gossip-learn")
        elif msg.kind == "resync_request" and not self.averager.uses_public_copies:
            # nothing would ever answer it, nor let it go: it was kept for the whole run
            raise WireError("unexpected", "a resync request, but this swarm keeps no public copies")
        elif msg.kind == "quiet":
            self._hear_alarms(msg)
            self._inbox.put(msg.sender, msg.round, (None, False))
        elif msg.kind == "reply":
            self._hear_alarms(msg)
            self._answers.put(
                msg.sender, msg.round, (self.decode(msg, False, self._answers), False)
            )
        elif msg.kind == "walk":
            age = meta_int(msg.meta, WALK_AGE, "walk age")
            if len(self._walks) >= MAX_WALKS:
                raise WireError("too_many_pending", f"{MAX_WALKS} walking models already queued")
            self._walks.append((self.decode(msg, False), age))
        elif msg.kind == "alive":
            sent = meta_int(msg.meta, "sent", "heartbeat round", default=-1, minimum=-1)
            life = meta_int(msg.meta, "life", "heartbeat life", default=0)
            if life == sender.since and sender.until is None:
                self._inbox.sent(msg.sender, sent)
        elif msg.kind == "resync_request":
            wanted = meta_int(msg.meta, "round", "resync round", minimum=None)
            if wanted > self.round + MAX_RESYNC_AHEAD:
                raise WireError(
                    "resync_too_far",
                    f"a resync at round {wanted}, more than {MAX_RESYNC_AHEAD} rounds after ours "
                    f"({self.round})",
                )
            pending = sum(msg.sender in who for who in self._dense_for.values())
            if pending >= MAX_RESYNCS_PER_SENDER:
                raise WireError(
                    "too_many_pending", f"{pending} resyncs of this sender already pending"
                )
            at = max(wanted, self.round + 1)
            self._dense_for.setdefault(at, set()).add(msg.sender)
            if self.averager.resyncs_together:  # the whole swarm resyncs in that round
                self._resync_at = {r for r in self._resync_at if r >= self.round} | {at}
        elif msg.kind == "leave":
            reason = meta_text(msg.meta, "reason")
            until = meta_int(msg.meta, "until", "leave round")
            self.membership.mark_left(msg.sender, reason)
            self.membership.end(msg.sender, until)
            self.notes.append(
                f"peer {msg.sender} left at round {msg.round}, out of the topology from round "
                f"{until} {reason}"
            )
            self.evictions.forget(msg.sender)
        elif msg.kind == "accuse":
            return self._hear_accusation(msg.sender, meta_int(msg.meta, "suspect", "suspect"))
        else:
            raise WireError("unexpected", f"a {msg.kind!r} message, which the core does not run")
        return []

    # ----------------------------------------------------------------- eviction
    def _accuse(self) -> list[Send]:
        """Accuse, to every member, the neighbours our defence set aside in each of their
        last ``evict_after`` rounds (:mod:`~gossipdl.protocol.eviction`), and count it;
        neither in our own first ``GRACE_ROUNDS`` rounds nor in theirs, nor in their first
        as our neighbours."""
        if self.round < self.first_round + GRACE_ROUNDS:
            return []
        neighbours = self.mixing(self.round)[0]  # a suspect of an earlier life may be gone
        suspects = [
            j
            for j in self.averager.suspects(self.settings.evict_after)
            if j in neighbours and not self.membership.gone(j) and self._past_grace(j)
        ]
        sends: list[Send] = []
        for j in self.evictions.due(suspects, self.round):
            self.notes.append(
                f"accuses peer {j}: its model was set aside in each of its last "
                f"{self.settings.evict_after} rounds"
            )
            for m in self.membership.in_swarm():
                if m not in (self.id, j):
                    sends += self.send(m, "accuse", None, None, {"suspect": j})
            sends += self._hear_accusation(self.id, j)
        return sends

    def _past_grace(self, peer: int) -> bool:
        """Whether member ``peer``'s life began ``GRACE_ROUNDS`` rounds ago or more, and it
        has been our neighbour in each of those rounds: a graph rebuilt after a death or a
        cut pairs peers whose models never mixed (fault seed 2772: a peer whose two ring
        neighbours were cut off trained alone for 20 rounds, and the two it was paired with
        next evicted it three rounds later)."""
        member = self.membership.get(peer)
        if member is None or member.since + GRACE_ROUNDS > self.round:
            return False
        lately = range(self.round - GRACE_ROUNDS + 1, self.round)  # this round's: the caller's
        return all(peer in self.mixing(r)[0] for r in lately)

    def _hear_accusation(self, accuser: int, suspect: int) -> list[Send]:
        """Count ``accuser``'s accusation of ``suspect``; once that makes a quorum of its
        neighbours, refuse the suspect a rejoin and evict it (announcing the table) unless
        its end came first in a table. Refused from a member that was not the suspect's
        neighbour lately (``bad_accusation``), and in a swarm that evicts nobody."""
        if not self.settings.evict_after:
            raise WireError("unexpected", "an accusation, but this swarm evicts nobody")
        member = self.membership.get(suspect)
        if member is None or suspect == self.id or self.membership.why_left(suspect) is not None:
            return []  # not a member, us (the others decide), or it left or was evicted
        neighbours = self._neighbourhood(suspect)
        if accuser not in neighbours:
            if member.until is not None:  # it has left the topology: no quorum to count
                return []
            raise WireError(
                "bad_accusation",
                f"peer {accuser} accuses peer {suspect}, whose neighbour it was not in rounds "
                f"{self._window()}..{self.round}",
            )
        accusers = self.evictions.hear(accuser, suspect, neighbours)
        if accusers is None:
            return []
        reason = f"evicted: its model was set aside round after round by peers {accusers}"
        self.membership.mark_left(suspect, reason)
        self.evictions.ban(reason, member.address, member.key)
        self.counters.evicted += 1
        until = self._end_soon(suspect)
        if until is None:
            self.notes.append(f"peer {suspect} {reason}")
            return []  # a table ended it before the accusations made a quorum here
        self.notes.append(f"peer {suspect} {reason}; out of the topology from round {until}")
        # the suspect too, which the announcement skips (it has ended): it learns now that it
        # is out, not when its next message draws our table, which a table told just before
        # held back a heartbeat, past the end of a short run (the real-process test's flake)
        return self.announce() + self._table_for(suspect, "members")

    def _neighbourhood(self, suspect: int) -> set[int]:
        """The suspect's neighbours in any round since :meth:`_window` (one set on a static
        graph; a time-varying one changes them round by round)."""
        return {
            j
            for r in range(self._window(), self.round + 1)
            for j in self.topologies.mixing(self.membership.active(r), suspect, r)[0]
        }

    def _window(self) -> int:
        """The first round an accuser may have been the suspect's neighbour in: the last
        ``evict_after`` rounds, at most ``WINDOW_ROUNDS``."""
        return max(0, self.round - min(self.settings.evict_after, WINDOW_ROUNDS))

    def hear_table(self, sender: int, members: list[Member], let_in: bool = True) -> Verdict:
        """Take in member ``sender``'s table (:meth:`judge_table`), merging it when that is
        the verdict; returns the verdict."""
        verdict = self.judge_table(self._now, sender, members, let_in)
        if verdict is Verdict.MERGE:
            self.merge(members, self._now)
        return verdict

    def judge_table(self, now: float, sender: int, members: list[Member], let_in: bool) -> Verdict:
        """What member ``sender``'s table says to do
        (:func:`~gossipdl.protocol.joining.hear_table`); a verdict to rejoin starts one
        through the sender (``rejoin_via``) once ``let_in`` (started, or let in and waiting
        for a model) and :meth:`may_rejoin`. The caller merges on ``MERGE`` (the real peer
        learns keys and lost ids as it does)."""
        verdict = hear_table(self.membership, self.id, sender, members)
        if verdict is Verdict.REJOIN and let_in and self.may_rejoin(now):
            self.notes.append(f"peer {sender} says we were dropped; rejoining through it")
            said = {m.id: m for m in members}
            via = said.get(sender) or self.membership.get(sender)  # REJOIN: a member of ours
            assert via is not None
            rest = [m for m in members if m.until is None and m.id not in (sender, self.id)]
            self.rejoin_via, self.rejoin_since = sender, now
            self.rejoin_through = [via, *rest]  # the sender may not let us in: the others
        return verdict

    def rejoin_order(self) -> list[Member]:
        """Whom a rejoin asks, in order, at the addresses the sender's table gives: the member
        that said we were dropped, then the rest of its swarm (the sender may not let us in)."""
        assert self.rejoin_via is not None and self.rejoin_through
        return self.rejoin_through

    def end_rejoin(self) -> None:
        """The rejoin is over (welcomed, failed, or a newcomer asks to be let in anew): a
        table that says we were dropped may start another."""
        self.rejoin_via, self.rejoin_through = None, []

    def may_rejoin(self, now: float) -> bool:
        """Whether a table that says we were dropped starts a rejoin now: not while one runs,
        nor while the last failed one holds the next back (:meth:`rejoin_failed`), nor ever
        once we were evicted (:meth:`refusal`)."""
        return self.rejoin_via is None and now >= self.rejoin_held_until and not self.evicted

    def refuses_join(self, now: float, join: Message) -> bool:
        """Whether ``join`` must wait (the asker retries): while we rejoin,
        since our table is the dropped side's and a joiner let in by it would be lost when we
        take the swarm's table; and while a failed rejoin holds the next back, from a member
        of the swarm we asked. We still take that swarm for the larger side, and its members'
        joins are rejoins decided on a view of our side taken before it shrank (a leave just
        after a heal: both sides rejoined the other, fault-search seed 125255) or copies of
        them delayed past their timeout. Let in, each side gives lives to the other side's
        members, who take them up only through a rejoin of their own (``hear_table``; before
        it did so, they ignored each other's tables as written in an earlier life for good).
        Others (a third side of a cut in three, seed 17708) are let in, and while we rejoin,
        a member we yield to, ending our rejoin (:meth:`yields_to`)."""
        if self.rejoin_via is not None:
            return not self.yields_to(now, join)
        address = join.meta.get("address")
        held = now < self.rejoin_held_until
        return held and isinstance(address, str) and address in self._held_from

    def yields_to(self, now: float, join: Message) -> bool:
        """Whether we stop rejoining and let in a member we dropped that rejoins through us:
        rejoins can cycle, each asking one that rejoins itself (a cut in three healed,
        fault-search seed 139460), and only a timeout ended the wait. The one whose id is
        below its asker's and all it asks (a cycle's lowest always is) yields; the others
        come in behind it. Only once its own rejoin has waited ``YIELD_AFTER`` round timeouts
        with no welcome: at the head of a chain of rejoins, not a cycle, a welcome is on its
        way (seed 125057: yielding at once, a peer let its asker into its own cut-off table,
        and the tables split). Not for a plain join, nor one from an evicted member: it is
        refused all the same, and our rejoin would be lost for nothing."""
        address = join.meta.get("address")
        if not isinstance(address, str):
            return False
        asker = self.membership.by_address(address)
        if asker is None or asker.until is None or asker.id == self.id:
            return False
        if join.meta.get("rejoin") is not True or self.evictions.banned(address, join.key):
            return False
        if now < self.rejoin_since + YIELD_AFTER * self.settings.round_timeout:
            return False
        if self.id > min(asker.id, *(m.id for m in self.rejoin_through)):
            return False
        self.notes.append(f"peer {asker.id} rejoins through us as we rejoin: we yield, ours ends")
        self.end_rejoin()
        return True

    def rejoin_failed(self, now: float) -> None:
        """A rejoin got no welcome within its timeout: it ends, and the next is held back for
        a drawn part of ``REJOIN_BACKOFF`` round timeouts, joins from the swarm it asked
        refused meanwhile (:meth:`refuses_join`). Members that each rejoin through
        another at once (a partition in three heals) refuse one another's joins while they
        rejoin; without the draw they fail and start again in step for ever (fault-search
        seed 17708)."""
        self._held_from = frozenset(m.address for m in self.rejoin_through)
        self.end_rejoin()
        backoff = self._rejoin_rng.uniform(0.0, REJOIN_BACKOFF)
        self.rejoin_held_until = now + backoff * self.settings.round_timeout

    def merge(self, members: list[Member], now: float) -> list[Member]:
        """Merge entries into the member table; a member new or back starts over (its rounds,
        and its silence from ``now``). Returns the entries that changed. One this peer evicted
        (its address or key) is out again a join margin ahead: a member that did not count
        the quorum let it back in, and the end reaches that one with our table."""
        changed = self.membership.merge(members)
        for member in changed:
            evicted = self.evictions.banned(member.address, member.key)
            if member.until is None and evicted is not None:
                until = self._end_soon(member.id)
                self.notes.append(f"peer {member.id} back, but {evicted}: out from round {until}")
            elif member.until is None:
                self.forget_rounds(member.id)
                self.detector.heard(member.id, now)
        return changed

    # ----------------------------------------------------------------- joining
    def answer_join(
        self,
        now: float,
        msg: Message,
        started: bool,
        ring: bool = False,
        welcome: dict[str, Any] | None = None,
    ) -> JoinAnswer:
        """Let a joiner in (or back in) as :func:`~gossipdl.protocol.joining.admit` decides,
        or refuse it: the welcome (with ``welcome``'s entries too: the real peer's swarm
        config, id and clock) to its address, then the new table to every member. A refusal
        a limit made is counted (:attr:`dropped`) and says which (``REFUSED``: an evicted
        joiner asks no more). WireError for a join naming another key than the one it came
        over (CURVE), or no address."""
        self._now = now
        if msg.meta.get("key", "") != msg.key:
            raise WireError("wrong_key", "the key a join names is not the one it connected with")
        address = check_address(msg.meta.get("address"), "joiner address")
        nonce = echoed_nonce(msg.meta)
        rejoin = msg.meta.get("rejoin", False) is True
        want, incarnation = msg.meta.get("want_id"), join_incarnation(msg.meta)
        # what a join is decided on: our round, the notice a change gets, whether the swarm
        # formed, its last round
        swarm = SwarmState(self.round, self.join_margin(), started, self.final_round, ring)
        decision = self._decide_join(swarm, address, msg.key, want, rejoin, incarnation)
        if isinstance(decision, Refusal):
            meta: dict[str, Any] = {"error": decision.error, "members": self.membership.wire()}
            if decision.limit is not None:
                self.dropped.append(WireError(decision.limit, f"join from {address} refused"))
                self.notes.append(f"join from {address} refused: {decision.error}")
                meta[REFUSED] = decision.limit
            return JoinAnswer([self._reply(address, "welcome", {**meta, NONCE: nonce})])
        assert isinstance(decision, Admission)
        member = decision.member
        if not decision.again:
            self.merge([member], self._now)
            self.notes.append(
                f"{address} {'rejoined' if decision.rejoined else 'joined'} as peer {member.id} "
                f"from round {member.since}"
            )
        meta = {"id": member.id, "members": self.membership.wire(), NONCE: nonce, **(welcome or {})}
        sends = [self._reply(address, "welcome", meta)]
        if decision.again:  # its welcome was lost: the same entry, nothing new to announce
            return JoinAnswer(sends)
        return JoinAnswer(sends + self.announce(), member)  # the joiner has our table first

    def _decide_join(
        self,
        swarm: SwarmState,
        address: str,
        key: str,
        want: Any,
        rejoin: bool,
        incarnation: int,
    ) -> Admission | Refusal:
        """What :func:`~gossipdl.protocol.joining.admit` decides for a join, but a refusal
        (counted ``evicted``) for the address or key of a member evicted from this swarm."""
        evicted = self.evictions.banned(address, key)
        if evicted is not None:
            return Refusal(f"{address} was {evicted}", "evicted")
        return admit(self.membership, swarm, address, key, want, rejoin, incarnation)

    def ask(self, kind: str, address: str, meta: dict[str, Any], nonce: str) -> Send:
        """A request (``join``, ``model_request``) to ``address``; its answer, which must echo
        ``nonce`` (the engine draws it), is kept in :attr:`answers` when it arrives."""
        self._asked.ask(REPLY_TO[kind], "", nonce)
        return self._reply(address, kind, {**meta, NONCE: nonce})

    def _reply(self, address: str, kind: str, meta: dict[str, Any]) -> Send:
        """An answer to someone who is not a member yet: to its address, no sequence number."""
        return Send(-1, kind, encode(kind, self.id, 0, self.round, meta=meta), address)

    def answer_model_request(self, msg: Message, started: bool = True) -> list[Send]:
        """A member asks for our model (it joined, or is back): the published one, dense; or,
        before we are ``started`` (let in with it, not aligned yet: our model is the one this
        process began with), a refusal that sends it to the next member at once."""
        round_, model = self.published
        meta: dict[str, Any] = {NONCE: echoed_nonce(msg.meta)}
        if not started:  # no sequence number: it is no message of the round protocol
            meta[MODEL_ERROR] = "not in the swarm yet: ask another member"
            return [Send(msg.sender, "model", encode("model", self.id, 0, round_, meta=meta))]
        return self.send(msg.sender, "model", round_, dense_payload(model), meta)

    @staticmethod
    def model_refused(msg: Message) -> str | None:
        """Why a ``model`` answer holds no model (the member has none to give yet), or None."""
        error = msg.meta.get(MODEL_ERROR)
        return error if isinstance(error, str) else None

    def tell_table(self, msg: Message) -> list[Send]:
        """Our table, for the member that sent ``msg`` if it lacks it (once a heartbeat at most):
        ``dropped`` if we declared it dead and it still talks (it rejoins, or tells us to),
        ``members`` if the digest its ``msg`` carries (``TABLE``) differs from ours. The
        second is anti-entropy: each side merges what the other knows, so an announcement
        lost to a fault does not keep two members apart for good."""
        sender = self.membership.get(msg.sender)  # as it is now, after what msg changed
        if sender is None:
            return []
        if sender.until is not None and self.membership.why_left(sender.id) is None:
            kind = "dropped"
        elif type(digest := msg.meta.get(TABLE)) is int and digest != self.membership.digest():
            kind = "members"
        else:
            return []
        told = self._told.get(sender.id)
        if told is not None and self._now - told < self.settings.heartbeat:
            return []
        return self._table_for(sender.id, kind)

    def _table_for(self, j: int, kind: str) -> list[Send]:
        """Our table for member ``j`` as a ``kind`` message, noted as told (:meth:`tell_table`
        tells it again a heartbeat later at the soonest)."""
        self._told[j] = self._now
        # no sequence number, no heartbeat skipped for it: a table is idempotent; its digest
        # lets the receiver answer with its own if they differ (a member whose welcome was
        # lost hears only "dropped" from us otherwise, and tells nobody its table: seed 977)
        meta = {"members": self.membership.wire(), TABLE: self.membership.digest()}
        frames = encode(kind, self.id, 0, self.round, meta=meta)
        return [Send(j, kind, frames)]

    def refusal(self, welcome: Message) -> JoinRefused | None:
        """The refusal a (checked) welcome carries; None if it let us in. One that says we
        were evicted ends our rejoins for good (:attr:`evicted`): the members refuse our
        address and key, and asking again only fills the logs."""
        if "error" not in welcome.meta:
            return None
        refused = JoinRefused(meta_text(welcome.meta, "error"))
        if welcome.meta.get(REFUSED) == "evicted" and self.evicted is None:
            self.evicted = str(refused)
            self.notes.append(f"refused back for good ({refused}): training on alone")
        return refused

    def welcomed(self, now: float, welcome: Message) -> Member:
        """A member let us in (or back in): its welcome's id and table become ours (we answer
        joins again), every member's silence starts now, and rounds from our first one on
        are kept. Returns our entry; WireError if the welcome is malformed or names no entry
        for us, :class:`JoinRefused` if it refused us."""
        self._now = now
        members = check_welcome(welcome, self.membership.limit)
        refused = self.refusal(welcome)
        if refused is not None:
            raise refused
        peer_id = meta_int(welcome.meta, "id", "welcome id")
        me = next((m for m in members if m.id == peer_id), None)
        if me is None or me.until is not None:
            raise WireError("bad_meta", f"a welcome as peer {peer_id}, not in its own table")
        self.id = peer_id
        self._numbers = Sequences()  # members number what they send this id and life anew
        self.end_rejoin()  # our table is the swarm's again
        self.membership.replace_all(members)
        for m in members:  # silent while apart
            self.detector.heard(m.id, now)
        self.move_to(me.since)
        self.sent_round = -1  # our heartbeats vouch for no round of this life yet
        return me

    def _hear_alarms(self, msg: Message) -> None:
        """Add the sync rounds a neighbour's message announces (dynamic trigger), bounded."""
        alarms = msg.meta.get(SYNC_AT, [])
        if (
            not isinstance(alarms, list)
            or len(alarms) > MAX_ALARMS
            or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in alarms)
        ):
            raise WireError("bad_meta", f"sync alarms {alarms!r} are not a short list of rounds")
        if self.trigger.dynamic:
            self._alarms = set(_earliest(self._alarms.union(a for a in alarms if a >= self.round)))

    def decode_model(self, msg: Message) -> torch.Tensor:
        """A ``model`` answer as a tensor: the neighbour's published model, dense, whatever
        its averager's own dense copies carry (BEER's hold its tracker too, PowerGossip
        sends none); WireError if unusable."""
        if msg.codec != "none":
            raise WireError("bad_codec", f"codec {msg.codec!r}: a model is sent uncompressed")
        try:
            return _MODEL.decode(self._payload(msg), self.numel, self.device)
        except CodecError as exc:
            raise WireError("bad_payload", str(exc)) from None

    def _payload(self, msg: Message) -> Payload:
        """A message's arrays and its codec's meta (the peer's own keys left out)."""
        return Payload(tuple(msg.arrays), {k: v for k, v in msg.meta.items() if k not in PEER_META})

    def decode(self, msg: Message, dense: bool, box: Mailbox | None = None) -> torch.Tensor:
        """A received model payload as a tensor; WireError if unusable. With ``box``, only
        once it would keep the message (checked before the payload is decoded to full size)."""
        expected = "none" if dense else self.codec
        if msg.codec != expected:
            raise WireError("bad_codec", f"codec {msg.codec!r}, this swarm uses {expected!r}")
        if box is not None:
            box.admit(msg.sender, msg.round)
        try:
            payload = self._payload(msg)
            if box is not None and self.decodes is not None:  # what a mailbox keeps is only read
                return self.decodes.decode(self.averager, payload, dense, self.numel, self.device)
            return self.averager.decode(payload, dense, self.numel, self.device)
        except CodecError as exc:
            raise WireError("bad_payload", str(exc)) from None

    def check_seq(self, msg: Message, sender: Member) -> None:
        """WireError ``duplicate`` for a round-protocol message from member ``sender`` that
        repeats one taken already (the network may deliver one twice): a CHOCO update
        added twice leaves s_i wrong until the next resync."""
        self._numbers.check(msg.sender, sender.since, msg.seq)

    def track_seq(self, msg: Message) -> None:
        """Note an accepted message's sequence number; a gap means one was lost (resync)."""
        member = self.membership.get(msg.sender)
        life = member.since if member is not None else -1
        lost = self._numbers.took(msg.sender, life, msg.seq)
        if lost:
            self._gap = True
            self.notes.append(f"{lost} message(s) from peer {msg.sender} were lost")
