"""User-space link emulation: measured over real sockets, the link does what its profile says."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_peer_api import make_swarm, run_rounds

from gossipdl import Peer
from gossipdl.transport import Message, Transport, encode
from gossipdl.transport.shaping import ARRIVALS_KEPT, Link, LinkError, LinkProfile, parse_link


def _arrivals(profile: LinkProfile, count: int, size: int) -> tuple[list[float], list[float], int]:
    """Send ``count`` messages of ``size`` payload bytes through a shaped sender; returns
    send times, arrival times, and the bytes one message puts on the wire."""
    arrived: list[float] = []
    done = threading.Event()

    def on_message(msg: Message) -> None:
        arrived.append(time.monotonic())
        if len(arrived) == count:
            done.set()

    receiver = Transport("tcp://127.0.0.1:0", on_message)
    sender = Transport("tcp://127.0.0.1:0", lambda m: None, link=profile, send_hwm=10_000)
    try:
        frames = encode("params", 1, 0, 0, [np.zeros(size // 4, np.float32)])
        wire = sum(len(f) for f in frames)
        sent = []
        for _ in range(count):
            sent.append(time.monotonic())
            sender.send(receiver.address, frames)
        assert done.wait(60), f"only {len(arrived)} of {count} arrived"
    finally:
        sender.close()
        receiver.close()
    return sent, arrived, wire


# Over real sockets only what load cannot upset is asserted: a message never arrives
# before the link's profile lets it (each bound counts from a time read before the send).
# The link's exact schedule (rate, latency, jitter, loss) is its pure arithmetic, checked
# on a given clock below.


def test_the_uplink_holds_traffic_to_the_configured_rate() -> None:
    count, size, bps = 11, 62_500, 10e6
    sent, arrived, wire = _arrivals(LinkProfile(uplink_bps=bps), count, size)
    # One message after another through a 10 Mbit/s uplink: the last cannot arrive before
    # all of them have been serialised, counted from the first send (0.55 s here).
    assert arrived[-1] - sent[0] >= count * 8 * wire / bps - 1e-3


def test_flush_waits_until_what_the_link_holds_is_sent_and_counted() -> None:
    """A peer's last metrics line flushes first: the bytes still on the link count too."""
    receiver = Transport("tcp://127.0.0.1:0", lambda m: None)
    sender = Transport("tcp://127.0.0.1:0", lambda m: None, link=LinkProfile(uplink_bps=1e6))
    try:
        frames = encode("params", 1, 0, 0, [np.zeros(50_000, np.float32)])  # 1.6 s at 1 Mbit/s
        began = time.monotonic()
        sender.send(receiver.address, frames)
        assert sender.stats.bytes_sent == 0  # held by the link
        assert sender.flush(10.0)
        assert time.monotonic() - began >= 1.6
        assert sender.stats.bytes_sent == sum(len(f) for f in frames)
    finally:
        sender.close()
        receiver.close()


def test_latency_delays_every_message_by_at_least_what_it_says() -> None:
    sent, arrived, _ = _arrivals(LinkProfile(latency_s=0.08), 5, 1000)
    assert all(a - s >= 0.08 for s, a in zip(sent, arrived, strict=True))


def test_link_timing_serialises_jitters_in_order_and_loses_its_share() -> None:
    link = Link(LinkProfile(uplink_bps=8e6, latency_s=0.02, jitter_s=0.01, loss=0.2), seed=1)
    arrivals = [link.send(1_000_000, 0.0, "a") for _ in range(2000)]
    kept = [a for a in arrivals if a is not None]
    assert 0.17 < 1 - len(kept) / len(arrivals) < 0.23  # 20% lost
    assert kept == sorted(kept)  # one destination: order kept, as on TCP
    assert kept[-1] == pytest.approx(2000 * 1.0 + 0.02, abs=0.011)  # 1 s per MB at 8 Mbit/s
    down = Link(LinkProfile(downlink_bps=8e6))
    assert down.receive(1_000_000, 0.0) == pytest.approx(1.0)
    assert down.receive(1_000_000, 0.5) == pytest.approx(2.0)  # waits for the first


def test_a_link_forgets_past_destinations_and_still_keeps_each_ones_order() -> None:
    """The last arrival at every address ever sent to was kept for good (replies to
    strangers too); now only those that can still hold a message back are."""
    link = Link(LinkProfile(latency_s=0.02, jitter_s=0.01), seed=1)
    to_a = []
    for i in range(5000):
        now = i * 0.001
        link.send(100, now, f"tcp://127.0.0.1:{20000 + i}")
        to_a.append(link.send(100, now, "a"))
    assert len(link._last_arrival) <= 2 * ARRIVALS_KEPT
    assert to_a == sorted(to_a)


def test_a_transport_closes_at_once_while_its_slow_downlink_holds_a_message() -> None:
    """The receive thread slept out a message's downlink time (20 s here) and close(), which
    a peer's SIGTERM runs, waited for it."""
    slow = Transport("tcp://127.0.0.1:0", lambda m: None, link=parse_link("down=0.08mbit"))
    sender = Transport("tcp://127.0.0.1:0", lambda m: None)
    try:
        sender.send(slow.address, encode("alive", 1, 0, 0, [np.zeros(50_000, np.float32)]))
        assert sender.flush()
        time.sleep(0.5)  # read, and held for its downlink time
        started = time.monotonic()
        slow.close()
        assert time.monotonic() - started < 1.5
    finally:
        sender.close(0.5)


def test_link_specs_parse_and_bad_ones_say_the_form() -> None:
    profile = parse_link("up=10mbit,down=512kbit,latency=20ms,jitter=5ms,loss=1%")
    assert profile == LinkProfile(10e6, 512e3, 0.02, 0.005, 0.01)
    assert parse_link("") == LinkProfile() and not LinkProfile().shaped
    for bad, needle in [
        ("up=10", "mbit or kbit"),
        ("speed=1mbit", "KEY=NUMBER"),
        ("latency=5ms,jitter=10ms", "exceeds latency"),
        ("loss=100%", "loss"),
        ("up=.mbit", "not a finite number"),  # these were tracebacks, or an infinite link
        ("latency=1.2.3ms", "not a finite number"),
        ("latency=1e999s,jitter=1e999s", "not a finite number"),
        ("latency=7200s", "at most 3600 s"),
    ]:
        with pytest.raises(LinkError, match=needle):
            parse_link(bad)


def test_a_swarm_on_slow_links_pays_their_latency_every_round() -> None:
    slow = make_swarm(2, "ring", [0.0, 1.0], link=parse_link("latency=40ms"))
    try:
        started = time.monotonic()
        run_rounds(slow, 5)
        # Each round waits for the other's message of that round, sent after its last round.
        assert time.monotonic() - started >= 5 * 0.04
        assert all(p.round == 5 and p.neighbour_misses == 0 for p in slow)
        assert all(torch.allclose(values(p), torch.full_like(values(p), 0.5)) for p in slow)
    finally:
        for p in slow:
            p.close()


def values(peer: Peer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in peer.params])
