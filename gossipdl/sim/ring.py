"""The ring all-reduce baseline (mode ``ring``) on the simulated engine.

Each virtual peer runs the ring's protocol, :class:`~gossipdl.protocol.ring.RingCore`
(behind :class:`~gossipdl.protocol.ring_powersgd.LowRankRing` for ``powersgd:RANK``),
the same state machine the real engine drives with threads: its ``chunk`` frames
cross :class:`~gossipdl.sim.network.SimNetwork` as encoded, so bytes are counted as
in a real run, and its deadlines (the "waiting for" notices, the timeout that names
a dead member) are timers on the virtual clock. Beside it, each peer keeps the
gossip core the real ``Peer`` keeps in ring mode, for heartbeats, ``leave`` notices,
the round count and the metrics line.

What a step does is the real ``Peer.step`` of ``algorithm="allreduce"``: with the
trigger ``always``, the gradients are all-reduced before the optimizer step; with
``periodic:H``, every H-th step all-reduces the parameters (PowerSGD: their change
since the last round). A member that dies stops the ring: its successor times out
naming it, leaves with that reason, and so on around the ring (``failures``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from gossipdl.averaging import Averager, build_averager
from gossipdl.config import Config
from gossipdl.protocol.ring import RING_CHECKS_FINITE, RingCore, RingFailure
from gossipdl.protocol.ring_powersgd import LowRankMean, LowRankRing
from gossipdl.rundir import RunDir
from gossipdl.sim.clock import Timer
from gossipdl.sim.engine import Simulation, SimulationError, VirtualPeer
from gossipdl.transport.wire import WireError, decode

log = logging.getLogger(__name__)


@dataclass
class RingPeer:
    """A virtual peer's side of the ring: the state machine, what to do with the mean it
    is computing, and the timer set for its deadline."""

    reducer: RingCore | LowRankRing
    then: Callable[[], None] | None = None
    timer: Timer | None = None


class RingSimulation(Simulation):
    """The swarm of ``config`` (mode ``ring``) in ``run``, ready to :meth:`run`."""

    mode = "ring"
    sentences = False  # a ring names its dead on its own timeout (as the real Peer does)
    unsimulated = (
        "a ring all-reduce cannot take members once it started, for real either, and it has "
        "no heartbeats to slow; kill a peer for good, or run mode gossip"
    )

    def __init__(self, config: Config, run: RunDir, *, step_time: float | None = None) -> None:
        if config.overlap:
            raise SimulationError(
                "overlap = true in mode ring averages gradients in buckets during backward; "
                "the simulator has no backward to overlap (its mean is the same): set "
                "overlap = false to simulate the ring"
            )
        if config.shared_memory:
            raise SimulationError(
                "shared_memory = true averages through this host's memory, with no network "
                "for the simulator to model: set shared_memory = false to simulate the ring"
            )
        super().__init__(config, run, step_time=step_time)
        ids = [peer.id for peer in self.peers]
        # Peer.reduces_gradients: every step all-reduces the gradients (an optimizer is given)
        self.gradients = self.peers[0].core.trigger.period == 1
        self.low_rank = config.codec.startswith("powersgd:")
        self.rings = {peer.id: RingPeer(self._reducer(peer, ids)) for peer in self.peers}

    def _averager(self, peer_id: int | None = None) -> Averager:
        config = self.config  # the ring averages no models; the core counts rounds
        return build_averager("dense", "none", config.seed)

    def _topology(self) -> str:
        return "ring"

    def _reducer(self, peer: VirtualPeer, ids: list[int]) -> RingCore | LowRankRing:
        """The ring ``Peer._reducer`` builds: values in fp16 or float32, or PowerSGD's
        factors over a plain ring."""
        config = self.config
        if self.low_rank:
            rank = int(config.codec.split(":")[1])
            mean = LowRankMean([p.shape for p in peer.params], rank, seed=config.seed)
            ring = RingCore(peer.id, ids, mean.length, timeout=config.round_timeout)
            return LowRankRing(mean, ring)
        numel = sum(p.numel() for p in peer.params)
        codec = "fp16" if config.codec == "fp16" else "none"
        return RingCore(peer.id, ids, numel, codec=codec, timeout=config.round_timeout)

    # ----------------------------------------------------------------- events
    def _handler(self, peer: VirtualPeer) -> Callable[[int, list[bytes]], None]:
        limit = peer.core.settings.max_message_bytes

        def deliver(sender: int, frames: list[bytes]) -> None:
            if peer.dead:
                return
            now, sends = self.clock.now, []
            try:
                msg = decode(frames, limit, RING_CHECKS_FINITE)  # the ring checks its sums
                if msg.kind != "chunk":
                    sends = peer.core.receive(now, frames)  # heartbeats, leave notices
                elif peer.core.membership.get(msg.sender) is None:
                    raise WireError("unknown_sender", f"chunk from id {msg.sender}, not a member")
                else:
                    peer.core.detector.heard(msg.sender, now)
                    self.rings[peer.id].reducer.receive(now, msg)
            except WireError as exc:
                self.network.stats(peer.id).drop(exc.reason)
                return
            self._send(peer, sends)
            if self.rings[peer.id].reducer.busy:
                self._pump(peer)

        return deliver

    def _step(self, peer: VirtualPeer) -> None:
        """One local step's compute ends now: all-reduce the gradients, then the optimizer
        step (``Peer.step`` with ``reduces_gradients``), or the optimizer step at once."""
        if not self._computed(peer):
            return
        if not self.gradients:
            self._stepped(peer)
            return
        for p in peer.params:  # a missing gradient counts as zero
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in peer.params if p.grad is not None]
        flat = parameters_to_vector(grads).detach()

        def stepped() -> None:
            vector_to_parameters(flat, grads)
            self._stepped(peer)

        self._reduce(peer, flat, stepped)

    def _stepped(self, peer: VirtualPeer) -> None:
        """The optimizer step; a round if the trigger says (``Peer.gossip``): the mean of
        the parameters, or with PowerSGD the mean change since the last round."""
        peer.optimizer.step()
        peer.steps += 1
        if not peer.core.trigger.ends_round(peer.steps):
            self._after_round(peer)
            return
        if self.gradients:  # averaged before the local step
            self._next_round(peer)
            return
        x = peer.flat()
        reference = peer.core.reference
        delta = x - reference if self.low_rank else x

        def averaged() -> None:
            if self.low_rank:
                reference.add_(delta)
                peer.flat_params.load_(reference)
            else:
                peer.flat_params.load_(delta)
            self._next_round(peer)

        self._reduce(peer, delta, averaged)

    def _next_round(self, peer: VirtualPeer) -> None:
        peer.core.advance(self.clock.now)
        self._after_round(peer)

    # ----------------------------------------------------------------- the all-reduce
    def _reduce(self, peer: VirtualPeer, vector: torch.Tensor, then: Callable[[], None]) -> None:
        """All-reduce ``vector`` (flat float32, replaced by the mean), then call ``then``."""
        ring = self.rings[peer.id]
        ring.then = then
        ring.reducer.start(self.clock.now, vector.numpy())
        self._pump(peer)

    def _pump(self, peer: VirtualPeer) -> None:
        """Poll the peer's ring until it waits: send what it asks, and once the mean is
        there go on with the step; else set a timer for its deadline."""
        ring = self.rings[peer.id]
        reducer, now = ring.reducer, self.clock.now
        while True:
            why = peer.core.membership.why_left(reducer.predecessor)
            if why is not None:
                reducer.left(reducer.predecessor, why)
            progress = reducer.poll(now)
            for send in progress.sends:
                peer.core.counters.model_messages_sent += 1  # as Peer._send_chunk counts
                self.network.send(peer.id, send.to, send.frames)
            if progress.failure is not None or progress.result is not None:
                if ring.timer is not None:
                    ring.timer.cancel()
                ring.timer = None
            if progress.failure is not None:
                self._fail(peer, progress.failure)
                return
            if progress.result is not None:
                then, ring.then = ring.then, None
                assert then is not None
                then()
                return
            if not progress.moved:
                break
        deadline = reducer.deadline
        if deadline is not None and (ring.timer is None or ring.timer.at != deadline):
            if ring.timer is not None:
                ring.timer.cancel()
            ring.timer = self.clock.at(max(deadline, now), lambda: self._wake(peer))

    def _wake(self, peer: VirtualPeer) -> None:
        """The ring's deadline: a notice is due, or the wait timed out."""
        ring = self.rings[peer.id]
        ring.timer = None
        if not peer.dead and ring.reducer.busy:
            self._pump(peer)

    def _fail(self, peer: VirtualPeer, failure: RingFailure) -> None:
        """The all-reduce cannot finish: the peer stops as a real one does on ``RingError``
        (it leaves with the reason, so the next rank's error names the culprit too)."""
        log.error("%s", failure.message)  # it names the peer: "peer 2, ring all-reduce 7: ..."
        self.failures[peer.id] = failure.message
        self._send(peer, peer.core.leave(f"stopped by RingError: {failure.message}"))
        peer.dead, peer.finished_at = True, self.clock.now
        self.network.kill(peer.id)
