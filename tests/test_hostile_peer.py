"""A hostile member or stranger against real peers over real sockets: no code runs, state
stays bounded, spoofed answers are refused, and every refusal is counted with its reason."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from conftest import (
    gossipdl_cmd,
    last_record,
    small_config,
    start_peer,
    wait_for,
    write_config,
)

from gossipdl import Peer
from gossipdl.config import ConfigError
from gossipdl.coordinator.server import serve
from gossipdl.peers.membership import parse_members
from gossipdl.peers.peer import MAX_ANSWER_RATE, PeerError
from gossipdl.protocol.joining import MODEL_WAIT_S
from gossipdl.protocol.ps_server import ShardServer
from gossipdl.transport import Transport, encode
from gossipdl.transport.asked import NONCE
from gossipdl.transport.wire import frames_size
from gossipdl.trust import RemoteCodeError, config_from_peer

PROBE = """
import pathlib
pathlib.Path(__file__).with_name("imported.txt").write_text("the wire ran code")


def Thing(*args, **kwargs):
    raise TypeError("the probe was called")
"""


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def open_files(pid: int) -> int:
    """File descriptors a process holds (every socket and ZeroMQ's own)."""
    return len(os.listdir(f"/proc/{pid}/fd"))


class Hostile:
    """A hand-written peer: a ROUTER to hear answers on, a DEALER per address it talks to."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind("tcp://127.0.0.1:0")
        self.address = self.inbox.LAST_ENDPOINT.decode()
        self._out: dict[str, zmq.Socket] = {}

    def send(self, address: str, frames: list[Any]) -> None:
        if address not in self._out:
            dealer = self._out[address] = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.SNDHWM, 0)
            dealer.connect(address)
        self._out[address].send_multipart(frames)

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The header of the next message that comes in (its frames in ``frames``), or None."""
        if not self.inbox.poll(int(timeout * 1000)):
            return None
        frames = self.inbox.recv_multipart()[1:]
        header = msgpack.unpackb(frames[0], raw=False)
        header["frames"] = frames[1:]
        return header

    def close(self) -> None:
        for socket in [self.inbox, *self._out.values()]:
            socket.close(linger=0)
        self.ctx.term()


@pytest.fixture
def hostile() -> Iterator[Hostile]:
    attacker = Hostile()
    yield attacker
    attacker.close()


# ----------------------------------------------------------------------- no code from the wire
def fake_member(hostile: Hostile, config: dict[str, Any], stop: threading.Event) -> None:
    """Answer every info request as a member would, with ``config``."""
    while not stop.is_set():
        header = hostile.receive(0.1)
        if header is not None and header["kind"] == "info_request":
            meta = {"config": config, "members": [], NONCE: header["meta"].get(NONCE)}
            hostile.send(header["meta"]["address"], encode("info", 0, 0, 0, meta=meta))


def test_a_joiner_never_imports_the_plug_in_a_member_names(
    tmp_path: Path, hostile: Hostile
) -> None:
    (tmp_path / "probe_plugin.py").write_text(PROBE)
    config = {"codec": "probe_plugin:Thing", "dataset": "synthetic", "model": "logistic"}
    stop = threading.Event()
    member = threading.Thread(target=fake_member, args=(hostile, config, stop))
    member.start()
    try:  # the joiner runs in the directory the probe lies in (cwd is on sys.path)
        done = subprocess.run(gossipdl_cmd("join", hostile.address, "--timeout", "20"),
                              cwd=tmp_path, capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        stop.set()
        member.join()
    assert done.returncode == 2, done.stderr
    assert "probe_plugin:Thing" in done.stderr and "--config FILE" in done.stderr
    assert not (tmp_path / "imported.txt").exists()


@pytest.mark.parametrize(
    "key, value",
    [
        ("codec", "probe_plugin:Thing"),
        ("codec", "topk:0.01+probe_plugin:Thing"),
        ("topology", "probe_plugin:Thing"),
        ("topology", "edges:/etc/passwd"),
        ("dataset", "probe_plugin:Thing"),
        ("model", "probe_plugin:Thing"),
        ("algorithm", "probe_plugin:Thing"),
    ],
)
def test_a_config_from_a_peer_names_only_built_in_parts(
    key: str, value: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "probe_plugin.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RemoteCodeError, match=re.escape(f"{key} = '{value}'")):
        config_from_peer({key: value}, "tcp://10.0.0.5:5555")
    assert not (tmp_path / "imported.txt").exists()


def test_the_users_own_config_decides_and_this_machines_settings_never_come_from_a_peer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "probe_plugin.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    remote = {"codec": "probe_plugin:Thing", "peers": 7, "out": "/etc", "max_message_mb": 1e9}
    kill = [{"at": "1s", "kill": "0"}]  # a simulated schedule would stop a real joiner
    elsewhere = {"codec": "fp16", "faults": kill, "data_dir": "/etc", "dataset": "cifar10"}
    config = config_from_peer({**remote, **elsewhere}, "tcp://10.0.0.5:5555")
    assert (config.peers, config.codec, config.out, config.max_message_mb) == (7, "fp16", "", 1024)
    assert config.faults == [] and config.data_dir == ""  # no path on this machine from a peer
    own = config_from_peer(elsewhere, "tcp://10.0.0.5:5555", {"data_dir": str(tmp_path)})
    assert own.data_dir == str(tmp_path)
    sized = config_from_peer({"dataset": "mnist1d:640"}, "tcp://10.0.0.5:5555")
    assert sized.dataset == "mnist1d:640"  # built in, at another size: no plug-in to refuse
    assert not (tmp_path / "imported.txt").exists()
    with pytest.raises(ConfigError, match="the probe was called"):  # named in the user's own
        config_from_peer(remote, "tcp://10.0.0.5:5555", {"codec": "probe_plugin:Thing"})
    assert (tmp_path / "imported.txt").exists()  # their decision: it ran


def test_a_swarm_size_beyond_max_members_is_refused_before_anything_is_sized_by_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member's config saying peers = 10**6 built a 10**6-peer topology (memory that
    grows as its square) before max_members refused it."""
    import gossipdl.topologies

    def sized(spec: str, peers: int, seed: int) -> object:
        raise AssertionError(f"a topology of {peers} peers was built")

    monkeypatch.setattr(gossipdl.topologies, "build_topology", sized)
    with pytest.raises(ConfigError, match="max_members = 512 is below peers = 1000000"):
        config_from_peer({"peers": 10**6}, "tcp://10.0.0.5:5555")


# ----------------------------------------------------------------------- a live peer process
class LiveSwarm:
    """Peer 0 as a real ``gossipdl peer`` process, peer 1 in this process, gossiping."""

    def __init__(self, tmp_path: Path, **changes: Any) -> None:
        paced = {"paced": {"peers": "0", "step_time": "20ms"}}  # idle steps spare the CPU
        config = small_config(
            tmp_path, peers=2, steps=10_000_000, log_every=20, profiles=paced, **changes
        )
        path = write_config(tmp_path / "swarm.toml", config)
        self.metrics = tmp_path / "run" / "peers" / "0.jsonl"
        self.proc, self.address = start_peer(
            "--config", str(path), "--rank", "0", "--out", str(tmp_path / "run"), "--no-summary",
            log=tmp_path / "peer0.log",
        )  # fmt: skip
        torch.manual_seed(0)
        self.partner = Peer(torch.nn.Linear(32, 10), rank=1, bootstrap=self.address, min_peers=2,
                            round_timeout=config.round_timeout)  # fmt: skip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train)
        self._thread.start()
        wait_for(lambda: (self.record() or {}).get("step", 0) >= 50, 60, "the swarm to train")

    def _train(self) -> None:
        while not self._stop.is_set():
            self.partner.gossip()

    def record(self) -> dict[str, Any] | None:
        return last_record(self.metrics)

    def dropped(self, reason: str) -> int:
        return (self.record() or {}).get("dropped_reasons", {}).get(reason, 0)

    def wait_dropped(self, reason: str, count: int) -> None:
        wait_for(lambda: self.dropped(reason) >= count, 30, f"{count} drops counted as {reason}")

    def close(self) -> None:
        """Peer 0 stops first (its last round still has peer 1), then peer 1."""
        self.proc.send_signal(signal.SIGINT)
        try:
            assert self.proc.wait(30) == 130  # 128 + SIGINT, after an orderly stop
            assert (self.record() or {}).get("final"), "peer 0 did not finish cleanly"
        finally:
            self._stop.set()
            self._thread.join(30)
            self.partner.close()
            if self.proc.poll() is None:
                self.proc.kill()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveSwarm]:
    live = LiveSwarm(tmp_path_factory.mktemp("swarm"))
    yield live
    live.close()


def test_resync_requests_to_a_swarm_without_public_copies_are_refused(
    swarm: LiveSwarm, hostile: Hostile
) -> None:
    """A member (here: someone claiming to be peer 1) asks a dense swarm for resyncs, which
    it never answers: each was filed for the whole run. (Where they are answered, their
    limits are tested on the core: test_core_messages.)"""
    rss, fds = rss_mib(swarm.proc.pid), open_files(swarm.proc.pid)
    before = swarm.dropped("unexpected")
    for i in range(400):
        hostile.send(swarm.address, encode("resync_request", 1, 0, 0, meta={"round": 10**4 + i}))
    swarm.wait_dropped("unexpected", before + 400)
    assert rss_mib(swarm.proc.pid) - rss < 32 and open_files(swarm.proc.pid) - fds <= 2


def test_requests_naming_a_third_party_reach_it_at_a_bounded_rate(
    swarm: LiveSwarm, hostile: Hostile
) -> None:
    ctx = zmq.Context.instance()
    victim = ctx.socket(zmq.ROUTER)
    victim.bind("tcp://127.0.0.1:0")
    target = victim.LAST_ENDPOINT.decode()
    fds = open_files(swarm.proc.pid)
    bad_before, rated_before = swarm.dropped("bad_address"), swarm.dropped("answer_rate")
    requests = 3000
    try:
        for address in ("tcp://0.0.0.0:5", "tcp://224.0.0.1:5", "ipc:///tmp/x", "tcp://h:99999"):
            meta = {"address": address, NONCE: "n"}
            hostile.send(swarm.address, encode("info_request", -1, 0, 0, meta=meta))
        started = time.monotonic()
        for i in range(requests):
            meta = {"address": target, NONCE: f"n{i}"}
            hostile.send(swarm.address, encode("info_request", -1, 0, 0, meta=meta))
        swarm.wait_dropped("bad_address", bad_before + 4)
        swarm.wait_dropped("answer_rate", rated_before + requests // 2)
        arrived = []
        while victim.poll(1500):
            victim.recv_multipart()
            arrived.append(time.monotonic())
        assert arrived, "no request was answered at all"
        span = arrived[-1] - started  # every answer was made within it: one burst, then the rate
        assert len(arrived) <= MAX_ANSWER_RATE * (span + 1) + 1, (len(arrived), span)
        assert len(arrived) < requests / 10
        assert open_files(swarm.proc.pid) - fds <= 4  # one connection to the victim
    finally:
        victim.close(linger=0)


def test_a_member_table_too_large_is_refused_whole(swarm: LiveSwarm, hostile: Hostile) -> None:
    rss, fds = rss_mib(swarm.proc.pid), open_files(swarm.proc.pid)
    before = swarm.dropped("too_many_members")
    table = [[i, f"tcp://127.0.0.1:{1 + i % 60000}", 0, None, ""] for i in range(100_000)]
    for kind in ("members", "dropped", "ready"):
        hostile.send(swarm.address, encode(kind, 1, 0, 0, meta={"members": table}))
    swarm.wait_dropped("too_many_members", before + 3)
    steps = (swarm.record() or {})["step"]  # a table taken in would be heartbeated within a second
    wait_for(lambda: (swarm.record() or {})["step"] >= steps + 60, 30, "a second of rounds")
    record = swarm.record() or {}
    assert record["members"] == 2 and record["sockets"] <= 3  # peer 1 (and a victim above)
    assert rss_mib(swarm.proc.pid) - rss < 64 and open_files(swarm.proc.pid) - fds <= 2


def test_joins_beyond_the_table_limit_are_refused_and_counted(tmp_path: Path) -> None:
    """A join flood (any stranger may join a swarm without CURVE) stops at max_members."""
    limit = 6
    live = LiveSwarm(tmp_path, max_members=limit, round_timeout=1.0)
    attacker = Hostile()
    try:
        for i in range(3 * limit):  # distinct addresses: each would be a new member
            meta = {"address": f"tcp://127.0.0.1:{20000 + i}", "want_id": None, "key": "",
                    NONCE: f"n{i}"}  # fmt: skip
            attacker.send(live.address, encode("join", -1, 0, 0, meta=meta))
            time.sleep(1.5 / MAX_ANSWER_RATE)  # within the answer rate: only the table limits
        live.wait_dropped("too_many_members", 2 * limit + 2)
        record = live.record() or {}
        assert record["members"] <= limit and record["sockets"] <= limit + 64
    finally:
        attacker.close()
        live.close()


# ----------------------------------------------------------------------- peers in this process
def founder(**kwargs: Any) -> tuple[str, threading.Thread, list[Peer]]:
    """A founding Peer (min_peers=2) built in a thread: it forms once a second member is in."""
    made: list[Peer] = []
    listening = threading.Event()
    address: list[str] = []

    def build() -> None:
        def on_listening(a: str) -> None:
            address.append(a)
            listening.set()

        made.append(Peer(kwargs.pop("model"), min_peers=2, on_listening=on_listening, **kwargs))

    thread = threading.Thread(target=build)
    thread.start()
    assert listening.wait(30)
    return address[0], thread, made


def join_as_member(hostile: Hostile, address: str) -> dict[str, Any]:
    """Join ``address`` as a newcomer and say we are ready: the welcome's header."""
    meta = {"address": hostile.address, "want_id": 1, "key": "", NONCE: "mine"}
    hostile.send(address, encode("join", -1, 0, 0, meta=meta))
    while True:
        header = hostile.receive(10)
        assert header is not None, "no welcome"
        if header["kind"] == "welcome":
            table = header["meta"]["members"]
            hostile.send(address, encode("ready", 1, 1, 0, meta={"members": table}))
            return header


def test_a_join_that_reaches_a_founder_before_it_founded_waits_for_it(hostile: Hostile) -> None:
    """A launched rank can join before rank 0 has founded (its socket listens first): that
    join is dropped, not answered with a table that lacks the founder; the retry gets in."""
    made: list[Peer] = []
    listening: list[str] = []
    meta = {"address": hostile.address, "want_id": 1, "key": "", NONCE: "early"}

    def join_early(address: str) -> None:  # runs after the bind, before the founding
        listening.append(address)
        hostile.send(address, encode("join", -1, 0, 0, meta=meta))
        time.sleep(1.0)  # the join is handled (or dropped) by now

    def build() -> None:
        made.append(Peer(torch.nn.Linear(3, 2), min_peers=2, on_listening=join_early))

    thread = threading.Thread(target=build)
    thread.start()
    try:
        assert hostile.receive(1.5) is None, "a founder that has not founded answered a join"
        welcome = join_as_member(hostile, listening[0])
        assert [m[0] for m in welcome["meta"]["members"]] == [0, 1]
        thread.join(30)
        assert dropped(made[0], "not_member_yet") == 1
    finally:
        thread.join(30)
        for peer in made:
            peer.close()


def joining(**kwargs: Any) -> tuple[threading.Thread, list[Peer], list[BaseException]]:
    """A Peer joining through ``bootstrap`` in a thread: the Peer once in, or the error."""
    made: list[Peer] = []
    errors: list[BaseException] = []

    def join() -> None:
        try:
            made.append(Peer(torch.nn.Linear(3, 2), **kwargs))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=join)
    thread.start()
    return thread, made, errors


def test_a_spoofed_welcome_cannot_hijack_a_join(
    hostile: Hostile, caplog: pytest.LogCaptureFixture
) -> None:
    """The asked member's answer (an error here) counts; a third party's welcome does not."""
    spoofer = Hostile()
    thread, _, outcome = joining(bootstrap=hostile.address, startup_timeout=20)
    try:
        request = hostile.receive(10)
        assert request is not None and request["kind"] == "join"
        joiner = request["meta"]["address"]
        table = [[0, spoofer.address, 0, None, ""], [7, joiner, 0, None, ""]]
        for nonce in ("guess", None):
            meta = {"id": 7, "members": table, "config": {}, NONCE: nonce}
            spoofer.send(joiner, encode("welcome", 0, 0, 0, meta=meta))
        wait_for(lambda: caplog.text.count("unsolicited") >= 2, 10, "both spoofs dropped")
        meta = {"error": "go away", "members": [], NONCE: request["meta"][NONCE]}
        hostile.send(joiner, encode("welcome", 0, 0, 0, meta=meta))
        thread.join(20)
    finally:
        spoofer.close()
    assert len(outcome) == 1 and "refused to let us join: go away" in str(outcome[0])


def dropped(peer: Peer, reason: str) -> int:
    return peer.transport.stats.snapshot()["messages_dropped"].get(reason, 0)


def test_only_members_speak_for_the_swarm(hostile: Hostile) -> None:
    """A stranger's table (id 77 is nobody) that says member 1 is dead changes nothing."""
    address, thread, made = founder(model=torch.nn.Linear(3, 2))
    welcome = join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]
    try:
        table = [[0, peer.address, 0, None, ""], [1, hostile.address, 0, 2, ""]]
        for kind in ("members", "dropped"):
            hostile.send(address, encode(kind, 77, 0, 0, meta={"members": table}))
        wait_for(lambda: dropped(peer, "unknown_sender") >= 2, 10, "the stranger's tables dropped")
        member = peer.membership.get(1)
        assert member is not None and member.until is None and welcome["meta"]["id"] == 1
    finally:
        peer.close()


