"""Who is in the swarm: one entry per peer id, each a span of rounds it takes part in.

A member takes part from round ``since`` up to, not including, round
``until`` (``None``: still in). A join sets ``since`` a few rounds ahead; a
graceful leave or a death sets ``until`` a few rounds ahead, so every peer
switches to the topology over the remaining members at the same round.

Entries are merged so that peers hearing announcements in any order agree: a
later life of a peer (larger ``since``, after it rejoined) replaces an earlier
one, and within one life the earliest announced ``until`` wins. The entry keeps
the rounds of the life it replaced (``before``) and carries them on the wire,
so that every member, a newcomer too, computes those rounds' topologies alike;
spans of it merge by the same two rules. Two newcomers
let in at the same moment by different members can get the same id and
``since``; then the entry with the smaller address keeps the id everywhere,
and the other newcomer joins again (see ``Peer``).

A table holds at most ``limit`` entries (``MAX_MEMBERS``): a message that
would grow it further is refused whole (reason ``too_many_members``), so a
sender cannot make a peer track, dial and heartbeat without bound. An entry
that ended long ago can be forgotten; its id keeps a tombstone so that a
stale table cannot bring that life back.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from gossipdl.transport.address_syntax import check_address
from gossipdl.transport.key_syntax import is_curve_key
from gossipdl.transport.wire import WireError

MAX_MEMBERS = 512  # entries in a member table, live or ended; drop reason ``too_many_members``
MAX_ID = 2**31 - 1  # the largest peer id (ids name files in the run directory)
MAX_INCARNATION = 2**62  # the largest incarnation (a random draw per process)


@dataclass(frozen=True)
class Member:
    """One peer: its id, the address of its ROUTER socket, and the rounds it takes part in."""

    id: int
    address: str
    since: int = 0
    until: int | None = None
    key: str = ""  # its CURVE public key (Z85), "" in a swarm without CURVE
    # which process on that address asked for this life (drawn at its start; 0: not known):
    # a join from another one is a restarted peer, not the same join sent again
    incarnation: int = 0
    # the rounds [since, until) of the life this one replaced, in which that life still
    # takes part (None: no earlier life; an empty span: one that ended before it began)
    before: tuple[int, int] | None = None

    def takes_part(self, round: int) -> bool:
        """Whether the member, in this life or the one it replaced, is in the topology of
        ``round``."""
        if self.before is not None and self.before[0] <= round < self.before[1]:
            return True
        return self.since <= round and (self.until is None or round < self.until)

    def begun(self, round: int) -> bool:
        """Whether the member took part in some round up to ``round`` (this life or the one
        it replaced): from then on its silence means it died."""
        return self.since <= round or (self.before is not None and self.before[0] <= round)

    def newer_than(self, other: Member) -> bool:
        """Whether this entry should replace ``other`` (same id) when the two are merged."""
        if self.since != other.since:
            return self.since > other.since
        if self.address != other.address:  # two newcomers given one id at once
            return self.address < other.address
        return self.until is not None and (other.until is None or self.until < other.until)


def _round(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _span(value: Any) -> bool:
    """A wire entry's ``before``: None, or ``[since, until]`` with since <= until."""
    return value is None or (
        isinstance(value, list) and len(value) == 2 and all(map(_round, value))
        and value[0] <= value[1]
    )  # fmt: skip


def later_span(a: tuple[int, int] | None, b: tuple[int, int] | None) -> tuple[int, int] | None:
    """Two peers' spans of the life an entry replaced, merged as entries are: the later life
    (larger start) wins, and of one life the earliest end (None: a peer that knows of no
    earlier life adds nothing). One answer in any order."""
    if a is None or b is None:
        return a if b is None else b
    if a[0] != b[0]:
        return a if a[0] > b[0] else b
    return a[0], min(a[1], b[1])


def _until(old: Member, since: int) -> tuple[int, int]:
    """The rounds of life ``old`` that a later life from round ``since`` leaves it: it ended
    by the time the new one starts."""
    until = since if old.until is None else min(old.until, since)
    return old.since, max(old.since, until)


