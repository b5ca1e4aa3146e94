"""Per-sender sequence numbers: which message repeats one already taken, and which left a gap.

Every member numbers what it sends each member (:meth:`GossipCore.send`), anew in each of
its lives, from where its count of numbered sends stands when it first sends to that one
(so the numbers to a member it forgot and met again still rise). A receiver keeps, per
sender and life, the highest number it took and the numbers it skipped (at most
:data:`MAX_SEQ_HOLES`, the newest): a number above the highest tells of lost messages
(CHOCO resyncs), a skipped one is a message the network delayed past later ones, and any
other is a copy of one taken already, which a sum such as CHOCO's s_i must not add twice.
No locks and no clocks: the protocol's state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gossipdl.transport.wire import WireError

MAX_SEQ_HOLES = 64
"""Skipped numbers remembered per sender: one older than these counts as a ``duplicate``
when it comes (delayed past 64 later messages; the gap it left already asked for a resync)."""


@dataclass
class _Numbers:
    life: int  # the sender's ``Member.since`` these numbers belong to
    last: int  # the highest number taken
    holes: set[int] = field(default_factory=set)  # numbers below ``last`` not taken (newest)


class Sequences:
    """What a peer took of each sender's numbered messages (module docstring).

    Example:
        >>> book = Sequences()
        >>> book.took(7, life=0, seq=1), book.took(7, life=0, seq=4)  # 2 and 3 skipped
        (0, 2)
        >>> book.check(7, life=0, seq=3)  # delayed: taken
        >>> book.took(7, life=0, seq=3)
        0
        >>> book.check(7, life=0, seq=3)
        Traceback (most recent call last):
        gossipdl.transport.wire.WireError: duplicate: message 3 of peer 7 was taken already
    """

    def __init__(self) -> None:
        self._senders: dict[int, _Numbers] = {}

    def check(self, sender: int, life: int, seq: int) -> None:
        """WireError ``duplicate`` if ``sender``'s message ``seq`` of life ``life`` was taken
        already (or is older than every number remembered as skipped); unnumbered messages
        (``seq`` 0: heartbeats, answers to non-members) pass."""
        numbers = self._senders.get(sender)
        if seq <= 0 or numbers is None or numbers.life != life:
            return
        if seq <= numbers.last and seq not in numbers.holes:
            raise WireError("duplicate", f"message {seq} of peer {sender} was taken already")

    def took(self, sender: int, life: int, seq: int) -> int:
        """Note that ``sender``'s message ``seq`` of life ``life`` was taken; returns how many
        of its messages the number says were lost (0: none; a sender's first message, or
        its first of a new life, sets where its numbers start)."""
        if seq <= 0:
            return 0
        numbers = self._senders.get(sender)
        if numbers is None or numbers.life != life:
            self._senders[sender] = _Numbers(life, seq)
            return 0
        if seq <= numbers.last:
            numbers.holes.discard(seq)
            return 0
        lost = seq - numbers.last - 1
        numbers.holes.update(range(max(numbers.last + 1, seq - MAX_SEQ_HOLES), seq))
        if len(numbers.holes) > MAX_SEQ_HOLES:
            numbers.holes = set(sorted(numbers.holes)[-MAX_SEQ_HOLES:])
        numbers.last = seq
        return lost

    def forget(self, sender: int) -> None:
        """Forget ``sender``'s numbers (it was forgotten)."""
        self._senders.pop(sender, None)
