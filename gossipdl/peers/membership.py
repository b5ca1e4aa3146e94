"""The real engine's member table: the protocol's :class:`MemberTable` under one lock, shared
by the training, receive and watch threads."""

from __future__ import annotations

import threading

from gossipdl.protocol.membership import (  # noqa: F401 (the real engine's names for them)
    MAX_ID,
    MAX_MEMBERS,
    Member,
    MemberTable,
    parse_members,
)


class Membership(MemberTable):
    """A :class:`MemberTable` safe to share between threads."""

    def __init__(self, members: list[Member] | None = None, limit: int = MAX_MEMBERS) -> None:
        super().__init__(members, limit, guard=threading.Lock())
