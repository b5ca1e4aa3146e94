"""The simulated network on virtual time: no sockets, no sleeps, the same result every run."""

from __future__ import annotations

import numpy as np
import pytest

from gossipdl.sim import ClockError, NetworkError, Scheduler, SimNetwork
from gossipdl.transport import decode, encode
from gossipdl.transport.shaping import LinkProfile, parse_link
from gossipdl.transport.wire import frames_size

Arrivals = list[tuple[float, int, int, int]]  # (time, receiver, sender, round)


def _swarm(
    n: int, seed: int = 0, link: LinkProfile | None = None
) -> tuple[Scheduler, SimNetwork, Arrivals]:
    clock = Scheduler()
    net = SimNetwork(clock, seed)
    seen: Arrivals = []
    for node in range(n):

        def handler(sender: int, frames: list[bytes], node: int = node) -> None:
            msg = decode(frames, 1 << 30)  # the real decoder reads what the real encoder made
            seen.append((clock.now, node, sender, msg.round))

        net.attach(node, handler, link)
    return clock, net, seen


def _model(round: int, size: int = 1000) -> list[bytes]:
    return encode("params", 0, round, round, [np.full(size, round, np.float32)])


def test_the_clock_runs_events_in_time_then_schedule_order_and_refuses_the_past() -> None:
    clock, seen = Scheduler(), []
    for name, when in (("c", 2.0), ("a", 1.0), ("b", 1.0)):
        clock.at(when, lambda name=name: seen.append((name, clock.now)))
    cancelled = clock.after(1.5, lambda: seen.append(("x", clock.now)))
    cancelled.cancel()
    assert clock.run(until=1.7) == 2 and clock.now == 1.7
    assert seen == [("a", 1.0), ("b", 1.0)]
    clock.run()
    assert seen[-1] == ("c", 2.0)
    with pytest.raises(ClockError, match="cannot schedule"):
        clock.at(1.0, lambda: None)
    with pytest.raises(ClockError, match="non-negative"):
        clock.after(float("nan"), lambda: None)


def test_a_message_takes_its_size_over_the_bandwidth_plus_the_latency_and_counts_its_bytes() -> (
    None
):
    link = parse_link("up=8mbit,down=8mbit,latency=50ms")  # 1 MB/s each way
    clock, net, seen = _swarm(2, link=link)
    frames = _model(1, size=250_000)  # 1 MB of float32 plus the header
    size = frames_size(frames)
    net.send(0, 1, frames)
    net.send(0, 1, _model(2, size=250_000))  # queues behind the first on the uplink
    clock.run()
    first, second = (t for t, *_ in seen)
    # uplink 1 MB/s, 50 ms, then the downlink carries it in another second
    assert first == pytest.approx(size / 1e6 + 0.05 + size / 1e6)
    assert second == pytest.approx(first + size / 1e6)  # the uplink serialises
    assert [r for *_, r in seen] == [1, 2]
    assert net.stats(0).bytes_sent == net.stats(1).bytes_received == 2 * size
    assert net.stats(0).header_bytes_sent == len(frames[0]) * 2
    assert net.ledger["delivered"] == 2 and net.balanced()


def test_frames_are_copied_when_sent_as_bytes_on_a_wire_are() -> None:
    clock, net, _ = _swarm(2)
    got: list[np.ndarray] = []
    net.attach(1, lambda s, f: got.append(decode(f, 1 << 30).arrays[0].copy()))
    array = np.zeros(10, np.float32)
    net.send(0, 1, encode("params", 0, 0, 0, [array]))
    array[:] = 7  # the sender goes on training before the message arrives
    clock.run()
    assert got[0].tolist() == [0.0] * 10


def test_partitions_clogs_deaths_and_injected_faults_are_each_accounted_for() -> None:
    clock, net, seen = _swarm(4, seed=3)
    net.partition([{0, 1}, {2}])  # node 3 is in no group: a side of its own
    for dst in (1, 2, 3):
        net.send(0, dst, _model(0))
    clock.run()
    assert [(node, sender) for _, node, sender, _ in seen] == [(1, 0)]
    assert net.ledger["partition"] == 2
    net.heal()
    net.clog(0, 1)
    net.send(0, 1, _model(1))
    clock.run()
    assert len(seen) == 1 and net.in_flight == 1  # held, not lost
    net.unclog(0, 1)
    clock.run()
    assert seen[-1][1:] == (1, 0, 1) and net.in_flight == 0
    net.send(0, 2, _model(2))
    net.kill(2)  # dies while the message is on its way
    net.inject(loss=0.5, duplicate=0.5, reorder_s=0.01)
    for r in range(200):
        net.send(1, 3, _model(r))
    clock.run()
    assert net.ledger["dead"] == 1
    assert 60 < net.ledger["injected_loss"] < 140 and net.ledger["duplicated"] > 20
    rounds = [r for _, node, _, r in seen if node == 3]
    assert rounds != sorted(rounds)  # extra delay let messages overtake each other
    assert net.balanced()


