"""Membership across real peer processes: death, pauses, restarts from checkpoints; and the
member-table rules those rest on."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import last_record, restore_logging, small_config, start_peer, wait_for, write_config
from typer.testing import CliRunner

import gossipdl.cli as cli
from gossipdl import rundir
from gossipdl.averaging import build_averager
from gossipdl.averaging.local_optimizer import SGD
from gossipdl.averaging.triggers import parse_trigger
from gossipdl.config import ConfigError
from gossipdl.experiments.forking import ForkedCommand
from gossipdl.peers.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from gossipdl.peers.membership import Member, Membership, parse_members
from gossipdl.peers.runner import train_peer
from gossipdl.protocol.core import GossipCore, JoinRefused, Settings
from gossipdl.protocol.joining import (
    Admission,
    Refusal,
    SwarmState,
    Verdict,
    admit,
    hear_table,
    join_incarnation,
    late_steps,
    outranks,
)
from gossipdl.rundir import RunDir, temporary_beside
from gossipdl.training import dataset_of, initial_model, make_optimizer, save_atomic
from gossipdl.transport import WireError
from gossipdl.transport.wire import NONCE, Message, decode, encode

# Quick failure detection, and steps of at least 20 ms so that idle peers do not burn the CPU
# that the other tests (and the heartbeats) need.
FAST: dict[str, Any] = {
    "heartbeat": 0.2,
    "dead_after": 1.5,
    "round_timeout": 10.0,
    "steps": 1_000_000,
    "profiles": {"paced": {"peers": "*", "step_time": "20ms"}},
}


def test_merging_keeps_the_newest_life_and_the_earliest_end_in_any_order() -> None:
    entries = [
        Member(1, "tcp://10.0.0.1:1", 0),
        Member(1, "tcp://10.0.0.1:1", 0, until=30),
        Member(1, "tcp://10.0.0.1:1", 0, until=25),
        Member(1, "tcp://10.0.0.2:2", 40),  # back after a restart, on another port
    ]
    for order in (entries, entries[::-1], [entries[2], entries[3], entries[0], entries[1]]):
        table = Membership()
        for entry in order:
            table.merge([entry])
        # the new life keeps the rounds of the one it replaced, to its earliest end
        assert table.get(1) == Member(1, "tcp://10.0.0.2:2", 40, before=(0, 25))
    table = Membership([Member(0, "tcp://10.0.0.1:1", 0), Member(1, "tcp://10.0.0.1:2", 0)])
    table.merge([Member(1, "tcp://10.0.0.1:2", 0, until=30)])
    table.merge([Member(1, "tcp://10.0.0.1:2", 0, until=25)])
    assert table.get(1).until == 25 and table.gone(1)  # type: ignore[union-attr]
    assert table.active(24) == [0, 1] and table.active(25) == [0] and table.in_swarm() == [0]
    assert table.end(1, 40) is None  # already out by then
    table.mark_left(1, "bye")
    table.merge([Member(1, "tcp://10.0.0.1:9", 50)])  # a new life clears the leave
    assert not table.gone(1) and table.active(50) == [0, 1]


def test_two_newcomers_given_one_id_leave_the_one_with_the_smaller_address_in_any_order() -> None:
    entries = [
        Member(2, "tcp://10.0.0.2:1", 5),
        Member(2, "tcp://10.0.0.1:1", 5),  # let in by another member at the same moment
        Member(2, "tcp://10.0.0.2:1", 5, until=9),
    ]
    for order in (entries, entries[::-1], [entries[2], entries[1], entries[0]]):
        table = Membership()
        for entry in order:
            table.merge([entry])
        assert table.get(2) == Member(2, "tcp://10.0.0.1:1", 5)


def test_member_lists_from_the_wire_are_checked() -> None:
    assert parse_members(
        [
            [0, "tcp://10.0.0.8:1", 0],
            [1, "tcp://10.0.0.8:2", 3, None],
            [2, "tcp://10.0.0.8:3", 0, 9],
        ]
    )
    key = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"
    assert parse_members([[0, "tcp://10.0.0.8:1", 0, None, key]])[0].key == key
    for bad in (
        "x",
        [[0, "tcp://10.0.0.8:1"]],
        [[-1, "tcp://10.0.0.8:1", 0]],
        [[0, "udp://h:1", 0]],
        [[0, "tcp://10.0.0.8:1", 5, 5]],  # ends before it starts
        [[0, "tcp://10.0.0.8:1", 0, "soon"]],
        [[True, "tcp://10.0.0.8:1", 0]],
        [
            [0, "tcp://10.0.0.8:1", 9, None, "", 0, [5, 4]]
        ],  # a replaced life that ends before it starts
        [[0, "tcp://10.0.0.8:1", 9, None, "", 0, [5]]],
        [[0, "tcp://10.0.0.8:1", 9, None, "", 0, "0-5"]],
        [[0, "tcp://10.0.0.8:1", 0, None, "~" * 40]],  # 40 characters, no key: every send failed
        [[0, "tcp://10.0.0.8:1", 0, None, "#" * 40]],
    ):
        with pytest.raises(WireError, match="member"):
            parse_members(bad)


def test_after_a_partition_the_larger_side_stays_and_ties_go_to_the_smallest_id() -> None:
    assert outranks({0, 1, 2}, {3, 4}) and not outranks({3, 4}, {0, 1, 2})
    assert outranks({0, 1}, {2, 3}) and not outranks({2, 3}, {0, 1})
    assert outranks({5}, set()) and not outranks(set(), {5})
    # both sides count a member neither has heard from since the cut (a newcomer still
    # aligning): the tie goes to the smallest id the other side lacks, and a side never
    # outranks itself (before, both tied on the shared smallest id and neither rejoined)
    assert outranks({0, 1}, {0, 2}) and not outranks({0, 2}, {0, 1})
    assert not outranks({0, 1}, {0, 1})


def test_a_join_is_let_in_ahead_answered_again_the_same_or_refused_saying_why() -> None:
    table = Membership(
        [Member(0, "tcp://10.0.0.8:1", 0), Member(1, "tcp://10.0.0.8:2", 0)], limit=3
    )
    running = SwarmState(round=40, margin=20, started=True, final_round=None, ring=False)
    first = admit(table, running, "tcp://10.0.0.8:3", "", None, rejoin=False)
    assert isinstance(first, Admission) and not first.again
    assert (first.member.id, first.member.since) == (2, 60)  # the next id, a margin ahead
    table.merge([first.member])
    again = admit(table, running, "tcp://10.0.0.8:3", "", None, rejoin=False)  # no welcome yet
    assert isinstance(again, Admission) and again.again and again.member == first.member
    back = admit(
        table, SwarmState(70, 20, True, None, False), "tcp://10.0.0.8:3", "", 2, rejoin=True
    )
    assert isinstance(back, Admission) and back.rejoined and back.member.since == 90
    for swarm, address, want, needle, limit in [
        (running, "tcp://10.0.0.8:4", 1, "id 1 is taken", None),
        (running, "tcp://10.0.0.8:4", -3, "not an integer", None),
        (running, "tcp://10.0.0.8:4", None, "member table is full", "too_many_members"),
        (SwarmState(40, 20, True, 50, False), "tcp://10.0.0.8:4", None, "finished training", None),
        (SwarmState(40, 20, True, None, True), "tcp://10.0.0.8:4", None, "ring all-reduce", None),
    ]:
        refused = admit(table, swarm, address, "", want, rejoin=False)
        assert isinstance(refused, Refusal) and needle in refused.error, (needle, refused)
        assert refused.limit == limit


def test_a_refused_want_id_is_named_by_its_type_never_echoed() -> None:
    """A refusal goes to the join's reply address, which may be a third party's: a want_id
    of 4,000 characters came back whole (3x reflection). Only an integer is shown."""
    table = Membership([Member(0, "tcp://10.0.0.8:1", 0)])
    running = SwarmState(round=40, margin=20, started=True, final_round=None, ring=False)
    for want, shown in [("x" * 4000, "id of type str"), ([0] * 500, "id of type list"),
                        (2**62, f"id {2**62}")]:  # fmt: skip
        refused = admit(table, running, "tcp://10.0.0.8:4", "", want, rejoin=False)
        assert isinstance(refused, Refusal) and refused.error.startswith(shown)
        assert len(refused.error) < 120


def test_a_restarted_process_gets_a_new_life_even_before_its_first_one_began() -> None:
    """Seed 548 of the fault search: a peer let back in from round 20 (the swarm at round 1)
    sent its public copy for round 20 and died; restarted, it was given the same life, so
    the members mixed its dead process's copy for round 20 with its new model. A join from
    another process (another incarnation) on that address is a new life; the same process
    asking again gets the same answer."""
    table = Membership([Member(0, "tcp://10.0.0.8:1", 0), Member(1, "tcp://10.0.0.8:2", 0)])
    early = SwarmState(round=1, margin=19, started=True, final_round=None, ring=False)
    first = admit(table, early, "tcp://10.0.0.8:3", "", 2, rejoin=True, incarnation=7)
    assert isinstance(first, Admission) and first.member.incarnation == 7
    table.merge([first.member])
    again = admit(table, early, "tcp://10.0.0.8:3", "", 2, rejoin=True, incarnation=7)
    assert isinstance(again, Admission) and again.again and again.member == first.member
    restarted = admit(table, early, "tcp://10.0.0.8:3", "", 2, rejoin=True, incarnation=8)
    assert isinstance(restarted, Admission) and not restarted.again
    assert restarted.member.since == first.member.since + 1  # its old life ends as it begins
    assert parse_members(table.wire()) == table.members()  # the incarnation travels
    assert join_incarnation({}) == 0
    for bad in (-1, True, "7", 2**62 + 1):
        with pytest.raises(WireError, match="incarnation"):
            join_incarnation({"incarnation": bad})
    with pytest.raises(WireError, match="member entry"):
        parse_members([[0, "tcp://10.0.0.8:1", 0, None, "", -1]])


def test_a_table_that_says_we_were_dropped_makes_the_outranked_side_rejoin() -> None:
    """After a partition of 0-2 from 3-4 each side ended the other at round 9."""

    def side(alive: range) -> list[Member]:
        return [Member(i, f"tcp://10.0.0.8:1{i}", 0, None if i in alive else 9) for i in range(5)]

    big, small = side(range(3)), side(range(3, 5))
    assert hear_table(Membership(small), 3, 0, big) is Verdict.REJOIN  # {0,1,2} outrank us
    assert hear_table(Membership(big), 0, 3, small) is Verdict.IGNORE  # they rejoin us
    grown = [
        *big[:3],
        Member(3, "tcp://10.0.0.8:13", 20),
        Member(4, "tcp://10.0.0.8:14", 20),
    ]  # back in
    assert hear_table(Membership(big), 1, 0, grown) is Verdict.MERGE
    assert hear_table(Membership(grown), 1, 3, small) is Verdict.IGNORE  # an earlier life's
    assert hear_table(Membership(big), 1, 3, big) is Verdict.IGNORE  # from one we dropped
    # seed 940: one we dropped but let back in since (a later life): its table is the swarm's
    assert hear_table(Membership(big), 1, 3, grown) is Verdict.MERGE


def _core(me: int, table: Membership) -> GossipCore:
    averager = build_averager("dense", "none", 0)
    trigger = parse_trigger("always")
    return GossipCore(
        me, table, averager=averager, trigger=trigger, settings=Settings(), model=torch.zeros(4)
    )


def test_the_core_lets_a_joiner_in_and_takes_only_the_answers_it_asked_for() -> None:
    """The member's side answers a join with a welcome to the joiner's address and the new
    table to its members; the joiner's side takes that welcome (it asked, with a nonce),
    ignores a second answer to it (a retry's), and refuses a welcome or model nobody asked
    for, whatever its nonce looks like (``unsolicited``, as the real peer's ``Asked``)."""
    member = _core(
        0, Membership([Member(0, "tcp://10.0.0.8:10", 0), Member(1, "tcp://10.0.0.8:11", 0)])
    )
    joiner = _core(-1, Membership())
    request = joiner.ask(
        "join", "tcp://10.0.0.8:10", {"address": "tcp://10.0.0.8:5", "want_id": None}, "n1"
    )
    sends = member.receive(0.0, request.frames)
    welcome = next(s for s in sends if s.kind == "welcome")
    assert welcome.address == "tcp://10.0.0.8:5"
    assert {s.to for s in sends if s.kind == "members"} == {1, 2}  # the newcomer too
    joiner.receive(0.1, welcome.frames)
    me = joiner.welcomed(0.1, joiner.answers.pop())
    assert (joiner.id, me.id, len(joiner.membership.members())) == (2, 2, 3)
    again = encode("welcome", 0, 0, 0, meta={"id": 3, "members": [], NONCE: "n1"})
    assert joiner.receive(0.2, again) == [] and joiner.answers == []  # answered: ignored
    for nonce in ("other", ["unhashable"]):  # never asked / malformed: refused, as for real
        forged = encode("welcome", 0, 0, 0, meta={"id": 3, "members": [], NONCE: nonce})
        with pytest.raises(WireError, match="answers no request") as refused:
            joiner.receive(0.2, forged)
        assert refused.value.reason == "unsolicited"
    ask = member.ask("join", "tcp://10.0.0.8:9", {"address": "tcp://10.0.0.8:10"}, "n2")
    refusal = encode("welcome", 9, 0, 0, meta={"error": "full", "members": [], NONCE: "n2"})
    member.receive(0.3, refusal)
    with pytest.raises(JoinRefused, match="full"):
        member.welcomed(0.3, member.answers.pop())
    assert decode(ask.frames, 1 << 20).meta[NONCE] == "n2"


def test_a_joiner_asks_the_members_in_before_its_first_round_for_a_model_first() -> None:
    """Neighbours of its first round first, then the others; either way the members let in
    with it (or after) last: until their own joins are done they hold only the model their
    process started with."""
    table = Membership([Member(0, "tcp://10.0.0.8:10", 0), Member(1, "tcp://10.0.0.8:11", 0),
                        Member(2, "tcp://10.0.0.8:12", 20), Member(3, "tcp://10.0.0.8:13", 20),
                        Member(4, "tcp://10.0.0.8:14", 0)])  # fmt: skip
    core = _core(3, table)
    neighbours = [j for j in core.neighbours(20) if j != 3]
    assert neighbours == [2, 4]  # the ring 0-1-2-3-4; 2 came in with us
    assert core.model_sources(20) == [4, 0, 1, 2]


def test_a_peer_not_in_yet_refuses_a_model_request_instead_of_giving_its_first_model() -> None:
    """Let in with the asker but not aligned yet, a peer holds only the model its process
    began with (seed 1508: a restarted peer took it, untrained, and was evicted): it answers
    with why, no model and no sequence number; once started, with its model."""
    table = [Member(0, "tcp://10.0.0.8:10", 0), Member(1, "tcp://10.0.0.8:11", 0)]
    member, asker = _core(0, Membership(table)), _core(1, Membership(table))
    member.published = (7, torch.full((4,), 7.0))

    def answer(started: bool) -> Message:
        request = asker.ask("model_request", "tcp://10.0.0.8:10", {}, "n")
        (send,) = member.receive(0.0, request.frames, started)
        return decode(send.frames, 1 << 20)

    early = answer(started=False)
    assert "not in the swarm yet" in (member.model_refused(early) or "")
    assert early.arrays == [] and early.seq == 0 and member.counters.model_messages_sent == 0
    given = answer(started=True)
    assert member.model_refused(given) is None
    assert torch.equal(member.decode_model(given), torch.full((4,), 7.0))


def test_a_peer_let_in_late_hands_on_the_round_it_aligned_with_not_its_first() -> None:
    """Let in from round 23 with a model of round 3, a peer trains alone to its first round.
    A model request meanwhile gets round 3: round 23 would make the asker take up 60 steps
    nobody trained (fault seed 19931: two peers rejoined through such a peer at step 72 of
    73). Nobody to align with: its first round, as before."""
    table = [Member(0, "tcp://10.0.0.8:10", 0), Member(1, "tcp://10.0.0.8:11", 0)]
    member, asker = _core(0, Membership(table)), _core(1, Membership(table))
    for aligned, expected in ((3, 3), (None, 23)):
        member.start_at(23, torch.full((4,), 3.0), took_model=True, aligned=aligned)
        request = asker.ask("model_request", "tcp://10.0.0.8:10", {}, "n")
        (send,) = member.receive(0.0, request.frames)
        reply = decode(send.frames, 1 << 20)
        assert reply.round == expected and member.round == 23
        assert torch.equal(member.decode_model(reply), torch.full((4,), 3.0))


def test_late_steps_count_only_steps_trained_and_train_alone_to_the_first_round() -> None:
    """A newcomer goes on from its model's round, a peer back from the later of its own count
    and the swarm's (the swarm's steps while away are not owed); both train alone to the
    first round, a join margin on. A resumed peer keeps its count and has no alone phase."""
    period, start = 3, 23
    assert late_steps(0, True, False, start, 3, period) == (9, 69)
    assert late_steps(12, True, True, start, 3, period) == (9, 69)  # the model's, not its own
    assert late_steps(30, False, True, start, 3, period) == (30, 69)
    assert late_steps(5, False, True, start, 3, period) == (9, 69)
    assert late_steps(5, False, True, start, None, period) == (69, 69)  # nobody: its round
    assert late_steps(45, False, False, start, 3, period) == (45, -1)


def test_a_checkpoint_round_trips_and_a_wrong_or_torn_one_is_refused(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "ckpt" / "1.pt"
    save_checkpoint(path, model, opt, 70)
    other = torch.nn.Linear(4, 3)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    assert load_checkpoint(path, other, other_opt) == 70
    assert torch.equal(other.weight, model.weight)
    assert other_opt.state_dict()["state"].keys() == opt.state_dict()["state"].keys()
    with pytest.raises(CheckpointError, match="different model"):
        wide = torch.nn.Linear(5, 3)
        load_checkpoint(path, wide, torch.optim.SGD(wide.parameters(), lr=0.1))
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable gossipdl checkpoint"):
        load_checkpoint(path, other, other_opt)
    with pytest.raises(CheckpointError, match="checkpoint_every"):
        load_checkpoint(tmp_path / "none.pt", other, other_opt)
    path.write_bytes(b"")  # killed as the file was made: a reason, and the way on
    with pytest.raises(CheckpointError, match=r"EOFError.*delete it, and the peer rejoins"):
        load_checkpoint(path, other, other_opt)


def test_a_save_clears_what_killed_writers_left_and_keeps_a_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process killed mid-save leaves its temporary file, as large as a checkpoint (or a
    metrics CSV being widened); the next process to save into that folder removes those
    (their writers are gone), not a running writer's."""
    ended = subprocess.Popen(["true"])
    ended.wait()  # reaped: no process has its id now
    with monkeypatch.context() as as_the_killed_writer:
        as_the_killed_writer.setattr(rundir.os, "getpid", lambda: ended.pid)
        temporary_beside(tmp_path / "1.pt").write_bytes(b"half")
        temporary_beside(tmp_path / "2.csv").write_text("step,")
    running = temporary_beside(tmp_path / "1.pt")  # this process's, still writing
    running.write_bytes(b"half")
    assert len(list(tmp_path.glob(".*.tmp"))) == 3
    monkeypatch.setattr(rundir, "_cleared", set())  # as the next process to write there
    save_atomic({"x": 1}, tmp_path / "1.pt")
    assert list(tmp_path.glob(".*.tmp")) == [running]
    assert torch.load(tmp_path / "1.pt", weights_only=True) == {"x": 1}


def test_a_checkpoint_of_another_peer_or_swarm_or_of_odd_contents_is_refused(
    tmp_path: Path,
) -> None:
    """A checkpoint names its peer and swarm (one copied from elsewhere resumes nothing), and
    contents of the wrong kind are an error naming the file, not a traceback."""
    model = torch.nn.Linear(4, 3)
    opt = SGD(list(model.parameters()), lr=0.1, momentum=0.9)  # a peer's (make_optimizer)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    path = tmp_path / "1.pt"
    save_checkpoint(path, model, opt, 30, peer=1, swarm="a1")
    assert load_checkpoint(path, model, opt, peer=1, swarm="a1") == 30
    assert load_checkpoint(path, model, opt) == 30  # nothing to compare with
    with pytest.raises(CheckpointError, match="of peer 1, not of peer 2"):
        load_checkpoint(path, model, opt, peer=2, swarm="a1")
    with pytest.raises(CheckpointError, match="of swarm 'a1', not of swarm 'b2'"):
        load_checkpoint(path, model, opt, peer=1, swarm="b2")
    state = torch.load(path, weights_only=True)
    odd = {
        "a list for a model": {**state, "model": [1, 2]},
        "an optimizer entry that is no dict": {
            **state,
            "optimizer": {**state["optimizer"], "state": {0: 5}},
        },
        "an optimizer entry of no parameter": {
            **state,
            "optimizer": {**state["optimizer"], "state": {7: {"momentum_buffer": None}}},
        },
        "a momentum of another shape": {
            **state,
            "optimizer": {
                **state["optimizer"],
                "state": {0: {"momentum_buffer": torch.zeros(2, 2)}},
            },
        },
    }
    for value in odd.values():  # the failing one's key shows in the traceback's locals
        torch.save(value, path)
        with pytest.raises(CheckpointError, match="different model or optimizer"):
            load_checkpoint(path, model, opt)


def _swarm(tmp_path: Path, n: int, **changes: Any) -> tuple[list[ForkedCommand], Path]:
    """``n`` hand-started peers of one run; returns them and the run directory."""
    out = tmp_path / "run"
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=n, **changes))
    first, address = start_peer("--config", str(config), "--rank", "0", "--out", str(out),
                                log=tmp_path / "p0.log")  # fmt: skip
    procs = [first]
    for i in range(1, n):
        proc, _ = start_peer("--config", str(config), "--rank", str(i), "--bootstrap", address,
                             "--out", str(out), log=tmp_path / f"p{i}.log")  # fmt: skip
        procs.append(proc)
    return procs, out


def _record(out: Path, i: int) -> dict[str, Any]:
    return last_record(out / "peers" / f"{i}.jsonl") or {}


def _stop(procs: list[ForkedCommand]) -> list[int | None]:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(60))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(None)
    return codes


