"""Peers on three emulated hosts (network namespaces on a bridge): join over the bridge, lose
one host's link past dead_after mid-run, and come back together. Needs root (skipped
otherwise)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import last_record, small_config, wait_for

from gossipdl.config import to_toml
from gossipdl.experiments.launcher import Placement, Swarm
from gossipdl.experiments.namespaces import Hosts, why_not
from gossipdl.rundir import RunDir

pytestmark = pytest.mark.skipif(why_not() is not None, reason=str(why_not()))


def test_a_host_cut_off_past_dead_after_is_dropped_then_rejoins(tmp_path: Path) -> None:
    """The real transport across namespaces: the cut host is declared dead by the other two,
    who train on; once its link is back it hears it was dropped and rejoins. (The protocol
    side of partitions is simulated, seeded, in test_sim_faults.py.)"""
    with Hosts(3) as hosts:
        config = small_config(
            tmp_path, peers=3, steps=1_000_000, heartbeat=0.3, dead_after=2.0,
            round_timeout=5.0, host=hosts.ip(0),
            profiles={"paced": {"peers": "*", "step_time": "20ms"}},  # idle peers spare the CPU
        )  # fmt: skip
        run = RunDir(config.out).create()
        run.config.write_text(to_toml(config))
        swarm = Swarm(config, run, place=lambda k: Placement(tuple(hosts.prefix(k)), hosts.ip(k)))

        def record(i: int) -> dict[str, Any]:
            return last_record(run.metrics(i)) or {}

        try:
            swarm.start()
            wait_for(lambda: all(record(i).get("step", 0) >= 20 for i in range(3)), 60,
                     "the three hosts to train together")  # fmt: skip
            every_host = {hosts.ip(k) for k in range(3)}  # one peer per host in peers.json
            wait_for(lambda: {a.split(":")[1][2:] for a in run.member_addresses().values()}
                     == every_host, 30, "peers.json to list a peer on every host")  # fmt: skip
            hosts.cut(2)
            wait_for(lambda: all(record(i).get("members") == 2 for i in (0, 1)), 30,
                     "hosts 0 and 1 to drop host 2")  # fmt: skip
            steps = record(0)["step"]
            wait_for(lambda: record(0)["step"] >= steps + 20, 30, "hosts 0 and 1 to train on")
            hosts.restore(2)
            wait_for(lambda: record(2).get("rejoins", 0) >= 1, 30, "host 2 to rejoin")
            wait_for(lambda: all(record(i).get("members") == 3 for i in range(3)), 30,
                     "every host to count three members again")  # fmt: skip
            misses = [record(i)["neighbour_misses"] for i in range(3)]
            steps = record(2)["step"]
            wait_for(lambda: record(2)["step"] >= steps + 20, 30, "the swarm to train on")
            assert [record(i)["neighbour_misses"] for i in range(3)] == misses
            assert all(p.poll() is None for p in swarm.procs.values())
        finally:
            swarm.stop()
            swarm.close()
        assert [p.returncode for p in swarm.procs.values()] == [130, 130, 130]  # SIGINT: 128 + 2
        assert "says we were dropped; rejoining" in run.log(2).read_text()


@pytest.mark.parametrize("mbit", [1, 10, 100])
def test_kernel_shaping_holds_a_transfer_to_the_configured_rate(tmp_path: Path, mbit: int) -> None:
    """tc tbf on host 1's uplink, measured with a TCP transfer to host 0 over the bridge. Only
    the bound the shaper sets is asserted: a busy machine can read the bytes later (a lower
    rate, once 8.7 Mbit/s of 10 under the parallel suite), never sooner."""
    nbytes = int(mbit * 1e6 / 8 * 2)  # two seconds' worth
    receive = (
        "import socket, time\n"
        f"s = socket.socket(); s.bind(('{{ip}}', 7000)); s.listen(); c, _ = s.accept()\n"
        "got, first = 0, None\n"
        f"while got < {nbytes}:\n"
        "    data = c.recv(1 << 20)\n"
        "    first = first or time.monotonic()\n"
        "    got += len(data)\n"
        "print(got / (time.monotonic() - first))\n"
    )
    send = (  # the receiver may not listen yet: try again until it does
        "import socket, time\n"
        "deadline = time.monotonic() + 30\n"
        "while True:\n"
        "    try:\n"
        "        s = socket.create_connection(('{ip}', 7000), timeout=30)\n"
        "        break\n"
        "    except ConnectionRefusedError:\n"
        "        if time.monotonic() > deadline:\n"
        "            raise\n"
        "        time.sleep(0.05)\n"
        f"s.sendall(bytes({nbytes}))\n"
    )
    with Hosts(2) as hosts:
        hosts.shape(1, uplink_bps=mbit * 1e6)
        server = subprocess.Popen(
            [*hosts.prefix(0), sys.executable, "-c", receive.replace("{ip}", hosts.ip(0))],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        subprocess.run([*hosts.prefix(1), sys.executable, "-c", send.replace("{ip}", hosts.ip(0))],
                       check=True, timeout=60)  # fmt: skip
        out, _ = server.communicate(timeout=60)
    measured = 8 * float(out) / 1e6
    assert 0 < measured <= mbit * 1.10, f"{measured:.2f} Mbit/s"


def test_missing_netem_is_detected_and_said() -> None:
    with Hosts(1) as hosts:
        reason = hosts.netem_missing()
    assert reason is None or "latency and loss stay in user space" in reason


def test_two_sets_of_hosts_at_once_have_names_of_their_own() -> None:
    """Two in one process took the same names: the second's setup failed, and its cleanup
    deleted the first's namespaces while it used them."""
    with Hosts(1) as first, Hosts(1) as second:
        assert first.names != second.names and first.bridge != second.bridge
        done = subprocess.run([*first.prefix(0), "true"], capture_output=True, timeout=30)
        assert done.returncode == 0