def test_a_member_sending_what_the_swarm_does_not_run_is_refused_and_counted(
    hostile: Hostile,
) -> None:
    """A parameter server's kinds, a dynamic trigger's ``quiet`` and a walk, from a member of
    a dense swarm with the ``always`` trigger: each is ``unexpected`` (the simulator's core
    refuses the same). A ``quiet`` taken in crashed the peer's next round; the others fell
    through uncounted, their numbers counted as taken."""
    address, thread, made = founder(model=torch.nn.Linear(3, 2))
    join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]
    try:
        kinds = [("push", {}), ("pull", {}), ("shard", {}), ("info", {}), ("walk", {"_age": 1}),
                 ("quiet", {"_sync_at": []})]  # fmt: skip
        for seq, (kind, meta) in enumerate(kinds, start=2):
            hostile.send(address, encode(kind, 1, seq, 0, meta=meta))
        wait_for(lambda: dropped(peer, "unexpected") == len(kinds), 10, "each refused")
        assert peer.transport.stats.snapshot()["messages_dropped"].keys() == {"unexpected"}
    finally:
        peer.close()


def test_a_message_the_inbox_refuses_is_never_decoded(hostile: Hostile) -> None:
    address, thread, made = founder(model=torch.nn.Linear(100, 100))
    join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]
    decoded = []
    decode = peer.averager.decode
    peer.averager.decode = lambda *a: decoded.append(1) or decode(*a)  # type: ignore[method-assign]
    try:
        values = np.zeros(peer.numel, np.float32)
        for r in range(100, 150):  # rounds far ahead: 8 are kept, the rest refused
            hostile.send(address, encode("params", 1, 1 + r, r, [values]))
        wait_for(lambda: dropped(peer, "too_many_pending") == 42, 10, "42 refused")
        assert len(decoded) == 8
    finally:
        peer.close()


