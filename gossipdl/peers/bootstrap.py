"""Ask a running member about its swarm (config and members) before joining it."""

from __future__ import annotations

import threading
from typing import Any

from gossipdl.peers.peer import PeerError
from gossipdl.transport import Message, Transport, WireError, encode


def fetch_swarm_info(
    address: str, *, listen: str = "tcp://127.0.0.1:0", timeout: float = 30.0
) -> dict[str, Any]:
    """The ``{"config", "members"}`` a member at ``address`` answers with.

    Binds a throwaway endpoint at ``listen`` for the answer and retries every
    second until ``timeout``.
    """
    answer: list[Message] = []
    arrived = threading.Event()

    def on_message(msg: Message) -> None:
        if msg.kind != "info" or not isinstance(msg.meta.get("config"), dict):
            raise WireError("unexpected", f"expected an info answer, got {msg.kind}")
        answer.append(msg)
        arrived.set()

    transport = Transport(listen, on_message, name="join")
    try:
        waited = 0.0
        while waited < timeout and not arrived.is_set():
            transport.send(
                address, encode("info_request", -1, 0, 0, meta={"address": transport.address})
            )
            arrived.wait(min(1.0, timeout - waited))
            waited += 1.0
    finally:
        transport.close(flush_timeout=0.5)
    if not answer:
        raise PeerError(
            f"no answer from {address} within {timeout:.0f}s; is a gossipdl peer listening there?"
        )
    return {"config": answer[0].meta["config"], "members": answer[0].meta.get("members", [])}
