"""CURVE: encrypted swarms that admit only listed keys, refused at the handshake."""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq.auth
from conftest import (
    fork_gossipdl,
    free_addresses,
    last_record,
    run_forked,
    small_config,
    start_peer,
    wait_for,
    write_config,
)

from gossipdl import Peer
from gossipdl.experiments.forking import ForkedCommand
from gossipdl.peers.peer import PeerError
from gossipdl.rundir import RunDir
from gossipdl.transport.curve import (
    Curve,
    CurveError,
    generate_keys,
    load_curve,
    load_curve_public,
    read_allow_list,
)


def _keys(tmp_path: Path, name: str) -> tuple[Path, str]:
    public, _ = generate_keys(tmp_path / name)
    return tmp_path / name, load_curve_public(public)


def _allow(path: Path, *keys: str) -> Path:
    path.write_text("# allowed peers\n" + "".join(f"{k}  # peer\n" for k in keys))
    return path


def _linear(value: float) -> torch.nn.Module:
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_only_listed_keys_get_in_and_a_stranger_gets_nothing_accepted(tmp_path: Path) -> None:
    (dir_a, key_a), (dir_b, key_b), (dir_s, key_s) = (_keys(tmp_path, n) for n in "abs")
    allow = _allow(tmp_path / "allow.txt", key_a, key_b)
    founded: list[Peer] = []
    listening: list[str] = []
    start = threading.Thread(target=lambda: founded.append(Peer(
        _linear(0.0), curve=load_curve(dir_a, allow), min_peers=2, topology="complete",
        on_listening=listening.append)))  # fmt: skip
    start.start()
    wait_for(lambda: listening, 30, "the founder to listen")
    # B joins knowing only the founder's address: the founder's key is found on the list
    member = Peer(
        _linear(10.0), bootstrap=listening[0], curve=load_curve(dir_b, allow),
        topology="complete",
    )  # fmt: skip
    start.join(30)
    founder = founded[0]
    stranger_allow = _allow(tmp_path / "stranger.txt", key_a, key_s)  # it knows A's key
    try:
        rounds = [threading.Thread(target=p.gossip) for p in (founder, member)]
        for t in rounds:
            t.start()
        for t in rounds:
            t.join(30)
        assert float(founder.model.weight[0, 0].detach()) == pytest.approx(5.0)  # trained together
        with pytest.raises(PeerError, match=f"refused our public key {re.escape(key_s)}"):
            Peer(_linear(99.0), bootstrap=founder.address, startup_timeout=3,
                 curve=load_curve(dir_s, stranger_allow))  # fmt: skip
        stats = founder.stats()
        assert stats["handshakes_refused"] >= 1
        assert stats["messages_dropped"] == {}  # none of its messages got as far as decoding
        assert [m.id for m in founder.membership.members()] == [0, 1]
        assert {m.key for m in founder.membership.members()} == {key_a, key_b}
    finally:
        member.close()
        founder.close()


