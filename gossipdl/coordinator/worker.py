"""A parameter-server worker on the real engine: local steps, pushes to every shard, the
shards' model back, over ZeroMQ with threads and the wall clock.

``ServerWorker`` has the shape of ``Peer`` (``step()``, ``steps``, ``stats()``,
``close()``), so the same training loop drives gossip peers and PS workers. What
it pushes, which answers it accepts and what it adopts is the protocol's
:class:`~gossipdl.protocol.ps_worker.WorkerCore` (the simulator drives the same
one); here the transport's receive thread hands it the shards' answers and the
training thread waits on a condition until they are all in, or the wait's deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossipdl.averaging.local_optimizer import LocalOptimizer
from gossipdl.models.parameters import parameter_bytes
from gossipdl.protocol.core import Send
from gossipdl.protocol.ps_server import HEARTBEAT_S
from gossipdl.protocol.ps_worker import WorkerCore, WorkerSettings
from gossipdl.transport import Message, Transport, TransportError
from gossipdl.transport.addresses import ResolveError, resolve
from gossipdl.transport.curve import Curve
from gossipdl.transport.inbox import received_limit
from gossipdl.transport.key_search import find_key
from gossipdl.transport.probe import CONNECT_WAIT_S, reachable
from gossipdl.transport.shaping import LinkProfile

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A shard did not answer in time; the message names it."""


