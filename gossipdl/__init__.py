"""gossipdl: decentralized (gossip) deep learning over ZeroMQ, no central server.

>>> import gossipdl
>>> gossipdl.build_topology("ring", 4).neighbors(0)
[1, 3]
"""

from gossipdl.config import Config, ConfigError, load_config
from gossipdl.peers import Peer, PeerError
from gossipdl.topologies import build_topology

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "Peer", "PeerError", "build_topology", "load_config"]