@pytest.mark.parametrize("mode", ["gossip", "ring"])
def test_join_from_the_cli_with_secure_gets_in_and_a_stranger_does_not(
    mode: str, tmp_path: Path
) -> None:
    (dir_a, key_a), (dir_b, key_b), (dir_s, key_s) = (_keys(tmp_path, n) for n in "abs")
    allow = _allow(tmp_path / "allow.txt", key_a, key_b)
    config = small_config(tmp_path, mode=mode, peers=2, steps=30)
    config = write_config(tmp_path / "exp.toml", config)
    founder, address = start_peer(
        "--config", str(config), "--out", str(tmp_path / "run"),
        "--secure", "--keys", str(dir_a), "--allow", str(allow), log=tmp_path / "founder.log",
    )  # fmt: skip
    try:
        stranger = run_forked(
            "join", address, "--timeout", "2", "--out", str(tmp_path / "s"),
            "--secure", "--keys", str(dir_s),
            "--allow", str(_allow(tmp_path / "s.txt", key_a, key_s)),
            log=tmp_path / "stranger.log", timeout=60,
        )  # fmt: skip
        assert stranger.returncode == 2
        said = " ".join(stranger.stderr.split())
        assert f"refused our public key {key_s}" in said and "not on that peer's" in said, said
        joined = run_forked(
            "join", address, "--out", str(tmp_path / "b"), "--threads", "1",
            "--secure", "--keys", str(dir_b), "--allow", str(allow),
            log=tmp_path / "joiner.log", timeout=180,
        )  # fmt: skip
        assert joined.returncode == 0, joined.stderr
        assert founder.wait(60) == 0
    finally:
        if founder.poll() is None:
            founder.kill()
    records = list(RunDir(tmp_path / "b").records(1))
    first, final = records[0], records[-1]
    assert first["members"] == 2  # in the swarm with the founder (at the end it may have left)
    assert final["final"] and final["step"] == 30 and final["neighbour_misses"] == 0
    founder_final = last_record(tmp_path / "run" / "peers" / "0.jsonl") or {}
    assert founder_final["handshakes_refused"] >= 1  # the stranger, refused at the handshake


def test_a_secure_parameter_server_serves_listed_workers_and_refuses_a_stranger(
    tmp_path: Path,
) -> None:
    (dir_s, key_s), (dir_w, key_w), (dir_x, key_x) = (_keys(tmp_path, n) for n in "swx")
    allow = _allow(tmp_path / "allow.txt", key_s, key_w)  # both workers use key pair w
    config = small_config(tmp_path, mode="ps", peers=2, steps=20, round_timeout=4.0)
    path = write_config(tmp_path / "ps.toml", config)
    out = tmp_path / "run"
    server = fork_gossipdl(
        "server", "--config", str(path), "--out", str(out),
        "--secure", "--keys", str(dir_s), "--allow", str(allow), log=tmp_path / "server.log",
    )  # fmt: skip
    assert server.stdout is not None

    def worker(rank: int, keys: Path, allowed: Path, name: str, into: Path) -> ForkedCommand:
        """Worker ``rank`` writing its run to ``into``, its stderr to ``NAME.log``."""
        return fork_gossipdl(
            "peer", "--config", str(path), "--servers", address, "--rank", str(rank),
            "--out", str(into), "--secure", "--keys", str(keys), "--allow", str(allowed),
            log=tmp_path / f"{name}.log",
        )  # fmt: skip

    workers: list[ForkedCommand] = []
    stranger = None
    try:
        address = server.stdout.readline().split()[-1]
        stranger = worker(1, dir_x, _allow(tmp_path / "x.txt", key_s, key_x), "x", tmp_path / "x")
        # The workers start once the stranger was refused: a stranger slowed by a loaded
        # machine could otherwise knock after they finished and the server was gone.
        wait_for(lambda: _counters(out).get("handshakes_refused"), 90, "the stranger's refusal")
        workers += [worker(rank, dir_w, allow, f"w{rank}", out) for rank in (0, 1)]  # beside it
        assert stranger.wait(60) == 2
        stderr = (tmp_path / "x.log").read_text()
        # told at once that the shard refused its key (it waited out the timeout before)
        assert f"refused our public key {key_x}" in " ".join(stderr.split())
        for rank, proc in enumerate(workers):
            assert proc.wait(120) == 0, (tmp_path / f"w{rank}.log").read_text()
        assert server.wait(30) == 0
    finally:
        for proc in [server, *workers, *([stranger] if stranger else [])]:
            if proc.poll() is None:
                proc.kill()
    for rank in (0, 1):
        final = last_record(out / "peers" / f"{rank}.jsonl") or {}
        assert final["final"] and final["step"] == 20 and final["accuracy"] > 0.5
    shard = _counters(out)
    assert shard["handshakes_refused"] >= 1  # the stranger, refused before any message was read
    assert not shard["messages_dropped"]  # keys are found by handshakes, no message sent


