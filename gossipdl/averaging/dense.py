"""Dense gossip averaging (D-PSGD, Lian et al. 2017): x_i <- sum_j W_ij x_j."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gossipdl.averaging.base import Arrival, Averager, Round, mix
from gossipdl.averaging.robust import (
    Defence,
    descent_scores,
    distances,
    median_gap,
    nearest_to_rest,
)
from gossipdl.compression import Payload

LATE_ROUNDS = 4
"""Rounds a peer keeps its own model of, while a neighbour's model for it is missing, so a
late one still pairs up exactly (one model-sized copy per such round)."""


FINGERPRINT = 64
"""Coordinates of a model a defended peer remembers per neighbour, evenly spaced: enough
to tell a model that moved from one that did not (an honest model moves every round)."""


EVICT_SHARE = 0.5
"""A round counts against a neighbour (:meth:`DenseGossip.suspects`) when the defence set
aside at least this share of its model: BALANCE rejected it (beyond γ‖x‖: not by RHO
alone, see ``Defence.judge``), its model did not move, or clipping cut its pull to at most
half (it sat at least twice the radius away); a model rejected or clipped must also sit
far beyond the neighbourhood (:func:`~gossipdl.averaging.robust.outlying`)."""


DESCENT_MEMORY = 0.1
"""The weight of the newest round in a neighbour's running descent score (``+descent``): an
exponential mean over about the last 10 rounds, since one round's score is noisy (a
batch's gradient) and a restart's first round is meaningless."""


def fingerprint(model: torch.Tensor) -> torch.Tensor:
    """A few of ``model``'s coordinates, evenly spaced (a copy): equal for an unchanged model,
    different, in practice, for one that took any step."""
    step = max(1, model.numel() // FINGERPRINT)
    return model[::step][:FINGERPRINT].clone()


class DenseGossip(Averager):
    """Send the model (through the codec, lossless by default); average what arrived.

    A neighbour that missed the round leaves its weight with the peer (:func:`mix`), so a
    late neighbour slows nobody. When the loss is one-sided, the neighbour whose model
    did arrive applied the edge ``W_ij (x_i − x_j)`` and this peer did not; its model
    still counts when it comes late (up to :data:`LATE_ROUNDS` rounds later), as
    ``W_ij (x_j^t − x_i^t)`` with this peer's own model of that round, so the two halves
    of the edge cancel and the swarm's average is kept exactly. A model lost for good
    leaves the edge applied at one end only (no acknowledgement over a lossy link can
    make both ends agree), and moves the average once by ``W_ij (x_i − x_j) / n``.
    With a lossy codec this is naive compressed gossip (the model itself quantized),
    which is why CHOCO is the default as soon as the codec is lossy.

    With a ``defence`` (:mod:`gossipdl.averaging.robust`) the arrived models are combined
    by that rule instead of the weighted average, and a late model is not paired up:
    a robust rule judges the models of one round together. A neighbour whose model has
    not changed since its last message is set aside first (:func:`fingerprint`): an honest
    peer's model moves every round, a crashed or replaying one's does not, and a stale
    model stays close enough to pass every distance test while it pulls its neighbours
    back, round after round, to where it stopped. With ``+descent`` a neighbour whose
    running descent score (:func:`~gossipdl.averaging.robust.descent_scores`) is below
    −TAU, and that is farther than the median neighbour, is set aside the same way; that
    never counts towards an accusation (:meth:`suspects`): on non-IID shards an honest
    neighbour can score as low.
    """

    name = "dense"
    arrivals_read_only = True  # the average reads what arrived
    accepts_late = True  # a late model pairs up with the own model of its round

    def __init__(self, codec: str = "none", seed: int = 0, defence: Defence | None = None):
        super().__init__(codec, seed)
        self.defence = defence
        self._judged: dict[int, list[float]] = {}  # sender -> [rounds, Σ distance, Σ set aside]
        self._marks: dict[int, torch.Tensor] = {}  # sender -> fingerprint of its last model
        self._streaks: dict[int, int] = {}  # sender -> judged rounds in a row it was set aside
        self._last_judged: int | None = None  # the round this peer last judged models in
        self._mixed: torch.Tensor | None = None  # +descent: the model the last judged round left
        self._scores: dict[int, float] = {}  # +descent: sender -> running descent score
        # round -> (own model of that round, neighbours whose model is still missing)
        self._held: OrderedDict[int, tuple[torch.Tensor, set[int]]] = OrderedDict()

    def metrics(self) -> dict[str, Any]:
        """With a defence, ``neighbours``: per neighbour id, the ``rounds`` its model was
        judged, its mean ``distance`` to this peer's model and the share the defence set
        aside (``filtered``), over the whole run: the neighbour that looks wrong stands out;
        with ``+descent`` also its running ``descent`` score."""
        if self.defence is None:
            return {}
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

    def _judge(self, x: torch.Tensor, rnd: Round, arrived: Mapping[int, Arrival]) -> torch.Tensor:
        """The defence's new model from the fresh arrivals; every arrival's distance and
        set-aside share recorded. A stale one is set aside whole and its weight shared
        among the fresh ones, as BALANCE shares a rejected one's (left with x, a crashed
        neighbour slowed its neighbours' mixing for the rest of the run); so is one whose
        running descent score is below −TAU (``+descent``), which is not evidence."""
        assert self.defence is not None
        gaps, stale, x_norm = self._measure(x, arrived)
        rounds = 1 if self._last_judged is None else max(1, rnd.index - self._last_judged)
        self._last_judged = rnd.index
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
            )
            model = judged.model
            aside_now, evidence_now = torch.stack([judged.aside, judged.evidence]).tolist()
            shares.update(zip(fresh, aside_now, strict=True))
            evidence.update(zip(fresh, evidence_now, strict=True))
        for j in arrived:
            record = self._judged.setdefault(j, [0.0, 0.0, 0.0])
            record[0] += 1
            record[1] += gaps[j]
            record[2] += shares[j]
            self._streaks[j] = self._streaks.get(j, 0) + 1 if evidence[j] >= EVICT_SHARE else 0
        if self.defence.descent:
            self._mixed = model.clone()
        return model

    def _measure(
        self, x: torch.Tensor, arrived: Mapping[int, Arrival]
    ) -> tuple[dict[int, float], list[int], float | None]:
        """Each arrival's distance to ``x``, the neighbours whose model has not changed since
        their last message (:func:`fingerprint`), and for BALANCE ``‖x‖``: worked out where
        ``x`` is and read in one go (on a GPU one wait a round, not two per neighbour). One
        neighbour at a time: no stack of a stale model beside the others'."""
        assert self.defence is not None
        ids = list(arrived)
        marks = [fingerprint(arrived[j].value) for j in ids]
        numbers = [distances(x, arrived[j].value.unsqueeze(0))[0] for j in ids]
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
        stale = [j for j, flag in zip(ids, read[k : 2 * k], strict=True) if flag]
        x_norm = read[2 * k] if len(read) > 2 * k else None
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
        assert self.defence is not None
        if not self.defence.descent or self._mixed is None or models is None:
            return []
        scores = descent_scores(x - self._mixed, self._mixed, models).tolist()
        for j, score in zip(moving, scores, strict=True):
            previous = self._scores.get(j, 0.0)
            self._scores[j] = previous + DESCENT_MEMORY * (score - previous)
        middle = median_gap(torch.tensor([gaps[j] for j in moving], dtype=torch.float64))
        limit = -self.defence.descent
        return [j for j in moving if self._scores[j] < limit and gaps[j] > middle]

    def suspects(self, rounds: int) -> list[int]:
        """Neighbours the defence set aside (:data:`EVICT_SHARE`) in each of their last
        ``rounds`` judged rounds."""
        return sorted(j for j, streak in self._streaks.items() if streak >= rounds)

    def outgoing(self, x: torch.Tensor, rnd: Round) -> Payload | Mapping[int, Payload]:
        """The whole parameter vector, encoded (:meth:`encoded`)."""
        return self.encoded(x)

    def sends_memory_of(self, x: torch.Tensor) -> bool:
        """Uncompressed on a CPU, the payload is ``x``'s own memory: no copy, no estimate."""
        return self.codec.spec == "none" and x.device.type == "cpu"

    def encoded(self, x: torch.Tensor) -> Payload:
        """``x`` as sent (:meth:`sends_memory_of`: its own memory, which nobody writes)."""
        if self.sends_memory_of(x):
            return Payload((x.detach().numpy(),), {})
        payload, _ = self.codec.encode(x)
        return payload

    def catch_up(self, arrived: Mapping[int, Arrival]) -> torch.Tensor | None:
        """Its neighbours' models of the round, weighted as the round weighs them; with a
        defence the one nearest the rest (a liar among them moves a mean anywhere)."""
        if not arrived:
            return None
        values = [a.value for a in arrived.values()]
        if self.defence is not None:
            return values[nearest_to_rest(torch.stack(values))[0]].clone()
        total = sum(a.weight for a in arrived.values())
        mean = torch.zeros_like(values[0])
        for a in arrived.values():
            mean.add_(a.value, alpha=a.weight / total)
        return mean

    def incoming(
        self,
        x: torch.Tensor,
        rnd: Round,
        arrived: Mapping[int, Arrival],
        missing: Sequence[int],
        late: Sequence[tuple[int, Arrival]] = (),
    ) -> torch.Tensor:
        """Weighted average of ``x`` and the arrived vectors, plus the late ones' edges (or
        the defence's combination of the arrived ones)."""
        if self.defence is not None and arrived:
            return self._judge(x, rnd, arrived)
        out = mix(x, rnd, list(arrived.values()))
        for j, arrival in late:
            held = self._held.get(arrival.round)
            if held is not None and j in held[1]:
                own, waiting = held
                out.add_(arrival.value - own, alpha=arrival.weight)
                waiting.discard(j)
                if not waiting:
                    del self._held[arrival.round]
        if missing and self.defence is None:
            self._held[rnd.index] = (x.clone(), set(missing))
            while len(self._held) > LATE_ROUNDS:
                self._held.popitem(last=False)
        return out
