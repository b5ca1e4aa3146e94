"""Member tables converge: digests, tables traded when they differ, lives kept on a welcome,
and the joins and model requests that tables decide. Unit tests on the protocol core; the
fault search (tests/test_fault_search.py) shows the same in whole swarms."""

from __future__ import annotations

import pytest
import torch

from gossipdl.averaging import build_averager, parse_trigger
from gossipdl.protocol.core import YIELD_AFTER, GossipCore, Settings
from gossipdl.protocol.kinds import TABLE
from gossipdl.protocol.membership import Member, MemberTable
from gossipdl.transport.wire import WireError, decode, encode


def address(i: int) -> str:
    return f"tcp://10.0.0.{i + 1}:5555"


def core(me: int, members: list[Member], heartbeat: float = 1.0) -> GossipCore:
    return GossipCore(
        me,
        MemberTable(members),
        averager=build_averager("dense", "none", 0),
        trigger=parse_trigger("always"),
        settings=Settings(heartbeat=heartbeat),
        model=torch.zeros(4),
    )


def swarm(n: int) -> list[Member]:
    return [Member(i, address(i)) for i in range(n)]


def frames(kind: str, sender: int, **meta: object) -> list[bytes]:
    return [bytes(f) for f in encode(kind, sender, 1, 0, meta=dict(meta))]


def test_equal_tables_have_equal_digests_and_any_change_changes_it() -> None:
    a, b = MemberTable(swarm(3)), MemberTable(list(reversed(swarm(3))))
    assert a.digest() == b.digest()
    before = a.digest()
    a.end(2, 10)
    assert a.digest() != before and a.digest() != b.digest()
    b.merge(a.members())
    assert a.digest() == b.digest()  # merged: the same table again
    for change in (lambda t: t.forget(2), lambda t: t.merge([Member(5, address(5), 12)])):
        change(a)  # every change, each way it is made (forget and merge too, not only end)
        assert a.digest() != b.digest()
        change(b)
        assert a.digest() == b.digest() == MemberTable(a.members()).digest()


def test_a_member_whose_digest_differs_gets_our_table_once_a_heartbeat() -> None:
    """Anti-entropy: an announcement lost on the way leaves two tables apart; the digest on
    the next round message or heartbeat shows it, and the tables are traded."""
    ours, theirs = core(0, swarm(3)), core(1, swarm(3))
    ours.membership.end(2, 10)  # we heard of 2's death, peer 1 did not
    theirs.tick(0.0)  # it learns of its members now; heartbeats are due a heartbeat later
    to_us = next(s for s in theirs.tick(2.0).sends if s.to == 0)
    assert decode(to_us.frames, 1 << 20).meta[TABLE] == theirs.membership.digest()
    answer = ours.receive(2.0, [bytes(f) for f in to_us.frames])
    assert [s.kind for s in answer] == ["members"]
    assert ours.receive(2.5, [bytes(f) for f in to_us.frames]) == []  # not twice a heartbeat
    theirs.receive(2.6, [bytes(f) for f in answer[0].frames])
    assert theirs.membership.digest() == ours.membership.digest()
    again = next(s for s in theirs.tick(4.0).sends if s.to == 0)
    assert ours.receive(4.0, [bytes(f) for f in again.frames]) == []  # the same table now


def test_a_member_we_declared_dead_that_still_talks_is_told_whatever_it_sends() -> None:
    """Not only its heartbeats: a member answering our tables with its own (whose traffic
    then keeps its heartbeats away) must still learn it was dropped."""
    ours = core(0, swarm(3))
    ours.membership.end(2, 10)
    told = ours.receive(3.0, frames("members", 2, members=MemberTable(swarm(3)).wire()))
    assert [s.kind for s in told] == ["dropped"] and told[0].to == 2


def test_a_welcome_keeps_the_lives_its_table_has_not_heard_of() -> None:
    """A peer let in while we were cut off is known only to our side: taking the welcomer's
    table back must not lose it, or it is a member nobody else knows."""
    table = MemberTable([*swarm(3), Member(3, address(3), since=40)])
    table.replace_all([*swarm(2), Member(2, address(2), until=20), Member(3, address(3), 0, 20)])
    # a later life than the welcome's, which it keeps as the one it replaced
    assert table.get(3) == Member(3, address(3), since=40, before=(0, 20))
    assert table.get(2) == Member(2, address(2), until=20)  # the welcomer's word on 2's life