def test_an_error_that_is_not_a_bad_message_stops_the_peer_with_its_cause(
    hostile: Hostile,
) -> None:
    address, thread, made = founder(model=torch.nn.Linear(3, 2), round_timeout=600)
    join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]

    def out_of_memory(*args: Any) -> None:
        raise MemoryError("no memory left for the decode")

    peer.averager.decode = out_of_memory  # type: ignore[method-assign]
    raised: list[BaseException] = []

    def one_round() -> None:
        try:
            peer.gossip()
        except BaseException as exc:  # checked below
            raised.append(exc)

    try:
        hostile.send(address, encode("params", 1, 2, 0, [np.zeros(peer.numel, np.float32)]))
        gossip = threading.Thread(target=one_round, daemon=True)
        gossip.start()
        gossip.join(60)  # the round timeout is 600 s: only the error can end the round sooner
        assert not gossip.is_alive(), "the round waited for its timeout"
        assert len(raised) == 1 and isinstance(raised[0], PeerError), raised
        assert "MemoryError: no memory left" in str(raised[0])
    finally:
        peer.close()


def test_a_dead_member_is_forgotten_and_a_stale_table_cannot_bring_it_back(
    hostile: Hostile,
) -> None:
    settings = {"heartbeat": 0.2, "dead_after": 1.0, "forget_after": 1.0, "round_timeout": 0.2}
    address, thread, made = founder(model=torch.nn.Linear(3, 2), **settings)
    join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]
    try:  # the hostile member goes silent: dead, then forgotten; rounds go on meanwhile
        wait_for(lambda: peer.gossip() or peer.membership.get(1) is None, 20, "peer 1 forgotten")
        assert peer.declared_dead == 1
        wait_for(lambda: peer.transport.open_sockets == 0, 5, "its connection closed")
        stale = [[0, peer.address, 0, None, ""], [1, hostile.address, 0, None, ""]]
        peer._merge(parse_members(stale))
        assert peer.membership.get(1) is None  # its tombstone keeps that life dead
    finally:
        peer.close()


