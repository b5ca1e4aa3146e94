"""Requests in flight: a reply counts only if it answers a request this endpoint sent.

Every request (``join``, ``info_request``, ``model_request``) carries a fresh
random nonce and its reply echoes it. A third party never sees the nonce, so
it cannot hijack a join or a rejoin with a spoofed ``welcome``, or feed a
joiner a model it did not ask for; with CURVE the reply must also come over
the key the request was sent to. Both engines keep their requests here: the real peer
under a lock (:class:`~gossipdl.transport.asked.SharedAsked`), the simulator's core
without one.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from gossipdl.transport.wire import NONCE, Message, WireError

MAX_ASKED = 1024  # requests remembered (open or answered); the oldest is forgotten beyond it


class Asked:
    """The nonces of this endpoint's requests, each with the reply kind it waits for, the
    CURVE key of the peer it went to ("" without CURVE) and its answer once one came.

    Example:
        >>> asked = Asked()
        >>> nonce = asked.ask("welcome", key="")
        >>> asked.take(Message("welcome", 0, 0, 0, meta={NONCE: nonce}))
        True
        >>> asked.answer([nonce]).kind
        'welcome'
    """

    def __init__(
        self, limit: int = MAX_ASKED, guard: AbstractContextManager[Any] | None = None
    ) -> None:
        """At most ``limit`` requests remembered; ``guard`` is held around every call."""
        self._lock = guard if guard is not None else nullcontext()
        self._limit = limit
        # nonce -> [reply kind, key, answer or None]; closed requests keep answer "closed"
        self._requests: OrderedDict[str, list[Any]] = OrderedDict()

    def ask(self, reply: str, key: str, nonce: str = "") -> str:
        """A new nonce for a request whose answer is a ``reply`` message sent over ``key``
        (``nonce``: the caller's own, drawn from a seeded stream in the simulator; a fresh
        random one without it)."""
        nonce = nonce or secrets.token_hex(8)
        with self._lock:
            self._requests[nonce] = [reply, key, None]
            while len(self._requests) > self._limit:
                self._requests.popitem(last=False)
        return nonce

    def take(self, msg: Message) -> bool:
        """Keep ``msg`` as the answer to its request (True); False for one more answer to a
        request already answered or closed (a retry's, harmless). WireError ``unsolicited``
        if it answers no request of ours, ``wrong_key`` if it came over another key."""
        nonce = msg.meta.get(NONCE)
        with self._lock:
            request = self._requests.get(nonce) if isinstance(nonce, str) else None
            if request is None or request[0] != msg.kind:
                raise WireError("unsolicited", f"a {msg.kind} that answers no request of ours")
            if request[1] != msg.key:
                raise WireError("wrong_key", f"a {msg.kind} over another key than we asked")
            if request[2] is not None:
                return False
            request[2] = msg
            return True

    def answer(self, nonces: list[str]) -> Message | None:
        """The first answer that came to any of ``nonces``, or None."""
        with self._lock:
            for nonce in nonces:
                request = self._requests.get(nonce)
                if request is not None and isinstance(request[2], Message):
                    return request[2]
        return None

    def close(self, nonces: list[str]) -> None:
        """Stop waiting on ``nonces``: later answers to them are ignored, not kept."""
        with self._lock:
            for nonce in nonces:
                if nonce in self._requests:
                    self._requests[nonce][2] = "closed"