def test_a_peer_told_to_rejoin_lets_nobody_in_until_it_is_back() -> None:
    ours = core(0, swarm(3))
    ours.rejoin_via = 1
    join = frames("join", -1, address=address(7), want_id=7, key="", nonce="ab" * 8)
    with pytest.raises(WireError, match="rejoins the swarm") as refused:
        ours.receive(1.0, join)
    assert refused.value.reason == "not_member_yet"  # the joiner retries later
    welcome = frames("welcome", 1, id=0, members=[[i, address(i), 0, None] for i in range(3)])
    ours.welcomed(1.5, decode(welcome, 1 << 20))  # back in: our table is the swarm's again
    assert ours.rejoin_via is None and ours.rejoin_through == []
    assert next(s.kind for s in ours.receive(2.0, join)) == "welcome"


def test_after_a_failed_rejoin_the_swarm_it_asked_is_not_let_into_our_side() -> None:
    """Fault-search seed 125255: both sides of a healed cut rejoined the other and refused
    each other; once the rejoins failed, joins delayed past their timeout were let in on both
    sides, each side gave the other's members lives they never took up, and ignored the
    other's tables for good. While the next rejoin is held back, the swarm we asked stays
    out; anyone else (a third side of a cut in three) is let in, and after the hold all."""
    ours = core(0, [*swarm(2), *(Member(i, address(i), 0, 20) for i in (2, 3))])
    # peers 2 and 3 said we were dropped and are the swarm; nobody let us in
    ours.rejoin_via, ours.rejoin_through = 2, [Member(i, address(i)) for i in (2, 3)]
    ours.rejoin_failed(2.0)
    assert ours.rejoin_via is None and ours.rejoin_held_until > 2.0
    held = ours.rejoin_held_until

    def join(i: int) -> list[bytes]:
        return frames("join", -1, address=address(i), want_id=i, key="", nonce=f"{i:02x}" * 8,
                      rejoin=True)  # fmt: skip

    with pytest.raises(WireError, match="rejoins the swarm") as refused:
        ours.receive(held - 1e-3, join(3))
    assert refused.value.reason == "not_member_yet"  # it retries, or rejoins on a fresh view
    assert ours.membership.get(3) == Member(3, address(3), 0, 20)  # no life given
    ours.membership.merge([Member(4, address(4), 0, 20)])  # cut off alone, on a third side
    assert next(s.kind for s in ours.receive(held - 1e-3, join(4))) == "welcome"
    assert next(s.kind for s in ours.receive(held, join(3))) == "welcome"  # the hold is over