# ----------------------------------------------------------------------- slow receivers
def test_a_receiver_that_never_reads_cannot_grow_the_senders_memory() -> None:
    ctx = zmq.Context.instance()
    sink = ctx.socket(zmq.ROUTER)  # reads nothing, holds at most one message
    sink.setsockopt(zmq.RCVHWM, 1)
    sink.setsockopt(zmq.RCVBUF, 4096)
    sink.bind("tcp://127.0.0.1:0")
    address = sink.LAST_ENDPOINT.decode()
    limit = 16 * 2**20
    sender = Transport("tcp://127.0.0.1:0", lambda m: None, max_queued_bytes=limit)
    tracemalloc.start()
    try:
        for i in range(100):  # 400 MiB in all, each message its own memory
            sender.send(address, encode("params", 0, i, i, [np.full(2**20, i, np.float32)]))
            time.sleep(0.002)
        assert sender.flush(30)
        held, _ = tracemalloc.get_traced_memory()  # what is still referenced, ZeroMQ's included
        dropped = sender.stats.snapshot()["messages_dropped"].get("send_queue_full", 0)
        assert held < limit + 2 * 2**22, f"{held / 2**20:.0f} MiB still held"
        assert dropped >= 80  # a few fit the limit, a few more the kernel's socket buffers
    finally:
        tracemalloc.stop()
        sender.close(flush_timeout=0)
        sink.close(linger=0)


