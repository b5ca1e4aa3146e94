"""Ask a running member about its swarm (config and members) before joining it."""

from __future__ import annotations

import threading
import time
from typing import Any

from gossipdl.peers.peer import PeerError
from gossipdl.transport import Message, Transport, TransportError, WireError, encode
from gossipdl.transport.addresses import ResolveError, resolve
from gossipdl.transport.asked import NONCE, SharedAsked
from gossipdl.transport.curve import Curve
from gossipdl.transport.key_search import find_key
from gossipdl.transport.probe import CONNECT_WAIT_S, reachable


def fetch_swarm_info(
    address: str,
    *,
    listen: str = "tcp://127.0.0.1:0",
    timeout: float = 30.0,
    curve: Curve | None = None,
    advertise: str | None = None,
) -> dict[str, Any]:
    """The ``{"config", "members", "key"}`` a member at ``address`` answers with (``key``: the
    member's CURVE key, "" without CURVE, for the join that follows: see
    :meth:`Curve.knowing`).

    Binds a throwaway endpoint at ``listen`` for the answer, telling the member to send it
    to ``advertise`` if given, else to our IP on the interface that routes to ``address``
    (a machine with several, or behind NAT, is reached only there). With CURVE the member's
    key is first found among the allow-list's (:func:`find_key`). Then it asks every second
    until ``timeout``. Only an answer that echoes the nonce of one of our requests counts:
    nobody else can slip us a config. The config is the member's word, not checked here:
    see ``gossipdl.trust``. Where nothing listens, the member's encryption differs from
    ours, or it refuses our key, it fails within seconds.
    """
    deadline = time.monotonic() + timeout
    try:
        address = resolve(address, "the member's address")  # the transport dials only IPs
        reachable([address], secure=curve is not None, wait=min(timeout, CONNECT_WAIT_S))
        key = find_key(address, curve, deadline - time.monotonic()) if curve is not None else ""
    except (TransportError, ResolveError) as exc:
        raise PeerError(str(exc)) from None
    asked = SharedAsked()
    nonces: list[str] = []
    arrived = threading.Event()

    def on_message(msg: Message) -> None:
        if msg.kind != "info" or not isinstance(msg.meta.get("config"), dict):
            raise WireError("unexpected", f"expected an info answer, got {msg.kind}")
        if asked.take(msg):
            arrived.set()

    transport = Transport(
        listen,
        on_message,
        name="join",
        curve=curve,
        on_failure=lambda _: arrived.set(),
        advertise=advertise,
        toward=address,
    )
    if curve is not None:
        transport.set_key(address, key)
    try:
        while not arrived.is_set() and (left := deadline - time.monotonic()) > 0:
            nonces.append(asked.ask("info", key))
            meta = {"address": transport.address, NONCE: nonces[-1]}
            transport.send(address, encode("info_request", -1, 0, 0, meta=meta))
            arrived.wait(min(1.0, left))
    finally:
        transport.close(flush_timeout=0.5)
    if transport.failure is not None:
        raise PeerError(f"reading the answer from {address} failed: {transport.failure!r}")
    answer = asked.answer(nonces)
    if answer is None:
        raise PeerError(
            f"no answer from {address} within {timeout:.0f}s; is a gossipdl peer listening "
            f"there, and can it reach us at {transport.address}? (if not: --listen "
            "tcp://0.0.0.0:0, or --advertise tcp://HOST:PORT with an address it reaches)"
        )
    return {"config": answer.meta["config"], "members": answer.meta.get("members", []), "key": key}