def combined(known: Member | None, new: Member) -> Member:
    """The entry a table keeps for ``known`` (None: none yet) merged with an announced ``new``
    one of the same id: a later life replaces an earlier one and keeps its rounds
    (``before``, :func:`later_span`), news of an earlier life goes to ``before`` the same
    way, and within one life :meth:`Member.newer_than` picks."""
    if known is None:
        return new
    if new.since > known.since:
        return replace(new, before=later_span(new.before, _until(known, new.since)))
    if new.since < known.since:
        return replace(known, before=later_span(known.before, _until(new, known.since)))
    keep = new if new.newer_than(known) else known
    return replace(keep, before=later_span(known.before, new.before))


def parse_members(value: Any, limit: int = MAX_MEMBERS) -> list[Member]:
    """Validate a member list received on the wire (``[[id, address, since, until, key,
    incarnation, before], ...]``; ``until`` may be left out or ``None``, ``key`` left out or
    ``""``, ``incarnation`` left out or 0, ``before`` left out or ``None``): at most
    ``limit`` entries, ids up to ``MAX_ID``, addresses a peer may dial (IPs: ``bad_address``
    otherwise)."""
    if not isinstance(value, list):
        raise WireError("bad_meta", f"member list is {type(value).__name__}, expected a list")
    if len(value) > limit:
        raise WireError(
            "too_many_members", f"a member list of {len(value)} entries; the limit is {limit}"
        )
    members = []
    for entry in value:
        if not (
            isinstance(entry, list)
            and 3 <= len(entry) <= 7
            and _round(entry[0])
            and entry[0] <= MAX_ID
            and _round(entry[2])
            and (len(entry) == 3 or entry[3] is None or (_round(entry[3]) and entry[3] > entry[2]))
            and (len(entry) < 5 or entry[4] == "" or is_curve_key(entry[4]))
            and (len(entry) < 6 or (_round(entry[5]) and entry[5] <= MAX_INCARNATION))
            and (len(entry) < 7 or _span(entry[6]))
        ):
            raise WireError(
                "bad_meta", f"member entry {entry!r} is not [id, tcp://address, since, until]"
            )
        check_address(entry[1], f"member {entry[0]}'s address")
        member = Member(*entry[:6])
        if len(entry) == 7 and entry[6] is not None:
            member = replace(member, before=(entry[6][0], entry[6][1]))
        members.append(member)
    return members


def _wire(members: list[Member]) -> list[list[Any]]:
    """Entries as the wire carries them: ``[id, address, since, until, key, incarnation,
    before]`` (``before``: ``[since, until]`` or None)."""
    return [
        [m.id, m.address, m.since, m.until, m.key, m.incarnation, m.before and list(m.before)]
        for m in members
    ]


