"""A parameter-server worker: local steps, pushes to every shard, the shards' model back.

``ServerWorker`` has the shape of ``Peer`` (``step()``, ``steps``, ``stats()``,
``close()``), so the same training loop drives gossip peers and PS workers.
A push is the worker's parameters minus the model it last pulled, per shard,
through the run's codec with error feedback for a lossy one; the answer is
the shard's current slice, which replaces the worker's parameters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossipdl.compression import build_codec
from gossipdl.coordinator.ring import chunk_bounds
from gossipdl.coordinator.server import HEARTBEAT_S, PS_RULES
from gossipdl.coordinator.staleness import StalenessTally
from gossipdl.transport import Message, Transport, WireError, encode
from gossipdl.transport.curve import KEY_TRY_S, Curve, listed_key
from gossipdl.transport.shaping import LinkProfile

log = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A shard did not answer in time; the message names it."""


class ServerWorker:
    """Worker ``rank`` of a parameter-server run with shards at ``servers``.

    ``rule`` is ``sync`` (push every ``period`` steps and wait for the round's
    mean), ``async`` (push every ``period`` steps, continue with whatever the
    shards hold) or ``fedavg`` (train ``local_steps`` steps in each round this
    worker is picked for; ``samples`` weighs its update). ``link`` emulates the
    worker's access link (the shards' links are not shaped: a server in a data centre).
    With ``curve`` every message is encrypted; each shard's public key is found
    on the allow-list first (:meth:`_find_server_keys`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
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
        if rule not in PS_RULES:
            raise ValueError(f"ps rule {rule!r}; choose one of {', '.join(PS_RULES)}")
        self.model = model
        self.optimizer = optimizer
        self.params = list(model.parameters())
        self.id = rank
        self.rule = rule
        self.period = period
        self.local_steps = local_steps
        self.samples = samples
        self.timeout = timeout
        self.servers = list(servers)
        self.numel = sum(p.numel() for p in self.params)
        self.bounds = chunk_bounds(self.numel, len(self.servers))
        self.codecs = [build_codec(codec, seed + 7919 * rank + k) for k in range(len(servers))]
        self.codec = self.codecs[0].spec
        self.steps = 0
        self.round = 0
        self.done = False
        self.syncs = 0
        self.model_messages_sent = 0
        self.idle_s = 0.0
        self.staleness = StalenessTally()
        self.max_lead = 0
        self._replies: dict[int, Message] = {}
        self._picked = True
        self._step_times: deque[float] = deque(maxlen=32)
        self._last_step_at: float | None = None
        self.residuals: list[torch.Tensor | None] = [None] * len(self.servers)
        self._shard_keys: list[str] = [""] * len(self.servers)  # CURVE: each shard's key
        self._arrived = threading.Condition()
        self._closed = False
        self.transport = Transport(
            listen,
            self._on_message,
            max_message_bytes=max_message_bytes,
            name="worker",
            link=link,
            seed=seed * 7919 + rank,
            curve=curve,
            on_failure=self._wake,
            advertise=advertise,
            toward=self.servers[0] if self.servers else None,
        )
        self.address = self.transport.address
        if curve is not None:
            try:
                self._find_server_keys(curve)
            except BaseException:
                self.transport.close(flush_timeout=0.5)
                raise
        self._global = self._flat()
        self._stop_beat = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        self._beat.start()
        if rule == "fedavg":
            try:
                self._next_picked_round(0)
            except BaseException:
                self.close(reason="no first round")
                raise

    # ----------------------------------------------------------------- public API
    def step(self) -> None:
        """Local optimizer step; then, when due, push the update and take the shards' model."""
        if self.optimizer is not None:
            self.optimizer.step()
        self.steps += 1
        now = time.monotonic()
        if self._last_step_at is not None:
            self._step_times.append(now - self._last_step_at)
        self._last_step_at = now
        if self.rule == "fedavg":
            if self.steps % self.local_steps == 0:
                self._push(self.round)
                self._next_picked_round(self.round + 1)
        elif self.steps % self.period == 0:
            self._push(self.round)
            self._adopt(self.round, "push")

    def sync_at_step(self, step: int) -> None:
        """Nothing to arrange: a parameter server's model is the agreed one."""

    def stats(self) -> dict[str, Any]:
        """Counters for metrics, with the staleness of this worker's updates (async)."""
        return {
            **self.transport.stats.snapshot(),
            "round": self.round,
            "model_messages_sent": self.model_messages_sent,
            "syncs": self.syncs,
            "neighbour_misses": 0,
            "resyncs": 0,
            "idle_s": round(self.idle_s, 4),
            **(
                {
                    **self.staleness.metrics(),
                    "max_lead": self.max_lead,
                }
                if self.rule == "async"
                else {}
            ),
        }

    def close(self, reason: str = "") -> None:
        """Tell every shard this worker stopped, and close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._stop_beat.set()
        for k, address in enumerate(self.servers):
            self.transport.send(address, self._frames("leave", k, {"reason": reason[:500]}))
        self.transport.close()

    def __enter__(self) -> ServerWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- exchanges
    @torch.no_grad()
    def _push(self, round: int) -> None:
        """Send each shard its slice of (parameters − last pulled model), compressed; a lossy
        codec's leftover is kept and added to the next push (error feedback)."""
        x = self._flat()
        for k, (a, b) in enumerate(self.bounds):
            update = x[a:b] - self._global[a:b]
            residual = self.residuals[k]
            if residual is not None:
                update += residual
            payload, sent = self.codecs[k].encode(update)
            if self.codecs[k].lossy:
                self.residuals[k] = update - sent
            meta = {"codec_meta": payload.meta, "samples": self.samples}
            frames = self._frames("push", k, meta, payload.arrays, round)
            self.transport.send(self.servers[k], frames)
            self.model_messages_sent += 1

    def _find_server_keys(self, curve: Curve) -> None:
        """CURVE: which listed key each shard has. We pull with each key in turn (only the
        right one gets through the handshake) and keep the key the answer came over; the
        answers, the model we start from anyway, are dropped."""
        deadline = time.monotonic() + self.timeout
        for k, address in enumerate(self.servers):
            tries = 0
            with self._arrived:
                while k not in self._replies:
                    if time.monotonic() > deadline:
                        raise ServerError(
                            f"worker {self.id}: shard {k} at {address} did not answer within "
                            f"{self.timeout:.0f}s with any key of the allow-list; is it "
                            "running, and is each side's public key on the other's allow-list?"
                        )
                    self.transport.set_key(address, listed_key(curve, tries))
                    tries += 1
                    self.transport.send(address, self._frames("pull", k, {}, (), 0))
                    self._arrived.wait(KEY_TRY_S)
                self._shard_keys[k] = self._replies[k].key
                self.transport.set_key(address, self._replies[k].key)
        with self._arrived:
            self._replies.clear()

    def _pull(self, round: int) -> None:
        for k, address in enumerate(self.servers):
            self.transport.send(address, self._frames("pull", k, {}, (), round))

    @torch.no_grad()
    def _adopt(self, round: int, kind: str) -> None:
        """Wait for every shard's slice (the answer to our push or pull) and adopt it."""
        started = time.monotonic()
        timeout = self.timeout
        if self.rule != "async":  # the shard may first wait ``timeout`` to drop a dead worker
            timeout += self.timeout
        if self.rule == "fedavg" and self._step_times:  # a round lasts the picked ones' training
            timeout += 3 * self.local_steps * float(np.median(self._step_times))
        with self._arrived:
            while len(self._replies) < len(self.servers):
                if self.transport.failure is not None:
                    raise ServerError(
                        f"worker {self.id}: stopped, because handling a message failed with "
                        f"{self.transport.failure!r} (traceback in the log above)"
                    )
                left = started + timeout - time.monotonic()
                if left <= 0:
                    missing = [k for k in range(len(self.servers)) if k not in self._replies]
                    where = ", ".join(f"shard {k} at {self.servers[k]}" for k in missing)
                    raise ServerError(
                        f"worker {self.id}: no answer to its {kind} of round {round} within "
                        f"{timeout:.0f}s from {where}; the server died or is overloaded "
                        "(raise round_timeout if it is only slow)"
                    )
                self._arrived.wait(left)
            replies = dict(self._replies)
            self._replies.clear()
        self.idle_s += time.monotonic() - started
        new = torch.empty(self.numel, device=self._global.device)
        for k, (a, b) in enumerate(self.bounds):
            new[a:b] = torch.from_numpy(replies[k].arrays[0].copy()).to(new.device)
        vector_to_parameters(new, self.params)  # the parameters become views of ``new``
        self._global = new.clone()
        self.syncs += 1
        first = replies[0].meta
        self.round = first.get("round", self.round + 1)
        self.done = bool(first.get("done", False))
        self._picked = all(r.meta.get("picked", True) for r in replies.values())
        if self.rule == "async":
            tau = max(r.meta.get("staleness", 0) for r in replies.values())
            self.staleness.add(tau)
            self.max_lead = max(self.max_lead, *(r.meta.get("lead", 0) for r in replies.values()))

    def _next_picked_round(self, round: int) -> None:
        """FedAvg: pull rounds from ``round`` on until this worker is picked or the run is done;
        a round it sits out still counts its steps, so every worker keeps the same schedule.
        A picked round starts from the global model with a fresh optimizer state, as
        ClientUpdate does (McMahan et al. 2017, Algorithm 1): no momentum from the last one."""
        while True:
            self._pull(round)
            self._adopt(round, "pull")
            if self.done or self._picked:
                if self.optimizer is not None:
                    self.optimizer.state.clear()
                return
            self.steps += self.local_steps
            round = self.round + 1

    def _frames(
        self, kind: str, shard: int, meta: dict[str, Any], arrays: Any = (), round: int = 0
    ) -> list[Any]:
        codec = self.codecs[shard].spec if kind == "push" else "none"
        meta = {**meta, "address": self.address, "clock": self.steps}
        return encode(kind, self.id, 0, round, arrays, meta, codec)

    def _flat(self) -> torch.Tensor:
        with torch.no_grad():
            return parameters_to_vector(self.params).to(torch.float32)

    def _heartbeat(self) -> None:
        while not self._stop_beat.wait(HEARTBEAT_S):
            for k, address in enumerate(self.servers):
                self.transport.send(address, self._frames("alive", k, {}))

    # ----------------------------------------------------------------- receive thread
    def _wake(self, _failure: BaseException) -> None:
        """The receive thread stopped on an error: wake ``_adopt`` so it says so."""
        with self._arrived:
            self._arrived.notify_all()

    def _on_message(self, msg: Message) -> None:
        if msg.kind != "shard":
            raise WireError("unexpected", f"a worker takes shard messages, got {msg.kind}")
        shard = msg.meta.get("shard")
        if not isinstance(shard, int) or not 0 <= shard < len(self.servers):
            raise WireError("bad_meta", f"shard {shard!r} is not one of this run's shards")
        if self._shard_keys[shard] and msg.key != self._shard_keys[shard]:
            raise WireError("wrong_key", f"a shard {shard} answer over another key than its own")
        a, b = self.bounds[shard]
        if len(msg.arrays) != 1 or msg.arrays[0].dtype != np.float32 or msg.arrays[0].size != b - a:
            raise WireError("bad_payload", f"shard {shard} sends one float32 array of {b - a}")
        with self._arrived:
            self._replies[shard] = msg
            self._arrived.notify_all()