def test_a_cycle_of_rejoins_is_broken_by_its_lowest_id_alone() -> None:
    """Fault-search seed 139460: three peers cut apart three ways each dropped the other two
    and, after the heal, each rejoined through another that rejoined itself and refused it;
    all waited out a timeout. The lowest id of a cycle yields (its rejoin ends, it lets its
    asker in) once its own rejoin has waited half a round timeout, and nobody else does; of
    two sides rejoining each other, only the side with the lowest id lets the other in. At
    the head of a chain (seed 125057) a welcome is on its way: no yield before that wait;
    nor to a plain join, or one that is refused anyway (an evicted member's)."""
    waited = YIELD_AFTER * Settings().round_timeout

    def rejoining(me: int, ids: list[int], through: list[int]) -> GossipCore:
        ours = core(me, [Member(i, address(i), 0, None if i == me else 20) for i in ids])
        ours.rejoin_via, ours.rejoin_through = through[0], [Member(i, address(i)) for i in through]
        return ours

    def asks(ours: GossipCore, i: int, now: float = waited, rejoin: bool = True) -> bool:
        join = frames("join", -1, address=address(i), want_id=i, key="", nonce=f"{i:02x}" * 8,
                      rejoin=rejoin)  # fmt: skip
        try:
            return next(s.kind for s in ours.receive(now, join)) == "welcome"
        except WireError as refused:
            assert refused.reason == "not_member_yet"
            return False

    head = rejoining(0, [0, 1, 2], [2])  # its rejoin began at 0: too soon to yield
    assert not asks(head, 1, now=waited - 0.01) and head.rejoin_via == 2
    assert not asks(head, 1, rejoin=False) and head.rejoin_via == 2  # no rejoin: no cycle
    head.evictions.ban("evicted by a quorum", address(1))
    asks(head, 1)  # refused all the same: our rejoin is not given up for it
    assert head.rejoin_via == 2
    head = rejoining(0, [0, 1, 2], [2])
    assert asks(head, 1) and head.rejoin_via is None

    # the cycle of seed 139460 (0 through 2, 2 through 1, 1 through 0); in a longer one each
    # peer below both its neighbours yields, the lowest always (the parts then heal as sides)
    for cycle, yielders in (([0, 2, 1], [0]), ([3, 1, 4, 0, 2], [1, 0])):
        edges = list(zip(cycle, cycle[1:] + cycle[:1], strict=True))  # (asker, asked)
        cores = {p: rejoining(p, cycle, [q]) for p, q in edges}
        assert [q for p, q in edges if asks(cores[q], p)] == yielders
        assert {p for p in cycle if cores[p].rejoin_via is None} == set(yielders)  # stay
    # two sides, each member rejoining through the other side: {0, 1} lets {2, 3} in
    sides = {0: [2, 3], 1: [3, 2], 2: [0, 1], 3: [1, 0]}
    for me, through in sides.items():
        for asker in through:
            ours = rejoining(me, [0, 1, 2, 3], through)
            assert asks(ours, asker) is (me < 2), (me, asker)
    # a newcomer, or a member ours has in, is no rejoin of a cycle: still refused
    ours = rejoining(0, [0, 1, 2], [2])
    ours.membership.merge([Member(1, address(1), 30)])
    assert not asks(ours, 1) and not asks(ours, 7) and ours.rejoin_via == 2


def test_a_joiner_asks_its_neighbours_then_any_member_and_never_the_dead() -> None:
    ours = core(3, swarm(5))
    assert ours.model_sources(0) == [2, 4, 0, 1]  # ring neighbours first, then in id order
    ours.membership.end(2, 1)
    ours.membership.end(4, 1)
    assert ours.model_sources(0) == [0, 1]  # both neighbours died as we joined


def test_a_table_longer_than_the_members_limit_is_refused_whole() -> None:
    """The core reads a table with its own ``max_members``, as the real peer does: one with
    more entries is dropped (``too_many_members``), and our table stays as it was."""
    ours = GossipCore(
        0,
        MemberTable(swarm(3), limit=4),
        averager=build_averager("dense", "none", 0),
        trigger=parse_trigger("always"),
        settings=Settings(),
        model=torch.zeros(4),
    )
    table = MemberTable(swarm(6)).wire()
    with pytest.raises(WireError, match="the limit is 4") as refused:
        ours.receive(1.0, frames("members", 1, members=table))
    assert refused.value.reason == "too_many_members"
    assert [m.id for m in ours.membership.members()] == [0, 1, 2]


def test_a_table_giving_us_a_later_life_rejoins_even_from_an_earlier_life_of_its_writer() -> None:
    """Seed 125255 again, without the hold: each side of a healed cut let the other's members
    in, with lives they never took up, and each ignored the other's tables for good as
    written in an earlier life than the one it had given their writer. The later life a
    table gives us comes first: we rejoin through its writer (a table written before a cut
    cannot name a life of ours later than the one we hold)."""
    from gossipdl.protocol.joining import Verdict, hear_table

    ours = MemberTable([Member(0, address(0), 0), Member(1, address(1), 40)])  # 1: given 40
    theirs = [Member(0, address(0), 40), Member(1, address(1), 0)]  # 0: given 40, by 1
    assert hear_table(ours, 0, 1, theirs) is Verdict.REJOIN
    stale = [Member(0, address(0), 0), Member(1, address(1), 0)]  # before the cut: ignored
    assert hear_table(ours, 0, 1, stale) is Verdict.IGNORE
