"""Who is in the swarm: a grow-only member set plus the set of peers that left.

Announcements are merged as a union keyed by peer id, so peers that hear them
in different orders still agree. Each member carries the first round it takes
part in (``since``), which lets every peer switch to a larger topology at the
same round when someone joins a running swarm.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from gossipdl.transport.wire import WireError


@dataclass(frozen=True)
class Member:
    """One peer: its id, the address of its ROUTER socket, and its first round."""

    id: int
    address: str
    since: int = 0


def parse_members(value: Any) -> list[Member]:
    """Validate a member list received on the wire (``[[id, address, since], ...]``)."""
    if not isinstance(value, list) or len(value) > 100_000:
        raise WireError("bad_meta", f"member list is {type(value).__name__}, expected a list")
    members = []
    for entry in value:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], int)
            and entry[0] >= 0
            and isinstance(entry[1], str)
            and entry[1].startswith("tcp://")
            and len(entry[1]) < 300
            and isinstance(entry[2], int)
            and entry[2] >= 0
        ):
            raise WireError("bad_meta", f"member entry {entry!r} is not [id, tcp://address, round]")
        members.append(Member(entry[0], entry[1], entry[2]))
    return members


class Membership:
    """Thread-safe member table shared by the training and receive threads."""

    def __init__(self, members: list[Member] | None = None) -> None:
        self._lock = threading.Lock()
        self._members: dict[int, Member] = {}
        self._left: dict[int, str] = {}  # id -> why it stopped, as it announced
        if members:
            self.merge(members)

    def merge(self, members: list[Member]) -> list[Member]:
        """Add members not yet known; returns the new ones. Known ids keep their entry."""
        added = []
        with self._lock:
            for member in members:
                if member.id not in self._members:
                    self._members[member.id] = member
                    added.append(member)
        return added

    def get(self, peer_id: int) -> Member | None:
        """The member with this id, or None."""
        with self._lock:
            return self._members.get(peer_id)

    def by_address(self, address: str) -> Member | None:
        """The member listening on ``address``, or None."""
        with self._lock:
            return next((m for m in self._members.values() if m.address == address), None)

    def active(self, round: int) -> list[int]:
        """Sorted ids of the members that take part in ``round`` (left ones included)."""
        with self._lock:
            return sorted(i for i, m in self._members.items() if m.since <= round)

    def mark_left(self, peer_id: int, reason: str = "") -> None:
        """Record that a peer stopped training (and why, if it said); nobody waits for it."""
        with self._lock:
            self._left[peer_id] = reason

    def has_left(self, peer_id: int) -> bool:
        """Whether the peer announced that it stopped."""
        with self._lock:
            return peer_id in self._left

    def why_left(self, peer_id: int) -> str | None:
        """The reason a peer gave when it stopped ("" if none), or None if it has not left."""
        with self._lock:
            return self._left.get(peer_id)

    def next_id(self) -> int:
        """The smallest id above every known one."""
        with self._lock:
            return max(self._members, default=-1) + 1

    def members(self) -> list[Member]:
        """All members sorted by id."""
        with self._lock:
            return sorted(self._members.values(), key=lambda m: m.id)

    def wire(self) -> list[list[Any]]:
        """The member list as sent on the wire."""
        return [[m.id, m.address, m.since] for m in self.members()]
