"""What a user meets first across machines: the address a peer tells others to dial, and
joins that cannot work failing in seconds with one line that says why."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import gossipdl_cmd, small_config, start_peer, wait_for, write_config

from gossipdl import Peer
from gossipdl.config import to_dict
from gossipdl.experiments.namespaces import Hosts, why_not
from gossipdl.transport.addresses import advertised_address, interface_ips, is_loopback
from gossipdl.transport.curve import generate_keys, load_curve_public


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI, given a generous deadline: the start-up timeouts of these tests are longer
    (``LONG``), so a command that ends in time did not wait for one of them."""
    return subprocess.run(gossipdl_cmd(*args), capture_output=True, text=True, timeout=120)


LONG = 3600.0  # a start-up timeout no test outlives


def _founder(
    hosts: Hosts, config: Path, tmp_path: Path, env: dict[str, str]
) -> subprocess.Popen[str]:
    """``gossipdl peer`` founding a swarm in host 0, listening on every interface; it prints
    its address on stdout, logs to ``m0.log`` and writes its run to ``m0``."""
    return subprocess.Popen(
        [*hosts.prefix(0), *gossipdl_cmd("peer", "--config", str(config), "--listen",
         "tcp://0.0.0.0:0", "--out", str(tmp_path / "m0"))],
        stdout=subprocess.PIPE, stderr=(tmp_path / "m0.log").open("w"), text=True, env=env,
    )  # fmt: skip


def test_a_wildcard_listen_advertises_an_address_other_machines_reach(
    caplog: pytest.LogCaptureFixture,
) -> None:
    address = advertised_address("tcp://0.0.0.0:5555")
    assert not is_loopback(address) and address.endswith(":5555")
    if interface_ips():  # the host name resolves to 127.0.0.1 here; the interface does not
        assert address.removeprefix("tcp://").rpartition(":")[0] in interface_ips()
    assert advertised_address("tcp://*:7", advertise="tcp://10.1.2.3:9") == "tcp://10.1.2.3:9"
    assert advertised_address("tcp://127.0.0.1:7") == "tcp://127.0.0.1:7"
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            advertised_address("tcp://0.0.0.0:6000", advertise="tcp://127.0.0.1:6000")
    warnings = [r for r in caplog.records if "only this machine can reach" in r.message]
    assert len(warnings) == 1 and "--advertise" in warnings[0].message


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_two_machines_find_each_other_through_a_wildcard_listen_and_advertise(
    tmp_path: Path,
) -> None:
    """Two network namespaces, each listening on every interface: the founder advertises the
    interface that is not loopback, the joiner (a machine with two addresses) the one
    GOSSIPDL_ADVERTISE names; ``peers.json`` lists both, and both train to the end."""
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=2, steps=30))
    with Hosts(2) as hosts:
        second = hosts.add_address(1)  # not the one the route to the founder would pick
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        founder = _founder(hosts, config, tmp_path, env)
        assert founder.stdout is not None
        address = founder.stdout.readline().split()[-1]
        assert address.startswith(f"tcp://{hosts.ip(0)}:"), address
        port = _free_port()
        joiner = subprocess.Popen(
            [*hosts.prefix(1), *gossipdl_cmd("peer", "--config", str(config), "--listen",
             f"tcp://0.0.0.0:{port}", "--bootstrap", address, "--out", str(tmp_path / "m1"))],
            stdout=subprocess.PIPE, stderr=(tmp_path / "m1.log").open("w"), text=True,
            env={**env, "GOSSIPDL_ADVERTISE": f"tcp://{second}:{port}"},
        )  # fmt: skip
        try:
            codes = [founder.wait(90), joiner.wait(90)]
        finally:
            for proc in (founder, joiner):
                if proc.poll() is None:
                    proc.kill()
    logs = (tmp_path / "m0.log").read_text() + (tmp_path / "m1.log").read_text()
    assert codes == [0, 0], logs
    for machine in ("m0", "m1"):
        listed = {e["address"] for e in json.loads((tmp_path / machine / "peers.json").read_text())}
        assert listed == {address, f"tcp://{second}:{port}"}, machine
        summary = json.loads((tmp_path / machine / "summary.json").read_text())
        assert summary["peers"][0]["steps"] == 30


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_join_asks_from_the_interface_that_routes_to_the_member(tmp_path: Path) -> None:
    """A review's probe: on a machine whose default route leaves by another interface, `join`
    told the member to answer there (unreachable from it) and timed out blaming the member,
    where `peer --bootstrap` got in."""
    config = write_config(tmp_path / "exp.toml", small_config(tmp_path, peers=2, steps=10))
    with Hosts(2) as hosts:
        inside = hosts.prefix(1)
        for command in (
            ["ip", "link", "add", "gdlx", "type", "veth", "peer", "name", "gdly"],
            ["ip", "addr", "add", "10.254.254.2/24", "dev", "gdlx"],
            ["ip", "link", "set", "gdlx", "up"],
            ["ip", "link", "set", "gdly", "up"],
            ["ip", "route", "add", "default", "via", "10.254.254.1"],
        ):
            subprocess.run([*inside, *command], check=True)  # a default route the member misses
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        founder = _founder(hosts, config, tmp_path, env)
        try:
            assert founder.stdout is not None
            address = founder.stdout.readline().split()[-1]
            joined = subprocess.run(
                [*inside, *gossipdl_cmd("join", address, "--listen", "tcp://0.0.0.0:0",
                 "--timeout", "10", "--out", str(tmp_path / "m1"))],
                capture_output=True, text=True, timeout=120, env=env,
            )  # fmt: skip
            assert joined.returncode == 0, joined.stderr
            assert founder.wait(60) == 0
        finally:
            if founder.poll() is None:
                founder.kill()
    listed = {e["address"] for e in json.loads((tmp_path / "m1" / "peers.json").read_text())}
    assert any(a.startswith(f"tcp://{hosts.ip(1)}:") for a in listed), listed


