"""CHOCO's consensus alone, in memory: how large a step a codec and a graph let γ take
before compressed gossip stops converging (what :func:`~gossipdl.averaging.auto_gamma`'s
graph bound was measured with, and a check for a user's own codec or topology)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from gossipdl.averaging.base import Arrival, Round
from gossipdl.averaging.choco import Choco
from gossipdl.topologies import Topology

__all__ = ["consensus_spreads", "critical_gamma"]


def consensus_spreads(
    spec: str,
    topology: Topology,
    gamma: float | None,
    rounds: int,
    shapes: Sequence[Sequence[int]] = ((1000,),),
    every: int = 0,
    seed: int = 0,
) -> list[float]:
    """The models' spread (‖x − x̄‖ over peers, relative to the start) after every
    ``every``-th of ``rounds`` rounds (0: after the last only) of CHOCO with ``spec`` on
    ``topology`` and no training: peers start apart (random, seeded) with one public copy,
    as after a vouched first round. ``gamma`` None is the automatic step; ``shapes`` are
    the parameters' (PowerSGD compresses each matrix)."""
    n, cpu = topology.n, torch.device("cpu")
    numel = sum(int(torch.Size(s).numel()) for s in shapes)
    peers = [Choco(spec, seed=seed + i, gamma=gamma) for i in range(n)]
    for p in peers:
        p.bind_layout(shapes)
        p.begin(torch.zeros(numel))
    gen = torch.Generator().manual_seed(seed)
    xs = list(torch.randn(n, numel, generator=gen))
    start, spreads = _spread(xs), []
    for t in range(rounds):
        rows = [topology.weights(i, t) for i in range(n)]
        rnds = [
            Round(t, {j: w for j, w in row.items() if j != i}, row[i], resync=t == 0)
            for i, row in enumerate(rows)
        ]
        payloads = [p.outgoing(x, r) for p, x, r in zip(peers, xs, rnds, strict=True)]
        sent = [p.vouch() if t == 0 else q for p, q in zip(peers, payloads, strict=True)]
        values = [p.decode(q, t == 0, numel, cpu) for p, q in zip(peers, sent, strict=True)]
        xs = [  # one decoded value per sender: CHOCO only reads arrivals
            p.incoming(
                x, r, {j: Arrival(w, values[j], t, t == 0) for j, w in r.weights.items()}, []
            )
            for p, x, r in zip(peers, xs, rnds, strict=True)
        ]
        if (every and (t + 1) % every == 0) or t == rounds - 1:
            spreads.append(_spread(xs) / start)
    return spreads


def _spread(xs: Sequence[torch.Tensor]) -> float:
    x = torch.stack(list(xs)).double()
    return float((x - x.mean(0)).norm())


def critical_gamma(
    spec: str,
    topology: Topology,
    rounds: int = 1500,
    shapes: Sequence[Sequence[int]] = ((1000,),),
    halvings: int = 7,
) -> float:
    """γ*: the largest step in [1/1024, 1] (bisected in log scale, ``halvings`` times: 7
    gives 5.5%) whose consensus does not drift apart: the spread after ``rounds`` is no
    larger than halfway, or below :data:`FLOOR`. Just above γ* the spread shrinks for a
    while and then grows slowly, which is why the test runs long; a coarse quantizer's
    spread may level off instead of reaching 0 (sign: about 1% of the start on a ring of 8
    at γ 0.4), which counts as stable. 0 when even 1/1024 drifts apart."""
    floor = low = math.log(1 / 1024)
    high = 0.0
    for _ in range(halvings):
        mid = (low + high) / 2
        if _converges(spec, topology, math.exp(mid), rounds, shapes):
            low = mid
        else:
            high = mid
    if low == floor and not _converges(spec, topology, math.exp(floor), rounds, shapes):
        return 0.0
    return math.exp(low)


def _converges(
    spec: str, topology: Topology, gamma: float, rounds: int, shapes: Sequence[Sequence[int]]
) -> bool:
    spreads = consensus_spreads(spec, topology, gamma, rounds, shapes, every=rounds // 2)
    return spreads[-1] <= spreads[0] or spreads[-1] < FLOOR  # nan (blown up): False


FLOOR = 1e-4
"""A relative spread below which float32 rounding in the sums, not γ, sets what is left."""
