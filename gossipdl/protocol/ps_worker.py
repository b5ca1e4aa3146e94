"""A parameter-server worker's protocol as a state machine: what it pushes, which answers it
accepts, and the model it adopts, with no I/O.

Events in: a local step ended (:meth:`WorkerCore.step`, then :meth:`WorkerCore.push`
with the parameters when it says a push is due), a shard's answer arrived
(:meth:`WorkerCore.receive`), every answer is in (:meth:`WorkerCore.adopt`). Actions
out: frames for shard k (:class:`~gossipdl.protocol.core.Send` with ``to = k``), the
shards' model to use, and whether a FedAvg round starts afresh. The threaded
:class:`gossipdl.coordinator.worker.ServerWorker` drives it with ZeroMQ and the wall
clock, :class:`gossipdl.sim.ps.PsSimulation` on virtual time.

A push is the worker's parameters minus the model it last pulled, per shard
slice, through the run's codec with error feedback for a lossy one (the part
not sent is added to the next push); each shard answers with its current slice,
which replaces the worker's parameters. Under FedAvg a worker pulls the next
round right after its push and, while a round does not pick it, pulls the one
after, counting the steps it sat out (every worker keeps the same schedule).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossipdl.compression import build_codec
from gossipdl.protocol.core import Send
from gossipdl.protocol.ps_server import PS_RULES
from gossipdl.protocol.ring import chunk_bounds
from gossipdl.protocol.staleness import StalenessTally
from gossipdl.transport.wire import Message, WireError, encode, meta_int

STEP_TIMES_KEPT = 32  # recent step times, whose median sizes a FedAvg worker's wait


@dataclass(frozen=True)
class WorkerSettings:
    """How a worker takes part: ``rule`` (``sync``: push every ``period`` steps and wait for
    the round's mean; ``async``: push every ``period`` steps and go on with what the shards
    hold; ``fedavg``: train ``local_steps`` steps in each round it is picked for, its update
    weighed by ``samples``), the ``codec`` of its pushes, the ``timeout`` of a wait for the
    shards (``round_timeout``) and the ``seed`` of its codecs."""

    rule: str = "sync"
    codec: str = "none"
    period: int = 1
    local_steps: int = 1
    samples: int = 1
    timeout: float = 10.0
    seed: int = 0


@dataclass
class Adopted:
    """What taking every shard's answer gives: the model to train on from now, the next pull
    (FedAvg, when this round did not pick the worker) and whether a picked FedAvg round
    starts, which begins from the global model with a fresh optimizer state."""

    model: torch.Tensor
    sends: list[Send]
    fresh_round: bool


class WorkerCore:
    """Worker ``rank`` of a run with ``shards`` shards, starting from the flat ``model``.

    ``address`` is the reply address every message carries (an engine that binds its
    socket later sets it before the first send); ``shard_keys`` (CURVE) the public key each
    shard answers over, "" while unknown."""

    def __init__(
        self,
        rank: int,
        shards: int,
        model: torch.Tensor,
        settings: WorkerSettings,
        address: str = "",
    ) -> None:
        if settings.rule not in PS_RULES:
            raise ValueError(f"ps rule {settings.rule!r}; choose one of {', '.join(PS_RULES)}")
        self.id = rank
        self.settings = settings
        self.rule = settings.rule
        self.address = address
        self.numel = model.numel()
        self.bounds = chunk_bounds(self.numel, shards)
        self.codecs = [
            build_codec(settings.codec, settings.seed + 7919 * rank + k) for k in range(shards)
        ]
        self.residuals: list[torch.Tensor | None] = [None] * shards
        self.shard_keys = [""] * shards
        self.tickets = [0] * shards  # each shard's last answer's sequence number, echoed
        self.reference = model.detach().to(torch.float32).clone()  # the model last pulled
        self.steps = 0
        self.round = 0
        self.done = False  # FedAvg: the server ran its last round
        self.picked = True
        self.syncs = 0
        self.model_messages_sent = 0
        self.idle_s = 0.0
        self.staleness = StalenessTally()
        self.max_lead = 0
        self.replies: dict[int, Message] = {}  # shard -> its answer to the open wait
        self.versions = [0] * shards  # each shard's version in the answer last taken
        self.waiting: str | None = None  # the kind ("push", "pull") whose answers it awaits
        self.waiting_round = 0
        self._since = 0.0  # when the open wait began
        self._step_times: deque[float] = deque(maxlen=STEP_TIMES_KEPT)
        self._last_step_at: float | None = None

    # ----------------------------------------------------------------- events
    def start(self, now: float) -> list[Send]:
        """The worker begins: under FedAvg it pulls rounds until one picks it (then waits
        for the answers); under the other rules there is nothing to do."""
        return self._pull(now, 0) if self.rule == "fedavg" else []

    def step(self, now: float) -> bool:
        """A local optimizer step ended at ``now``; True when a push is due (call ``push``)."""
        self.steps += 1
        if self._last_step_at is not None:
            self._step_times.append(now - self._last_step_at)
        self._last_step_at = now
        if self.rule == "fedavg":
            return self.steps % self.settings.local_steps == 0
        return self.steps % self.settings.period == 0

    @torch.no_grad()
    def push(self, now: float, x: torch.Tensor) -> list[Send]:
        """Push the update of parameters ``x`` to every shard, then wait for the answers:
        to the push itself, or under FedAvg to the pull of the next round."""
        sends = self._push(x.detach().to(torch.float32), self.round)
        if self.rule == "fedavg":
            return sends + self._pull(now, self.round + 1)
        self._wait(now, "push", self.round)
        return sends

    def receive(self, msg: Message) -> None:
        """A shard's answer; WireError (nothing kept) unless it is one this run's shards send."""
        if msg.kind != "shard":
            raise WireError("unexpected", f"a worker takes shard messages, got {msg.kind}")
        shard = msg.meta.get("shard")
        if not isinstance(shard, int) or not 0 <= shard < len(self.bounds):
            raise WireError("bad_meta", f"shard {shard!r} is not one of this run's shards")
        if self.shard_keys[shard] and msg.key != self.shard_keys[shard]:
            raise WireError("wrong_key", f"a shard {shard} answer over another key than its own")
        a, b = self.bounds[shard]
        if len(msg.arrays) != 1 or msg.arrays[0].dtype != np.float32 or msg.arrays[0].size != b - a:
            raise WireError("bad_payload", f"shard {shard} sends one float32 array of {b - a}")
        for key, least in (("round", 0), ("staleness", 0), ("lead", None)):
            if key in msg.meta:  # adopt reads them: checked here, where a WireError drops it
                meta_int(msg.meta, key, f"shard {shard}'s {key}", minimum=least)
        for key in ("done", "picked"):
            if not isinstance(msg.meta.get(key, False), bool):
                raise WireError("bad_meta", f"shard {shard}'s {key} is not true or false")
        self._check_answers_the_wait(shard, msg)
        self.replies[shard] = msg
        self.tickets[shard] = msg.seq  # the shard answers the next request only with it

    def _check_answers_the_wait(self, shard: int, msg: Message) -> None:
        """WireError ``unexpected`` unless ``msg`` answers the open wait: a copy of an earlier
        answer (the network may deliver one twice, or late) would complete the next wait
        with an older model. A sync push of round t is answered at round t + 1, a FedAvg
        pull of round r at r or later; an async answer is of a version no older than the
        last one taken from that shard."""
        if self.waiting is None:
            raise WireError("unexpected", f"an answer from shard {shard}, but no wait is open")
        version = meta_int(msg.meta, "version", f"shard {shard}'s version")
        if self.rule == "async":
            if version < self.versions[shard]:
                raise WireError(
                    "unexpected", f"shard {shard}'s version {version}, older than the last taken"
                )
            return
        least = self.waiting_round + (1 if self.waiting == "push" else 0)
        answered = meta_int(msg.meta, "round", f"shard {shard}'s round")
        if answered < least:
            raise WireError(
                "unexpected",
                f"shard {shard}'s answer of round {answered}; the {self.waiting} of round "
                f"{self.waiting_round} waits for round {least} or later",
            )

    @property
    def complete(self) -> bool:
        """Whether the open wait has every shard's answer (call ``adopt``)."""
        return self.waiting is not None and len(self.replies) == len(self.bounds)

    @torch.no_grad()
    def adopt(self, now: float) -> Adopted:
        """Take every shard's answer as the model; under FedAvg pull the next round when
        this one did not pick the worker (its steps count as taken), else the wait ends."""
        assert self.complete, "adopt needs an answer from every shard"
        replies, self.replies = self.replies, {}
        self.idle_s += now - self._since
        new = torch.empty(self.numel, device=self.reference.device)
        for k, (a, b) in enumerate(self.bounds):
            new[a:b] = torch.from_numpy(replies[k].arrays[0].copy()).to(new.device)
            self.versions[k] = replies[k].meta["version"]
        self.reference = new.clone()
        self.syncs += 1
        first = replies[0].meta
        self.round = first.get("round", self.round + 1)
        self.done = bool(first.get("done", False))
        self.picked = all(r.meta.get("picked", True) for r in replies.values())
        if self.rule == "async":
            self.staleness.add(max(r.meta.get("staleness", 0) for r in replies.values()))
            self.max_lead = max(self.max_lead, *(r.meta.get("lead", 0) for r in replies.values()))
        pulled = self.waiting == "pull"
        if pulled and not (self.done or self.picked):
            self.steps += self.settings.local_steps
            return Adopted(new, self._pull(now, self.round + 1), fresh_round=False)
        self.waiting = None
        return Adopted(new, [], fresh_round=pulled)

    def heartbeat(self) -> list[Send]:
        """``alive`` to every shard (a shard declares a worker silent for ``timeout`` dead)."""
        return [self.send("alive", k) for k in range(len(self.bounds))]

    def leave(self, reason: str = "") -> list[Send]:
        """``leave`` to every shard: this worker stopped (``reason``: why, when it failed)."""
        return [self.send("leave", k, {"reason": reason[:500]}) for k in range(len(self.bounds))]

    # ----------------------------------------------------------------- waiting
    def finished(self, steps: int) -> bool:
        """Whether the worker is through: under FedAvg once the server ran its last round,
        under the other rules after ``steps`` local steps."""
        return self.done if self.rule == "fedavg" else self.steps >= steps

    @property
    def deadline(self) -> float | None:
        """When the open wait gives up (None: no wait open): ``timeout``, twice under sync
        and FedAvg (the shard may first wait ``timeout`` to drop a dead worker), plus under
        FedAvg three rounds of local steps at the recent step time (a round lasts as long as
        the picked workers train)."""
        if self.waiting is None:
            return None
        limit = self.settings.timeout
        if self.rule != "async":
            limit += self.settings.timeout
        if self.rule == "fedavg" and self._step_times:
            limit += 3 * self.settings.local_steps * float(np.median(self._step_times))
        return self._since + limit

    def missing(self) -> list[int]:
        """The shards whose answer the open wait still lacks."""
        return [k for k in range(len(self.bounds)) if k not in self.replies]

    def no_answer(self, addresses: Sequence[str]) -> str:
        """Why the open wait failed at its deadline, naming the silent shards at ``addresses``."""
        where = ", ".join(f"shard {k} at {addresses[k]}" for k in self.missing())
        assert self.deadline is not None
        return (
            f"worker {self.id}: no answer to its {self.waiting} of round {self.waiting_round} "
            f"within {self.deadline - self._since:.0f}s from {where}; the server died or is "
            "overloaded (raise round_timeout if it is only slow)"
        )

    def stats(self) -> dict[str, Any]:
        """The protocol's part of a metrics line, with the staleness of its updates (async)."""
        staleness = {**self.staleness.metrics(), "max_lead": self.max_lead}
        return {
            "round": self.round,
            "model_messages_sent": self.model_messages_sent,
            "syncs": self.syncs,
            "neighbour_misses": 0,
            "resyncs": 0,
            "idle_s": round(self.idle_s, 4),
            **(staleness if self.rule == "async" else {}),
        }

    # ----------------------------------------------------------------- messages
    def send(
        self,
        kind: str,
        shard: int,
        meta: dict[str, Any] | None = None,
        arrays: Any = (),
        round: int = 0,
    ) -> Send:
        """One message to ``shard``, carrying the reply address and this worker's step; its
        sequence number is the ticket of the shard's last answer taken, which shows the
        shard that the address receives its answers."""
        codec = self.codecs[shard].spec if kind == "push" else "none"
        meta = {**(meta or {}), "address": self.address, "clock": self.steps}
        ticket = self.tickets[shard]
        return Send(shard, kind, encode(kind, self.id, ticket, round, arrays, meta, codec))

    def _push(self, x: torch.Tensor, round: int) -> list[Send]:
        """Each shard's slice of (parameters − last pulled model), compressed; a lossy codec's
        leftover is kept and added to the next push (error feedback)."""
        sends = []
        for k, (a, b) in enumerate(self.bounds):
            update = x[a:b] - self.reference[a:b]
            residual = self.residuals[k]
            if residual is not None:
                update += residual
            payload, sent = self.codecs[k].encode(update)
            if self.codecs[k].lossy:
                self.residuals[k] = update - sent
            meta = {"codec_meta": payload.meta, "samples": self.settings.samples}
            sends.append(self.send("push", k, meta, payload.arrays, round))
            self.model_messages_sent += 1
        return sends

    def _pull(self, now: float, round: int) -> list[Send]:
        self._wait(now, "pull", round)
        return [self.send("pull", k, {}, (), round) for k in range(len(self.bounds))]

    def _wait(self, now: float, kind: str, round: int) -> None:
        self.waiting, self.waiting_round, self._since = kind, round, now