def test_join_tells_the_member_to_answer_at_its_advertised_address() -> None:
    """``--advertise`` reaches the config's request too (a NAT'd joiner is reached only
    there); the member's answer goes where the request says."""
    from gossipdl.peers.bootstrap import fetch_swarm_info
    from gossipdl.peers.peer import PeerError
    from gossipdl.transport import Message, Transport

    asked_at: list[str] = []

    def note(msg: Message) -> None:
        asked_at.append(msg.meta["address"])

    member = Transport("tcp://127.0.0.1:0", note, name="member")  # notes, never answers
    advertised = f"tcp://127.0.0.1:{_free_port()}"
    try:
        with pytest.raises(PeerError, match=f"can it reach us at {advertised}"):
            fetch_swarm_info(member.address, timeout=1.5, advertise=advertised)
    finally:
        member.close(flush_timeout=0)
    assert asked_at and set(asked_at) == {advertised}


def test_a_dead_bootstrap_is_one_error_within_seconds(tmp_path: Path) -> None:
    config = small_config(tmp_path, peers=2, startup_timeout=LONG)
    config = write_config(tmp_path / "exp.toml", config)
    dead = f"tcp://127.0.0.1:{_free_port()}"
    commands = (
        ("peer", "--config", str(config), "--bootstrap", dead, "--out", str(tmp_path / "p")),
        ("join", dead, "--timeout", "3", "--out", str(tmp_path / "j")),
    )
    with ThreadPoolExecutor(len(commands)) as pool:  # both at once: each is a fresh interpreter
        results = list(pool.map(lambda command: _run(*command), commands))
    for command, done in zip(commands, results, strict=True):
        assert done.returncode == 2, (command, done.stderr)
        errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
        assert len(errors) == 1 and "connection refused" in done.stderr, done.stderr
        assert "send queue" not in done.stderr


def test_a_plain_peer_meeting_a_secure_swarm_is_told_so(tmp_path: Path) -> None:
    public, _ = generate_keys(tmp_path / "keys")
    allow = tmp_path / "allow.txt"
    allow.write_text(f"{load_curve_public(public)}  # founder\n")
    config = small_config(tmp_path, peers=2, startup_timeout=LONG)
    config = write_config(tmp_path / "exp.toml", config)
    founder, address = start_peer("--config", str(config), "--secure", "--keys",
                                  str(tmp_path / "keys"), "--allow", str(allow), "--out",
                                  str(tmp_path / "f"), log=tmp_path / "f.log")  # fmt: skip
    try:
        done = _run("peer", "--config", str(config), "--bootstrap", address,
                    "--out", str(tmp_path / "p"))  # fmt: skip
        assert done.returncode == 2, done.stderr
        text = " ".join(done.stderr.split())
        assert "secure swarm (CURVE)" in text and "--secure" in text, text
    finally:
        founder.kill()
        founder.wait()


def test_a_join_after_the_swarm_finished_is_told_so(tmp_path: Path) -> None:
    """Two peers that trained their last step but still listen: a newcomer would train no
    step, so its join is refused, naming why, instead of exiting 0 having done nothing."""
    config = small_config(tmp_path, peers=2, steps=3)
    peers: dict[int, Peer] = {}
    listening: list[str] = []

    def start(rank: int) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        peers[rank] = Peer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), rank=rank, min_peers=2,
            bootstrap=listening[0] if rank else None, on_listening=listening.append,
            swarm_config=to_dict(config),
        )  # fmt: skip
        peers[rank].sync_at_step(3)
        for _ in range(3):
            peers[rank].step()

    threads = [threading.Thread(target=start, args=(0,))]
    threads[0].start()
    wait_for(lambda: listening, 30, "the founder to listen")
    threads.append(threading.Thread(target=start, args=(1,)))
    threads[1].start()
    for t in threads:
        t.join(60)
    try:
        assert sorted(peers) == [0, 1] and all(p.steps == 3 for p in peers.values())
        done = _run("join", listening[0], "--timeout", str(LONG), "--out", str(tmp_path / "late"))
        assert done.returncode == 2, done.stderr
        assert "finished training" in " ".join(done.stderr.split()), done.stderr
    finally:
        for p in peers.values():
            p.close()
