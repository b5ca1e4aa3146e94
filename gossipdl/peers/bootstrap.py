"""Ask a running member about its swarm (config and members) before joining it."""

from __future__ import annotations

import threading
import time
from typing import Any

from gossipdl.peers.peer import PeerError
from gossipdl.transport import Message, Transport, WireError, encode
from gossipdl.transport.asked import NONCE, SharedAsked
from gossipdl.transport.curve import KEY_TRY_S, Curve, listed_key
from gossipdl.transport.probe import CONNECT_WAIT_S, Unreachable, reachable


def fetch_swarm_info(
    address: str,
    *,
    listen: str = "tcp://127.0.0.1:0",
    timeout: float = 30.0,
    curve: Curve | None = None,
) -> dict[str, Any]:
    """The ``{"config", "members"}`` a member at ``address`` answers with.

    Binds a throwaway endpoint at ``listen`` for the answer and asks again
    until ``timeout``: every second, or with CURVE every third of a second with
    the next key of the allow-list (the member's key is not known yet; only
    the right one gets through the handshake). Only an answer that echoes the
    nonce of one of our requests counts: nobody else can slip us a config. The
    config is the member's word, not checked here: see ``gossipdl.trust``. Where nothing
    listens, or the member's encryption differs from ours, it fails within seconds.
    """
    try:
        reachable([address], secure=curve is not None, wait=min(timeout, CONNECT_WAIT_S))
    except Unreachable as exc:
        raise PeerError(str(exc)) from None
    asked = SharedAsked()
    nonces: list[str] = []
    arrived = threading.Event()

    def on_message(msg: Message) -> None:
        if msg.kind != "info" or not isinstance(msg.meta.get("config"), dict):
            raise WireError("unexpected", f"expected an info answer, got {msg.kind}")
        if asked.take(msg):
            arrived.set()

    every = KEY_TRY_S if curve is not None else 1.0
    transport = Transport(
        listen, on_message, name="join", curve=curve, on_failure=lambda _: arrived.set()
    )
    try:
        deadline = time.monotonic() + timeout
        while not arrived.is_set() and (left := deadline - time.monotonic()) > 0:
            key = listed_key(curve, len(nonces)) if curve is not None else ""
            if curve is not None:
                transport.set_key(address, key)
            nonces.append(asked.ask("info", key))
            meta = {"address": transport.address, NONCE: nonces[-1]}
            transport.send(address, encode("info_request", -1, 0, 0, meta=meta))
            arrived.wait(min(every, left))
    finally:
        transport.close(flush_timeout=0.5)
    if transport.failure is not None:
        raise PeerError(f"reading the answer from {address} failed: {transport.failure!r}")
    answer = asked.answer(nonces)
    if answer is None:
        hint = ", and is our public key on its allow-list" if curve is not None else ""
        raise PeerError(
            f"no answer from {address} within {timeout:.0f}s; is a gossipdl peer listening "
            f"there{hint}?"
        )
    return {"config": answer.meta["config"], "members": answer.meta.get("members", [])}