def test_a_secure_shard_holds_one_key_per_worker_however_many_addresses_it_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listed worker naming a fresh reply address per message grew the shard's key table
    by one entry each (20,000 after 20,000 pulls): a key is now set for a worker's bound
    address only, and a new life's address (the worker declared dead) replaces the old."""
    import zmq

    from gossipdl.coordinator import server as shard_process
    from gossipdl.protocol.ps_server import ShardServer
    from gossipdl.transport.wire import encode

    s_pub, s_sec = (k.decode() for k in zmq.curve_keypair())
    w_pub, w_sec = (k.decode() for k in zmq.curve_keypair())
    made: list[shard_process.Transport] = []

    class Kept(shard_process.Transport):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(shard_process, "Transport", Kept)
    server = ShardServer(torch.zeros(4), rule="sync", workers=2, timeout=1e9)  # 1 never comes
    listening: list[str] = []
    stop = threading.Event()
    thread = threading.Thread(
        target=shard_process.serve,
        args=(server, "tcp://127.0.0.1:0"),
        kwargs={
            "curve": Curve(s_pub, s_sec, frozenset({w_pub})),
            "on_listening": listening.append,
            "should_stop": stop.is_set,
        },
        daemon=True,
    )
    thread.start()
    wait_for(lambda: listening, 10, "the shard to listen")
    context = zmq.Context.instance()
    dealer = context.socket(zmq.DEALER)
    dealer.curve_secretkey, dealer.curve_publickey = w_sec.encode(), w_pub.encode()
    dealer.curve_serverkey = s_pub.encode()
    dealer.connect(listening[0])
    try:
        for n in range(300):  # a pull of a round never reached: no answer, only an address
            meta = {"address": f"tcp://10.0.{n >> 8}.{n & 255}:{1000 + n}", "clock": 0}
            dealer.send_multipart([bytes(f) for f in encode("pull", 0, 0, 10**6, (), meta)])
            time.sleep(0.001)

        def refused() -> int:
            dropped = made[0].stats.snapshot()["messages_dropped"]
            return int(dropped.get("bad_address", 0) + dropped.get("too_many_pending", 0))

        wait_for(lambda: refused() >= 299, 10, "the other addresses' refusal")
        assert len(made[0]._keys) == 1
        server.timeout = 0.05
        for n in range(3):  # declared dead, then back from a new address each time
            time.sleep(0.3)
            address = f"tcp://127.0.0.1:{2000 + n}"
            meta = {"address": address, "clock": 0}
            dealer.send_multipart([bytes(f) for f in encode("alive", 0, 0, 0, (), meta)])
            wait_for(lambda a=address: server.known[0].address == a, 10, "the new life")
            time.sleep(0.2)
            assert set(made[0]._keys) == {address}
    finally:
        stop.set()
        thread.join(10)
        dealer.close(0)


def _counters(run: Path) -> dict[str, object]:
    """Parameter-server shard 0's counters (``{}`` before it first wrote them)."""
    path = run / "servers" / "0.json"
    return json.loads(path.read_text()) if path.exists() else {}


def test_allow_lists_and_key_directories_are_checked(tmp_path: Path) -> None:
    directory, key = _keys(tmp_path, "a")
    good = _allow(tmp_path / "ok.txt", key)
    assert read_allow_list(good) == {key}
    bad = tmp_path / "bad.txt"
    bad.write_text(f"{key}\nnot-a-key\n")
    with pytest.raises(CurveError, match="line 2"):
        read_allow_list(bad)
    bad.write_text(f"{key}\n{'#' * 40}\n")  # 40 characters, not Z85 of 32 bytes: a crash
    with pytest.raises(CurveError, match="line 2"):
        read_allow_list(bad)
    (tmp_path / "empty.txt").write_text("# nobody\n")
    with pytest.raises(CurveError, match="lists no key"):
        read_allow_list(tmp_path / "empty.txt")
    with pytest.raises(CurveError, match="cannot read"):
        read_allow_list(tmp_path / "missing.txt")
    (tmp_path / "latin1.txt").write_bytes(key.encode() + b"  # J\xf6rg\n")
    with pytest.raises(CurveError, match=r"latin1.txt is not UTF-8 text \(byte 45\)"):
        read_allow_list(tmp_path / "latin1.txt")
    with pytest.raises(CurveError, match="exactly one"):
        load_curve(tmp_path / "nowhere", good)
    with pytest.raises(CurveError, match="never overwritten"):
        generate_keys(directory)


