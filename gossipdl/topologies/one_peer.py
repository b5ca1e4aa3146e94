"""Time-varying one-peer exponential graph: one partner per round, hops 1, 2, 4, ..."""

from __future__ import annotations

import numpy as np

from gossipdl.topologies.base import Topology, check_peer_count
from gossipdl.topologies.mixing import BoolMatrix

__all__ = ["OnePeerExponential"]


class OnePeerExponential(Topology):
    """Each round every peer averages with exactly one partner, cycling through hops 2^k.

    At round ``t`` let ``k = t mod period`` with ``period = ceil(log2 n)`` (at
    least 1). Peer ``i`` pairs with ``i XOR 2^k`` when that is ``< n``, and
    idles that round otherwise. The round's mixing matrix gives ``1/2`` to
    the partner and ``1/2`` to itself, and ``1`` to itself when idle (this is
    also what Metropolis–Hastings yields on a matching), so every round's
    ``W`` is symmetric and doubly stochastic. The union of the edges over one
    period is the hypercube restricted to ``0..n-1``, which is connected (clear
    the top bit of ``i`` to reach a smaller node), so gossip reaches consensus;
    when ``n`` is a power of two one period averages exactly (product = 11^T/n).

    This is the undirected (pairwise-exchange) variant of the one-peer
    exponential graph of Ying et al., "Exponential Graph is Provably Efficient
    for Decentralized Deep Training", NeurIPS 2021: one message per peer per
    round instead of O(log n).

    Example::

        >>> topo = OnePeerExponential(8)
        >>> topo.period, [topo.partner(0, t) for t in range(3)]
        (3, [1, 2, 4])
    """

    def __init__(self, n: int) -> None:
        """Create the schedule for ``n`` peers; ``period = max(1, ceil(log2 n))``."""
        n = check_peer_count(n)
        super().__init__(n, period=max(1, (n - 1).bit_length()), name="one-peer-exponential")

    def partner(self, rank: int, round: int = 0) -> int | None:
        """The single peer ``rank`` exchanges with at ``round``, or None if it idles."""
        rank = self._check_rank(rank)
        other = rank ^ (1 << self._round_key(round))
        return other if other < self.n else None

    def adjacency(self, round: int = 0) -> BoolMatrix:
        """The perfect-or-near-perfect matching ``i ~ i XOR 2^(round mod period)``."""
        hop = 1 << self._round_key(round)
        ranks = np.arange(self.n)
        partners = ranks ^ hop
        paired = partners < self.n
        adj = np.zeros((self.n, self.n), dtype=np.bool_)
        adj[ranks[paired], partners[paired]] = True
        return adj
