"""What the protocol core takes from a member, and what it refuses: a message the swarm does
not run, a copy of one taken already, and the numbering of a member's new life. The core
alone, driven by hand: no sockets, no clock."""

from __future__ import annotations

import pytest
import torch
import zmq

from gossipdl.averaging.registry import build_averager
from gossipdl.averaging.triggers import parse_trigger
from gossipdl.protocol.core import GossipCore, Send, Settings
from gossipdl.protocol.membership import Member, MemberTable
from gossipdl.transport.wire import NONCE, Message, WireError, decode, encode

A, B = Member(0, "tcp://10.0.0.8:10", 0), Member(1, "tcp://10.0.0.8:11", 0)


def core(
    me: int, members: list[Member], algorithm: str = "dense", codec: str = "none"
) -> GossipCore:
    averager = build_averager(algorithm, codec, 0, gamma=0.5 if algorithm == "choco" else None)
    return GossipCore(
        me, MemberTable(members), averager=averager, trigger=parse_trigger("always"),
        settings=Settings(), model=torch.zeros(8),
    )  # fmt: skip


@pytest.mark.parametrize(("kind", "meta"), [("quiet", {"_sync_at": []}), ("reply", {}),
                                            ("walk", {"_age": 3})])  # fmt: skip
def test_a_dynamic_triggers_message_or_a_walk_is_refused_where_the_swarm_does_not_run_it(
    kind: str, meta: dict[str, object]
) -> None:
    """A ``quiet`` in a swarm without a dynamic trigger went into the inbox as no model, and
    the round's merge then crashed the peer; a walk was decoded and held for good."""
    victim = core(0, [A, B])
    victim.open_round(0.0, torch.zeros(8))
    arrays = [] if kind == "quiet" else [torch.ones(8).numpy()]
    with pytest.raises(WireError, match="unexpected"):
        victim.receive(0.0, encode(kind, 1, 1, 0, arrays, meta))
    victim.receive(0.0, encode("params", 1, 2, 0, [torch.ones(8).numpy()]))
    assert torch.equal(victim.poll(0.0).model, torch.full((8,), 0.5))  # the round goes on


def exchange(
    a: GossipCore, b: GossipCore, t: float, xa: torch.Tensor, xb: torch.Tensor
) -> list[Send]:
    """One round between ``a`` and ``b``; ``a``'s sends, for a network to repeat."""
    sent_a, sent_b = a.open_round(t, xa), b.open_round(t, xb)
    for s in sent_a:
        b.receive(t, s.frames)
    for s in sent_b:
        a.receive(t, s.frames)
    a.poll(t)
    b.poll(t)
    return sent_a


def test_a_choco_update_the_network_delivers_twice_is_added_once() -> None:
    """A copy of a round's update, arriving after the round, is a ``duplicate``: kept as a late
    update it was added to s_i again, which stayed wrong until the next resync."""
    a, b = core(0, [A, B], "choco", "topk:0.5"), core(1, [A, B], "choco", "topk:0.5")
    draws = torch.Generator().manual_seed(0)
    repeated = []
    for t in range(4):
        sent = exchange(
            a, b, float(t), torch.randn(8, generator=draws), torch.randn(8, generator=draws)
        )
        if t == 1:
            repeated = [s for s in sent if s.kind == "params"]
    for s in repeated:
        with pytest.raises(WireError, match="duplicate"):
            b.receive(4.0, s.frames)
    exchange(a, b, 4.0, torch.randn(8, generator=draws), torch.randn(8, generator=draws))
    weights, self_weight = b.mixing(b.round)
    s_i = b.averager.x_hat * self_weight + sum(w * a.averager.x_hat for w in weights.values())
    torch.testing.assert_close(b.averager.s, s_i)