def test_a_peer_busy_merging_holds_at_most_max_received_bytes_of_a_flood(hostile: Hostile) -> None:
    """While the training thread holds the core lock (a long merge, a defence's pass), the
    receive thread waits for it; ZeroMQ read on behind it, up to 10,000 messages of any size
    per connection, before anyone checked the sender. Now at most ``max_received_bytes`` wait,
    the rest is dropped and counted, and the peer takes up what waited once it is free."""
    limit = 16 * 2**20
    address, thread, made = founder(
        model=torch.nn.Linear(3, 2), round_timeout=600, max_received_bytes=limit
    )
    join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]
    alive = encode("alive", 1, 0, 0, meta={"sent": -1, "life": 0})
    flood = encode("params", 999, 0, 0, [np.ones(2**20, np.float32)])  # 4 MiB from a stranger
    floods = 48
    fit = (limit - frames_size(alive)) // frames_size(flood)
    try:
        base = rss_mib(os.getpid())
        with peer._core:
            hostile.send(address, alive)  # the member's: the receive thread waits for the lock
            for _ in range(floods):
                hostile.send(address, flood)
            wait_for(lambda: dropped(peer, "receive_queue_full") == floods - fit, 10,
                     f"all but {fit} of the flood dropped")  # fmt: skip
            grown = rss_mib(os.getpid()) - base
        assert grown < limit / 2**20 + 48, f"{grown:.0f} MiB held for a {limit >> 20} MiB limit"
        hostile.send(address, encode("push", 1, 2, 0))  # a member's, after the flood
        wait_for(lambda: dropped(peer, "unexpected") == 1, 10, "the member's next message")
        assert dropped(peer, "unknown_sender") == fit  # what waited was handled, in order
    finally:
        peer.close()


def test_messages_to_many_addresses_are_sent_under_the_socket_cap_without_drops() -> None:
    """Past the cap the least recently used connection is closed for a new one; ZeroMQ frees
    the closed one's slot later, so sends to 640 addresses through 16 sockets failed with
    EMFILE (``too_many_sockets``) with the cap not reached."""
    sender = Transport("tcp://127.0.0.1:0", lambda m: None, max_sockets=16)
    try:
        for i in range(640):
            sender.send(f"tcp://127.0.0.1:{30000 + i}", encode("info", 0, 0, 0, meta={NONCE: "x"}))
        assert sender.flush(60)
        assert sender.open_sockets == 16
        assert sender.stats.snapshot()["messages_dropped"] == {}
    finally:
        sender.close(flush_timeout=0)