def test_a_secret_key_is_written_private_and_both_files_name_the_pair(tmp_path: Path) -> None:
    public, secret = generate_keys(tmp_path / "k", "alice")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(public.stat().st_mode) & 0o077 == 0o044  # public: anyone may read it
    for path in (public, secret):
        assert 'name = "alice"' in [line.strip() for line in path.read_text().splitlines()]
    assert "secret-key" in secret.read_text() and "secret-key" not in public.read_text()
    with pytest.raises(CurveError, match="cannot be a file name"):
        generate_keys(tmp_path / "k", "../elsewhere")


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604])
def test_a_secret_key_others_may_read_is_refused_with_the_fix(mode: int, tmp_path: Path) -> None:
    directory, key = _keys(tmp_path, "a")
    secret = directory / "peer.key_secret"
    secret.chmod(mode)
    with pytest.raises(CurveError) as refused:
        load_curve(directory, _allow(tmp_path / "allow.txt", key))
    assert str(secret) in str(refused.value) and f"mode {mode:04o}" in str(refused.value)
    assert f"chmod 600 {secret}" in str(refused.value)


@pytest.mark.parametrize("case", ["truncated", "short secret", "not z85", "another public"])
def test_a_damaged_secret_key_file_is_refused_naming_it(case: str, tmp_path: Path) -> None:
    """Each loaded; the peer then died in ZeroMQ naming no file ('Invalid argument'), or,
    with another pair's public key, could be reached by nobody and never said why."""
    directory, key = _keys(tmp_path, "a")
    secret = directory / "peer.key_secret"
    text = secret.read_text()

    def edit(field: str, value: str) -> str:
        start = text.index(f'{field} = "') + len(field) + 4
        return text[:start] + value + text[start + 40 :]

    secret.write_text(
        {
            "truncated": text[:-20],
            "short secret": edit("secret-key", "abc"),
            "not z85": edit("secret-key", "~" * 40),
            "another public": edit("public-key", zmq.curve_keypair()[0].decode()),
        }[case]
    )
    with pytest.raises(CurveError, match=re.escape(str(secret))):
        load_curve(directory, _allow(tmp_path / "allow.txt", key))


@pytest.mark.parametrize("case", ["dangling link", "the file itself", "fifo", "secret listed"])
def test_key_files_that_cannot_be_a_key_pair_are_refused_naming_the_fix(
    case: str, tmp_path: Path
) -> None:
    """A review's probes: a dangling link was a FileNotFoundError traceback, --keys naming
    the file said 'found none', a FIFO blocked the read forever, and an allow-list holding
    our own secret key (shared with everyone who got the list) loaded silently."""
    directory, key = _keys(tmp_path, "a")
    allow = _allow(tmp_path / "allow.txt", key)
    secret = directory / "peer.key_secret"
    keys, says = directory, ""
    if case == "dangling link":
        secret.unlink()
        secret.symlink_to(tmp_path / "gone.key_secret")
        says = f"cannot read the secret key {secret}"
    elif case == "the file itself":
        keys, says = secret, f"give the directory that holds it: --keys {directory}"
    elif case == "fifo":
        secret.unlink()
        os.mkfifo(secret, 0o600)
        says = f"{secret} is not a regular file"
    else:
        allow.write_text(allow.read_text() + f"{load_curve(directory, allow).secret}  # oops\n")
        says = "holds this peer's SECRET key"
    outcome: list[BaseException | Curve] = []

    def load() -> None:
        try:
            outcome.append(load_curve(keys, allow))
        except BaseException as exc:  # the test reports what it was
            outcome.append(exc)

    loader = threading.Thread(target=load, daemon=True)  # a FIFO's read would never return
    loader.start()
    loader.join(10)
    assert outcome, "load_curve still reading after 10 s"
    assert isinstance(outcome[0], CurveError) and says in str(outcome[0]), repr(outcome[0])


