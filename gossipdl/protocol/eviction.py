"""Evicting a member whose neighbours' defences set its model aside round after round.

A peer with a defence and ``evict_after`` rounds accuses, to every member, a neighbour
whose model its defence set aside in each of that neighbour's last ``evict_after`` judged
rounds (``Averager.suspects``), and again every ``evict_after`` rounds while that lasts
(an accusation may be lost). Every member counts the accusations it hears; once more than
half of the suspect's neighbours accuse it, the member ends it as it ends a dead one: out
of the topology a join margin ahead, so the graph is rebuilt over the others, and its
address and key are refused a rejoin for the rest of the run.

The quorum is what keeps one neighbour, confused by its own skewed data or hostile, from
evicting an honest peer: it must convince the suspect's other neighbours' defences too.
That is not enough on skewed shards, where every neighbour of an honest peer holding one
or two classes sets it aside round after round; so a round counts against a neighbour
only when its model sits far beyond the neighbourhood
(:func:`~gossipdl.averaging.robust.outlying`), as the attacks eviction is for do. An
honest peer can still sit that far early in training on very skewed shards (README
*Misbehaving peers*).
It assumes that fewer than half of any peer's neighbours are bad (a peer with two
neighbours, on a ring, needs both), and it takes two at least: a member with one
neighbour is never evicted, so two peers alone cannot split their swarm. Only a neighbour
of the suspect may accuse it (any other accusation is refused, ``bad_accusation``), so
what a member holds is bounded by the members' degrees.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_BANNED = 512  # addresses and keys refused a rejoin; the oldest are let go beyond it
WINDOW_ROUNDS = 16  # an accuser must have been the suspect's neighbour this recently (at most)
GRACE_ROUNDS = 10  # a life's first rounds (a newcomer's, or a peer's back from a restart):
# its model is still catching up with the swarm's, so nobody accuses it, and it accuses nobody;
# nor does anyone accuse a neighbour it has had for fewer rounds (a rebuilt graph's new pairs)


MIN_ACCUSERS = 2  # a quorum is never one peer: two that disagree cannot evict each other


def quorum(accusers: set[int], neighbours: set[int]) -> bool:
    """Whether the ``accusers`` include more than half of the suspect's ``neighbours``, and
    at least :data:`MIN_ACCUSERS` of them.

    Example:
        >>> quorum({1, 2}, {1, 2, 3, 4}), quorum({1, 2, 3}, {1, 2, 3, 4}), quorum({1}, {1})
        (False, True, False)
    """
    count = len(accusers & neighbours)
    return count >= MIN_ACCUSERS and 2 * count > len(neighbours)


class Evictions:
    """One member's accusations, heard and made, and the addresses it refuses."""

    def __init__(self, rounds: int) -> None:
        """``rounds``: ``evict_after``, the judged rounds in a row that make a suspect."""
        self.rounds = rounds
        self._accusers: dict[int, set[int]] = {}  # suspect -> the neighbours that accused it
        self._accused: dict[int, int] = {}  # suspect -> the round we last accused it
        self._banned: OrderedDict[str, str] = OrderedDict()  # address or key -> why

    def due(self, suspects: list[int], round: int) -> list[int]:
        """Which of our ``suspects`` to accuse at ``round``: those never accused, or not for
        ``rounds`` rounds."""
        due = [j for j in suspects if round - self._accused.get(j, -self.rounds) >= self.rounds]
        self._accused.update(dict.fromkeys(due, round))
        return due

    def hear(self, accuser: int, suspect: int, neighbours: set[int]) -> list[int] | None:
        """``accuser`` (one of ``neighbours``, the suspect's) accuses ``suspect``: the
        accusers that now make a quorum, sorted, or None while they do not."""
        accusers = self._accusers.setdefault(suspect, set())
        accusers.add(accuser)
        if not quorum(accusers, neighbours):
            return None
        del self._accusers[suspect]
        self._accused.pop(suspect, None)
        return sorted(accusers & neighbours)

    def ban(self, reason: str, *names: str) -> None:
        """Refuse ``names`` (an evicted member's address and key) a rejoin, saying ``reason``."""
        for name in names:
            if name:
                self._banned[name] = reason
        while len(self._banned) > MAX_BANNED:
            self._banned.popitem(last=False)

    def banned(self, *names: str) -> str | None:
        """Why one of ``names`` (a joiner's address and key) may not join, or None."""
        return next((self._banned[n] for n in names if n and n in self._banned), None)

    def forget(self, suspect: int) -> None:
        """``suspect`` left the swarm some other way: its accusations count no more."""
        self._accusers.pop(suspect, None)
        self._accused.pop(suspect, None)
