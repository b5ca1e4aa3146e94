"""Human-readable summary of a topology: neighbours, mixing weights, spectral gap."""

from __future__ import annotations

from gossipdl.topologies.base import Topology
from gossipdl.topologies.mixing import FloatMatrix, spectral_gap

__all__ = ["format_topology"]

MAX_MATRIX_PEERS = 16
"""Mixing matrices are printed only up to this many peers; beyond, they are unreadable."""

MAX_ROUNDS_SHOWN = 4
"""How many rounds of a time-varying topology are spelled out."""


def _format_weight(value: float) -> str:
    """A weight in at most 5 characters; exact zeros as '.' so the sparsity pattern stands out."""
    return "." if value == 0.0 else f"{value:.3g}"


def _format_matrix(w: FloatMatrix, indent: str) -> list[str]:
    """Rows of ``w`` with rank labels, right-aligned in equal columns."""
    n = w.shape[0]
    cells = [[_format_weight(float(v)) for v in row] for row in w]
    width = max(5, *(len(c) for row in cells for c in row))
    label = len(str(n - 1))
    header = indent + " " * label + "  " + " ".join(f"{j:>{width}}" for j in range(n))
    rows = [
        f"{indent}{i:>{label}}  " + " ".join(f"{c:>{width}}" for c in row)
        for i, row in enumerate(cells)
    ]
    return [header, *rows]


def _format_round(topology: Topology, round: int, indent: str) -> list[str]:
    """Neighbour lists, mixing matrix and gap of one round."""
    label = len(str(topology.n - 1))
    lines = [f"{indent}neighbours:"]
    for rank in range(topology.n):
        peers = " ".join(map(str, topology.neighbors(rank, round))) or "(none)"
        lines.append(f"{indent}  {rank:>{label}}: {peers}")
    w = topology.mixing_matrix(round)
    if topology.n <= MAX_MATRIX_PEERS:
        lines.append(f"{indent}mixing matrix:")
        lines.extend(_format_matrix(w, indent + "  "))
    else:
        lines.append(
            f"{indent}mixing matrix: {topology.n} x {topology.n}, not shown above "
            f"{MAX_MATRIX_PEERS} peers (see Topology.mixing_matrix)"
        )
    lines.append(f"{indent}spectral gap: {spectral_gap(w):.4f}")
    return lines


def format_topology(topology: Topology, round: int = 0) -> str:
    """Text for ``gossipdl topology show``: who talks to whom, with what weights, how fast it mixes.

    Static topologies show ``round``; time-varying ones show up to
    ``MAX_ROUNDS_SHOWN`` rounds from ``round`` and the spectral gap of one
    whole period's product ``W_{p-1} ... W_0``.

    Example::

        >>> from gossipdl.topologies import build_topology
        >>> print(format_topology(build_topology("ring", n=3)).splitlines()[0])
        ring: n=3, static
    """
    if topology.is_static:
        lines = [f"{topology.name}: n={topology.n}, static"]
        lines.extend(_format_round(topology, round, indent=""))
        lines.append("(spectral gap = 1 - second largest |eigenvalue| of W; larger mixes faster)")
        return "\n".join(lines)

    shown = min(topology.period, MAX_ROUNDS_SHOWN)
    lines = [f"{topology.name}: n={topology.n}, time-varying with period {topology.period}"]
    for t in range(round, round + shown):
        lines.append(f"round {t}:")
        lines.extend(_format_round(topology, t, indent="  "))
    if shown < topology.period:
        lines.append(f"... {topology.period - shown} more rounds in each period")
    gap = spectral_gap(topology.period_mixing_matrix())
    lines.append(
        f"spectral gap of one period (W_{topology.period - 1} ... W_0): {gap:.4f}  "
        "(1 = exact average after one period)"
    )
    return "\n".join(lines)
