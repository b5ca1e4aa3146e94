"""Deterministic static graph families: ring, torus, star, complete, exponential."""

from __future__ import annotations

import math

from gossipdl.topologies.base import StaticTopology, check_peer_count
from gossipdl.topologies.errors import TopologyError

__all__ = ["complete", "exponential", "ring", "star", "torus", "torus_shape"]


def ring(n: int) -> StaticTopology:
    """Cycle ``0 - 1 - ... - (n-1) - 0``: two neighbours each, slow to mix (gap ~1/n^2)."""
    n = check_peer_count(n)
    if n < 2:
        raise TopologyError(f"ring needs at least 2 peers, got n={n}")
    return StaticTopology.from_edges(n, ((i, (i + 1) % n) for i in range(n)), name="ring")


def _is_grid(n: int) -> bool:
    """Whether ``n`` factors as rows x cols with both at least 2."""
    return n >= 4 and any(n % r == 0 for r in range(2, math.isqrt(n) + 1))


def _grid_hint(n: int) -> str:
    """The nearest peer counts around ``n`` that form a torus, for error messages."""
    below = next((m for m in range(n - 1, 3, -1) if _is_grid(m)), None)
    above = next(m for m in range(max(n + 1, 4), 2 * n + 5) if _is_grid(m))
    near = ", ".join(str(m) for m in (below, above) if m is not None)
    return f"valid counts are 4, 6, 8, 9, 10, 12, ... (nearest: {near})"


def torus_shape(n: int) -> tuple[int, int]:
    """Most square ``(rows, cols)`` grid for ``n`` peers: rows the largest divisor <= sqrt(n)."""
    n = check_peer_count(n)
    if not _is_grid(n):
        why = "is too small" if n < 4 else "is prime"
        raise TopologyError(
            f"torus needs a peer count that is a rows x cols grid with rows, cols >= 2; "
            f"n={n} {why}; {_grid_hint(n)}; or give the shape explicitly, e.g. torus:2x4 for n=8"
        )
    rows = max(r for r in range(2, math.isqrt(n) + 1) if n % r == 0)
    return rows, n // rows


def torus(n: int, rows: int | None = None, cols: int | None = None) -> StaticTopology:
    """2-D grid with wraparound: four neighbours each (fewer when a side is 2), gap ~ 1/n.

    Node ``r * cols + c`` sits at row ``r``, column ``c``. Without ``rows`` and
    ``cols`` the most square shape is chosen (see :func:`torus_shape`).
    """
    n = check_peer_count(n)
    if rows is None and cols is None:
        rows, cols = torus_shape(n)
    elif rows is None or cols is None:
        raise TopologyError(f"torus needs both rows and cols or neither, got {rows=}, {cols=}")
    if rows < 2 or cols < 2:
        raise TopologyError(f"torus:{rows}x{cols} needs rows and cols >= 2")
    if rows * cols != n:
        raise TopologyError(
            f"torus:{rows}x{cols} has {rows * cols} peers but n={n}; "
            f"use n={rows * cols}, or a shape with rows * cols = {n}"
            + (f" such as torus:{'x'.join(map(str, torus_shape(n)))}" if _is_grid(n) else "")
        )
    edges = []
    for r in range(rows):
        for c in range(cols):
            node = r * cols + c
            edges.append((node, r * cols + (c + 1) % cols))
            edges.append((node, ((r + 1) % rows) * cols + c))
    return StaticTopology.from_edges(n, edges, name=f"torus:{rows}x{cols}")


def star(n: int) -> StaticTopology:
    """Hub 0 linked to every other peer: a server in disguise, the hub carries all traffic."""
    n = check_peer_count(n)
    return StaticTopology.from_edges(n, ((0, i) for i in range(1, n)), name="star")


def complete(n: int) -> StaticTopology:
    """Every pair linked: one round averages exactly (gap 1) at n - 1 messages per peer."""
    n = check_peer_count(n)
    edges = ((i, j) for i in range(n) for j in range(i + 1, n))
    return StaticTopology.from_edges(n, edges, name="complete")


def exponential(n: int) -> StaticTopology:
    """Static exponential graph: ``i ~ i +- 2^k (mod n)`` for every ``2^k < n``.

    O(log n) neighbours and a gap that shrinks only like 1/log n (Assran et
    al., 2019; Ying et al., 2021), made undirected here so weights are symmetric.
    """
    n = check_peer_count(n)
    hops = [1 << k for k in range((n - 1).bit_length())]  # exactly the powers of 2 below n
    edges = ((i, (i + h) % n) for i in range(n) for h in hops)
    return StaticTopology.from_edges(n, edges, name="exponential")
