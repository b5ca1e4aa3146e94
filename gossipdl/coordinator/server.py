"""The real driver of a parameter-server shard: ZeroMQ and the wall clock around the state
machine :class:`~gossipdl.protocol.ps_server.ShardServer`.

The receive thread only queues messages; one thread hands each to the shard with the
time, ticks it after every message and every ``TICK_S`` seconds, and sends what its
outbox holds, until every worker left or was declared dead.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from gossipdl.models.parameters import parameter_bytes
from gossipdl.protocol.ps_server import TICK_S, ShardServer
from gossipdl.transport import Message, Transport, WireError
from gossipdl.transport.curve import Curve
from gossipdl.transport.inbox import received_limit
from gossipdl.transport.ratelimit import DEFAULT_MESSAGE_RATE

log = logging.getLogger(__name__)

# Messages received and not yet applied, per worker of the run (plus a few for strangers): a
# worker waits for each answer, so more means a flood; drop reason ``too_many_pending``.
MAX_QUEUED_PER_WORKER = 8


def serve(
    server: ShardServer,
    listen: str,
    *,
    max_message_bytes: int = 1 << 30,
    max_message_rate: float = DEFAULT_MESSAGE_RATE,
    on_listening: Callable[[str], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    report: Callable[[dict[str, Any]], None] | None = None,
    report_every: float = 1.0,
    curve: Curve | None = None,
) -> dict[str, Any]:
    """Run ``server`` on ``listen`` until every worker left (or ``should_stop``); returns stats.

    The receive thread only queues messages (at most ``MAX_QUEUED_PER_WORKER``
    per worker of the run); this thread applies them, so the shard's state has
    one writer. ``report`` gets the stats every ``report_every`` seconds and once
    at the end. With ``curve``, only the allow-list's keys get in, and a worker
    is answered over the key its messages came with, held for its bound reply address
    only (one per worker: the shard binds a worker's address, and an earlier life's key
    joins the transport's bounded reply keys).
    """
    inbox: queue.Queue[Message] = queue.Queue(MAX_QUEUED_PER_WORKER * (server.workers + 1))

    def queue_message(msg: Message) -> None:
        try:
            inbox.put_nowait(msg)
        except queue.Full:
            raise WireError("too_many_pending", f"{inbox.maxsize} messages wait already") from None

    transport = Transport(
        listen,
        queue_message,
        max_message_bytes=max_message_bytes,
        name="server",
        max_message_rate=max_message_rate,
        curve=curve,
        # every worker's push of the shard at once (a sync round), with room to spare
        max_received_bytes=received_limit(None, server.workers * parameter_bytes([server.x])),
    )
    if on_listening is not None:
        on_listening(transport.address)
    reported = time.monotonic()
    try:
        while not should_stop():
            try:
                msg = inbox.get(timeout=TICK_S)
            except queue.Empty:
                msg = None
            now = time.monotonic()
            if msg is not None:
                try:
                    before = server.known.get(msg.sender)
                    bound = before.address if before is not None else ""
                    server.handle(msg, now)
                    address = server.known[msg.sender].address
                    if msg.key and address != bound:  # first contact, or a new life elsewhere
                        transport.set_key(address, msg.key)
                        if bound:  # the earlier life's key joins the bounded reply keys
                            transport.retain_keys({s.address for s in server.known.values()})
                except WireError as exc:
                    transport.stats.drop(exc.reason)
                    log.warning(
                        "shard %d: dropped %s from %d: %s", server.shard, msg.kind, msg.sender, exc
                    )
            server.tick(now)
            for address, frames in server.outbox:
                transport.send(address, frames)
            server.outbox.clear()
            if report is not None and now - reported >= report_every:
                report({**server.stats(), **transport.stats.snapshot()})
                reported = now
            if server.finished:
                break
        stats = {**server.stats(), **transport.stats.snapshot()}
        if report is not None:
            report(stats)
        return stats
    finally:
        transport.close()