def _curves(n: int) -> tuple[Curve, Curve, Curve]:
    """A founder, a listed joiner and an unlisted stranger, each knowing ``n`` other keys too;
    the founder's key sorts last, so a search one key after another meets it last."""
    pairs = sorted(
        ((p.decode(), s.decode()) for p, s in (zmq.curve_keypair() for _ in range(n + 3))),
        reverse=True,
    )
    (founder_pub, founder_sec), (joiner_pub, joiner_sec), (stranger_pub, stranger_sec) = pairs[:3]
    others = {p for p, _ in pairs[3:]}
    allowed = frozenset({founder_pub, joiner_pub, *others})
    return (
        Curve(founder_pub, founder_sec, allowed),
        Curve(joiner_pub, joiner_sec, allowed),
        Curve(stranger_pub, stranger_sec, allowed | {stranger_pub}),
    )


def test_a_secure_worker_whose_shard_is_not_running_is_told_so() -> None:
    """The key search blamed the allow-list ("no key … completed a CURVE handshake") after
    the whole timeout for a shard that was simply not running."""
    from gossipdl.coordinator.worker import ServerError, ServerWorker

    _, worker_curve, _ = _curves(2)
    began = time.monotonic()
    with pytest.raises(ServerError, match="no gossipdl peer answers at"):
        ServerWorker(_linear(0.0), None, rank=0, servers=free_addresses(1),
                     timeout=30.0, curve=worker_curve)  # fmt: skip
    assert time.monotonic() - began < 15  # told within the probe's wait, not the timeout


def test_a_joiner_finds_the_members_key_among_many_at_once_and_is_told_when_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review's probe: with 122 keys and the member's last, trying one key per third of a
    second took 41 s, past the 30 s of `gossipdl join`; then the join searched again from
    the start. An unlisted joiner waited out its timeout without being told why."""
    from gossipdl.peers import peer as peer_module
    from gossipdl.peers.bootstrap import fetch_swarm_info

    founder_curve, joiner_curve, stranger_curve = _curves(120)
    founded: list[Peer] = []
    listening: list[str] = []
    start = threading.Thread(target=lambda: founded.append(Peer(
        _linear(0.0), curve=founder_curve, min_peers=2, on_listening=listening.append,
    )))  # fmt: skip
    start.start()
    wait_for(lambda: listening, 30, "the founder to listen")
    address = listening[0]
    member = None
    try:
        began = time.monotonic()
        info = fetch_swarm_info(address, curve=joiner_curve, timeout=15)
        assert info["key"] == founder_curve.public
        assert time.monotonic() - began < 8  # 122 keys one by one: 41 s
        began = time.monotonic()
        with pytest.raises(PeerError) as refused:
            fetch_swarm_info(address, curve=stranger_curve, timeout=15)
        assert f"refused our public key {stranger_curve.public}" in str(refused.value)
        assert time.monotonic() - began < 8  # told at once, not after the timeout

        def searched_again(*_: object) -> str:
            raise AssertionError("the join searched the allow-list again")

        monkeypatch.setattr(peer_module, "find_key", searched_again)
        member = Peer(_linear(10.0), bootstrap=address, startup_timeout=15,
                      curve=joiner_curve.knowing(address, info["key"]))  # fmt: skip
        start.join(30)
        assert [m.id for m in founded[0].membership.members()] == [0, 1]
        # a rejoin through a member in our table dials it with the table's key: its round
        # timeout would leave no time for a search
        assert founded[0]._key_of(member.address, 0.1) == joiner_curve.public
    finally:
        start.join(30)
        for peer in (member, *founded):
            if peer is not None:
                peer.close()


def test_key_files_written_before_labels_still_load(tmp_path: Path) -> None:
    """Pairs from pyzmq's create_certificates (older gossipdl): no name, secret left 0644."""
    old = tmp_path / "old"
    old.mkdir()
    public, secret = (Path(p) for p in zmq.auth.create_certificates(str(old), "peer"))
    key = load_curve_public(public)
    allow = _allow(tmp_path / "allow.txt", key)
    with pytest.raises(CurveError, match="chmod 600"):
        load_curve(old, allow)
    secret.chmod(0o600)
    curve = load_curve(old, allow)
    assert curve.public == key and curve.allowed == {key}


