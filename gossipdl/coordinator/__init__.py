"""Fallback baselines over the same transport: ring all-reduce and the parameter server."""

from gossipdl.coordinator.ring import (
    RING_CODECS,
    RingAllReduce,
    RingError,
    RingGroup,
    check_ring_codec,
    chunk_bounds,
)

__all__ = [
    "RING_CODECS",
    "RingAllReduce",
    "RingError",
    "RingGroup",
    "check_ring_codec",
    "chunk_bounds",
]