def test_a_paused_peer_and_a_killed_one_are_dropped_and_rejoin_one_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """One real swarm of three, twice broken. Peer 2 is paused (SIGSTOP) longer than
    dead_after: the others declare it dead and train on; after SIGCONT it hears it was
    dropped, rejoins through a live member, and the swarm is whole again. Then peer 1 is
    killed; ``gossipdl peer --resume`` brings it back from its checkpoint, into the same
    swarm, with its counters carried on. Last, peer 2 is killed and its checkpoint lost:
    ``--resume`` brings it back as a newcomer that keeps its id and file (it failed,
    naming the checkpoint, and a new life in the same directory was refused). (All three
    are also simulated, seeded, in test_sim_faults.py; this is the real processes, signals
    and files.)"""
    procs, out = _swarm(tmp_path, 3, checkpoint_every=10, **FAST)
    restarted = newcomer = None
    try:
        wait_for(lambda: all(_record(out, i).get("step", 0) >= 20 for i in range(3)), 60,
                 "the swarm to train")  # fmt: skip
        # -- paused past dead_after: dropped, then rejoins when it wakes
        procs[2].send_signal(signal.SIGSTOP)
        wait_for(lambda: all(_record(out, i).get("members") == 2 for i in (0, 1)), 30,
                 "peer 2 to be declared dead")  # fmt: skip
        steps = _record(out, 0)["step"]
        wait_for(lambda: _record(out, 0)["step"] >= steps + 20, 30, "the others to train on")
        procs[2].send_signal(signal.SIGCONT)
        wait_for(lambda: _record(out, 2).get("rejoins") == 1, 30, "peer 2 to rejoin")
        wait_for(lambda: all(_record(out, i).get("members") == 3 for i in range(3)), 30,
                 "everyone to count three members again")  # fmt: skip
        misses = _record(out, 0)["neighbour_misses"]
        steps = _record(out, 2)["step"]
        wait_for(lambda: _record(out, 2)["step"] >= steps + 20, 30, "peer 2 to train on")
        assert _record(out, 0)["neighbour_misses"] == misses  # no waiting on anyone any more
        logs = (tmp_path / "p0.log").read_text() + (tmp_path / "p1.log").read_text()
        assert "no word from peer 2" in logs and "declared dead" in logs
        assert "says we were dropped; rejoining" in (tmp_path / "p2.log").read_text()
        # -- killed: resumes from its checkpoint and rejoins
        procs[1].kill()
        procs[1].wait(10)
        before = _record(out, 1)  # the first life's last word
        saved = torch.load(out / "checkpoints" / "1.pt", weights_only=True)["step"]
        assert saved >= 20 and saved % 10 == 0
        wait_for(lambda: all(_record(out, i).get("members") == 2 for i in (0, 2)), 30,
                 "peer 1 to be declared dead")  # fmt: skip
        restarted, _ = start_peer("--resume", str(out), "--rank", "1", log=tmp_path / "p1b.log")
        wait_for(lambda: all(_record(out, i).get("members") == 3 for i in range(3)), 60,
                 "everyone to count three members again")  # fmt: skip

        def starts(i: int) -> list[dict[str, Any]]:  # each life's first line of peer i
            return [r for r in RunDir(out).records(i) if r.get("start")]

        # the others count it once they let it in, which can come before its first line
        wait_for(lambda: len(starts(1)) == 2, 30, "peer 1's second life to write its first line")
        first, second = starts(1)
        assert second["step"] == saved  # from the checkpoint, not 0
        # The second life carries on: one clock, one swarm, counters that do not restart at 0,
        # and the time it was down shows as a gap.
        assert second["resumed"] and second["swarm"] == first["swarm"]
        assert second["swarm_start"] == first["swarm_start"]
        assert second["time"] - before["time"] >= second["down_s"] - 0.001 > 0  # both rounded
        for key in ("bytes_sent", "bytes_received", "model_messages_sent", "messages_sent"):
            assert second[key] >= before[key] > 0, key
        wait_for(lambda: _record(out, 1)["step"] >= saved + 20, 30, "peer 1 to train on")
        assert "back in at round" in (tmp_path / "p1b.log").read_text()
        assert _record(out, 2)["rejoins"] == 1  # the others were not disturbed by it
        # -- killed, its checkpoint lost: back as a newcomer under its id, in its own file
        procs[2].kill()
        procs[2].wait(10)
        before = _record(out, 2)
        (out / "checkpoints" / "2.pt").unlink()
        newcomer, _ = start_peer("--resume", str(out), "--rank", "2", log=tmp_path / "p2b.log")
        wait_for(lambda: len(starts(2)) == 2, 60, "peer 2's second life to write its first line")
        second = starts(2)[1]
        assert second["resumed"] is False and second["down_s"] > 0
        assert second["swarm"] == starts(2)[0]["swarm"]
        assert second["bytes_sent"] < before["bytes_sent"]  # a new process's counters
        wait_for(lambda: all(_record(out, i).get("members") == 3 for i in range(3)), 30,
                 "everyone to count three members again")  # fmt: skip
        assert "no checkpoint in" in (tmp_path / "p2b.log").read_text()
    finally:
        procs[2].send_signal(signal.SIGCONT)
        codes = _stop(
            [procs[0], *([restarted] if restarted else []), *([newcomer] if newcomer else [])]
        )
    assert codes == [130, 130, 130]  # each stopped in order by SIGINT: 128 + it


