"""One parameter-server shard as a state machine: holds a slice of the model and combines the
workers' pushes, with no I/O.

With ``--ps-shards K`` the flat parameter vector is cut into K contiguous
slices (``chunk_bounds``), one per server, as in DistBelief; a worker talks to
every shard and each shard runs the same rule on its slice.

Workers push updates (their parameters minus the model they last pulled,
through the run's codec) and get the shard's current slice back. The rule:

* ``sync``: wait for every live worker's update of round t, apply their mean,
  answer them all (H = 1 is synchronous SGD; H > 1 is parameter averaging);
* ``async``: apply each update as it comes, by the ``staleness`` rule, and
  answer at once (or, under SSP, once the slowest live worker catches up);
* ``fedavg``: each round pick a fraction C of the workers, answer their pull
  with the model, and apply the mean of their updates weighted by their
  sample counts once all picked (live) workers pushed.

The engine hands :meth:`ShardServer.handle` each decoded message with the time,
calls :meth:`ShardServer.tick` after it and every ``TICK_S`` seconds, and sends
what ``outbox`` holds: :func:`gossipdl.coordinator.server.serve` with ZeroMQ and
the wall clock, :class:`gossipdl.sim.ps.PsSimulation` on virtual time. A worker
unheard of for ``timeout`` seconds (workers send a heartbeat every
``HEARTBEAT_S``) is declared dead: rounds stop waiting for it, SSP stops holding
others for it.

Without CURVE anyone can send a message that claims to be worker w and names any reply
address, so a shard answers only addresses that show they receive its answers. A worker's
reply address is bound at its first message: another address for a worker that is alive
or left is refused (``bad_address``); only a worker declared dead starts a new life (a
restarted process) at a new address. Every answer's sequence number is a fresh random
ticket (as TCP's are, for the same reason) and a worker's messages carry as theirs the
ticket of the shard's last answer it took; a request (a pull, a push that is answered) is
answered only with the ticket of the shard's last answer to that worker, or while none was
sent in its life (``bad_ticket``). So requests that name a third party's address, or a
worker's own, make a shard send one answer, not one per request.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gossipdl.compression import CodecError, Payload, build_codec
from gossipdl.protocol.staleness import StalenessTally, parse_staleness
from gossipdl.transport.address_syntax import check_address
from gossipdl.transport.wire import Message, WireError, encode, meta_int

log = logging.getLogger(__name__)

PS_RULES = ("sync", "async", "fedavg")
_TICKETS = random.SystemRandom()  # an answer's ticket: nobody who does not receive it guesses it
HEARTBEAT_S = 1.0  # how often a worker tells every shard it is alive
TICK_S = 0.1  # how often a shard with nothing to handle looks at its workers and rounds


@dataclass
class WorkerState:
    """What a shard knows about one worker."""

    address: str
    heard: float
    clock: int = 0  # the worker's local steps at its last push
    base: int = 0  # the shard version the worker last pulled
    alive: bool = True
    left: bool = False  # said goodbye (a dead worker is not alive and did not leave)
    key: str = ""  # CURVE: the public key its messages come over ("" without CURVE)
    ticket: int = 0  # the ticket of the last answer sent to it in this life (0: none yet)


@dataclass
class Pending:
    """A reply the shard owes a worker, sent when ``ready`` says so."""

    worker: int
    round: int
    staleness: int = 0


def fedavg_pick(seed: int, index: int, workers: int, fraction: float) -> list[int]:
    """The workers that train in round ``index``: max(1, round(C·N)) of them, the same on
    every shard.

    Example:
        >>> fedavg_pick(0, 3, 8, 1.0)
        [0, 1, 2, 3, 4, 5, 6, 7]
    """
    count = max(1, round(fraction * workers))
    return sorted(random.Random(seed * 1_000_003 + index).sample(range(workers), count))


def fedavg_local_steps(shard_size: int, batch_size: int, epochs: int) -> int:
    """Local steps of a picked FedAvg worker per round: ``epochs`` passes over its shard.

    Example:
        >>> fedavg_local_steps(500, 32, 2)
        32
    """
    return max(1, epochs * math.ceil(shard_size / batch_size))


def fedavg_rounds(steps: int, shard_sizes: list[int], batch_size: int, epochs: int) -> int:
    """FedAvg rounds so a worker picked every round takes about ``steps`` local steps."""
    mean = sum(fedavg_local_steps(n, batch_size, epochs) for n in shard_sizes) / len(shard_sizes)
    return max(1, math.ceil(steps / mean))


class ShardServer:
    """The state and rule of one shard; ``handle`` and ``tick`` run on one thread."""

    def __init__(
        self,
        initial: torch.Tensor,
        *,
        rule: str,
        workers: int,
        shard: int = 0,
        codec: str = "none",
        staleness: str = "scale",
        fraction: float = 1.0,
        rounds: int = 0,
        seed: int = 0,
        timeout: float = 10.0,
        startup_timeout: float = 120.0,
    ) -> None:
        if rule not in PS_RULES:
            raise ValueError(f"ps rule {rule!r}; choose one of {', '.join(PS_RULES)}")
        self.x = initial.detach().to(torch.float32).clone()
        self.rule = rule
        self.shard = shard
        self.workers = workers
        self.codec = build_codec(codec)
        self.staleness = parse_staleness(staleness)
        self.fraction = fraction
        self.rounds = rounds
        self.seed = seed
        self.timeout = timeout
        self.startup_timeout = startup_timeout
        self.version = 0  # updates applied (async) or rounds completed (sync, fedavg)
        self._snapshot: tuple[int, np.ndarray] | None = None  # (version, a copy of x then)
        self.round = 0
        self.known: dict[int, WorkerState] = {}
        self.updates: dict[int, tuple[torch.Tensor, float]] = {}  # this round's, by worker
        self.soft: list[torch.Tensor] = []
        self.pending: list[Pending] = []
        self.first_heard: float | None = None
        self.staleness_seen = StalenessTally()  # async: every applied update
        self.max_lead = 0  # SSP: the largest clock lead of a worker we answered
        self.outbox: list[tuple[str, list[Any]]] = []  # (address, frames) for the transport

    # ----------------------------------------------------------------- messages
    def handle(self, msg: Message, now: float) -> None:
        """One message from a worker; WireError for anything malformed or out of place, which
        changes nothing. Replies are queued in ``outbox`` by ``tick``."""
        worker = msg.sender
        if not 0 <= worker < self.workers:
            raise WireError("unknown_sender", f"worker id {worker} outside 0..{self.workers - 1}")
        if msg.kind not in ("alive", "leave", "pull", "push"):
            raise WireError("unexpected", f"a shard takes push, pull, alive, leave; got {msg.kind}")
        address = check_address(msg.meta.get("address"), "reply address")
        known = self.known.get(worker)
        if known is not None and known.address and known.key != msg.key:
            raise WireError("wrong_key", f"{msg.kind} claims to be worker {worker}")  # CURVE
        ticket = msg.seq  # the ticket of the shard's last answer it took (0: none yet)
        same_life = self._same_life(worker, known, address, ticket)
        answered = msg.kind == "pull" or (msg.kind == "push" and self.rule != "fedavg")
        if answered and same_life and known is not None and known.ticket not in (0, ticket):
            raise WireError(
                "bad_ticket",
                f"a {msg.kind} of worker {worker} without the ticket of the shard's last answer",
            )
        clock = meta_int(msg.meta, "clock", "clock", default=known.clock if known else 0)
        pushed = self._checked_push(worker, known, msg, clock) if msg.kind == "push" else None
        if self.first_heard is None:
            self.first_heard = now
        state = self.known.setdefault(worker, WorkerState("", now))
        if not same_life:
            state.ticket = 0  # a new life: its first answer goes out unasked
        state.heard, state.address, state.key = now, address, msg.key
        if not state.alive and not state.left:
            log.info("shard %d: worker %d is back", self.shard, worker)
            state.alive = True
        if msg.kind == "leave":
            state.alive, state.left = False, True
        elif msg.kind == "pull":
            self._owe(Pending(worker, msg.round))
        elif pushed is not None:
            state.clock = clock
            self._push(worker, state, msg, *pushed)

    def _same_life(self, worker: int, known: WorkerState | None, address: str, ticket: int) -> bool:
        """Whether a message naming ``address`` with ``ticket`` comes from the life of
        ``worker`` the shard knows. False for its first message (it binds the address) and
        for a worker declared dead that names another address or not its ticket (a
        restarted process); WireError ``bad_address`` for another address of a worker that
        is alive or left (replies would go to whoever the sender names)."""
        if known is None or not known.address:
            return False
        if known.alive or known.left:
            if address != known.address:
                raise WireError(
                    "bad_address",
                    f"worker {worker} answers at {known.address}, not {address[:80]}",
                )
            return True
        return address == known.address and ticket == known.ticket

    def _checked_push(
        self, worker: int, known: WorkerState | None, msg: Message, clock: int
    ) -> tuple[torch.Tensor, float]:
        """A push's update, decoded, and its weight (FedAvg: the worker's samples); WireError
        ``unexpected`` for one the round does not wait for (from a worker that left, one
        FedAvg did not pick, or of another round), or ``duplicate`` for an async push no
        later than the last one taken from its worker (the network delivered it twice)."""
        if known is not None and known.left:
            raise WireError("unexpected", f"an update from worker {worker}, which left")
        if self.rule == "async":
            if known is not None and clock <= known.clock:
                raise WireError(
                    "duplicate", f"an update of step {clock}; worker {worker} is at {known.clock}"
                )
        elif msg.round != self.round:
            raise WireError("unexpected", f"update for round {msg.round}, shard at {self.round}")
        elif self.rule == "fedavg" and worker not in fedavg_pick(
            self.seed, self.round, self.workers, self.fraction
        ):
            raise WireError("unexpected", f"an update from worker {worker}, not picked this round")
        meta = msg.meta if self.rule == "fedavg" else {}
        samples = meta_int(meta, "samples", "samples", default=1, minimum=1)
        return self._decode(msg), float(samples)

    def _owe(self, pending: Pending) -> None:
        """Owe a worker a reply: one at a time (a worker waits for each answer before it asks
        again), so a new request replaces what it was owed and nobody grows the list."""
        self.pending = [p for p in self.pending if p.worker != pending.worker]
        self.pending.append(pending)

    def _push(
        self, worker: int, state: WorkerState, msg: Message, update: torch.Tensor, weight: float
    ) -> None:
        if self.rule == "async":
            tau = self.version - state.base
            self.staleness_seen.add(tau)
            if self.staleness.kind == "soft":
                self.soft.append(update)
                if len(self.soft) >= self.staleness.bound:
                    self.x.add_(torch.stack(self.soft).mean(0))
                    self.soft.clear()
                    self.version += 1
            else:
                self.x.add_(update, alpha=self.staleness.weight(tau))
                self.version += 1
            self._owe(Pending(worker, msg.round, tau))
            return
        self.updates[worker] = (update, weight)
        if self.rule == "sync":
            self._owe(Pending(worker, msg.round + 1))

    def _decode(self, msg: Message) -> torch.Tensor:
        if msg.codec != self.codec.spec:
            raise WireError("bad_codec", f"codec {msg.codec!r}, this run uses {self.codec.spec!r}")
        try:
            return self.codec.decode(
                Payload(tuple(msg.arrays), msg.meta.get("codec_meta", {})),
                self.x.numel(),
                torch.device("cpu"),
            )
        except CodecError as exc:
            raise WireError("bad_payload", str(exc)) from None

    # ----------------------------------------------------------------- progress
    def tick(self, now: float) -> None:
        """Declare silent workers dead, close a round when it is complete, send what is due.

        A worker never heard from counts as at step 0 until ``startup_timeout`` after the
        first worker was heard from; then it is dead too."""
        if self.first_heard is not None and now - self.first_heard > self.startup_timeout:
            for worker in range(self.workers):
                self.known.setdefault(worker, WorkerState("", self.first_heard))
        for worker, state in self.known.items():
            if state.alive and now - state.heard > self.timeout:
                state.alive = False
                log.warning(
                    "shard %d: worker %d silent for %.0fs; carrying on without it",
                    self.shard,
                    worker,
                    now - state.heard,
                )
        if self.rule != "async" and self._round_complete():
            self._close_round()
        self.pending = [p for p in self.pending if not self._answer(p)]

    @property
    def finished(self) -> bool:
        """Every worker of the run left or was declared dead: nothing more will come."""
        states = self.known.values()
        return bool(states) and len(states) == self.workers and not any(s.alive for s in states)

    def expected(self) -> list[int]:
        """Workers whose update this round waits for: live ones (picked ones under FedAvg)."""
        if self.rule == "fedavg":
            picked = fedavg_pick(self.seed, self.round, self.workers, self.fraction)
        else:
            picked = list(range(self.workers))
        return [w for w in picked if w not in self.known or self.known[w].alive]

    def _round_complete(self) -> bool:
        """Every expected update is in (a round nobody live was picked for is skipped)."""
        if self.done:
            return False
        expected = self.expected()
        return all(w in self.updates for w in expected) and (bool(self.updates) or not expected)

    def _close_round(self) -> None:
        """Apply the mean of this round's updates (weighted by samples) and start the next."""
        if self.updates:
            total = sum(weight for _, weight in self.updates.values())
            mean = torch.zeros_like(self.x)
            for _, (update, weight) in sorted(self.updates.items()):  # fixed order: same bits
                mean.add_(update, alpha=weight / total)
            self.x.add_(mean)
        self.updates.clear()
        self.round += 1
        self.version += 1

    @property
    def done(self) -> bool:
        """FedAvg: every round has been run."""
        return self.rule == "fedavg" and self.round >= self.rounds

    def _answer(self, pending: Pending) -> bool:
        """Send a reply if it is due; True once sent."""
        state = self.known.get(pending.worker)
        if state is None:
            return True
        meta: dict[str, Any] = {"shard": self.shard, "version": self.version}
        if self.rule == "async":
            unseen = [0] * (self.workers - len(self.known))  # not started yet: at step 0
            live = [s.clock for s in self.known.values() if s.alive] + unseen
            slowest = min(live, default=state.clock)
            if state.alive and self.staleness.holds(state.clock, slowest):
                return False
            self.max_lead = max(self.max_lead, state.clock - slowest)
            meta.update(staleness=pending.staleness, lead=state.clock - slowest)
        elif pending.round > self.round:
            return False
        else:
            meta["round"] = self.round
            if self.rule == "fedavg":
                meta["picked"] = pending.worker in fedavg_pick(
                    self.seed, self.round, self.workers, self.fraction
                )
                meta["done"] = self.done
        state.base = self.version
        state.ticket = (1 << 31) | _TICKETS.getrandbits(31)  # 5 bytes of msgpack, every one
        frames = encode("shard", -1 - self.shard, state.ticket, self.round, [self.snapshot()], meta)
        self.outbox.append((state.address, frames))
        return True

    def snapshot(self) -> np.ndarray:
        """The shard's model at the current version, as a copy nothing writes to: ZeroMQ
        sends a reply's frame after ``handle`` returns, without copying it, while the next
        update is added to ``x``. One copy per version (``x`` changes only with it), shared
        by every reply of that version."""
        if self._snapshot is None or self._snapshot[0] != self.version:
            self._snapshot = (self.version, self.x.numpy().copy())
        return self._snapshot[1]

    def stats(self) -> dict[str, Any]:
        """What a shard reports in its metrics."""
        return {
            "shard": self.shard,
            "version": self.version,
            "round": self.round,
            "updates": self.staleness_seen.count if self.rule == "async" else self.version,
            **self.staleness_seen.metrics(),
            "max_lead": self.max_lead,
            "dead_workers": sorted(w for w, s in self.known.items() if not s.alive and not s.left),
        }
