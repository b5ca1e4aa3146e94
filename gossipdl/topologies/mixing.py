"""Pure functions on adjacency and mixing matrices: weights, connectivity, spectral gap.

A mixing matrix ``W`` says how a gossip round combines models: peer ``i`` moves to
``sum_j W[i, j] * x_j``. Averaging converges to the global mean when ``W`` is
symmetric, doubly stochastic and its graph is connected; how fast is set by the
spectral gap.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from gossipdl.topologies.errors import TopologyError

__all__ = [
    "BoolMatrix",
    "FloatMatrix",
    "check_adjacency",
    "connected_components",
    "is_connected",
    "is_doubly_stochastic",
    "metropolis_hastings",
    "spectral_gap",
]

BoolMatrix = npt.NDArray[np.bool_]
FloatMatrix = npt.NDArray[np.float64]


def check_adjacency(adj: npt.ArrayLike, n: int | None = None) -> BoolMatrix:
    """Return ``adj`` as a bool matrix, checked square, symmetric and loop-free, as gossip needs."""
    a = np.asarray(adj)
    if a.ndim != 2 or a.shape[0] != a.shape[1]:
        raise TopologyError(f"adjacency must be a square matrix, got shape {a.shape}")
    if n is not None and a.shape[0] != n:
        raise TopologyError(f"adjacency has {a.shape[0]} nodes, expected n={n}")
    if a.dtype != np.bool_:
        if not np.isin(a, (0, 1)).all():
            raise TopologyError("adjacency entries must be bool or 0/1")
        a = a.astype(np.bool_)
    loops = np.flatnonzero(np.diag(a))
    if loops.size:
        raise TopologyError(f"adjacency has a self loop at node {int(loops[0])}")
    asym = np.argwhere(a != a.T)
    if asym.size:
        i, j = (int(v) for v in asym[0])
        raise TopologyError(f"adjacency is not symmetric: entry ({i}, {j}) differs from ({j}, {i})")
    return a


def metropolis_hastings(adj: npt.ArrayLike) -> FloatMatrix:
    """Metropolis–Hastings weights: symmetric, doubly stochastic, and computable from local degrees.

    ``W[i, j] = 1 / (1 + max(d_i, d_j))`` for each edge ``i ~ j`` and
    ``W[i, i] = 1 - sum_{j != i} W[i, j]`` (always > 0, so no period-2 oscillation).
    Each peer needs only its own and its neighbours' degrees (Xiao & Boyd, 2004).
    """
    a = check_adjacency(adj)
    deg = a.sum(axis=1)
    w = np.where(a, 1.0 / (1.0 + np.maximum.outer(deg, deg)), 0.0).astype(np.float64)
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


def connected_components(adj: npt.ArrayLike) -> list[list[int]]:
    """Connected components of an undirected graph, each sorted, ordered by smallest node."""
    a = check_adjacency(adj)
    n = a.shape[0]
    seen = np.zeros(n, dtype=np.bool_)
    components: list[list[int]] = []
    for start in range(n):
        if seen[start]:
            continue
        member = np.zeros(n, dtype=np.bool_)
        member[start] = True
        frontier = np.array([start])
        while frontier.size:
            reached = a[frontier].any(axis=0) & ~member
            member |= reached
            frontier = np.flatnonzero(reached)
        seen |= member
        components.append(np.flatnonzero(member).tolist())
    return components


def is_connected(adj: npt.ArrayLike) -> bool:
    """Whether every node reaches every other: gossip needs that to reach consensus."""
    return len(connected_components(adj)) <= 1


def is_doubly_stochastic(w: npt.ArrayLike, tol: float = 1e-9) -> bool:
    """Whether ``w`` is square, nonnegative and every row and column sums to 1 (within ``tol``).

    Row sums of 1 keep a consensus fixed; column sums of 1 preserve the global mean.
    """
    m = np.asarray(w, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1] or not np.isfinite(m).all():
        return False
    return bool(
        (m >= -tol).all()
        and np.allclose(m.sum(axis=1), 1.0, rtol=0.0, atol=tol)
        and np.allclose(m.sum(axis=0), 1.0, rtol=0.0, atol=tol)
    )


def spectral_gap(w: npt.ArrayLike) -> float:
    """Spectral gap ``1 - |lambda_2|`` of a doubly stochastic mixing matrix, in [0, 1].

    For symmetric ``W`` (every static topology here), ``|lambda_2|`` is the second
    largest eigenvalue magnitude; the disagreement ``x - mean(x)`` shrinks by at
    least that factor per round, so a larger gap mixes faster. The gap is 0 when
    the graph is disconnected (or the round oscillates), 1 when one round averages
    exactly (complete graph, ``n = 1``). For a non-symmetric ``W`` (e.g. the product
    of one period of a time-varying topology) the same contraction factor is
    ``||W - 11^T / n||_2``, which equals ``|lambda_2|`` whenever ``W`` is symmetric.
    """
    m = np.asarray(w, dtype=np.float64)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise TopologyError(f"mixing matrix must be square, got shape {m.shape}")
    n = m.shape[0]
    if n <= 1:
        return 1.0
    if np.allclose(m, m.T, rtol=0.0, atol=1e-12):
        magnitudes = np.sort(np.abs(np.linalg.eigvalsh((m + m.T) / 2.0)))
        second = float(magnitudes[-2])
    else:
        if not is_doubly_stochastic(m):
            raise TopologyError("a non-symmetric mixing matrix must be doubly stochastic")
        second = float(np.linalg.norm(m - 1.0 / n, ord=2))
    return min(1.0, max(0.0, 1.0 - second))
