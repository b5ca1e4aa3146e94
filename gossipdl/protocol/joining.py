"""Joining a swarm, as decisions: who is let in and as what, what a welcome must say, and
what a member table that says we were dropped makes us do. Pure functions over the member
table; both engines carry them out (the real one with requests over sockets and the wall
clock, the simulator over its network and virtual clock).

A joiner asks a member (``join``: its address, the id it wants, whether it is a
``rejoin`` of a peer that trained before, and its ``incarnation``, a number each
process draws at its start, which tells a join sent again from a restarted
process's first join); the member answers with a ``welcome``
(an id and its table, or an error), lets it in from a few rounds ahead and announces
the new table. The joiner then asks a neighbour for its model (``model_request``)
to align its round with the swarm's, and takes that model if it is new.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from gossipdl.protocol.membership import (
    MAX_ID,
    MAX_INCARNATION,
    Member,
    MemberTable,
    parse_members,
)
from gossipdl.transport.wire import Message, WireError, meta_int

SWARM_ID = re.compile(r"[0-9a-f]{1,32}")  # a swarm id in a welcome
RETRY_S = 1.0  # a request unanswered this long is sent again
# A member asked for its model this long without an answer (nor a refusal, nor a death
# sentence) makes a welcomed peer ask the next; it gives up after this long per neighbour.
MODEL_WAIT_S = 10.0
# A rejoin asks this many times within its timeout (a round timeout): the member asked may
# be rejoining itself a moment longer (it refuses joins until it is in), or its welcome lost.
REJOIN_TRIES = 4


def rejoin_retry(timeout: float, members: int) -> float:
    """Seconds between a rejoin's requests, each to the next of ``members`` in turn, so that
    each is asked ``REJOIN_TRIES`` times within ``timeout``.

    Example:
        >>> rejoin_retry(1.0, 1), rejoin_retry(1.0, 2)
        (0.25, 0.125)
    """
    return timeout / (REJOIN_TRIES * max(1, members))


def late_steps(
    steps: int, took_model: bool, back: bool, start: int, aligned: int | None, period: int
) -> tuple[int, int]:
    """The step count a peer let into a running swarm at round ``start`` goes on from, and
    the step it trains alone to (no rounds: its first round is a join margin ahead, and the
    swarm trains to it meanwhile); -1: none. ``aligned``: the round of the member that
    answered with its model (None: nobody did). A peer that ``took_model`` (a newcomer)
    goes on from that model's round; one ``back`` after it was dropped from the later of
    its own count and that round (the swarm's steps while it was away are not owed; with
    nobody answering, ``start``'s). Taking up ``start``'s count after an answer would count
    a margin of steps nobody trained, and hand them on to whoever aligns with this peer
    next (fault seed 19931). A peer resumed from a checkpoint keeps its count.

    Example:
        >>> late_steps(0, True, False, start=23, aligned=3, period=3)
        (9, 69)
        >>> late_steps(30, False, True, start=23, aligned=3, period=3)
        (30, 69)
        >>> late_steps(45, False, False, start=23, aligned=3, period=3)
        (45, -1)
    """
    if took_model:
        assert aligned is not None, "a model comes with the round of the member that sent it"
        return aligned * period, start * period
    if back:
        return max(steps, (start if aligned is None else aligned) * period), start * period
    return steps, -1


def outranks(side: set[int], other: set[int]) -> bool:
    """Whether, after a partition, the members ``side`` are the swarm and ``other`` the part
    that rejoins it: the larger side wins; a tie goes to the side with the smallest id the
    other lacks (sides may share members: one that neither side has heard from since the
    cut is in both tables).

    Example:
        >>> outranks({0, 1, 2}, {3, 4}), outranks({3, 4}, {0, 1}), outranks({0, 1}, {0, 2})
        (True, False, True)
    """
    if not side:
        return False
    if not other:
        return True
    return (len(side), sorted(other)) > (len(other), sorted(side))


@dataclass(frozen=True)
class Refusal:
    """A join that cannot be let in: the error its welcome says, and the drop reason it is
    counted under when a limit refused it (None: a refusal, not a limit)."""

    error: str
    limit: str | None = None


@dataclass(frozen=True)
class Admission:
    """A join let in: the joiner's entry, whether it is the same answer as before (the join
    was sent again before our welcome arrived) and whether it is a new life of a known id."""

    member: Member
    again: bool
    rejoined: bool


@dataclass(frozen=True)
class SwarmState:
    """What a member that answers a join knows of its own progress."""

    round: int
    margin: int  # rounds of notice a change gets (GossipCore.join_margin)
    started: bool  # the swarm formed: a newcomer starts a few rounds ahead
    final_round: int | None  # the swarm's last round, if it is known
    ring: bool  # a ring all-reduce cannot take members once it started


def join_incarnation(meta: dict[str, Any]) -> int:
    """The incarnation a join names (0 if it names none); WireError if it is malformed."""
    value = meta_int(meta, "incarnation", "join incarnation", default=0)
    if value > MAX_INCARNATION:
        raise WireError("bad_meta", f"join incarnation {value} is above {MAX_INCARNATION}")
    return value


def admit(
    table: MemberTable,
    swarm: SwarmState,
    address: str,
    key: str,
    want: Any,
    rejoin: bool,
    incarnation: int = 0,
) -> Admission | Refusal:
    """Whether a join from ``address`` (over CURVE ``key``; "" without) asking for id
    ``want`` (None: any) is let in, and as which entry; nothing is changed (the caller
    merges the entry and announces it)."""
    member = table.by_address(address)
    # A join sent again (no welcome yet) gets the same answer, not another entry.
    again = member is not None and member.until is None
    if (
        again
        and member is not None
        and ((rejoin and member.since <= swarm.round) or member.incarnation != incarnation)
    ):
        # a member back from a restart on the same address; or another process there,
        # whose first life may never have begun (what it sent for it must not count)
        again = False
    if member is not None and again:
        return Admission(member, again=True, rejoined=False)
    refused = refusal(table, swarm, member, want, rejoin, key)
    if refused is not None:
        return refused
    if member is not None:
        want = member.id
    known = table.get(want) if want is not None else None
    peer_id = want if want is not None else table.next_id()
    since = swarm.round + swarm.margin if swarm.started else 0
    if known is not None:  # a new life starts after the last one
        since = max(since, known.until or 0, known.since + 1)
    entry = Member(peer_id, address, since, key=key, incarnation=incarnation)
    return Admission(entry, again=False, rejoined=bool(known))


def refusal(
    table: MemberTable,
    swarm: SwarmState,
    member: Member | None,
    want: Any,
    rejoin: bool,
    key: str = "",
) -> Refusal | None:
    """Why a join cannot be let in, or None if it can (``member``: the entry at the joiner's
    address, if any; ``key``: the joiner's CURVE key, "" without)."""
    if swarm.ring and swarm.started:
        return Refusal("a ring all-reduce cannot take members once it started; start all together")
    final = swarm.final_round
    # a peer back (rejoin) is let in even so: it ends with the others instead of alone
    if final is not None and swarm.started and not rejoin and swarm.round + swarm.margin > final:
        return Refusal(
            f"the swarm has finished training (its last round is {final}, it is at round "
            f"{swarm.round}): a newcomer would train no step; start a new swarm"
        )
    if member is not None:  # back on its own address, under its own id: if it is its key
        return other_key(member, key)
    if want is not None and not (
        isinstance(want, int) and not isinstance(want, bool) and 0 <= want <= MAX_ID
    ):
        # an integer is echoed (at most 20 characters: MAX_WIRE_INT), anything else named by
        # its type: a refusal goes to a reply address, and must not carry a sender's bytes there
        shown = str(want) if isinstance(want, int) else f"of type {type(want).__name__}"
        return Refusal(f"id {shown} is not an integer in 0..{MAX_ID}; choose another rank")
    known = table.get(want) if want is not None else None
    if known is not None and (wrong := other_key(known, key)) is not None:
        return wrong
    if known is not None and known.until is None and not rejoin:
        return Refusal(f"id {want} is taken; choose another rank or leave it out")
    size = len(table.members())
    if known is None and size >= table.limit:
        error = (
            f"the swarm's member table is full ({size} entries, max_members = "
            f"{table.limit}); start the swarm with a larger max_members"
        )
        return Refusal(error, "too_many_members")
    if want is None and table.next_id() > MAX_ID:
        return Refusal(f"no id left up to {MAX_ID}; give a free rank", "too_many_members")
    return None


def other_key(entry: Member, key: str) -> Refusal | None:
    """A refusal when the id a joiner would take (``entry``, by id or address) belongs to
    another CURVE key: over CURVE a key is who a member is, and a listed key that took
    another's id had the owner's messages refused as ``wrong_key``, its own id included."""
    if not entry.key or not key or entry.key == key:
        return None
    return Refusal(
        f"id {entry.id} (at {entry.address}) belongs to another key: join without asking "
        "for it, from an address of your own"
    )


def check_welcome(msg: Message, limit: int) -> list[Member]:
    """A welcome names our id (at most ``MAX_ID``) and its member table (returned), or says
    why we may not join (no table returned); WireError if it is malformed."""
    table = parse_members(msg.meta.get("members"), limit)
    if "error" in msg.meta:
        if not isinstance(msg.meta["error"], str):
            raise WireError("bad_meta", "a welcome's error is not text")
        return []
    if meta_int(msg.meta, "id", "welcome id") > MAX_ID:
        raise WireError("bad_meta", f"welcome id {msg.meta['id']} is above {MAX_ID}")
    if "swarm" in msg.meta:
        start = msg.meta.get("swarm_start")
        if not isinstance(msg.meta["swarm"], str) or not SWARM_ID.fullmatch(msg.meta["swarm"]):
            raise WireError("bad_meta", "a welcome's swarm id is not 1-32 hex digits")
        if not isinstance(start, int | float) or isinstance(start, bool):
            raise WireError("bad_meta", "a welcome's swarm_start is not a number")
        if not math.isfinite(start):
            raise WireError("bad_meta", "a welcome's swarm_start is not finite")
    return table


class Verdict(Enum):
    """What to do with a member table a member sent."""

    IGNORE = "ignore"
    MERGE = "merge"
    REJOIN = "rejoin"  # it says we are out, and its side is the swarm: rejoin through it


def hear_table(table: MemberTable, me: int, sender: int, members: list[Member]) -> Verdict:
    """What member ``sender``'s table ``members`` makes peer ``me`` (with ``table``) do.

    A table from a member we dropped is not merged: its view of who is alive is stale
    (the other side of a partition, or messages it sent before a cut that arrive after
    it), unless it gives the sender a later life than the one we ended (a member let it
    back in: its table is that swarm's). Nor is one the sender wrote in an earlier life
    than the one we know (sent before a cut, delivered after it rejoined): it would end
    members the sender thought dead then. A table that says we are out makes us rejoin
    through the sender if our own table has the sender alive, or if the sender's side of
    the swarm outranks ours (:func:`outranks`); otherwise we ignore it, and the sender's
    side will rejoin ours. A table that gives us a later life than ours (a member let us
    back in, and its welcome was lost) makes us rejoin through the sender too.
    """
    theirs = {m.id: m for m in members}
    said_of_us, own = theirs.get(me), table.get(me)
    known, said = table.get(sender), theirs.get(sender)
    if own is not None and said_of_us is not None and said_of_us.since > own.since:
        # a life of ours we never took up: its welcome was lost. Before the earlier-life
        # check: two sides that each gave the other's members lives ignored each other's
        # tables for good (fault-search seed 125255); a table written before a cut cannot
        # name a life of ours later than the one we hold
        return Verdict.REJOIN
    if known is not None and (said is None or said.since < known.since):
        return Verdict.IGNORE
    # out: the life we ended is the one it speaks for (one let back in since speaks for
    # the swarm that let it in)
    sender_out = (
        known is not None
        and known.until is not None
        and said is not None
        and said.since == known.since
    )
    stale_about_us = own is not None and said_of_us is not None and own.since > said_of_us.since
    if said_of_us is None or said_of_us.until is None or stale_about_us:
        return Verdict.IGNORE if sender_out else Verdict.MERGE
    if known is None:
        return Verdict.IGNORE
    their_side = {m.id for m in members if m.until is None}
    if not sender_out or outranks(their_side, set(table.in_swarm())):
        return Verdict.REJOIN
    return Verdict.IGNORE
