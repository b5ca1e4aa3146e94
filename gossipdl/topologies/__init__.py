"""Communication graphs for gossip: who talks to whom each round, and with what weights.

Pure graph code (numpy only). Build a topology from a spec string, then ask it
for neighbours and mixing weights per round::

    >>> from gossipdl.topologies import build_topology, spectral_gap
    >>> topo = build_topology("ring", n=8)
    >>> topo.neighbors(0)
    [1, 7]
    >>> round(spectral_gap(topo.mixing_matrix()), 4)
    0.1953
"""

from gossipdl.topologies.base import StaticTopology, Topology
from gossipdl.topologies.describe import format_topology
from gossipdl.topologies.errors import TopologyError
from gossipdl.topologies.mixing import (
    connected_components,
    is_connected,
    is_doubly_stochastic,
    metropolis_hastings,
    spectral_gap,
)
from gossipdl.topologies.one_peer import OnePeerExponential
from gossipdl.topologies.registry import (
    TOPOLOGY_NAMES,
    TopologyFactory,
    available_topologies,
    build_topology,
    builtin_topology,
    register_topology,
)

__all__ = [
    "TOPOLOGY_NAMES",
    "OnePeerExponential",
    "StaticTopology",
    "Topology",
    "TopologyError",
    "TopologyFactory",
    "available_topologies",
    "build_topology",
    "builtin_topology",
    "connected_components",
    "format_topology",
    "is_connected",
    "is_doubly_stochastic",
    "metropolis_hastings",
    "register_topology",
    "spectral_gap",
]
