"""The peer runtime: the Peer object, membership, inbox, and the built-in training loop."""

from gossipdl.peers.membership import Member, Membership
from gossipdl.peers.peer import Peer, PeerError

__all__ = ["Member", "Membership", "Peer", "PeerError"]
