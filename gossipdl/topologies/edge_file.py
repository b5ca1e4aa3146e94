"""A user-supplied static graph read from a text file of edges."""

from __future__ import annotations

import os
from pathlib import Path

from gossipdl.topologies.base import StaticTopology, check_peer_count
from gossipdl.topologies.errors import TopologyError
from gossipdl.topologies.mixing import connected_components

__all__ = ["read_edge_file"]


def read_edge_file(path: str | os.PathLike[str], n: int) -> StaticTopology:
    """Load an undirected graph over nodes ``0..n-1`` from a file of ``i j`` lines.

    One edge per line, node ids separated by whitespace or a comma; ``#`` starts
    a comment; blank lines are skipped; repeated edges are merged. Every node
    must appear and the graph must be connected, so a typo cannot silently
    leave a peer out of the swarm.

    Example file::

        # a 4-cycle
        0 1
        1 2
        2 3
        3 0
    """
    n = check_peer_count(n)
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TopologyError(f"edges file not found: {file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"cannot read edges file {file}: {exc}") from exc

    edges: list[tuple[int, int]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{file}:{lineno}"
        fields = line.replace(",", " ").split()
        if len(fields) != 2:
            raise TopologyError(f"{where}: expected one edge 'i j', got {line!r}")
        try:
            i, j = int(fields[0]), int(fields[1])
        except ValueError:
            raise TopologyError(f"{where}: node ids must be integers, got {line!r}") from None
        for node in (i, j):
            if not 0 <= node < n:
                raise TopologyError(
                    f"{where}: node {node} is out of range for n={n} (nodes are 0..{n - 1})"
                )
        if i == j:
            raise TopologyError(f"{where}: self loop {i} {j}; a peer is not its own neighbour")
        edges.append((i, j))

    named = {node for edge in edges for node in edge}
    if n > 1 and len(named) != n:
        missing = sorted(set(range(n)) - named)
        shown = ", ".join(map(str, missing[:10])) + (", ..." if len(missing) > 10 else "")
        raise TopologyError(
            f"edges file {file} names {len(named)} nodes but n={n}; nodes with no edge: {shown}"
        )
    topology = StaticTopology.from_edges(n, edges, name=f"edges:{path}")
    components = connected_components(topology.adjacency())
    if len(components) > 1:
        parts = "; ".join(str(c) if len(c) <= 8 else f"{c[:8]}..." for c in components[:3])
        raise TopologyError(
            f"edges file {file} describes a disconnected graph "
            f"({len(components)} components: {parts}); gossip needs every peer reachable"
        )
    return topology