def test_a_message_a_restarted_member_loses_is_a_gap_whatever_its_last_life_sent() -> None:
    """A new life numbers its messages from 1 again: the receiver starts its count anew (it
    kept the old life's highest, so a loss went unseen until the numbers passed it)."""
    for earlier in (0, 50):
        a = core(0, [A, B])
        old = core(1, [A, B])
        for _ in range(earlier):  # B's first life speaks
            for s in old.announce():
                a.receive(0.0, s.frames)
        back = Member(1, "tcp://10.0.0.8:11", 5, incarnation=2)
        a.merge([back], 1.0)
        b = core(1, [A, back])
        sends = [s for _ in range(3) for s in b.announce()]
        a.receive(2.0, sends[0].frames)
        a.receive(2.0, sends[2].frames)  # the second was lost
        assert any("1 message(s) from peer 1 were lost" in n for n in a.reports()[1]), earlier


def test_a_departure_announced_far_ahead_ends_once_the_leaver_is_silent_past_dead_after() -> None:
    """A ``leave`` whose round is 2**62 kept the member in every topology for good (and its
    table entry, never forgotten): on a ring, two such members cut the swarm in two."""
    members = [Member(i, f"tcp://10.0.0.8:{10 + i}", 0) for i in range(4)]
    victim = core(0, members)
    victim.receive(0.0, encode("leave", 2, 1, 0, meta={"until": 2**62, "reason": "bye"}))
    assert 2 in victim.membership.active(5)
    now = 0.0
    for _ in range(40):  # 20 s, past dead_after, with the others heard from
        now += 0.5
        for j in (1, 3):
            victim.detector.heard(j, now)
        victim.tick(now)
    until = victim.membership.get(2).until
    assert until is not None and until <= victim.round + victim.join_margin()
    assert 2 not in victim.membership.active(until) and 3 in victim.membership.active(until)
    assert any("ends before its announced round" in note for note in victim.notes)


def test_numbers_kept_for_members_forgotten_are_dropped_and_rise_when_they_are_back() -> None:
    """Every id ever sent to kept its sequence count after it was forgotten: joins under
    fresh ids grew the core past its member table's limit."""
    limit = 8
    victim = GossipCore(
        0, MemberTable([A, B], limit=limit), averager=build_averager("dense", "none", 0),
        trigger=parse_trigger("always"), model=torch.zeros(4),
        settings=Settings(heartbeat=1.0, dead_after=5.0, forget_after=10.0),
    )  # fmt: skip
    now, numbers = 0.0, []
    for n in range(36):  # strangers that join, are sent to, never speak, and are forgotten
        meta = {"address": f"tcp://10.1.0.{n + 1}:5555", "want_id": 100, NONCE: f"n{n}"}
        victim.receive(now, encode("join", -1, 0, 0, meta=meta))
        numbers += [decode(s.frames, 2**20).seq for s in victim.send(100, "alive", None, None, {})]
        for _ in range(40):
            now += 1.0
            victim.round += 1
            victim.detector.heard(1, now)
            victim.tick(now)
        assert set(victim._seq) <= {1}, n  # 100 forgotten, with its numbers
    assert len(numbers) == 36 and numbers == sorted(
        set(numbers)
    )  # never repeated: 100 new each time


def test_a_listed_key_cannot_take_the_id_of_a_member_with_another_key() -> None:
    """Over CURVE a joiner took a live member's id (asking to rejoin as it, or naming its
    address), even the answering member's own: the owner's messages were then refused as
    ``wrong_key``. The owner's own key still rejoins, and without CURVE nothing changes."""
    k0, k1, k2 = (zmq.curve_keypair()[0].decode() for _ in range(3))

    def member_0(keys: tuple[str, str]) -> GossipCore:
        table = [Member(i, f"tcp://10.0.0.{i + 1}:5555", 0, key=k) for i, k in enumerate(keys)]
        answerer = core(0, table)
        answerer.round = 40
        return answerer

    def join(answerer: GossipCore, address: str, key: str, **meta: object) -> Member | None:
        meta = {"address": address, "key": key, NONCE: "n", **meta}
        msg = Message("join", -1, 0, 0, meta=meta, key=key)
        return answerer.answer_join(1.0, msg, started=True).admitted

    for address, meta in [
        ("tcp://10.0.0.3:5555", {"want_id": 1, "rejoin": True}),
        ("tcp://10.0.0.2:5555", {"incarnation": 5}),  # peer 1's address
        ("tcp://10.0.0.3:5555", {"want_id": 0, "rejoin": True}),  # the answerer's own id
    ]:
        answerer = member_0((k0, k1))
        assert join(answerer, address, k2, **meta) is None
        assert [m.key for m in answerer.membership.members()] == [k0, k1]
        if meta.get("want_id") == 1:  # its owner's key is let back in
            assert join(answerer, address, k1, **meta) is not None
    assert join(member_0(("", "")), "tcp://10.0.0.3:5555", "", want_id=1, rejoin=True) is not None