class MemberTable:
    """The member table, at most ``limit`` entries. ``guard`` is held around every call: the
    real engine passes a lock (three threads share the table), the simulator nothing."""

    def __init__(
        self,
        members: list[Member] | None = None,
        limit: int = MAX_MEMBERS,
        guard: AbstractContextManager[Any] | None = None,
    ) -> None:
        self._lock = guard if guard is not None else nullcontext()
        self.limit = limit
        self._members: dict[int, Member] = {}
        self._left: dict[int, str] = {}  # id -> why it stopped, as it announced
        self._forgotten: OrderedDict[int, int] = OrderedDict()  # id -> until of its last life
        self._digest: int | None = None  # of the entries, until they change
        if members:
            self.merge(members)

    def merge(self, members: list[Member]) -> list[Member]:
        """Take in announced entries; returns those that added or changed something.
        ``too_many_members`` (nothing taken) if the table would outgrow its limit."""
        changed = []
        with self._lock:
            fresh = [m for m in members if not self._stale(m)]
            new = {m.id for m in fresh} - self._members.keys()
            if len(self._members) + len(new) > self.limit:
                raise WireError(
                    "too_many_members",
                    f"{len(new)} new member(s) would outgrow the table's limit of {self.limit}",
                )
            for member in fresh:
                known = self._members.get(member.id)
                entry = combined(known, member)
                if entry != known:
                    if known is not None and entry.since > known.since:
                        self._left.pop(member.id, None)  # a new life: it is back
                    self._forgotten.pop(member.id, None)
                    self._members[member.id] = entry
                    changed.append(entry)
            if changed:
                self._digest = None
        return changed

    def _stale(self, member: Member) -> bool:
        """Whether ``member`` is a life that ended before we forgot it (lock held)."""
        return member.since < self._forgotten.get(member.id, -1)

    def replace_all(self, members: list[Member]) -> None:
        """Adopt another peer's table (rejoining after this peer was dropped): its word on
        every life it lists is final; of ours it keeps only lives it has not heard of (a
        peer let in on our side of a cut), which would otherwise be lost to both sides."""
        with self._lock:
            ours = self._members
            self._members = {m.id: m for m in members[: self.limit]}
            for m in ours.values():
                known = self._members.get(m.id)
                if (known is None or m.since > known.since) and len(self._members) < self.limit:
                    self._members[m.id] = combined(known, m)
                elif known is not None and known.since > m.since:
                    self._members[m.id] = combined(m, known)
            self._digest = None
            self._left = {i: why for i, why in self._left.items() if i in self._members}
            for i in self._members:
                self._forgotten.pop(i, None)

    def forget(self, peer_id: int) -> Member | None:
        """Remove an ended entry (no heartbeats, no socket for it any more) and keep a
        tombstone, so a stale table cannot bring that life back; returns the entry."""
        with self._lock:
            member = self._members.get(peer_id)
            if member is None or member.until is None:
                return None
            del self._members[peer_id]
            self._digest = None
            self._left.pop(peer_id, None)
            self._forgotten[peer_id] = member.until
            while len(self._forgotten) > self.limit:
                self._forgotten.popitem(last=False)
            return member

    def end(self, peer_id: int, until: int) -> Member | None:
        """Take ``peer_id`` out of the topology from round ``until`` (the life it replaced
        too); returns the changed entry, or None if it was already out by then."""
        with self._lock:
            known = self._members.get(peer_id)
            if known is None:
                return None
            ended = replace(known, until=max(until, known.since + 1))
            if not ended.newer_than(known):
                ended = known
            if known.before is not None:
                start, end = known.before
                ended = replace(ended, before=(start, max(start, min(end, until))))
            if ended == known:
                return None
            self._members[peer_id] = ended
            self._digest = None
            return ended

    def get(self, peer_id: int) -> Member | None:
        """The member with this id, or None."""
        with self._lock:
            return self._members.get(peer_id)

    def by_address(self, address: str) -> Member | None:
        """The member listening on ``address``, or None."""
        with self._lock:
            return next((m for m in self._members.values() if m.address == address), None)

    def active(self, round: int) -> list[int]:
        """Sorted ids of the members in the topology of ``round`` (one that left without
        ending yet included: ``gone`` tells)."""
        with self._lock:
            return sorted(i for i, m in self._members.items() if m.takes_part(round))

    def spans(self) -> list[tuple[int, int | None]]:
        """The rounds ``[since, until)`` of every life the table knows (``until`` None: still
        in), a life a later one replaced included: where the topology changes."""
        with self._lock:
            lives = list(self._members.values())
            return [(m.since, m.until) for m in lives] + [
                m.before for m in lives if m.before is not None and m.before[0] < m.before[1]
            ]

    def mark_left(self, peer_id: int, reason: str = "") -> None:
        """Record that a peer stopped training (and why, if it said); nobody waits for it."""
        with self._lock:
            self._left[peer_id] = reason

    def gone(self, peer_id: int) -> bool:
        """Whether nobody should wait for the peer: it left, or it was declared dead."""
        with self._lock:
            member = self._members.get(peer_id)
            return peer_id in self._left or (member is not None and member.until is not None)

    def why_left(self, peer_id: int) -> str | None:
        """The reason a peer gave when it stopped ("" if none), or None if it has not left."""
        with self._lock:
            return self._left.get(peer_id)

    def next_id(self) -> int:
        """The smallest id above every known one."""
        with self._lock:
            return max(self._members, default=-1) + 1

    def members(self) -> list[Member]:
        """All members sorted by id."""
        with self._lock:
            return sorted(self._members.values(), key=lambda m: m.id)

    def in_swarm(self) -> list[int]:
        """Sorted ids of the members not ended (dead or left for good)."""
        with self._lock:
            return sorted(i for i, m in self._members.items() if m.until is None)

    def wire(self) -> list[list[Any]]:
        """The member list as sent on the wire."""
        return _wire(self.members())

    def digest(self) -> int:
        """A checksum of the entries (32 bits): members whose digests differ hold different
        tables, and trade them until they agree (``GossipCore.tell_table``)."""
        with self._lock:
            if self._digest is None:
                entries = sorted(self._members.values(), key=lambda m: m.id)
                self._digest = zlib.crc32(repr(_wire(entries)).encode())
            return self._digest