def test_keys_generate_prints_the_public_key_and_peer_refuses_half_a_setup(
    tmp_path: Path,
) -> None:
    done = run_forked("keys", "generate", str(tmp_path / "k"), log=tmp_path / "k.log", timeout=60)
    assert done.returncode == 0, done.stderr
    key = done.stdout.split()[0]
    assert key == load_curve_public(tmp_path / "k" / "peer.key")
    assert done.stdout.startswith(f"{key}  # peer")  # the line to paste, labelled with the name
    assert read_allow_list(_allow(tmp_path / "allow.txt", done.stdout.strip())) == {key}
    done = run_forked("peer", "--secure", "--keys", str(tmp_path / "k"),
                      log=tmp_path / "peer.log", timeout=60)  # fmt: skip
    assert done.returncode == 2 and "--allow FILE" in done.stderr


def test_listening_on_a_network_address_without_curve_warns_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from gossipdl.transport import Transport, sockets

    monkeypatch.setattr(sockets, "_warned_plain", False)
    with caplog.at_level("WARNING", logger="gossipdl.transport.sockets"):
        ends = [Transport(listen, lambda m: None) for listen in
                ("tcp://127.0.0.1:0", "tcp://0.0.0.0:0", "tcp://0.0.0.0:0")]  # fmt: skip
    for end in ends:
        end.close()
    warnings = [r for r in caplog.records if "without encryption" in r.getMessage()]
    assert len(warnings) == 1 and "--secure" in warnings[0].getMessage()


