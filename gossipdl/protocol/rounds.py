"""A round as the protocol sees it: the mixing row over the members, the rounds the topology
changes, and what goes to the averager once the round's messages are in."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

from gossipdl.averaging import Arrival, Round
from gossipdl.topologies import Topology, TopologyError, build_topology

MAX_TOPOLOGIES = 16  # topologies kept built, one per member set seen (churn makes new ones)


FALLBACK = "exponential"  # the graph over a member set the swarm's topology cannot be built on


class Topologies:
    """The swarm's topology over each member set (the ``MAX_TOPOLOGIES`` most recently used
    are kept built): one graph per set of ids, the same on every peer. A set the topology
    cannot be built on (a swarm that shrank to four or fewer under ``random-regular:4``, a
    torus over a prime count) gets the :data:`FALLBACK` graph, which any count allows,
    rather than stopping the peer that computes it."""

    def __init__(self, spec: str, seed: int) -> None:
        self.spec = spec
        self.seed = seed
        self._built: OrderedDict[tuple[int, ...], Topology] = OrderedDict()

    def over(self, ids: list[int]) -> Topology:
        """The topology over the members ``ids`` (sorted)."""
        key = tuple(ids)
        topology = self._built.get(key)
        if topology is None:
            try:
                topology = build_topology(self.spec, len(ids), self.seed)
            except TopologyError:
                topology = build_topology(FALLBACK, len(ids), self.seed)
            self._built[key] = topology
            while len(self._built) > MAX_TOPOLOGIES:
                self._built.popitem(last=False)
        self._built.move_to_end(key)
        return topology

    def mixing(self, ids: list[int], me: int, round: int) -> tuple[dict[int, float], float]:
        """Neighbour id -> weight, and the self weight, of peer ``me`` in ``round`` among the
        active members ``ids``; alone (or not a member) it keeps its own model."""
        if me not in ids or len(ids) == 1:
            return {}, 1.0
        index = ids.index(me)
        row = self.over(ids).weights(index, round)
        return {ids[p]: w for p, w in row.items() if p != index}, row.get(index, 0.0)


def topology_changes(spans: Iterable[tuple[int, int | None]], first_round: int) -> set[int]:
    """Rounds after ``first_round`` at which a member joins or is dropped (``spans``: each
    life's rounds, ``MemberTable.spans``): everyone resyncs there (CHOCO's public copies
    must start again from dense ones)."""
    return {r for span in spans for r in span if r is not None and r > first_round}


def arrivals(
    rnd: Round, got: Mapping[int, tuple[Any, bool]]
) -> tuple[dict[int, Arrival], list[int]]:
    """What came for ``rnd`` as the averager takes it (``got``: id -> (value, dense)), and
    which neighbours of the round sent nothing."""
    arrived = {
        j: Arrival(w, got[j][0], rnd.index, got[j][1]) for j, w in rnd.weights.items() if j in got
    }
    return arrived, [j for j in rnd.weights if j not in got]
