"""The topology interface: who talks to whom in each gossip round, and with what weights."""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from typing import TypeVar

import numpy as np
import numpy.typing as npt

from gossipdl.topologies.errors import TopologyError
from gossipdl.topologies.mixing import (
    BoolMatrix,
    FloatMatrix,
    check_adjacency,
    metropolis_hastings,
)

__all__ = ["StaticTopology", "Topology", "TopologyError", "check_peer_count"]

# Rounds repeat with the period, so caches are keyed by ``round % period``; a huge
# period (a user's topology) would grow them without bound, hence the cap.
_CACHE_LIMIT = 64
T = TypeVar("T")


def _remember(cache: dict[int, T], key: int, compute: Callable[[int], T]) -> T:
    """``cache[key]``, computed on first use; the cache is emptied when it reaches the cap."""
    if key not in cache:
        value = compute(key)
        if len(cache) >= _CACHE_LIMIT:
            cache.clear()
        cache[key] = value
    return cache[key]


def check_peer_count(n: int) -> int:
    """Return ``n`` as an int after checking it is a positive peer count."""
    if isinstance(n, bool):
        raise TopologyError(f"peer count n must be a positive integer, got n={n!r}")
    try:
        count = operator.index(n)
    except TypeError:
        raise TopologyError(f"peer count n must be a positive integer, got n={n!r}") from None
    if count < 1:
        raise TopologyError(f"peer count n must be at least 1, got n={count}")
    return count


class Topology(ABC):
    """A communication graph over peers ``0..n-1``, possibly changing from round to round.

    Subclasses call ``super().__init__(n, period=..., name=...)`` and implement
    :meth:`adjacency`; neighbours and Metropolis–Hastings mixing weights follow
    and are cached per round. To use other weights, override ``_mixing(round)``
    (it must return a symmetric doubly stochastic matrix). The graph at round
    ``t`` must depend only on ``t % period``.

    Example::

        >>> from gossipdl.topologies import build_topology
        >>> topo = build_topology("ring", n=5)
        >>> topo.neighbors(0), round(topo.weights(0)[1], 3)
        ([1, 4], 0.333)
    """

    n: int
    period: int

    def __init__(self, n: int, *, period: int = 1, name: str | None = None) -> None:
        """Set the peer count, the number of distinct rounds and the spec string."""
        self.n = check_peer_count(n)
        if isinstance(period, bool) or operator.index(period) < 1:
            raise TopologyError(f"period must be a positive integer, got period={period!r}")
        self.period = operator.index(period)
        self._name = name if name is not None else type(self).__name__
        self._adjacency_cache: dict[int, BoolMatrix] = {}
        self._mixing_cache: dict[int, FloatMatrix] = {}
        self._spread_cache: dict[int, int] = {}
        self._rows_cache: dict[int, dict[int, dict[int, float]]] = {}  # round key -> rank -> row

    @property
    def name(self) -> str:
        """The spec string this topology was built from, e.g. ``torus:3x3``."""
        return self._name

    @property
    def is_static(self) -> bool:
        """Whether every round uses the same graph (``period == 1``)."""
        return self.period == 1

    @abstractmethod
    def adjacency(self, round: int = 0) -> BoolMatrix:
        """Bool ``n x n`` matrix of the edges used at ``round``: symmetric, no self loops."""

    def neighbors(self, rank: int, round: int = 0) -> list[int]:
        """Sorted ranks that ``rank`` exchanges models with at ``round``."""
        rank = self._check_rank(rank)
        return [int(j) for j in np.flatnonzero(self._checked_adjacency(round)[rank])]

    def mixing_matrix(self, round: int = 0) -> FloatMatrix:
        """Float64 ``n x n`` gossip weights at ``round`` (read-only; copy to modify)."""
        return _remember(self._mixing_cache, self._round_key(round), self._checked_mixing)

    def weights(self, rank: int, round: int = 0) -> dict[int, float]:
        """Nonzero weights of row ``rank`` of the mixing matrix, self included, keyed by rank."""
        rank = self._check_rank(rank)
        rows = _remember(self._rows_cache, self._round_key(round), lambda _: {})
        if rank not in rows:  # every peer asks for its row every round: read it once
            row = self.mixing_matrix(round)[rank]
            ranks = sorted({int(j) for j in np.flatnonzero(row)} | {rank})
            rows[rank] = {j: float(row[j]) for j in ranks}
        return dict(rows[rank])

    def spread_rounds(self, round: int = 0) -> int:
        """Rounds until news that any peer has at ``round`` reaches every peer, moving one hop
        per round along that round's edges: the diameter, for a static graph.

        The dynamic trigger schedules its swarm-wide syncs this many rounds ahead.

        Example::

            >>> from gossipdl.topologies import build_topology
            >>> [build_topology(name, n=8).spread_rounds() for name in ("ring", "complete")]
            [4, 1]
        """
        return _remember(self._spread_cache, self._round_key(round), self._spread)

    def _spread(self, round: int) -> int:
        # known[i, j]: peer j has heard peer i's news. float32 products run on BLAS (int64
        # ones do not: 13 s for a ring of 400) and are exact: 0/1 entries, sums <= n < 2**24
        known = np.eye(self.n, dtype=np.float32)
        for k in range(self.n * self.period + 1):
            if known.all():
                return k
            edges = self._checked_adjacency(round + k).astype(np.float32)
            known = (known + known @ edges > 0).astype(np.float32)
        raise TopologyError(
            f"{self.name}: some peer never hears from another over {self.period} round(s); "
            "the graph is not connected"
        )

    def period_mixing_matrix(self) -> FloatMatrix:
        """Product ``W_{p-1} ... W_1 W_0`` of one period: what ``period`` rounds do together."""
        product = np.eye(self.n)
        for t in range(self.period):
            product = self.mixing_matrix(t) @ product
        return product

    def _mixing(self, round: int) -> FloatMatrix:
        """Mixing matrix of one round; Metropolis–Hastings weights of its adjacency by default."""
        return metropolis_hastings(self._checked_adjacency(round))

    def _checked_adjacency(self, round: int) -> BoolMatrix:
        """Adjacency of ``round``, validated once and cached as a read-only array."""
        return _remember(self._adjacency_cache, self._round_key(round), self._read_adjacency)

    def _read_adjacency(self, key: int) -> BoolMatrix:
        adjacency = check_adjacency(self.adjacency(key), n=self.n).copy()
        adjacency.setflags(write=False)
        return adjacency

    def _checked_mixing(self, key: int) -> FloatMatrix:
        """The weights of round ``key``: symmetric, doubly stochastic and nonnegative, and
        nonzero only on the round's edges and the diagonal, as averaging needs (a plug-in's
        ``_mixing`` may promise that and break it)."""
        w = np.array(self._mixing(key), dtype=np.float64)
        if w.shape != (self.n, self.n):
            raise TopologyError(
                f"{self.name}: mixing matrix has shape {w.shape}, expected ({self.n}, {self.n})"
            )
        stochastic = np.allclose(w.sum(axis=1), 1.0, atol=1e-9) and np.allclose(w, w.T, atol=1e-9)
        if not (stochastic and np.all(w >= 0)):
            raise TopologyError(
                f"{self.name}: the mixing matrix of round {key} is not symmetric, doubly "
                "stochastic and nonnegative; averaging with it would move the swarm's mean"
            )
        off_edges = ~(self._checked_adjacency(key) | np.eye(self.n, dtype=bool))
        if np.any(w[off_edges] != 0):
            raise TopologyError(
                f"{self.name}: the mixing matrix of round {key} weighs peers that are not "
                "neighbours in that round"
            )
        w.setflags(write=False)
        return w

    def _round_key(self, round: int) -> int:
        """Reduce a round number to its slot in the period."""
        if isinstance(round, bool):
            raise TopologyError(f"round must be a non-negative integer, got round={round!r}")
        r = operator.index(round)
        if r < 0:
            raise TopologyError(f"round must be a non-negative integer, got round={r}")
        return r % self.period

    def _check_rank(self, rank: int) -> int:
        """Return ``rank`` as an int after checking it names a peer."""
        r = operator.index(rank)
        if not 0 <= r < self.n:
            raise TopologyError(f"{self.name}: rank {r} is out of range for n={self.n}")
        return r

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, n={self.n}, period={self.period})"