def test_strangers_trying_fresh_keys_grow_no_memory_and_flood_no_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Each refused key is remembered so its retries are logged once, but at most
    MAX_REFUSED_KEYS of them (the oldest forgotten), and a new one is logged at most once
    per REFUSED_LOG_S; every refusal is counted. (The set grew by one a key, without end.)"""
    from gossipdl.transport import Transport, sockets

    monkeypatch.setattr(sockets, "MAX_REFUSED_KEYS", 8)
    monkeypatch.setattr(sockets, "REFUSED_LOG_S", 3600.0)  # however slow this machine is
    dir_a, key_a = _keys(tmp_path, "a")
    end = Transport(
        "tcp://127.0.0.1:0", lambda m: None, curve=load_curve(dir_a, _allow(tmp_path / "l", key_a))
    )
    context = zmq.Context()
    try:
        with caplog.at_level("WARNING", logger="gossipdl.transport.sockets"):
            for tried in range(1, 21):
                public, secret = zmq.curve_keypair()
                stranger = context.socket(zmq.DEALER)
                stranger.linger = 0
                stranger.curve_secretkey, stranger.curve_publickey = secret, public
                stranger.curve_serverkey = key_a.encode()
                stranger.connect(end.address)  # the handshake, refused, is all it takes
                with contextlib.suppress(zmq.Again):  # refused before: no pipe, and a
                    stranger.send(b"hello", zmq.NOBLOCK)  # blocking send hung (loaded host)
                wait_for(lambda: end.stats.handshakes_refused >= tried, 30, "the refusal")  # noqa: B023
                stranger.close()
        remembered = end._auth.credentials_providers["*"]._refused  # type: ignore[union-attr]
        assert len(remembered) == 8  # a stranger that retried may be counted twice:
        assert end.stats.handshakes_refused >= 20  # every refusal counts
        logged = [r for r in caplog.records if "not on the allow-list" in r.getMessage()]
        assert len(logged) == 1  # one per REFUSED_LOG_S, not one a key
    finally:
        end.close()
        context.destroy(linger=0)  # a stranger left open by a failure must not hang term()


def test_requests_naming_fresh_reply_addresses_keep_a_bounded_number_of_keys(
    tmp_path: Path,
) -> None:
    """A listed sender's info requests, each naming a new reply address: only the answered
    ones leave a key, and reply keys are the newest ``max_sockets`` (each request left one,
    refused ones too, for good)."""
    from gossipdl.transport import Transport, encode

    dir_a, key_a = _keys(tmp_path, "a")
    dir_b, key_b = _keys(tmp_path, "b")
    allowed = _allow(tmp_path / "allowed", key_a, key_b)
    peer = Peer(torch.nn.Linear(4, 2), None, listen="tcp://127.0.0.1:0", min_peers=1,
                curve=load_curve(dir_a, allowed))  # fmt: skip
    client = Transport("tcp://127.0.0.1:0", lambda m: None, curve=load_curve(dir_b, allowed))
    client.set_key(peer.address, key_a)
    try:
        before = peer.transport.keys_held
        for i in range(300):
            meta = {"address": f"tcp://127.0.0.1:{20000 + i}", "nonce": f"n{i}"}
            client.send(peer.address, encode("info_request", -1, 0, 0, meta=meta))
        assert client.flush(30)
        refused = lambda: peer.stats()["messages_dropped"].get("answer_rate", 0)  # noqa: E731
        wait_for(lambda: refused() > 10, 30, "requests refused over the answer rate")
        time.sleep(0.5)  # the rest of what arrives
        stats = peer.stats()
        answered = stats["messages_received"] - stats["messages_dropped"]["answer_rate"]
        assert peer.transport.keys_held - before <= answered
    finally:
        client.close(0.5)
        peer.close()
    few = Transport("tcp://127.0.0.1:0", lambda m: None, max_sockets=4)
    try:
        for i in range(100):
            few.set_reply_key(f"tcp://127.0.0.1:{20000 + i}", key_b)
        assert few.keys_held == 4
    finally:
        few.close(0)


def test_member_keys_of_addresses_no_member_has_now_are_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listed key rejoining as one id from fresh address after fresh address left one
    member key per address for good (only a forgotten member's current one was let go)."""
    import gossipdl.peers.peer
    from gossipdl.transport import Transport, encode

    monkeypatch.setattr(gossipdl.peers.peer, "MAX_STRANGER_SOCKETS", 4)
    dir_a, key_a = _keys(tmp_path, "a")
    dir_b, key_b = _keys(tmp_path, "b")
    allowed = _allow(tmp_path / "allowed", key_a, key_b)
    peer = Peer(torch.nn.Linear(4, 2), None, listen="tcp://127.0.0.1:0", min_peers=1,
                max_members=4, curve=load_curve(dir_a, allowed))  # fmt: skip
    client = Transport("tcp://127.0.0.1:0", lambda m: None, curve=load_curve(dir_b, allowed))
    client.set_key(peer.address, key_a)
    try:
        before = peer.transport.keys_held
        for i in range(30):  # under the answer rate
            meta = {"address": f"tcp://127.0.0.1:{20000 + i}", "want_id": 1, "rejoin": True,
                    "key": key_b, "nonce": f"n{i}", "incarnation": i + 1}  # fmt: skip
            client.send(peer.address, encode("join", -1, 0, 0, meta=meta))
            time.sleep(1 / 15)
        assert client.flush(30)
        wait_for(lambda: peer.membership.get(1) is not None, 10, "the joiner let in")
        wait_for(lambda: peer.membership.get(1).incarnation == 30, 10, "its last life")
        assert peer.transport.keys_held - before <= 4 + (4 + 4)  # members' + reply keys
    finally:
        client.close(0.5)
        peer.close()