def test_the_same_seed_gives_the_same_deliveries_and_another_seed_does_not() -> None:
    def trace(seed: int) -> Arrivals:
        clock, net, seen = _swarm(3, seed, parse_link("up=1mbit,latency=20ms,jitter=10ms,loss=5%"))
        net.inject(duplicate=0.1, reorder_s=0.005)
        for r in range(100):
            net.send(r % 3, (r + 1) % 3, _model(r, size=100))
        clock.run()
        return seen

    assert trace(1) == trace(1)
    assert trace(1) != trace(2)


def test_offline_windows_and_unknown_nodes() -> None:
    clock, net, seen = _swarm(2, link=LinkProfile(offline=((1.0, 2.0),)))
    for node in (0, 1):
        net.start_link(node)
    clock.at(1.5, lambda: net.send(0, 1, _model(0)))  # inside the window: nothing leaves
    clock.at(2.5, lambda: net.send(0, 1, _model(1)))
    clock.run()
    assert [r for *_, r in seen] == [1] and net.ledger["offline"] == 1 and net.balanced()
    with pytest.raises(NetworkError, match="node 9 is not attached"):
        net.send(0, 9, _model(0))
    with pytest.raises(NetworkError, match="rates must be in"):
        net.inject(loss=1.0)


def test_a_restarted_node_loses_what_its_downlink_held_and_gets_a_fresh_link() -> None:
    """A killed node's downlink kept carrying what arrived before its death and handed it to
    its next life (9 of 10 messages, the new life's own first message queued behind them);
    an offline sender counted the bytes it never sent. As a real restart: lost, a new link,
    nothing counted; its offline windows stay on the swarm's clock (from its first start),
    as a real peer's count from the swarm's start."""
    link = LinkProfile(downlink_bps=8e6, offline=((2.0, 3.0),))  # 1 MB/s in
    clock, net, seen = _swarm(2, link=link)
    net.start_link(0)
    net.start_link(1)
    for r in range(10):  # 10 MB: ten seconds of downlink, all arrived at once
        net.send(0, 1, _model(r, size=250_000))
    clock.run(until=1.5)
    net.kill(1)
    clock.at(2.5, lambda: net.send(0, 1, _model(7)))  # 0 is offline: nothing leaves
    clock.run(until=4.0)
    net.revive(1)
    net.send(0, 1, _model(99, size=250_000))
    clock.run(until=5.5)
    assert [r for _, _, _, r in seen] == [0, 99]  # its first life read one; the rest died
    assert seen[-1][0] == pytest.approx(5.0, abs=0.01)  # a fresh downlink: 1 s for 1 MB
    clock.run(until=6.5)
    assert net.online(1)  # its window (2-3 s) was before the restart, not 2 s after it
    clock.run()
    assert net.ledger["dead"] == 9 and net.balanced()
    assert net.stats(0).bytes_sent == 11 * frames_size(_model(0, size=250_000))
    assert net.stats(0).dropped["offline"] == 1


def test_a_clog_released_after_a_partition_or_while_its_sender_is_away_drops_it() -> None:
    """unclog released what it held "as if sent now" but skipped what a send now checks: a
    held message crossed a partition made after it, and one left an offline sender."""
    clock, net, seen = _swarm(3, link=LinkProfile(offline=((1.0, 5.0),)))
    net.clog(0, 1)
    net.clog(2, 1)
    net.send(0, 1, _model(1))
    net.send(2, 1, _model(2))
    net.partition([[0], [1, 2]])
    net.unclog(0, 1)  # 0 is cut off from 1 now
    for node in range(3):
        net.start_link(node)
    clock.run(until=2.0)
    net.unclog(2, 1)  # 2 is offline now
    clock.run()
    assert seen == [] and net.ledger["partition"] == 1 and net.ledger["offline"] == 1
    assert net.balanced()


