"""Fallback baselines over the same transport: ring all-reduce and the parameter server.

Their protocols are state machines in :mod:`gossipdl.protocol` (``ring``, ``ps_server``,
``ps_worker``); here are their real drivers, the shared-memory all-reduce of ranks on one
host (``shared_reduce``), and the names a user of the baselines needs.
"""

from gossipdl.coordinator.ring import (
    RING_CODECS,
    RingAllReduce,
    RingError,
    RingGroup,
    check_ring_codec,
    chunk_bounds,
)
from gossipdl.coordinator.server import serve
from gossipdl.coordinator.worker import ServerError, ServerWorker
from gossipdl.protocol.ps_server import PS_RULES, ShardServer, fedavg_pick
from gossipdl.protocol.staleness import Staleness, parse_staleness

__all__ = [
    "PS_RULES",
    "RING_CODECS",
    "RingAllReduce",
    "RingError",
    "RingGroup",
    "ServerError",
    "ServerWorker",
    "ShardServer",
    "Staleness",
    "check_ring_codec",
    "chunk_bounds",
    "fedavg_pick",
    "parse_staleness",
    "serve",
]
