"""Ask a running member about its swarm (config and members) before joining it."""

from __future__ import annotations

import threading
import time
from typing import Any

from gossipdl.peers.peer import PeerError
from gossipdl.transport import Message, Transport, WireError, encode
from gossipdl.transport.curve import KEY_TRY_S, Curve, listed_key


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
    the right one gets through the handshake).
    """
    answer: list[Message] = []
    arrived = threading.Event()

    def on_message(msg: Message) -> None:
        if msg.kind != "info" or not isinstance(msg.meta.get("config"), dict):
            raise WireError("unexpected", f"expected an info answer, got {msg.kind}")
        answer.append(msg)
        arrived.set()

    every = KEY_TRY_S if curve is not None else 1.0
    transport = Transport(listen, on_message, name="join", curve=curve)
    try:
        deadline = time.monotonic() + timeout
        tries = 0
        while not arrived.is_set() and (left := deadline - time.monotonic()) > 0:
            if curve is not None:
                transport.set_key(address, listed_key(curve, tries))
            tries += 1
            transport.send(
                address, encode("info_request", -1, 0, 0, meta={"address": transport.address})
            )
            arrived.wait(min(every, left))
    finally:
        transport.close(flush_timeout=0.5)
    if not answer:
        hint = ", and is our public key on its allow-list" if curve is not None else ""
        raise PeerError(
            f"no answer from {address} within {timeout:.0f}s; is a gossipdl peer listening "
            f"there{hint}?"
        )
    return {"config": answer[0].meta["config"], "members": answer[0].meta.get("members", [])}
