"""Device profiles and offline windows: parsing, config round trips, and a link that goes down."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import tomllib
from conftest import wait_for

from gossipdl.conditions import (
    ConditionError,
    device_of,
    parse_peer_ids,
    parse_profile,
    parse_profiles,
)
from gossipdl.config import Config, ConfigError, from_dict, load_config, to_toml
from gossipdl.experiments.display import unreached_windows
from gossipdl.transport import Message, Transport, encode
from gossipdl.transport.shaping import Link, LinkError, LinkProfile, parse_windows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_peer_ids_take_ranges_lists_and_all() -> None:
    assert parse_peer_ids("0-2,5", 8, "p") == (0, 1, 2, 5)
    assert parse_peer_ids("*", 3, "p") == (0, 1, 2)
    assert parse_peer_ids([3, 1], 4, "p") == (1, 3)
    assert parse_peer_ids(2, 4, "p") == (2,)
    for bad in ("8", "3-1", "a", "", [True], "-1"):
        with pytest.raises(ConditionError, match="peers = "):
            parse_peer_ids(bad, 8, "profile 'phone'")


def test_a_profile_reads_its_link_slowdown_and_windows() -> None:
    table = {
        "peers": "0-1",
        "up": "10mbit",
        "down": "20mbit",
        "latency": "20ms",
        "jitter": "5ms",
        "loss": "1%",
        "slowdown": 3,
        "step_time": "250ms",
        "offline": ["30s-40s", "5-10"],
    }
    profile = parse_profile("phone", table, 4)
    assert profile.peers == (0, 1) and profile.slowdown == 3.0 and profile.step_time == 0.25
    assert parse_profile("board", {"peers": "2", "step_time": 1.5}, 4).step_time == 1.5
    link = profile.link
    assert (link.uplink_bps, link.downlink_bps) == (10e6, 20e6)
    assert (link.latency_s, link.jitter_s, link.loss) == (0.02, 0.005, 0.01)
    assert link.offline == ((5.0, 10.0), (30.0, 40.0))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"peers": "0", "bandwidth": "1mbit"}, "unknown key"),
        ({"up": "1mbit"}, "names no peers"),
        ({"peers": "0", "slowdown": 0.5}, "slowdown"),
        ({"peers": "0", "slowdown": "fast"}, "slowdown"),
        ({"peers": "0", "step_time": "250"}, "step_time"),  # seconds or ms? say which
        ({"peers": "0", "step_time": "-1s"}, "step_time"),
        ({"peers": "0", "step_time": True}, "step_time"),
        ({"peers": "0", "latency": "20"}, "latency is given in ms or s"),
        ({"peers": "0", "offline": ["10s-5s"]}, "START < END"),
        ({"peers": "0", "offline": ["0s-10s", "5s-20s"]}, "overlap"),
    ],
)
def test_a_bad_profile_names_itself_and_the_fix(table: dict, message: str) -> None:
    with pytest.raises(ConditionError, match=message) as info:
        parse_profile("phone", table, 4)
    assert "'phone'" in str(info.value)


def test_one_peer_in_two_profiles_is_an_error() -> None:
    with pytest.raises(ConditionError, match="peer 1 is in profiles 'a' and 'b'"):
        parse_profiles({"a": {"peers": "0-1"}, "b": {"peers": "1"}}, 4)


def test_a_profile_overrides_the_swarm_wide_link_and_slowdown() -> None:
    profiles = {"phone": {"peers": "1", "up": "1mbit", "slowdown": 2}}
    for peer_id, uplink, slowdown in ((1, 1e6, 2.0), (0, 50e6, 3.0), (None, 50e6, 1.0)):
        device = device_of(peer_id, 4, profiles, "up=50mbit", "0:3")  # None: no rank yet
        assert (device.link.uplink_bps, device.slowdown) == (uplink, slowdown)


def test_profiles_round_trip_through_the_run_directory_toml() -> None:
    config = Config(
        peers=4,
        profiles={"old phone": {"peers": "2-3", "up": "1mbit", "offline": ["1s-2s"]}},
    )
    assert from_dict(tomllib.loads(to_toml(config))) == config


def test_windows_the_training_ended_before_or_during_are_named_after_the_run() -> None:
    config = Config(
        peers=3,
        profiles={
            "commuter": {"peers": "1", "offline": ["2s-4s", "8s-12s", "30s-35s"]},
            "laptop": {"peers": "2", "offline": ["1s-2s"]},
        },
    )
    summary = {"peers": [{"id": 0, "time_s": 19.5}, {"id": 1, "time_s": 10.0}]}  # 2 died early
    assert unreached_windows(config, summary) == [
        "peer 1: offline window 8-12 s (commuter) was cut short: it trained for 10.0 s; "
        "add steps or move the window",
        "peer 1: offline window 30-35 s (commuter) never came: it trained for 10.0 s; "
        "add steps or move the window",
    ]


def test_bad_profiles_fail_as_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"\[profiles.phone\]"):
        from_dict({"profiles": {"phone": "up=1mbit"}})
    with pytest.raises(ConfigError, match="offline windows need the gossip mode"):
        Config(mode="ring", profiles={"p": {"peers": "0", "offline": "1s-2s"}})
    path = tmp_path / "exp.toml"
    path.write_text('peers = 2\n[profiles.phone]\npeers = "5"\n')
    with pytest.raises(ConfigError, match="ids < 2"):
        load_config(path)


def test_the_ps_mode_takes_an_emulated_link() -> None:
    assert Config(mode="ps", link="up=10mbit").link == "up=10mbit"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_is_valid(path: Path) -> None:
    config = load_config(path)
    assert config.profiles, f"{path.name} should show a device profile"
    assert parse_profiles(config.profiles, config.peers)


def test_example_configs_are_the_ones_the_readme_promises() -> None:
    names = {p.name for p in EXAMPLES.glob("*.toml")}
    assert {"edge-10mbit.toml", "stragglers.toml", "churn.toml", "noniid.toml"} <= names
    edge = load_config(EXAMPLES / "edge-10mbit.toml")
    phone = parse_profiles(edge.profiles, edge.peers)[0].link
    assert (edge.peers, phone.uplink_bps, phone.latency_s, phone.loss) == (8, 10e6, 0.02, 0.01)


def test_windows_parse_sorted_and_bad_ones_show_the_form() -> None:
    assert parse_windows("20s-40s,5-10") == ((5.0, 10.0), (20.0, 40.0))
    assert parse_windows([]) == ()
    for bad in ("5", "a-b", "5s-5s", "1.2.3s-5s", 5):  # the last two were tracebacks
        with pytest.raises(LinkError, match="START-END"):
            parse_windows(bad)  # type: ignore[arg-type]
    with pytest.raises(ConditionError, match="up = '10mbit,loss=50%'; give one value"):
        parse_profiles({"p": {"peers": "0", "up": "10mbit,loss=50%"}}, 1)  # loss smuggled in


def test_a_link_is_down_only_inside_its_windows_counted_from_its_start() -> None:
    link = Link(LinkProfile(offline=((1.0, 2.0),)))
    assert link.online(100.5) and link.online(101.5)  # not started: no window applies
    link.start(100.0)
    assert [link.online(100.0 + t) for t in (0.5, 1.0, 1.5, 2.0)] == [True, False, False, True]


def test_an_offline_link_sends_and_receives_nothing_then_carries_traffic_again() -> None:
    arrived: list[int] = []
    got = threading.Event()

    def on_message(msg: Message) -> None:
        arrived.append(msg.round)
        got.set()

    offline = LinkProfile(offline=((0.0, 1.0),))
    a = Transport("tcp://127.0.0.1:0", on_message, link=offline)
    b = Transport("tcp://127.0.0.1:0", on_message)
    try:
        a.start_link_clock()
        assert not a.online
        frames = encode("params", 1, 0, 1, [np.zeros(10, np.float32)])
        a.send(b.address, frames)  # a is offline: nothing leaves
        b.send(a.address, encode("params", 2, 0, 2, [np.zeros(10, np.float32)]))
        # Both are dropped at a, and counted: the one a sent never left, the one b sent was
        # thrown away on arrival; neither can arrive later.
        wait_for(lambda: a.stats.snapshot()["messages_dropped"] == {"offline": 2}, 10,
                 "a to drop both messages while offline")  # fmt: skip
        assert arrived == []
        assert a.stats.bytes_sent == 0 and a.stats.bytes_received == 0
        wait_for(lambda: a.online, 10, "the offline window to end")
        a.send(b.address, encode("params", 1, 0, 3, [np.zeros(10, np.float32)]))
        assert got.wait(10) and arrived == [3]
        # counted by a's sending thread once zmq took the frames: b may read them first
        wait_for(lambda: a.stats.bytes_sent > 0, 10, "a to count what it sent")
    finally:
        a.close()
        b.close()


def test_a_message_its_downlink_still_carries_as_the_receiver_goes_offline_is_dropped() -> None:
    """As the simulator drops it: read while online, 10 KB on an 80 kbit/s downlink take
    1 s, and the receiver's offline window starts 0.5 s in; it was handed over late."""
    arrived: list[int] = []
    slow = LinkProfile(downlink_bps=80e3, offline=((0.5, 3.0),))
    a = Transport("tcp://127.0.0.1:0", lambda msg: arrived.append(msg.round), link=slow)
    b = Transport("tcp://127.0.0.1:0", lambda msg: None)
    try:
        a.start_link_clock()
        b.send(a.address, encode("params", 2, 0, 7, [np.zeros(2500, np.float32)]))
        wait_for(lambda: a.stats.snapshot()["messages_dropped"] == {"offline": 1}, 10,
                 "the message dropped when its downlink time ended, offline")  # fmt: skip
        assert arrived == [] and a.stats.bytes_received == 0
    finally:
        a.close()
        b.close()


def test_a_step_time_makes_every_step_last_that_long(tmp_path: Path) -> None:
    """A device's ``step_time`` sets how long a step lasts, on the simulator's virtual clock
    (a real peer waits out the rest of each step on the wall clock; that it applies the
    profile is checked in test_swarm)."""
    from conftest import small_config

    from gossipdl.experiments.simulated import simulate
    from gossipdl.rundir import RunDir

    config = small_config(tmp_path, peers=2, steps=12, log_every=1,
                          profiles={"board": {"peers": "0-1", "step_time": "150ms"}})  # fmt: skip
    summary = simulate(config)  # no --step-time: the profile's is the only one
    run = RunDir(config.out)
    for peer_id in (0, 1):
        records = list(run.records(peer_id))  # the start, then one line per step
        assert [r["step"] for r in records] == list(range(13)) and records[-1]["final"]
        steps = np.diff([r["time"] for r in records])
        assert steps == pytest.approx(np.full(12, 0.15), abs=1e-6), steps
    assert summary["simulated_time_s"] == pytest.approx(12 * 0.15, abs=0.01)