def test_a_resumed_rank_holds_its_lock_while_it_rejoins(tmp_path: Path) -> None:
    """The lock was taken and let go before the rejoin, and taken again once in: a second
    resume of the rank meanwhile passed, joined too, and split the swarm. It is held from
    before the rejoin to the end, and let go when the peer stops (here: nobody to rejoin)."""
    config = small_config(tmp_path, peers=2)
    run = RunDir(tmp_path / "run").create()
    model = initial_model(config, dataset_of(config))
    save_checkpoint(run.checkpoint(1), model, make_optimizer(config, model), 10, peer=1)
    failed: list[BaseException] = []

    def resume() -> None:
        try:
            train_peer(config, run, rank=1, listen="tcp://127.0.0.1:0",
                       bootstrap="tcp://127.0.0.1:9", resume=True, connect_wait=3.0)  # fmt: skip
        except Exception as exc:
            failed.append(exc)

    def taken() -> bool:
        try:
            run.hold(1).close()
        except ConfigError:
            return True
        return False

    rejoining = threading.Thread(target=resume)
    rejoining.start()
    wait_for(taken, 30, "the resume to take its lock")
    held_throughout = True
    while rejoining.is_alive():  # it tries to rejoin for connect_wait
        held_throughout &= taken() or not rejoining.is_alive()
        rejoining.join(0.1)
    assert held_throughout and not taken()
    assert failed and "127.0.0.1:9" in str(failed[0])  # nothing listens there


