"""A peer's replicas of its neighbours' public copies, kept apart so a defence can judge
them: CHOCO's (one set, the models') and BEER's (two: the models', which a defence
judges, and the trackers', which follow its verdict).

A public-copy averager normally keeps only the sum ``s_i = Σ_j W_ij x̂_j``, which is all
plain mixing needs. A robust rule needs each neighbour's copy on its own, and a liar can
steer only its own copy, whatever updates it sends: so the rule bounds it as it bounds a
model in dense gossip. A stale neighbour is one whose updates stopped moving its copy
(:data:`STALE_MOVE`), not one whose fingerprint did not change: a compressed update moves
an honest copy in a few coordinates, so its fingerprint often stays the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from gossipdl.averaging.base import Arrival, Round, mix
from gossipdl.averaging.judging import Judge
from gossipdl.compression.sparse import SparseVector

STALE_MOVE = 1e-3
"""A defended peer sets a neighbour aside as stale in a round its updates moved its copy by
at most this share of what the peer's own update moved its own public copy
(:meth:`Replicas.stale`)."""


def leave_out(rnd: Round, aside: Sequence[int]) -> Round:
    """``rnd`` without the neighbours in ``aside``, their weight left with the peer as a
    missing neighbour's is (:func:`~gossipdl.averaging.base.mix`): the pairs that remain
    still cancel in the swarm's sum.

    >>> leave_out(Round(0, {1: 0.25, 2: 0.25, 3: 0.5}, 0.0), [3]).self_weight
    0.5
    """
    kept = {j: w for j, w in rnd.weights.items() if j not in aside}
    if len(kept) == len(rnd.weights):
        return rnd
    left = sum(w for j, w in rnd.weights.items() if j in aside)
    return replace(rnd, weights=kept, self_weight=rnd.self_weight + left)


class Replicas:
    """Each neighbour's public copy (by id), the updates that moved them this round, and the
    ``judge`` that combines them (None: plain mixing)."""

    def __init__(self, judge: Judge | None = None) -> None:
        self.judge = judge
        self.copies: dict[int, torch.Tensor] = {}
        self._moved: dict[int, torch.Tensor] = {}  # sender -> ‖its updates‖ this round
        self._own_move: torch.Tensor | None = None  # ‖this peer's own update‖ this round
        # without a judge (whose distances find them): which copies stopped being finite
        self._finite: dict[int, torch.Tensor] = {}  # sender -> unread: its updates' sums finite
        self.broken: set[int] = set()  # senders whose copy is no longer finite

    def rebuild(self, dense: Mapping[int, torch.Tensor]) -> None:
        """Start every copy again from a resync's dense public copies (copied: arrivals are
        read-only, and a vouch's value is the peer's own copy)."""
        self.copies = {j: value.clone() for j, value in dense.items()}
        self._finite, self.broken = {}, set()

    def new_round(self) -> None:
        """Forget the last round's moves: the stale test judges one round's updates."""
        self._moved = {}

    def own_update(self, values: torch.Tensor) -> None:
        """What this peer's own update moved its public copy by: the stale test's yardstick."""
        if self.judge is not None:  # read with the neighbours' moves, once
            self._own_move = torch.linalg.vector_norm(values.double())

    def add(self, sender: int, q: torch.Tensor | SparseVector, alpha: float) -> None:
        """``x̂_sender += alpha q``, dense or sparse; nothing for a sender with no copy (no
        neighbour at the last resync)."""
        into = self.copies.get(sender)
        if into is None:
            return
        if isinstance(q, SparseVector):
            into.index_add_(0, q.indices, q.values, alpha=alpha)
            values = q.values
        else:
            into.add_(q, alpha=alpha)
            values = q
        if self.judge is not None:  # how far the copy moved (read with the others, once)
            move = torch.linalg.vector_norm(values.double())
            earlier = self._moved.get(sender)
            self._moved[sender] = move if earlier is None else earlier + move
            return
        # every update is finite (the wire checks), but their sum can overflow: read later
        # (a judge finds such a copy by its distance, a pass it makes anyway)
        touched = into[q.indices] if isinstance(q, SparseVector) else into
        finite = torch.isfinite(touched).all()
        earlier = self._finite.get(sender)
        self._finite[sender] = finite if earlier is None else earlier & finite

    def combine(self, centre: torch.Tensor, rnd: Round, aside: Sequence[int] = ()) -> torch.Tensor:
        """The mix of ``centre`` with the copies of this round's neighbours: the judge's,
        when there is one, else the gossip weights'. Neighbours in ``aside`` are left out
        whatever their copies (:func:`leave_out`)."""
        self._read_finite()
        rnd = leave_out(rnd, [*aside, *self.broken])
        copies = {
            j: Arrival(w, self.copies[j], rnd.index)
            for j, w in rnd.weights.items()
            if j in self.copies
        }
        if self.judge is not None and copies:
            return self.judge.judge(centre, rnd, copies, self.stale())
        return mix(centre, rnd, list(copies.values()))

    def _read_finite(self) -> None:
        """Add to :attr:`broken` the senders whose updates since the last read left a
        non-finite value in their copy (copies mixed without a judge: BEER's trackers): one
        read for all (on a GPU, one wait a round). A broken copy is left out until a resync
        rebuilds it: a liar's finite updates that add up past float32's range would
        otherwise make every mix NaN. (A judge sets such a copy aside by its distance.)"""
        if not self._finite:
            return
        senders = list(self._finite)
        checks = torch.stack(list(self._finite.values())).tolist()
        self._finite = {}
        for j, finite in zip(senders, checks, strict=True):
            if not finite:
                self.broken.add(j)

    def stale(self) -> list[int]:
        """The neighbours whose updates this round moved their copy by at most
        :data:`STALE_MOVE` of what this peer's own update moved its public copy: a frozen
        model's copy stops moving once its updates have caught up (top-k: within 1/k
        rounds), an honest one moves every round by about what its peer trained, as this
        peer's does. The yardstick is the peer's own, which no neighbour can move: the
        median sender's, used first, let two scaled liars among four neighbours (a random
        4-regular graph of 16) make both honest ones look stale, and BALANCE then took the
        liars' model (the two agreed); that peer ended at chance."""
        if self._own_move is None or not self._moved:
            return []
        senders = list(self._moved)
        own, *moves = torch.stack([self._own_move, *self._moved.values()]).tolist()
        return [j for j, move in zip(senders, moves, strict=True) if move <= STALE_MOVE * own]
