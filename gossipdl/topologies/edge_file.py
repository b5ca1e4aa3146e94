"""A user-supplied static graph read from a text file of edges."""

from __future__ import annotations

import os
import re
from pathlib import Path

from gossipdl.topologies.base import StaticTopology, check_peer_count
from gossipdl.topologies.errors import TopologyError
from gossipdl.topologies.mixing import connected_components

__all__ = ["read_edge_file"]

MAX_EDGE_FILE_BYTES = 64 * 2**20  # a complete graph of 2,000 peers is about 25 MiB
_EDGE = re.compile(r"([0-9]+)[ \t]*(?:,|[ \t])[ \t]*([0-9]+)")  # ASCII digits, one separator


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
        with file.open("rb") as f:
            data = f.read(MAX_EDGE_FILE_BYTES + 1)  # no size to trust (/dev/zero has none)
        if len(data) > MAX_EDGE_FILE_BYTES:
            raise TopologyError(
                f"edges file {file} is over {MAX_EDGE_FILE_BYTES // 2**20} MiB; a graph's "
                "edges, one 'i j' a line, take far less"
            )
        text = data.decode("utf-8-sig")  # an editor's byte-order mark is no edge
    except FileNotFoundError:
        raise TopologyError(f"edges file not found: {file}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TopologyError(f"cannot read edges file {file}: {exc}") from exc

    edges: list[tuple[int, int]] = []
    # lines end at "\n" (and "\r\n") alone: splitlines() also broke at form feeds and
    # U+2028, which took text out of a comment and numbered the lines after them wrong
    for lineno, raw in enumerate(text.split("\n"), start=1):
        raw = raw.removesuffix("\r")
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{file}:{lineno}"
        edge = _EDGE.fullmatch(line)
        if edge is None:
            raise TopologyError(
                f"{where}: expected one edge 'i j' (or 'i,j') of node ids 0, 1, 2, ..., got "
                f"{line!r}"
            )
        i, j = int(edge[1]), int(edge[2])
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