# ----------------------------------------------------------------------- torn reads
def test_every_model_a_peer_answers_with_is_exactly_the_round_it_claims(
    hostile: Hostile,
) -> None:
    model = torch.nn.Linear(300, 300)  # 90,300 values: sent without a copy, as big ones are
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # version 0 is all zeros; version r all r
    address, thread, made = founder(model=model, round_timeout=0.01)
    join_as_member(hostile, address)
    thread.join(30)
    peer = made[0]
    stop = threading.Event()

    def train() -> None:  # step r: every value becomes r (in place, layer by layer), then a round
        r = 0
        while not stop.is_set():
            r += 1
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(r))
            peer.step()

    trainer = threading.Thread(target=train)
    trainer.start()
    replies: list[tuple[int, np.ndarray]] = []
    try:
        for i in range(300):
            hostile.send(address, encode("model_request", 1, 2 + i, 0, meta={NONCE: str(i)}))
            header = hostile.receive(10)
            while header is not None and header["kind"] != "model":
                header = hostile.receive(10)
            assert header is not None, "no model answer"
            replies.append((header["round"], np.frombuffer(header["frames"][0], np.float32)))
    finally:
        stop.set()
        trainer.join(30)
        peer.close()
    torn = [(r, np.unique(v)[:4]) for r, v in replies if not (v == r).all()]
    assert not torn, f"{len(torn)} of {len(replies)} answers are not their round: {torn[:5]}"
    assert len({r for r, _ in replies}) > 10  # the hammering overlapped training


def test_every_shard_a_server_answers_with_is_exactly_the_version_it_claims() -> None:
    server = ShardServer(torch.zeros(100_000), rule="async", workers=2, staleness="none")
    listening = threading.Event()
    where: list[str] = []
    stop = threading.Event()

    def on_listening(address: str) -> None:
        where.append(address)
        listening.set()

    settings = {"on_listening": on_listening, "should_stop": stop.is_set}
    thread = threading.Thread(target=serve, args=(server, "tcp://127.0.0.1:0"), kwargs=settings)
    thread.start()
    assert listening.wait(10)
    pusher, puller = Hostile(), Hostile()
    ones = np.ones(100_000, np.float32)
    replies: list[tuple[int, np.ndarray]] = []
    failed: list[BaseException] = []

    def ask(worker: Hostile, kind: str) -> None:
        """200 requests, each echoing the ticket of the answer before (as a worker does):
        the puller's answers are sent while the pusher's pushes apply."""
        ticket = 0
        try:
            for n in range(200):  # each push adds 1 everywhere: version v is all v
                meta = {"address": worker.address, "clock": n + 1}
                arrays = [ones] if kind == "push" else []
                worker.send(where[0], encode(kind, 0 if kind == "push" else 1, ticket, 0,
                                             arrays, meta))  # fmt: skip
                header = worker.receive(10)
                assert header is not None and header["kind"] == "shard"
                replies.append(
                    (header["meta"]["version"], np.frombuffer(header["frames"][0], np.float32))
                )
                ticket = header["seq"]
        except BaseException as exc:
            failed.append(exc)

    pairs = ((pusher, "push"), (puller, "pull"))
    threads = [threading.Thread(target=ask, args=pair) for pair in pairs]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        thread.join(10)
        pusher.close()
        puller.close()
    assert not failed, failed
    assert len(replies) == 400
    torn = [(v, np.unique(a)[:4]) for v, a in replies if not (a == v).all()]
    assert not torn, f"{len(torn)} of {len(replies)} answers are not their version: {torn[:5]}"


# ----------------------------------------------------------------------- the limits themselves
def test_the_configs_limits_are_the_ones_the_code_defaults_to() -> None:
    from gossipdl.config import DEFAULTS
    from gossipdl.peers.membership import MAX_MEMBERS
    from gossipdl.peers.peer import FORGET_AFTER_S
    from gossipdl.transport.shaping import MAX_QUEUED_BYTES

    assert DEFAULTS.max_members == MAX_MEMBERS
    assert DEFAULTS.forget_after == FORGET_AFTER_S
    assert DEFAULTS.max_queued_mb * 2**20 == MAX_QUEUED_BYTES