def test_a_message_reaching_an_offline_receiver_is_dropped_before_its_downlink_carries_it() -> None:
    """It went onto the downlink and was dropped only once read, so what came in while away
    kept the downlink busy: the first message after the window arrived seconds late."""
    clock, net, seen = _swarm(2, link=LinkProfile(downlink_bps=80e3, offline=((0.0, 1.0),)))
    net.start_link(1)  # the sender's windows never start
    frames = _model(0, size=2_000)  # 0.8 s on the downlink
    for k in range(8):
        clock.at(0.1 * k, lambda: net.send(0, 1, frames))
    clock.at(1.2, lambda: net.send(0, 1, frames))
    clock.run()
    assert [t for t, *_ in seen] == [pytest.approx(1.2 + 8 * frames_size(frames) / 80e3)]
    assert net.stats(1).dropped == {"offline": 8} and net.balanced()


def test_a_killed_senders_messages_not_yet_on_the_receivers_downlink_die_with_it() -> None:
    """Its uplink kept delivering after kill -9: in a real swarm the emulated link is the
    sender process's, so they are lost, and its silence starts at its death."""
    clock, net, seen = _swarm(3, link=parse_link("up=80kbit,down=80kbit"))
    frames = _model(0, size=2_000)
    took = frames_size(frames) * 8 / 80e3  # 0.8 s on either link
    net.send(0, 2, frames)  # on 2's downlink from 0.8 s: read at 1.6 s
    for _ in range(4):
        net.send(0, 1, frames)  # would arrive at 1.6, 2.4, 3.2 and 4.0 s
    clock.at(1.0, lambda: net.kill(0))
    clock.run()
    assert [(t, node) for t, node, *_ in seen] == [(pytest.approx(2 * took), 2)]
    assert net.ledger["dead"] == 4 and net.balanced()


def test_a_sender_queues_at_most_max_queued_bytes_per_destination() -> None:
    """The simulator held any amount for a slow uplink; the real transport drops a message
    past ``max_queued_mb`` of what has not arrived yet (one message always fits)."""
    clock = Scheduler()
    net = SimNetwork(clock, max_queued_bytes=10_000)
    seen: list[tuple[float, int]] = []
    net.attach(0, lambda s, f: None, parse_link("up=80kbit,latency=100ms"))
    for node in (1, 2):
        net.attach(node, lambda s, f, node=node: seen.append((clock.now, node)))
    frames = _model(0, size=2_000)  # 0.81 s on the uplink, then 0.1 s on its way
    for dst in (1, 1, 2, 1):  # the second to 1 does not fit behind the first: 2 has its own
        net.send(0, dst, frames)
    clock.at(0.85, lambda: net.send(0, 1, frames))  # the first is not there yet
    clock.at(1.0, lambda: net.send(0, 1, frames))  # it is: room again
    clock.run()
    assert net.stats(0).dropped == {"send_queue_full": 3}
    assert net.stats(0).messages_sent == 3 == len(seen)
    assert [node for _, node in seen] == [1, 2, 1] and net.balanced()


def test_a_receiver_holds_at_most_max_received_bytes_on_its_downlink() -> None:
    """The real transport drops what does not fit its inbox of ``max_received_bytes`` read and
    not handled yet (one message always fits); the simulator's downlink held any amount."""
    clock = Scheduler()
    net = SimNetwork(clock, max_received_bytes=10_000)
    seen: list[tuple[float, int]] = []
    net.attach(0, lambda s, f: seen.append((clock.now, s)), parse_link("down=80kbit"))
    for node in (1, 2, 3):
        net.attach(node, lambda s, f: None)
    frames = _model(0, size=2_000)  # 0.81 s on the receiver's downlink
    for src in (1, 2, 3):  # the first fits; the others do not fit behind it
        net.send(src, 0, frames)
    clock.at(1.0, lambda: net.send(3, 0, frames))  # the first was read: room again
    clock.run()
    size = frames_size(frames)
    assert net.stats(0).dropped == {"receive_queue_full": 2}
    assert net.stats(0).messages_received == 4 and net.stats(0).bytes_received == 4 * size
    assert [src for _, src in seen] == [1, 3] and net.balanced()
    assert seen[1][0] == pytest.approx(4 * 8 * size / 80e3)  # the dropped ones took their time
