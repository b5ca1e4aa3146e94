"""torchrun- and SLURM-style launches: rank, world size and bootstrap from the environment."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from conftest import small_config, write_config

from gossipdl.experiments.forking import ForkedCommand
from gossipdl.peers.launch_env import LaunchEnvError, first_host, from_environment

TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "6000"}
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NODELIST": "gpu[03-06]"}


def test_torchrun_variables_give_rank_world_and_the_founder_address() -> None:
    env = from_environment({**TORCHRUN, "LOCAL_RANK": "1"})
    assert env is not None and (env.rank, env.world_size, env.local_rank) == (2, 4, 1)
    # torchrun's own store holds MASTER_PORT: the swarm takes the next one
    assert env.bootstrap == "tcp://10.0.0.5:6001" and env.listen == "tcp://0.0.0.0:0"


def test_slurm_variables_use_the_first_node_and_torchruns_default_port() -> None:
    env = from_environment(SLURM)
    assert env is not None and env.source == "slurm" and env.rank == 0
    assert env.bootstrap == "tcp://gpu03:29500" and env.listen == "tcp://0.0.0.0:29500"
    assert from_environment({**SLURM, "MASTER_ADDR": "head", "MASTER_PORT": "7"}).bootstrap == (
        "tcp://head:7"
    )


def test_the_highest_master_port_leaves_the_swarm_a_port() -> None:
    env = from_environment({**TORCHRUN, "MASTER_PORT": "65534"})
    assert env is not None and env.bootstrap == "tcp://10.0.0.5:65535"
    env = from_environment({**SLURM, "MASTER_PORT": "65535"})
    assert env is not None and env.bootstrap == "tcp://gpu03:65535"
    with pytest.raises(LaunchEnvError) as refused:
        from_environment({**TORCHRUN, "MASTER_PORT": "65535"})
    assert "the swarm listens on MASTER_PORT + 1 (torchrun's store holds" in str(refused.value)


def test_no_launcher_means_no_launch_env() -> None:
    assert from_environment({"RANK": "1"}) is None and from_environment({}) is None


@pytest.mark.parametrize(
    ("nodelist", "host"),
    [("n1", "n1"), ("a,b", "a"), ("gpu[07-10,12],cpu1", "gpu07"), ("x[001]", "x001")],
)
def test_first_host_of_a_slurm_node_list(nodelist: str, host: str) -> None:
    assert first_host(nodelist) == host


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**TORCHRUN, "RANK": "x"}, "RANK='x' is not an integer"),
        ({**TORCHRUN, "WORLD_SIZE": "²"}, "WORLD_SIZE='²' is not an integer"),
        ({**SLURM, "SLURM_NODELIST": "n[①-2]"}, "cannot read the range"),
        ({**TORCHRUN, "RANK": "4"}, "rank 4 is not below the world size 4"),
        ({**TORCHRUN, "MASTER_PORT": "-1"}, "MASTER_PORT='-1'"),
        # a port past 65535 wrapped round to another in silence (99998 + 1: 34463)
        ({**TORCHRUN, "MASTER_PORT": "65535"}, "MASTER_PORT='65535': the swarm listens on"),
        ({**TORCHRUN, "MASTER_PORT": "99998"}, "give a MASTER_PORT of at most 65534"),
        ({**SLURM, "MASTER_PORT": "65536"}, "listens on MASTER_PORT, which must be at most 65535"),
        ({**TORCHRUN, "MASTER_ADDR": " "}, "MASTER_ADDR is empty"),
        ({**SLURM, "SLURM_NODELIST": "[1-2]"}, "names no host"),
        ({**SLURM, "SLURM_NODELIST": "n[a-b]"}, "cannot read the range"),
    ],
)
def test_bad_launcher_variables_are_named(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchEnvError, match=message.replace("[", r"\[")):
        from_environment(env)


def _free_port_pair() -> int:
    """A port p with p + 1 free too (torchrun-style peers take MASTER_PORT + 1)."""
    while True:
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = int(a.getsockname()[1])
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port


@pytest.mark.parametrize("launcher", ["torchrun", "slurm"])
def test_peers_started_like_torchrun_or_srun_form_one_swarm(launcher: str, tmp_path: Path) -> None:
    """Three `gossipdl peer` processes with only the launcher's variables (the config says 2
    peers; the world size wins) train together to the end."""
    config = small_config(tmp_path, peers=2, steps=20)
    path = write_config(tmp_path / "job.toml", config)
    port = str(_free_port_pair())
    procs = []
    for rank in range(3):
        if launcher == "torchrun":
            extra = {"RANK": str(rank), "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"}
        else:
            extra = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "3", "SLURM_NODELIST": "localhost"}
        env = {**os.environ, **extra, "MASTER_PORT": port, "OMP_NUM_THREADS": "1"}
        for name in ("RANK", "SLURM_PROCID", "WORLD_SIZE", "SLURM_NTASKS"):
            if name not in extra:
                env.pop(name, None)
        args = ["peer", "--config", str(path), "--out", str(tmp_path / "run")]
        procs.append(ForkedCommand(args, env, tmp_path / f"{rank}.log"))  # as the launcher does
    try:
        for rank, proc in enumerate(procs):
            code = proc.wait(timeout=120)
            logs = "\n".join((tmp_path / f"{r}.log").read_text() for r in range(3))
            assert code == 0, f"rank {rank} failed; every rank's log:\n{logs}"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for rank in range(3):
        lines = (tmp_path / "run" / "peers" / f"{rank}.jsonl").read_text().splitlines()
        final = json.loads(lines[-1])
        assert final["final"] and final["step"] == 20 and final["syncs"] == 20
    host, at = ("127.0.0.1", int(port) + 1) if launcher == "torchrun" else ("localhost", port)
    log = (tmp_path / "0.log").read_text()
    assert f"{launcher}: rank 0 of 3, swarm at tcp://{host}:{at}" in log