class ServerWorker:
    """Worker ``rank`` of a parameter-server run with shards at ``servers``.

    ``rule`` is ``sync`` (push every ``period`` steps and wait for the round's
    mean), ``async`` (push every ``period`` steps, continue with whatever the
    shards hold) or ``fedavg`` (train ``local_steps`` steps in each round this
    worker is picked for; ``samples`` weighs its update); see
    :class:`~gossipdl.protocol.ps_worker.WorkerSettings`. ``link`` emulates the
    worker's access link (the shards' links are not shaped: a server in a data centre).
    With ``curve`` every message is encrypted; each shard's public key is found
    on the allow-list first (:meth:`_find_server_keys`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: LocalOptimizer | None,
        *,
        rank: int,
        servers: Sequence[str],
        rule: str = "sync",
        codec: str = "none",
        period: int = 1,
        local_steps: int = 1,
        samples: int = 1,
        listen: str = "tcp://127.0.0.1:0",
        timeout: float = 10.0,
        max_message_bytes: int = 1 << 30,
        seed: int = 0,
        link: LinkProfile | None = None,
        curve: Curve | None = None,
        advertise: str | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.params = list(model.parameters())
        self.id = rank
        try:  # the user's host names, once, here: ZeroMQ would resolve them on every redial
            self.servers = [resolve(a, "--servers") for a in servers]
        except ResolveError as exc:
            raise ServerError(str(exc)) from None
        settings = WorkerSettings(
            rule=rule,
            codec=codec,
            period=period,
            local_steps=local_steps,
            samples=samples,
            timeout=timeout,
            seed=seed,
        )
        self.core = WorkerCore(rank, len(self.servers), self._flat(), settings)
        self._arrived = threading.Condition()  # guards the core: two threads feed it
        self._closed = False
        self.transport = Transport(
            listen,
            self._on_message,
            max_message_bytes=max_message_bytes,
            name="worker",
            link=link,
            seed=seed * 7919 + rank,
            curve=curve,
            max_received_bytes=received_limit(None, parameter_bytes(self.params)),  # the answers
            on_failure=self._wake,
            advertise=advertise,
            toward=self.servers[0] if self.servers else None,
        )
        self.address = self.core.address = self.transport.address
        if curve is not None:
            try:
                self._find_server_keys(curve)
            except BaseException:
                self.transport.close(flush_timeout=0.5)
                raise
        self._stop_beat = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        self._beat.start()
        try:  # FedAvg: pull until a round picks this worker
            with self._arrived:
                sends = self.core.start(time.monotonic())
            self._exchange(sends)
        except BaseException:
            self.close(reason="no first round")
            raise

    # ----------------------------------------------------------------- public API
    @property
    def steps(self) -> int:
        """Local steps taken (under FedAvg with the steps of the rounds it sat out)."""
        return self.core.steps

    def step(self) -> None:
        """Local optimizer step; then, when due, push the update and take the shards' model."""
        if self.optimizer is not None:
            self.optimizer.step()
        with self._arrived:
            now = time.monotonic()
            sends = self.core.push(now, self._flat()) if self.core.step(now) else []
        self._exchange(sends)

    def sync_at_step(self, step: int) -> None:
        """Nothing to arrange: a parameter server's model is the agreed one."""

    def stats(self) -> dict[str, Any]:
        """Counters for metrics, with the staleness of this worker's updates (async)."""
        with self._arrived:
            return {**self.transport.stats.snapshot(), **self.core.stats()}

    def close(self, reason: str = "") -> None:
        """Tell every shard this worker stopped, and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._stop_beat.set()
        with self._arrived:
            sends = self.core.leave(reason)
        self._send(sends)
        self.transport.close()

    def __enter__(self) -> ServerWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- exchanges
    def _exchange(self, sends: list[Send]) -> None:
        """Send, then wait for every shard's answer and adopt it, until the core waits for
        nothing more (FedAvg pulls on through the rounds that do not pick this worker)."""
        self._send(sends)
        while self.core.waiting is not None:
            with self._arrived:
                self._wait_for_answers()
                adopted = self.core.adopt(time.monotonic())
            vector_to_parameters(adopted.model, self.params)  # the parameters become views
            if adopted.fresh_round and self.optimizer is not None:
                self.optimizer.state.clear()  # McMahan et al. 2017, Algorithm 1: ClientUpdate
            self._send(adopted.sends)

    def _wait_for_answers(self) -> None:
        """Sleep until the open wait has every shard's answer (with ``_arrived`` held);
        ServerError once its deadline passed or the receive thread failed."""
        while not self.core.complete:
            if self.transport.failure is not None:
                raise ServerError(
                    f"worker {self.id}: stopped, because handling a message failed with "
                    f"{self.transport.failure!r} (traceback in the log above)"
                )
            deadline = self.core.deadline
            assert deadline is not None
            left = deadline - time.monotonic()
            if left <= 0:
                raise ServerError(self.core.no_answer(self.servers))
            self._arrived.wait(left)

    def _send(self, sends: list[Send]) -> None:
        for send in sends:
            self.transport.send(self.servers[send.to], send.frames)

    def _find_server_keys(self, curve: Curve) -> None:
        """CURVE: which listed key each shard has, found by handshakes (:func:`find_key`,
        many keys at once; a shard that refuses our key says so at once)."""
        deadline = time.monotonic() + self.core.settings.timeout
        for k, address in enumerate(self.servers):
            try:  # a shard not running is said so, not blamed on the allow-list
                reachable(
                    [address], secure=True, wait=min(self.core.settings.timeout, CONNECT_WAIT_S)
                )
                key = find_key(address, curve, max(0.0, deadline - time.monotonic()))
            except TransportError as exc:  # Unreachable among them
                raise ServerError(f"worker {self.id}: shard {k} at {address}: {exc}") from None
            self.core.shard_keys[k] = key
            self.transport.set_key(address, key)

    def _flat(self) -> torch.Tensor:
        with torch.no_grad():
            return parameters_to_vector(self.params).to(torch.float32)

    def _heartbeat(self) -> None:
        while not self._stop_beat.wait(HEARTBEAT_S):
            with self._arrived:
                sends = self.core.heartbeat()
            self._send(sends)

    # ----------------------------------------------------------------- receive thread
    def _wake(self, _failure: BaseException) -> None:
        """The receive thread stopped on an error: wake the wait so it says so."""
        with self._arrived:
            self._arrived.notify_all()

    def _on_message(self, msg: Message) -> None:
        with self._arrived:
            self.core.receive(msg)
            self._arrived.notify_all()