def test_a_resume_that_cannot_carry_its_peer_on_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run started without checkpoint_every (its config and member list as a peer leaves
    them, no line of peer 1): --resume names the missing checkpoint, before it dials
    anyone; so does one with other settings, another --out, or a rank still running. The
    CLI runs in this process (it sets up logging for it: the next tests get theirs back)."""
    restore_logging(monkeypatch)
    out = tmp_path / "run"
    run = RunDir(out).create()
    write_config(run.config, small_config(tmp_path, peers=2))
    run.write_members([(0, "tcp://127.0.0.1:9"), (1, "tcp://127.0.0.1:10")])
    done = CliRunner().invoke(cli.app, ["peer", "--resume", str(out), "--rank", "1"])
    assert done.exit_code == 2, done.output
    assert "no checkpoint at" in " ".join(done.stderr.split())
    done = CliRunner().invoke(cli.app, ["peer", "--resume", str(out)])
    assert done.exit_code == 2 and "--resume needs --rank" in " ".join(done.stderr.split())
    # A flag beside --resume that changes the swarm's settings: the swarm would refuse the
    # peer's messages, and its checkpoint's momentum would override --momentum anyway.
    args = ["peer", "--resume", str(out), "--rank", "1"]
    done = CliRunner().invoke(cli.app, [*args, "--codec", "topk:0.1", "--momentum", "0"])
    said = " ".join(done.stderr.split())
    assert done.exit_code == 2 and "carries its peer on with the settings" in said, said
    assert "codec = 'none' there, 'topk:0.1' here" in said and "momentum" in said
    done = CliRunner().invoke(cli.app, [*args, "--out", str(tmp_path / "elsewhere")])
    assert done.exit_code == 2 and "drop --out" in " ".join(done.stderr.split())
    # The rank's process still runs (it holds its lock): refused before it dials anyone.
    with RunDir(out).hold(1):
        done = CliRunner().invoke(cli.app, args)
    assert done.exit_code == 2 and "is still running" in " ".join(done.stderr.split())
    with RunDir(out).hold(1), pytest.raises(ConfigError, match=r"peer 1 of .* is still running"):
        RunDir(out).hold(1)  # one process or two: each open of the lock is its own holder


def test_a_newcomer_counts_the_rounds_of_a_replaced_life_as_the_members_do() -> None:
    """Fault seed 24418: peer 2 of a ring of four was dropped and let back in from round 41,
    its old life kept to then; peer 3, restarted, got a table that named only the new life,
    and in round 33 had a ring without peer 2 while the others had one with it. The
    replaced life travels with the entry, and every table merged in any order counts it."""
    old = [Member(i, f"tcp://10.0.0.8:{10 + i}", 0) for i in range(4)]
    member = Membership(old)
    member.end(2, 41)
    member.merge([Member(2, "tcp://10.0.0.8:12", 41)])  # back in, from the round its old life ends
    newcomer = Membership(parse_members(member.wire()))
    for round in (33, 40, 41):
        assert newcomer.active(round) == member.active(round) == [0, 1, 2, 3], round
    assert newcomer.spans() == member.spans()
    for order in (old[::-1], old):  # old news after the new life: the same table
        late = Membership(parse_members(member.wire()))
        late.merge(order)
        assert late.wire() == member.wire()
    member.end(2, 30)  # then it died: both lives end
    newcomer.merge(parse_members(member.wire()))
    assert newcomer.wire() == member.wire() and newcomer.get(2).before == (0, 30)  # type: ignore[union-attr]
    assert member.active(29) == [0, 1, 2, 3] and member.active(30) == [0, 1, 3]


def test_a_peer_that_dies_before_its_new_life_begins_is_declared_dead() -> None:
    """Seed 24418 again: peer 2, back in from round 41 and its old life still in, died at
    round 12. Its new life had not begun, and nobody sentenced it: every round to 41 had
    it. Silence now counts once either life has begun, from the news of the new life (a
    restarted process is not blamed for its old one's silence)."""
    from gossipdl.protocol.failure import FailureDetector

    table = Membership([Member(0, "tcp://10.0.0.8:10", 0), Member(2, "tcp://10.0.0.8:12", 0)])
    detector = FailureDetector(heartbeat=0.25, dead_after=1.5, forget_after=60.0)
    detector.check(0.0, 0, table.members(), 0, sentence=True, left=lambda j: False)
    detector.heard(2, 5.0)
    table.merge([Member(2, "tcp://10.0.0.8:12", 41)])  # its new life is news at 6 s
    said = detector.check(6.0, 0, table.members(), 12, sentence=True, left=lambda j: False)
    assert said.dead == []  # silent since 5 s, but its new life is news of now
    said = detector.check(7.0, 0, table.members(), 12, sentence=True, left=lambda j: False)
    assert said.dead == []
    said = detector.check(7.6, 0, table.members(), 13, sentence=True, left=lambda j: False)
    assert [j for j, _ in said.dead] == [2]


def test_a_round_does_not_wait_for_a_life_that_a_later_one_replaced() -> None:
    """Peer 1 restarted (or was dropped and let back in) from round 20: its old life is still
    in the topology until then, but nothing will come from it for those rounds (a restart's
    process died; a rejoin ran no round while it asked, and took up round 20). Peer 0's
    round 0 ends as soon as peer 2's model is in, not a round timeout later; while peer 2's
    is missing it still waits."""

    def table() -> Membership:
        members = Membership([Member(i, f"tcp://10.0.0.8:{10 + i}", 0) for i in range(3)])
        members.merge([Member(1, "tcp://10.0.0.8:11", 20)])  # a later life of peer 1
        return members

    me, two = _core(0, table()), _core(2, table())
    assert me.neighbours(0) == [1, 2]  # the old life still takes part in round 0
    me.open_round(0.0, torch.zeros(4))
    assert me.poll(0.1).model is None  # peer 2's model is not in: wait
    sends = two.open_round(0.0, torch.ones(4))
    me.receive(0.1, next(s for s in sends if s.to == 0).frames)
    done = me.poll(0.2)  # the deadline is 1 s away
    assert done.model is not None and float(done.model[0]) > 0.0
