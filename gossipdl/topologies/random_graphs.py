"""Seeded random graph families: random regular and Erdős–Rényi, always connected or an error."""

from __future__ import annotations

import math
from collections import defaultdict
from itertools import combinations

import numpy as np

from gossipdl.topologies.base import StaticTopology, check_peer_count
from gossipdl.topologies.errors import TopologyError
from gossipdl.topologies.mixing import connected_components

__all__ = ["erdos_renyi", "random_regular"]

_MAX_DRAWS = 1000
_MAX_RESHUFFLES = 1000


def _pair_stubs(n: int, degree: int, rng: np.random.Generator) -> set[tuple[int, int]] | None:
    """One try at a simple ``degree``-regular graph by random stub pairing (Steger & Wormald, 1999).

    Pairs that would make a loop or a repeated edge go back in the pool and are
    re-shuffled; returns None when the leftovers cannot (or keep failing to) be paired.
    """
    edges: set[tuple[int, int]] = set()
    stubs = [v for v in range(n) for _ in range(degree)]
    for _ in range(_MAX_RESHUFFLES):
        if not stubs:
            return edges
        shuffled = [stubs[i] for i in rng.permutation(len(stubs))]
        leftover: dict[int, int] = defaultdict(int)
        for u, v in zip(shuffled[::2], shuffled[1::2], strict=True):
            edge = (min(u, v), max(u, v))
            if u == v or edge in edges:
                leftover[u] += 1
                leftover[v] += 1
            else:
                edges.add(edge)
        pairable = any((a, b) not in edges for a, b in combinations(sorted(leftover), 2))
        if leftover and not pairable:
            return None
        stubs = [v for v, count in leftover.items() for _ in range(count)]
    return edges if not stubs else None


def random_regular(n: int, degree: int, seed: int = 0) -> StaticTopology:
    """A connected random graph where every peer has exactly ``degree`` neighbours.

    Expander-like: a good gap at a fixed degree. Reproducible for a given
    ``seed``; draws again until connected. For ``degree > (n-1)/2`` the
    complement of a random ``(n-1-degree)``-regular graph is drawn instead.
    """
    n = check_peer_count(n)
    spec = f"random-regular:{degree}"
    if isinstance(degree, bool) or not isinstance(degree, int | np.integer):
        raise TopologyError(f"{spec}: degree D must be an integer")
    degree = int(degree)
    if not 1 <= degree < n:
        raise TopologyError(f"{spec} needs 1 <= D < n, got D={degree} with n={n}")
    if (n * degree) % 2:
        raise TopologyError(
            f"{spec} needs n*D even, got n={n}, D={degree} (n*D={n * degree}); "
            "change D or n so one of them is even"
        )
    if degree == 1 and n > 2:
        raise TopologyError(f"{spec} with n={n} splits peers into disconnected pairs; use D >= 2")
    complement = degree > (n - 1) // 2
    draw_degree = n - 1 - degree if complement else degree
    rng = np.random.default_rng(seed)
    for _ in range(_MAX_DRAWS):
        edges = _pair_stubs(n, draw_degree, rng)
        if edges is None:
            continue
        adj = np.zeros((n, n), dtype=np.bool_)
        for u, v in edges:
            adj[u, v] = adj[v, u] = True
        if complement:
            adj = ~adj
            np.fill_diagonal(adj, False)
        if len(connected_components(adj)) == 1:
            return StaticTopology(adj, name=spec)
    raise TopologyError(
        f"{spec} with n={n}: no connected graph in {_MAX_DRAWS} draws from seed={seed}; "
        "try another seed or a larger D"
    )


def erdos_renyi(n: int, p: float, seed: int = 0) -> StaticTopology:
    """Random graph with each edge present independently with probability ``p``; seeded.

    Raises :class:`TopologyError` if the draw is disconnected rather than
    silently redrawing, so a given (n, p, seed) always means the same graph.
    Connectivity becomes likely once ``p`` exceeds about ``ln(n) / n``.
    """
    n = check_peer_count(n)
    spec = f"erdos-renyi:{p}"
    if not (isinstance(p, float | int) and not isinstance(p, bool) and 0.0 < p <= 1.0):
        raise TopologyError(f"{spec}: edge probability P must be in (0, 1], got P={p!r}")
    rng = np.random.default_rng(seed)
    upper = np.triu(rng.random((n, n)) < p, k=1)
    adj = upper | upper.T
    components = connected_components(adj)
    if len(components) > 1:
        threshold = math.log(n) / n
        raise TopologyError(
            f"{spec} with n={n} and seed={seed} drew a disconnected graph "
            f"({len(components)} components); try another seed or a larger P "
            f"(connectivity is likely above P = ln(n)/n = {threshold:.3g})"
        )
    return StaticTopology(adj, name=spec)
