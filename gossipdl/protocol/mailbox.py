"""Per-round mailbox of model messages, without locks or clocks: the protocol's state.

A message for a round the peer has finished is late: dropped, or with
``keep_late`` kept for the averager (a CHOCO update counts whenever it comes),
as is one that arrives for the current round after the peer stopped waiting
for it. Messages for future rounds are kept (a neighbour may be a round or many
ahead, e.g. a newcomer waiting at its first round), but at most ``max_pending``
rounds per sender, and at most ``max_pending`` late ones per sender until the
peer takes them, so a runaway sender cannot grow memory without bound.
``admit`` says whether a message would be kept before the caller decodes its
payload to full size. Whoever waits for a round asks :meth:`complete` after each
arrival and gives up at its deadline: the real engine on a condition variable, the
simulator at a virtual instant.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from gossipdl.transport.wire import WireError


class Mailbox:
    """Holds ``{round: {sender: payload}}`` for the current and future rounds."""

    def __init__(self, max_pending: int = 8, keep_late: bool = False) -> None:
        self._rounds: dict[int, dict[int, Any]] = {}
        self._pending: Counter[int] = Counter()
        self._floor = 0
        self._max_pending = max_pending
        self._keep_late = keep_late
        self._late: list[tuple[int, int, Any]] = []
        self._late_from: Counter[int] = Counter()  # sender -> its entries in _late
        self._taken: dict[int, set[int]] = {}  # round -> senders already handed to the peer
        self._sent_by: dict[int, int] = {}  # sender -> last round it says it sent

    def admit(self, sender: int, round: int) -> None:
        """Raise the WireError ``put`` would raise for ``sender``'s message for ``round``, so
        a message that will be refused is refused before its payload is decoded."""
        self._admitted_late(sender, round)

    def put(self, sender: int, round: int, payload: Any) -> None:
        """Store a payload; raises WireError('late' / 'too_many_pending' / 'duplicate')."""
        if self._admitted_late(sender, round):
            self._late.append((sender, round, payload))
            self._late_from[sender] += 1
            return
        self._rounds.setdefault(round, {})[sender] = payload
        self._pending[sender] += 1

    def _admitted_late(self, sender: int, round: int) -> bool:
        """Whether the message is kept as a late one (False: for its round); WireError if it
        is not kept at all."""
        if round < self._floor:
            if self._keep_late and self._late_from[sender] < self._max_pending:
                return True
            raise WireError("late", f"round {round} arrived after round {self._floor} began")
        if sender in self._rounds.get(round, {}):
            raise WireError("duplicate", f"second message for round {round}")
        if self._pending[sender] >= self._max_pending:
            raise WireError(
                "too_many_pending",
                f"already {self._max_pending} future rounds queued (this peer is at "
                f"{self._floor}, the message is for {round})",
            )
        return False

    def complete(self, round: int, expected: set[int]) -> bool:
        """Whether every id in ``expected`` has sent ``round``, or is known to have lost it
        (it already spoke for a later round: one connection delivers in order)."""
        return not self.waiting_for(round, expected)

    def waiting_for(self, round: int, ids: Iterable[int]) -> set[int]:
        """The ids of ``ids`` that ``complete`` still waits for in ``round``: neither sent it
        nor spoke for a later round."""
        missing = set(ids).difference(self._rounds.get(round, ()))
        if missing:
            for r, slot in self._rounds.items():
                if r > round:
                    missing.difference_update(slot)
            if missing and self._sent_by:
                sent_by = self._sent_by
                missing = {j for j in missing if j not in sent_by or sent_by[j] < round}
        return missing

    def take(self, round: int) -> dict[int, Any]:
        """What arrived for ``round``; anything for it that comes later counts as late."""
        slot = self._rounds.get(round, {})
        self._taken.setdefault(round, set()).update(slot)
        return dict(slot)

    def sent(self, sender: int, round: int) -> bool:
        """``sender`` says (on the connection its messages take, so after them) that it sent
        everything up to ``round``: what has not come by now is lost. True if that is news."""
        if round <= self._sent_by.get(sender, -1):
            return False
        self._sent_by[sender] = round
        return True

    def advance(self, round: int) -> None:
        """Forget every round below ``round``; later arrivals for them are late."""
        self._floor = max(self._floor, round)
        for r in [r for r in self._rounds if r < self._floor]:
            taken = self._taken.pop(r, set())
            for sender, payload in self._rounds.pop(r).items():
                self._pending[sender] -= 1
                if self._keep_late and sender not in taken:
                    self._late.append((sender, r, payload))
                    self._late_from[sender] += 1
        for r in [r for r in self._taken if r < self._floor]:
            del self._taken[r]

    def forget(self, sender: int) -> None:
        """Drop what ``sender`` said it sent: it rejoined and counts rounds anew (or it was
        forgotten)."""
        self._sent_by.pop(sender, None)

    def move_to(self, round: int) -> None:
        """Wait next for ``round``: like ``advance``, but an earlier round forgets everything
        (a peer that rejoins takes the swarm's round, which may be behind its own)."""
        if round >= self._floor:
            self.advance(round)
            return
        self._rounds.clear()
        self._pending.clear()
        self._taken.clear()
        self._late.clear()
        self._late_from.clear()
        self._sent_by.clear()
        self._floor = round

    def drain_late(self) -> list[tuple[int, int, Any]]:
        """``(sender, round, payload)`` of messages kept after their round had passed."""
        late, self._late = self._late, []
        self._late_from.clear()
        return late
