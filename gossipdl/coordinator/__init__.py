"""Fallback baselines over the same transport: ring all-reduce and the parameter server."""

from gossipdl.coordinator.ring import (
    RING_CODECS,
    RingAllReduce,
    RingError,
    RingGroup,
    check_ring_codec,
    chunk_bounds,
)
from gossipdl.coordinator.server import PS_RULES, ShardServer, fedavg_pick, serve
from gossipdl.coordinator.staleness import Staleness, parse_staleness
from gossipdl.coordinator.worker import ServerError, ServerWorker

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
