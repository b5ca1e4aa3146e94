"""Heartbeats and death sentences, decided from the times the engine reports.

A member that heard nothing from us for a heartbeat gets one; a member silent
past ``dead_after`` is declared dead (out of the topology a few rounds ahead);
so is one whose end is still ahead (a departure announced far ahead: a lie, or a
leaver many rounds ahead of us) once it is silent that long; an ended member
silent past ``forget_after`` is forgotten. Time is whatever the
engine says it is: the wall clock (real engine) or the virtual one (simulator).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

DEAD_HEARTBEAT_EVERY = 5  # an ended member still hears from us, this many times less often


class MemberView(Protocol):
    """What the detector reads of a member table entry."""

    @property
    def id(self) -> int: ...

    @property
    def since(self) -> int: ...

    @property
    def until(self) -> int | None: ...

    def begun(self, round: int) -> bool: ...


@dataclass
class Verdicts:
    """What one pass decided: whom to send a heartbeat, whom to declare dead or forget,
    whose end still ahead to bring forward (with how long each was silent, in seconds)."""

    heartbeats: list[int] = field(default_factory=list)
    dead: list[tuple[int, float]] = field(default_factory=list)
    forget: list[tuple[int, float]] = field(default_factory=list)
    overdue: list[tuple[int, float]] = field(default_factory=list)


class FailureDetector:
    """When each member was last heard from and sent to; who is owed what now."""

    def __init__(self, heartbeat: float, dead_after: float, forget_after: float) -> None:
        self.heartbeat = heartbeat
        self.dead_after = dead_after
        self.forget_after = forget_after
        self.heard_at: dict[int, float] = {}  # id -> when its last accepted message came
        self.sent_at: dict[int, float] = {}  # id -> when we last sent it anything
        # id -> (its life, when we first saw that life in the table): a restarted peer's
        # silence counts from the news of its new life, not from its old process's death
        self._known_at: dict[int, tuple[int, float]] = {}
        self._away_until = 0.0  # the last moment our device was offline: it heard nothing

    def heard(self, peer: int, now: float) -> None:
        """A message from ``peer`` was accepted at ``now``."""
        self.heard_at[peer] = now

    def sent(self, peer: int, now: float) -> None:
        """We sent ``peer`` something at ``now``: it needs no heartbeat for a while."""
        self.sent_at[peer] = now

    def away(self, now: float) -> None:
        """Our device is offline at ``now``: silence until then is ours, not the others'."""
        self._away_until = now

    def forget(self, peer: int) -> None:
        """No clocks for ``peer`` any more."""
        for clock in (self.heard_at, self.sent_at, self._known_at):
            clock.pop(peer, None)

    def check(
        self,
        now: float,
        me: int,
        members: Iterable[MemberView],
        round: int,
        *,
        sentence: bool,
        left: Callable[[int], bool],
    ) -> Verdicts:
        """One pass over ``members`` at ``now`` in round ``round``. ``sentence``: whether
        silence may be punished yet (the swarm formed; a ring stops on its own timeout);
        ``left(j)``: ``j`` left for good (no heartbeat, no sentence)."""
        verdicts = Verdicts()
        for member in members:
            j = member.id
            life, known = self._known_at.get(j, (member.since, now))
            if life != member.since:
                known = now
            self._known_at[j] = (member.since, known)
            if j == me:
                continue
            ended = member.until is not None
            silent = now - max(self.heard_at.get(j, 0.0), known, self._away_until)
            if member.until is not None and member.until <= round and silent > self.forget_after:
                verdicts.forget.append((j, silent))
                continue
            if member.until is not None and member.until > round and silent > self.dead_after:
                verdicts.overdue.append((j, silent))
            if left(j):
                continue
            every = self.heartbeat * (DEAD_HEARTBEAT_EVERY if ended else 1)
            # New members get a moment for the news of them to reach everyone.
            if now - known >= self.heartbeat and now - self.sent_at.get(j, 0.0) >= every:
                self.sent_at[j] = now
                verdicts.heartbeats.append(j)
            if sentence and not ended and member.begun(round) and silent > self.dead_after:
                verdicts.dead.append((j, silent))
        return verdicts
