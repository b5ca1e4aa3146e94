"""Rank, world size and the bootstrap address from the launchers users already run.

torchrun (and ``torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``; SLURM's ``srun`` sets ``SLURM_PROCID``,
``SLURM_NTASKS`` and ``SLURM_NODELIST``. Rank 0 founds the swarm on the
master address; every other rank joins through it. Under SLURM the master is
the first node of the allocation unless ``MASTER_ADDR`` says otherwise, and
the port is ``MASTER_PORT`` or 29500, torchrun's default. Under torchrun the
swarm uses ``MASTER_PORT + 1``: torchrun's own rendezvous store already
listens on ``MASTER_PORT``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gossipdl.numerals import is_decimal
from gossipdl.transport.address_syntax import MAX_PORT

DEFAULT_PORT = 29500
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class LaunchEnvError(ValueError):
    """A launcher variable that cannot be used; the message names it."""


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in a launched job."""

    rank: int
    world_size: int
    host: str  # rank 0's host
    port: int
    source: str  # "torchrun" or "slurm"
    local_rank: int = 0  # LOCAL_RANK / SLURM_LOCALID: which GPU of this machine

    @property
    def bootstrap(self) -> str:
        """The address every rank but 0 joins through."""
        return f"tcp://{self.host}:{self.port}"

    @property
    def listen(self) -> str:
        """Where this rank binds: rank 0 on the master port, the others on any free port;
        on every interface unless the master is this machine's loopback."""
        interface = "127.0.0.1" if self.host in _LOOPBACK else "0.0.0.0"
        return f"tcp://{interface}:{self.port if self.rank == 0 else 0}"


def _int(env: Mapping[str, str], name: str, minimum: int) -> int:
    value = env[name]
    if not is_decimal(value.strip()) or int(value) < minimum:
        raise LaunchEnvError(f"{name}={value!r} is not an integer >= {minimum}")
    return int(value)


def _swarm_port(env: Mapping[str, str], source: str) -> int:
    """The port rank 0 founds the swarm on: ``MASTER_PORT`` (+ 1 under torchrun, whose
    rendezvous store holds ``MASTER_PORT`` itself), or :data:`DEFAULT_PORT`; refused where it
    would pass :data:`MAX_PORT` (a socket would wrap it round to another port in silence)."""
    if "MASTER_PORT" not in env:
        return DEFAULT_PORT
    shift = 1 if source == "torchrun" else 0
    port = _int(env, "MASTER_PORT", 1) + shift
    if port > MAX_PORT:
        rule = "MASTER_PORT + 1 (torchrun's store holds MASTER_PORT)" if shift else "MASTER_PORT"
        raise LaunchEnvError(
            f"MASTER_PORT={env['MASTER_PORT']!r}: the swarm listens on {rule}, which must "
            f"be at most {MAX_PORT}; give a MASTER_PORT of at most {MAX_PORT - shift}"
        )
    return port


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list.

    Example:
        >>> first_host("gpu[07-10,12],cpu1"), first_host("node3,node4"), first_host("n[001]")
        ('gpu07', 'node3', 'n001')
    """
    match = re.match(r"\s*([^,\[\s]+)(?:\[([^\]]*)\])?", nodelist)
    if match is None or not match.group(1):
        raise LaunchEnvError(f"SLURM_NODELIST={nodelist!r} names no host")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0].strip()
    if not is_decimal(first):
        raise LaunchEnvError(f"SLURM_NODELIST={nodelist!r}: cannot read the range {ranges!r}")
    return prefix + first


def from_environment(env: Mapping[str, str]) -> LaunchEnv | None:
    """The launch described by ``env`` (torchrun's variables first, then SLURM's), or None."""
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        source, rank, world = "torchrun", _int(env, "RANK", 0), _int(env, "WORLD_SIZE", 1)
        host, local = env["MASTER_ADDR"], "LOCAL_RANK"
    elif all(k in env for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_NODELIST")):
        source, rank, world = "slurm", _int(env, "SLURM_PROCID", 0), _int(env, "SLURM_NTASKS", 1)
        host = env.get("MASTER_ADDR") or first_host(env["SLURM_NODELIST"])
        local = "SLURM_LOCALID"
    else:
        return None
    local_rank = _int(env, local, 0) if local in env else 0
    port = _swarm_port(env, source)
    if rank >= world:
        raise LaunchEnvError(f"rank {rank} is not below the world size {world} ({source})")
    if not host.strip():
        raise LaunchEnvError("MASTER_ADDR is empty")
    return LaunchEnv(rank, world, host.strip(), port, source, local_rank)