class StaticTopology(Topology):
    """A fixed graph: the same neighbours and weights in every round.

    Example::

        >>> import numpy as np
        >>> StaticTopology(np.array([[0, 1], [1, 0]]), name="pair").neighbors(1)
        [0]
    """

    def __init__(self, adjacency: npt.ArrayLike, *, name: str = "static") -> None:
        """Wrap a symmetric, loop-free adjacency matrix (bool or 0/1)."""
        adj = check_adjacency(adjacency).copy()
        super().__init__(adj.shape[0], period=1, name=name)
        adj.setflags(write=False)
        self._adj = adj

    @classmethod
    def from_edges(
        cls, n: int, edges: Iterable[tuple[int, int]], *, name: str = "static"
    ) -> StaticTopology:
        """Build from undirected edges ``(i, j)`` over nodes ``0..n-1``; duplicates are merged."""
        n = check_peer_count(n)
        adj = np.zeros((n, n), dtype=np.bool_)
        for i, j in edges:
            if not (0 <= i < n and 0 <= j < n):
                raise TopologyError(f"{name}: edge ({i}, {j}) names a node outside 0..{n - 1}")
            if i == j:
                raise TopologyError(f"{name}: edge ({i}, {j}) is a self loop")
            adj[i, j] = adj[j, i] = True
        return cls(adj, name=name)

    def adjacency(self, round: int = 0) -> BoolMatrix:
        """The fixed adjacency matrix (read-only), whatever the round."""
        self._round_key(round)
        return self._adj