@pytest.mark.parametrize(
    "address, ok",
    [
        ("tcp://10.0.0.5:5555", True),
        ("tcp://node-3.cluster.local:5555", True),
        ("tcp://[::1]:5555", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://255.255.255.255:5555", False),
        ("tcp://239.1.2.3:5555", False),
        ("tcp://10.0.0.5:0", False),
        ("tcp://10.0.0.5:65536", False),
        ("tcp://10.0.0.5:²", False),  # isdigit() takes it, int() did not: a peer stopped
        ("tcp://10.0.0.5", False),
        ("ipc:///tmp/socket", False),
        ("tcp://host name:5555", False),
        ("tcp://" + "a" * 300 + ":5555", False),
        (5555, False),
    ],
)
def test_a_peer_dials_only_tcp_addresses_of_one_machine(address: Any, ok: bool) -> None:
    from gossipdl.transport.addresses import address_problem

    assert (address_problem(address) is None) == ok


# ------------------------------------------------ a scripted member: a newcomer that waits
def let_in_at(hostile: Hostile, since: int) -> tuple[str, dict[str, Any]]:
    """Answer the next join as member 0 of a running swarm: the joiner is peer 1 from round
    ``since``; returns its address and the model request it sends next."""
    request = hostile.receive(10)
    assert request is not None and request["kind"] == "join"
    joiner = request["meta"]["address"]
    table = [[0, hostile.address, 0, None, ""], [1, joiner, since, None, ""]]
    meta = {"id": 1, "members": table, "config": {}, NONCE: request["meta"][NONCE]}
    hostile.send(joiner, encode("welcome", 0, 0, since - 2, meta=meta))
    while True:
        header = hostile.receive(10)
        assert header is not None, "no model request after the welcome"
        if header["kind"] == "model_request":
            return joiner, header


def test_a_newcomer_whose_every_source_dies_declares_it_dead_and_starts_with_its_own_model(
    hostile: Hostile,
) -> None:
    """Let in, a newcomer is a member: its only source, silent (dead), is declared dead in
    ``dead_after``, not asked for its model ``MODEL_WAIT_S`` long; with nobody left, the
    newcomer carries the swarm on from its first round with the model it has."""
    thread, made, errors = joining(bootstrap=hostile.address, heartbeat=0.2, dead_after=1.0)
    try:
        let_in_at(hostile, since=5)
        welcomed = time.monotonic()
        thread.join(MODEL_WAIT_S)
        took = time.monotonic() - welcomed
        assert not errors and made, errors
        peer = made[0]
        assert took < MODEL_WAIT_S / 2, f"{took:.1f} s to give up on a silent source"
        assert peer.started and peer.round == 5 and peer.membership.gone(0)
    finally:
        thread.join(30)
        for peer in made:
            peer.close()


def test_a_newcomer_told_it_was_dropped_while_it_waits_joins_again(hostile: Hostile) -> None:
    """A table that says a waiting newcomer was dropped (cut off as it was let in) sends it
    back to join through the member that said so, as a new life of the same id; it neither
    keeps asking for a model meanwhile nor starts. A join that goes unanswered is sent
    again within a second or so, not after a quarter of the startup timeout (15 s here)."""
    thread, made, errors = joining(bootstrap=hostile.address, startup_timeout=60)
    try:
        joiner, _ = let_in_at(hostile, since=5)
        dropped_at = [[0, hostile.address, 0, None, ""], [1, joiner, 5, 6, ""]]
        hostile.send(joiner, encode("dropped", 0, 1, 3, meta={"members": dropped_at}))
        joins, asked = [], 0  # our model is never sent: its requests go unanswered
        while len(joins) < 2:
            header = hostile.receive(10 if not joins else 5)
            assert header is not None, f"{len(joins)} join(s) after the table that dropped it"
            if header["kind"] == "join":
                joins.append(header)
            elif header["kind"] == "model_request":
                asked += 1  # one sent again (each RETRY_S) may cross the table
            else:
                assert header["kind"] == "alive", header["kind"]
        assert asked <= 1, f"asked for a model {asked} times after the table that dropped it"
        assert all(j["meta"]["rejoin"] is True and j["meta"]["want_id"] is None for j in joins)
        assert not made, "a newcomer told it was dropped started"
        meta = {"error": "not now", "members": [], NONCE: joins[-1]["meta"][NONCE]}
        hostile.send(joiner, encode("welcome", 0, 0, 0, meta=meta))
        thread.join(20)
        assert len(errors) == 1 and "refused to let us join: not now" in str(errors[0])
    finally:
        thread.join(30)
        for peer in made:
            peer.close()


def test_a_table_from_a_sender_not_known_yet_is_held_without_a_payload(
    hostile: Hostile,
) -> None:
    """Such tables wait a while for news of their sender (``MAX_EARLY`` of them): one
    carrying arrays pinned them too, 32 x ``max_message_mb`` for a stranger's tables, and one
    with more maps and lists than a table needs pinned up to 25 MiB of them each (the
    header's limit) for 2 s; a message that is no table waited out those 2 s too."""
    import numpy as np

    address, thread, made = founder(model=torch.nn.Linear(3, 2), round_timeout=600)
    join_as_member(hostile, address)
    thread.join(30)
    (peer,) = made
    try:
        table = [[0, peer.address, 0, None, ""]]
        blob = np.ones(1024, np.float32)
        hostile.send(address, encode("members", 1000, 0, 0, [blob], meta={"members": table}))
        # beside a valid table, 200,000 empty lists: 1.6 MB parsed, and 32 such held 50 MB
        padding = {"members": table, "pad": [[] for _ in range(200_000)], "answer": True}
        hostile.send(address, encode("members", 1001, 0, 0, meta=padding))
        wait_for(lambda: dropped(peer, "bad_payload") == 1, 10, "the table with arrays refused")
        wait_for(lambda: len(peer._early) == 1, 10, "the one without held")
        assert peer._early[0][1].meta == {"members": table, "answer": True}  # what it needs
        not_a_table = [[0, peer.address, 0, None, ""]] * (peer.membership.limit + 1)
        hostile.send(address, encode("ready", 1002, 0, 0, meta={"members": not_a_table}))
        wait_for(lambda: dropped(peer, "too_many_members") == 1, 10, "refused, not held")
        assert len(peer._early) == 1
    finally:
        peer.close()


def test_a_swarms_widths_that_no_message_could_carry_are_refused_before_building() -> None:
    """A member's ``hidden = [10**7, 10**7]`` was taken, and the joiner allocated 10**14
    parameters (a raw allocator error; just under the RAM, it would have succeeded)."""
    with pytest.raises(ConfigError, match=r"hidden = \[10000000, 10000000\], a model of at least"):
        config_from_peer({"model": "mlp", "hidden": [10**7, 10**7]}, "tcp://10.0.0.5:5555")
    assert config_from_peer({"hidden": [1024, 512]}, "tcp://10.0.0.5:5555").hidden == (1024, 512)
    mine = config_from_peer({"hidden": [10**7, 10**7]}, "tcp://10.0.0.5:5555", {"hidden": [8]})
    assert mine.hidden == (8,)  # the user's own widths decide


# ------------------------------------------------ addresses and connections from strangers
@pytest.mark.parametrize(
    "address", ["tcp://joiner-b.lan:5556", "tcp://localhost:5555", "tcp://node-3.cluster.local:1"]
)
def test_an_address_from_the_wire_must_name_an_ip(address: str) -> None:
    """ZeroMQ resolves a host name on its one I/O thread (a slow DNS froze a peer's every
    connection for 6 s): a join's, a reply's or a member table's address naming a host is
    refused as ``bad_address``, and the transport never dials one."""
    from gossipdl.transport.address_syntax import check_address
    from gossipdl.transport.wire import WireError

    with pytest.raises(WireError, match="is a name, not an IP address") as refused:
        check_address(address, "reply address")
    assert refused.value.reason == "bad_address"
    with pytest.raises(WireError) as table:
        parse_members([[0, "tcp://10.0.0.5:5555", 0], [1, address, 0]])
    assert table.value.reason == "bad_address"


def test_a_transport_drops_a_message_to_a_host_name_and_keeps_its_connections() -> None:
    got: list[int] = []
    victim = Transport("tcp://127.0.0.1:0", lambda m: None, name="victim")
    member = Transport("tcp://127.0.0.1:0", lambda m: got.append(m.round), name="member")
    try:
        victim.send("tcp://joiner-b.invalid:5556", encode("welcome", 0, 0, 0))
        victim.send(member.address, encode("alive", 0, 0, 1))
        wait_for(lambda: got == [1], 10, "the member's heartbeat")
        assert victim.stats.snapshot()["messages_dropped"] == {"bad_address": 1}
        assert victim.open_sockets == 1  # the member's; no DEALER was made for the name
    finally:
        victim.close(0.5)
        member.close(0.5)


def test_a_connection_that_never_greets_is_closed_after_the_handshake_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """libzmq caps no listener's connections: a stranger's idle connects held a file
    descriptor each until the peer ran out. One that does not finish ZeroMQ's handshake
    within ``HANDSHAKE_S`` is dropped."""
    import socket

    from gossipdl.transport import sockets

    monkeypatch.setattr(sockets, "HANDSHAKE_S", 0.3)
    victim = Transport("tcp://127.0.0.1:0", lambda m: None, name="victim")
    host, port = victim.address.removeprefix("tcp://").rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=10) as idle:
            started = time.monotonic()
            while idle.recv(4096):  # its greeting, then nothing: we never answer it
                pass
            assert time.monotonic() - started < 5  # libzmq's default held it for 30 s
    finally:
        victim.close(0.5)