def test_a_peer_announces_no_more_sync_alarms_than_a_member_takes() -> None:
    """It keeps the ``MAX_ALARMS`` earliest alarms it heard; one more raised beneath them
    went out in a message of ``MAX_ALARMS`` + 1 alarms, which every neighbour refused."""
    from gossipdl.protocol.kinds import MAX_ALARMS, SYNC_AT

    def dynamic(me: int) -> GossipCore:
        return GossipCore(
            me, MemberTable([A, B]), averager=build_averager("dense", "none", 0),
            trigger=parse_trigger("dynamic:0:1"), settings=Settings(), model=torch.zeros(8),
        )  # fmt: skip

    peer, neighbour = dynamic(0), dynamic(1)
    far = list(range(100, 100 + MAX_ALARMS))  # a big graph's alarms, all beyond our horizon
    peer.receive(0.0, encode("quiet", 1, 1, 0, [], {SYNC_AT: far}))
    sends = peer.open_round(0.0, torch.ones(8))  # moved from the reference: an alarm of its own
    (announced,) = [decode(s.frames, 1 << 30).meta[SYNC_AT] for s in sends]
    assert len(announced) == MAX_ALARMS and announced[0] < 100
    for s in sends:
        neighbour.receive(0.0, s.frames)  # taken, not refused


def test_a_resync_request_is_refused_where_the_swarm_keeps_no_public_copies() -> None:
    """Dense gossip never answers one, and never let one go: each stayed filed for the whole
    run (8 per sender, from every id that ever joined)."""
    victim = core(0, [A, B])
    with pytest.raises(WireError, match="unexpected"):
        victim.receive(0.0, encode("resync_request", 1, 1, 0, meta={"round": 3}))
    assert not victim._dense_for
    choco = core(0, [A, B], algorithm="choco", codec="topk:0.5")
    choco.receive(0.0, encode("resync_request", 1, 1, 0, meta={"round": 3}))
    assert choco._dense_for == {3: {1}}  # where it is answered, it is taken


def test_resync_requests_for_far_rounds_or_too_many_are_refused() -> None:
    """A member asks for resyncs it will never take: one too far ahead, or more than
    ``MAX_RESYNCS_PER_SENDER`` pending, is refused before it is filed."""
    from gossipdl.protocol.kinds import MAX_RESYNC_AHEAD, MAX_RESYNCS_PER_SENDER

    victim = core(0, [A, B], algorithm="choco", codec="topk:0.5")
    for i in range(20):
        with pytest.raises(WireError, match="resync_too_far"):
            victim.receive(0.0, encode("resync_request", 1, 1 + i, 0,
                                       meta={"round": MAX_RESYNC_AHEAD + 1 + i}))  # fmt: skip
    for i in range(MAX_RESYNCS_PER_SENDER + 20):
        request = encode("resync_request", 1, 100 + i, 0, meta={"round": 10 + i})
        if i < MAX_RESYNCS_PER_SENDER:
            victim.receive(0.0, request)
        else:
            with pytest.raises(WireError, match="too_many_pending"):
                victim.receive(0.0, request)
    assert sum(len(who) for who in victim._dense_for.values()) == MAX_RESYNCS_PER_SENDER
