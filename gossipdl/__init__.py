"""gossipdl: decentralized (gossip) deep learning over ZeroMQ, no central server.

>>> import gossipdl
>>> gossipdl.build_topology("ring", 4).neighbors(0)
[1, 3]
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossipdl.config import Config, ConfigError, load_config
    from gossipdl.peers import Peer, PeerError
    from gossipdl.topologies import build_topology

__version__ = "0.1.0"
# Public names, imported when first used: the protocol core and the simulator import this
# package without loading the real engine's sockets and threads.
_HOMES = {
    "Config": "gossipdl.config",
    "ConfigError": "gossipdl.config",
    "load_config": "gossipdl.config",
    "Peer": "gossipdl.peers",
    "PeerError": "gossipdl.peers",
    "build_topology": "gossipdl.topologies",
}


def __getattr__(name: str) -> Any:
    """The public name ``name`` from the module it lives in."""
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Config", "ConfigError", "Peer", "PeerError", "build_topology", "load_config"]
