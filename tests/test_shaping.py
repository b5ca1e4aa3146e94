"""User-space link emulation: measured over real sockets, the link does what its profile says."""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import pytest
from conftest import gossipdl_cmd
from test_peer_api import make_swarm, run_rounds

from gossipdl.transport import Message, Transport, encode
from gossipdl.transport.shaping import Link, LinkError, LinkProfile, parse_link


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


@pytest.mark.parametrize(
    ("mbit", "size", "count"), [(1, 12_500, 21), (10, 62_500, 41), (100, 250_000, 101)]
)
def test_the_uplink_carries_the_configured_rate_within_10_percent(
    mbit: int, size: int, count: int
) -> None:
    _sent, arrived, wire = _arrivals(LinkProfile(uplink_bps=mbit * 1e6), count, size)
    measured = 8 * wire * (count - 1) / (arrived[-1] - arrived[0]) / 1e6
    assert measured == pytest.approx(mbit, rel=0.10), f"{measured:.2f} Mbit/s"


def test_flush_waits_until_what_the_link_holds_is_sent_and_counted() -> None:
    """A peer's last metrics line flushes first: the bytes still on the link count too."""
    receiver = Transport("tcp://127.0.0.1:0", lambda m: None)
    sender = Transport("tcp://127.0.0.1:0", lambda m: None, link=LinkProfile(uplink_bps=1e6))
    try:
        frames = encode("params", 1, 0, 0, [np.zeros(25_000, np.float32)])  # 0.8 s at 1 Mbit/s
        began = time.monotonic()
        sender.send(receiver.address, frames)
        assert sender.stats.bytes_sent == 0  # held by the link
        assert sender.flush(5.0)
        assert time.monotonic() - began >= 0.7
        assert sender.stats.bytes_sent == sum(len(f) for f in frames)
    finally:
        sender.close()
        receiver.close()


def test_latency_adds_what_it_says() -> None:
    sent, arrived, _ = _arrivals(LinkProfile(latency_s=0.08), 5, 1000)
    plain_sent, plain_arrived, _ = _arrivals(LinkProfile(), 5, 1000)
    delays = [a - s for s, a in zip(sent, arrived, strict=True)]
    plain = [a - s for s, a in zip(plain_sent, plain_arrived, strict=True)]
    added = float(np.median(delays) - np.median(plain))
    assert added == pytest.approx(0.08, abs=0.015)


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


def test_link_specs_parse_and_bad_ones_say_the_form() -> None:
    profile = parse_link("up=10mbit,down=512kbit,latency=20ms,jitter=5ms,loss=1%")
    assert profile == LinkProfile(10e6, 512e3, 0.02, 0.005, 0.01)
    assert parse_link("") == LinkProfile() and not LinkProfile().shaped
    for bad, needle in [
        ("up=10", "mbit or kbit"),
        ("speed=1mbit", "KEY=NUMBER"),
        ("latency=5ms,jitter=10ms", "exceeds latency"),
        ("loss=100%", "loss"),
    ]:
        with pytest.raises(LinkError, match=needle):
            parse_link(bad)


def test_a_swarm_on_slow_links_pays_their_latency_every_round() -> None:
    fast = make_swarm(2, "ring", [0.0, 1.0])
    slow = make_swarm(2, "ring", [0.0, 1.0], link=parse_link("latency=40ms"))
    try:
        times = []
        for peers in (fast, slow):
            started = time.monotonic()
            run_rounds(peers, 10)
            times.append(time.monotonic() - started)
        assert times[1] >= 10 * 0.04 > times[0]  # each round waits for a 40 ms message
        assert all(p.round == 10 and p.neighbour_misses == 0 for p in fast + slow)
    finally:
        for p in fast + slow:
            p.close()


def test_a_bad_link_spec_fails_before_any_peer_starts() -> None:
    done = subprocess.run(gossipdl_cmd("run", "--link", "up=fast"), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and "link = 'up=fast'" in " ".join(done.stderr.split())