_FDS_SCRIPT = """
import os, resource
from gossipdl.transport import Transport, encode
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
victim = Transport("tcp://127.0.0.1:0", lambda m: None, name="victim")
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, flush=True)
resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
held = []
try:
    while True:
        held.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
victim.send("tcp://127.0.0.1:9", encode("alive", 0, 0, 0))
victim.flush(5)
print(victim.stats.snapshot()["messages_dropped"], flush=True)
for fd in held:
    os.close(fd)
victim.close(0.5)
"""


def test_a_peer_raises_its_fd_limit_and_names_running_out_of_them() -> None:
    """The soft file descriptor limit goes up to the hard one when a transport starts; a
    connection refused because the process has none left is ``out_of_file_descriptors``,
    not ``too_many_sockets`` (whose fix is another)."""
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FDS_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    raised, dropped = done.stdout.splitlines()
    assert raised == "True"
    assert dropped == "{'out_of_file_descriptors': 1}"
    assert "out of file descriptors (limit 256)" in done.stderr


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_two_transports_exchange_over_ipv6() -> None:
    got: list[int] = []
    one = Transport("tcp://[::1]:0", lambda m: None, name="one")
    two = Transport("tcp://[::1]:0", lambda m: got.append(m.sender), name="two")
    try:
        assert two.address.startswith("tcp://[::1]:")
        one.send(two.address, encode("alive", 1, 0, 0))
        wait_for(lambda: got == [1], 10, "a message over [::1]")
    finally:
        one.close(0.5)
        two.close(0.5)
