"""A defended peer's judge of its neighbours: applies a robust rule to each round's models
and remembers, per neighbour, what it made of them (issue 26).

Every averager that takes a defence holds one: dense gossip judges the models that arrived,
CHOCO its replicas of the neighbours' public copies (:class:`~gossipdl.averaging.choco.Choco`),
BEER those of their models, its trackers following the judge's ``verdict``
(:class:`~gossipdl.averaging.beer.Beer`).
The rules themselves are pure functions (:mod:`gossipdl.averaging.robust`); the judge adds
what needs memory: a stale model set aside, ``+descent``'s running scores, the statistics
a metrics line reports per neighbour, and the streaks eviction accuses by.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gossipdl.averaging.base import Arrival, Round
from gossipdl.averaging.robust import Defence, descent_scores, distances, median_gap

FINGERPRINT = 64
"""Coordinates of a model a defended peer remembers per neighbour, evenly spaced: enough
to tell a model that moved from one that did not (an honest model moves every round)."""


EVICT_SHARE = 0.5
"""A round counts against a neighbour (:meth:`Judge.suspects`) when the defence set aside
at least this share of its model: BALANCE rejected it (beyond γ‖x‖: not by RHO alone, see
``Defence.judge``), its model did not move, or clipping cut its pull to at most half (it
sat at least twice the radius away); a model rejected or clipped must also sit far beyond
the neighbourhood (:func:`~gossipdl.averaging.robust.outlying`)."""


DESCENT_MEMORY = 0.1
"""The weight of the newest round in a neighbour's running descent score (``+descent``): an
exponential mean over about the last 10 rounds, since one round's score is noisy (a
batch's gradient) and a restart's first round is meaningless."""


def fingerprint(model: torch.Tensor) -> torch.Tensor:
    """A few of ``model``'s coordinates, evenly spaced (a copy; a model of fewer than
    2·FINGERPRINT coordinates gives its first FINGERPRINT): equal for an unchanged model,
    different, in practice, for one that took any step."""
    step = max(1, model.numel() // FINGERPRINT)
    return model[::step][:FINGERPRINT].clone()


class Judge:
    """``defence`` applied round after round, with what it remembers of each neighbour.

    A neighbour whose model has not changed since its last message is set aside first
    (:func:`fingerprint`): an honest peer's model moves every round, a crashed or
    replaying one's does not, and a stale model stays close enough to pass every distance
    test while it pulls its neighbours back, round after round, to where it stopped. With
    ``+descent`` a neighbour whose running descent score
    (:func:`~gossipdl.averaging.robust.descent_scores`) is below −TAU, and that is farther
    than the median neighbour, is set aside the same way; that never counts towards an
    accusation (:meth:`suspects`): on non-IID shards an honest neighbour can score as low.

    ``copies``: the models judged are public copies (CHOCO's and BEER's). Their caller
    finds the stale ones by how far their updates moved them
    (:class:`~gossipdl.averaging.replicas.Replicas`): a compressed update moves a public
    copy in a few coordinates, so an honest copy's fingerprint often does not change. They
    are centred at the peer's own copy, and what the rule returns is a pull, not where the
    peer's model went; so ``+descent`` measures the peer's own move as its public copy's
    since the last judged round. (Measured from the last pull instead, the "own move" was
    mostly minus that pull, and a neighbour on the side the pull went scored as if it
    undid the peer's descent: with no local step at all, the far ones were set aside in
    37–79% of rounds.)
    """

    def __init__(self, defence: Defence, copies: bool = False) -> None:
        self.defence = defence
        self.copies = copies
        self._judged: dict[int, list[float]] = {}  # sender -> [rounds, Σ distance, Σ set aside]
        self._marks: dict[int, torch.Tensor] = {}  # sender -> fingerprint of its last model
        self._streaks: dict[int, int] = {}  # sender -> judged rounds in a row it was set aside
        self._last_mixed: int | None = None  # the round this peer last took a neighbour's model in
        self._mixed: torch.Tensor | None = None  # +descent: where the own move is measured from
        self._scores: dict[int, float] = {}  # +descent: sender -> running descent score
        self.verdict: dict[int, float] = {}  # the last round's share set aside, per neighbour

    def metrics(self) -> dict[str, Any]:
        """``neighbours``: per neighbour id, the ``rounds`` its model was judged, its mean
        ``distance`` to this peer's model and the share the defence set aside
        (``filtered``), over the whole run: the neighbour that looks wrong stands out; with
        ``+descent`` also its running ``descent`` score."""
        neighbours: dict[str, dict[str, Any]] = {
            str(j): {
                "rounds": int(n),
                "distance": round(total / n, 6),
                "filtered": round(aside / n, 4),
            }
            for j, (n, total, aside) in sorted(self._judged.items())
        }
        for j, score in self._scores.items():
            neighbours[str(j)]["descent"] = round(score, 4)
        return {"neighbours": neighbours}

    def suspects(self, rounds: int) -> list[int]:
        """Neighbours the defence set aside (:data:`EVICT_SHARE`) in each of their last
        ``rounds`` judged rounds."""
        return sorted(j for j, streak in self._streaks.items() if streak >= rounds)

    def judge(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        stale: Sequence[int] = (),
    ) -> torch.Tensor:
        """The defence's new model from ``x`` and the fresh ``arrived`` models; every
        arrival's distance and set-aside share recorded. A stale one (the fingerprint's, or
        one the caller found in ``stale``), or one at no finite distance (a public copy
        whose finite updates added up past float32's range, or lay that far from ``x``:
        any rule would turn its ``0 · inf`` into NaN), is set aside whole and
        its weight shared among the fresh ones, as BALANCE shares a rejected one's (left
        with x, a crashed neighbour slowed its neighbours' mixing for the rest of the run);
        so is one whose running descent score is below −TAU (``+descent``), which is not
        evidence."""
        gaps, unmoved, x_norm = self._measure(x, arrived)
        broken = [j for j in arrived if not math.isfinite(gaps[j])]  # overflowed: no model
        stale = list(dict.fromkeys([*unmoved, *broken, *(j for j in stale if j in arrived)]))
        if self._last_mixed is None:  # its first judged round: as if it mixed the one before
            self._last_mixed = rnd.index - 1
        rounds = max(1, rnd.index - self._last_mixed)
        moving = [j for j in arrived if j not in stale]
        stacked = torch.stack([arrived[j].value for j in moving]) if moving else None
        contrary = self._contrary(x, moving, stacked, gaps)
        aside = stale + contrary
        fresh = [j for j in moving if j not in contrary]
        shares: dict[int, float] = dict.fromkeys(aside, 1.0)
        evidence = dict.fromkeys(aside, 0.0) | dict.fromkeys(stale, 1.0)  # counts for eviction
        if not fresh:  # nothing new arrived: the peer keeps its own model
            model = x.clone()
        else:
            assert stacked is not None
            if contrary:  # the rows of the neighbours the rule sees
                stacked = stacked[[moving.index(j) for j in fresh]]
            weights = torch.tensor([arrived[j].weight for j in fresh], dtype=torch.float64)
            weights *= 1.0 + sum(arrived[j].weight for j in aside) / float(weights.sum())
            kept = rnd.self_weight + sum(rnd.weights.values()) - float(weights.sum())
            judged = self.defence.judge(
                x,
                stacked,
                weights,
                kept,
                steps=rounds * rnd.period,
                gaps=torch.tensor([gaps[j] for j in fresh], dtype=torch.float64),
                x_norm=x_norm,
                majority=not aside and 2 * len(fresh) > len(rnd.weights),  # most of the row
            )
            model = judged.model
            aside_now, evidence_now = torch.stack([judged.aside, judged.evidence]).tolist()
            shares.update(zip(fresh, aside_now, strict=True))
            evidence.update(zip(fresh, evidence_now, strict=True))
            if min(aside_now) < 1.0:  # a neighbour's model taken in, some of it at least
                self._last_mixed = rnd.index
        self.verdict = shares
        for j in arrived:
            record = self._judged.setdefault(j, [0.0, 0.0, 0.0])
            record[0] += 1
            record[1] += gaps[j] if math.isfinite(gaps[j]) else 0.0
            record[2] += shares[j]
            self._streaks[j] = self._streaks.get(j, 0) + 1 if evidence[j] >= EVICT_SHARE else 0
        if self.defence.descent:
            self._mixed = (x if self.copies else model).clone()
        return model

    def _measure(
        self, x: torch.Tensor, arrived: Mapping[int, Arrival]
    ) -> tuple[dict[int, float], list[int], float | None]:
        """Each arrival's distance to ``x``, the neighbours whose model has not changed since
        their last message (:func:`fingerprint`; none for ``copies``), and for
        BALANCE ``‖x‖``: worked out where ``x`` is and read in one go (on a GPU one wait a
        round, not two per neighbour). One neighbour at a time: no stack of a stale model
        beside the others'."""
        ids = list(arrived)
        numbers = [distances(x, arrived[j].value.unsqueeze(0))[0] for j in ids]
        if not self.copies:
            marks = [fingerprint(arrived[j].value) for j in ids]
            new = torch.zeros((), dtype=torch.float64, device=x.device)
            numbers += [  # 1 for a model that did not move
                (self._marks[j] == mark).all().double() if j in self._marks else new
                for j, mark in zip(ids, marks, strict=True)
            ]
            self._marks.update(zip(ids, marks, strict=True))
        if self.defence.rule == "balance":
            numbers.append(torch.linalg.vector_norm(x.double()))
        read = torch.stack(numbers).tolist()
        k = len(ids)
        flags = [0.0] * k if self.copies else read[k : 2 * k]
        stale = [j for j, flag in zip(ids, flags, strict=True) if flag]
        x_norm = read[-1] if self.defence.rule == "balance" else None
        return dict(zip(ids, read[:k], strict=True)), stale, x_norm

    def _contrary(
        self,
        x: torch.Tensor,
        moving: list[int],
        models: torch.Tensor | None,
        gaps: Mapping[int, float],
    ) -> list[int]:
        """With ``+descent``, of the neighbours whose models moved (``moving``, their models
        stacked as ``models``; ``gaps``: distances to ``x``), those farther than the
        :func:`~gossipdl.averaging.robust.median_gap` whose running descent score (updated
        with this round's, :data:`DESCENT_MEMORY`) is below −TAU; none before the peer has
        mixed once. Farther only: on Dirichlet(0.3) shards honest neighbours score as low at
        times, and setting aside the nearer half of them too cost 2.6 points with no attack
        (label flippers sit 1.3-2x as far as the median neighbour there)."""
        if not self.defence.descent or self._mixed is None or models is None:
            return []
        scores = descent_scores(x - self._mixed, self._mixed, models).tolist()
        for j, score in zip(moving, scores, strict=True):
            previous = self._scores.get(j, 0.0)
            self._scores[j] = previous + DESCENT_MEMORY * (score - previous)
        middle = median_gap([gaps[j] for j in moving])
        limit = -self.defence.descent
        return [j for j in moving if self._scores[j] < limit and gaps[j] > middle]
