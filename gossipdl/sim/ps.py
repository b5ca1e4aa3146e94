"""The parameter-server baseline (mode ``ps``) on the simulated engine.

The K shards (``ps_shards``) are nodes ``-1 … -K`` of the
:class:`~gossipdl.sim.network.SimNetwork` with unshaped links (a server in a data
centre, as the real benchmark runs them); each is the real engine's state machine,
:class:`~gossipdl.protocol.ps_server.ShardServer`: it is handed every decoded message
with the virtual time, ticked after each and every ``TICK_S`` (so a worker silent for
``round_timeout`` is declared dead on the virtual clock), and its outbox goes on the
network. The workers are the virtual peers, with their device links and step times;
each drives :class:`~gossipdl.protocol.ps_worker.WorkerCore`, the protocol the real
``ServerWorker`` drives with threads, and sends a heartbeat every ``HEARTBEAT_S``.
Every message is the real encoder's frames, so bytes count as in a real run.

The run directory is a real ps run's: ``peers/<id>.jsonl`` with a ps worker's keys,
``servers/<k>.json`` with each shard's counters (its ``time``: when it saw the last
worker leave or die), ``peers.json`` and the summary. Faults: ``kill`` names workers,
which the shards then declare dead; a partition's groups name workers, and the shards
are on the side of the workers named in no group; ``restart`` is refused (a ps worker
does not resume). A worker whose wait for the shards passes its deadline stops as a
real one does on ``ServerError`` (it leaves, saying why; ``failures``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gossipdl.averaging import Averager, build_averager
from gossipdl.config import Config
from gossipdl.protocol.core import Send
from gossipdl.protocol.ps_server import HEARTBEAT_S, TICK_S, ShardServer
from gossipdl.protocol.ps_worker import WorkerCore
from gossipdl.rundir import RunDir, write_json_atomic
from gossipdl.sim.clock import Timer
from gossipdl.sim.engine import (
    Simulation,
    SimulationError,
    VirtualPeer,
    sim_address,
)
from gossipdl.training import (
    json_line,
    metrics_line,
    ps_worker_settings,
    shard_server,
)
from gossipdl.transport.wire import WireError, decode

log = logging.getLogger(__name__)


def shard_node(shard: int) -> int:
    """The network node of shard ``shard`` (the id its answers carry as sender)."""
    return -1 - shard


def shard_address(shard: int) -> str:
    """The address a shard has in a worker's error messages (a name no machine has)."""
    return f"tcp://shard-{shard}.sim:5555"


@dataclass
class SimShard:
    """A shard on the simulated network: its state machine, and when every worker was gone."""

    server: ShardServer
    node: int
    stopped_at: float | None = None


@dataclass
class SimWorker:
    """A virtual peer's side of the parameter server: its protocol, what follows once the
    shards' answers are adopted, and the timer set for the wait's deadline."""

    core: WorkerCore
    then: Callable[[], None] | None = None
    timer: Timer | None = None


class PsSimulation(Simulation):
    """The run of ``config`` (mode ``ps``) in ``run``, ready to :meth:`run`.

    The peers' gossip cores (the base class builds one each) stay idle: a ps worker
    talks only to the shards, through its :class:`SimWorker`."""

    mode = "ps"
    unsimulated = (
        "a ps worker does not resume, for real either, and its shards keep no member table; "
        "kill the worker for good, or run mode gossip"
    )

    def __init__(self, config: Config, run: RunDir, *, step_time: float | None = None) -> None:
        super().__init__(config, run, step_time=step_time)
        self.max_message_bytes = int(config.max_message_mb * 2**20)
        self.shards = [
            SimShard(shard_server(config, self.dataset, k), shard_node(k))
            for k in range(config.ps_shards)
        ]
        for shard in self.shards:
            self.network.attach(shard.node, self._shard_handler(shard))  # unshaped
        self.workers = {
            peer.id: SimWorker(
                WorkerCore(
                    peer.id,
                    config.ps_shards,
                    peer.flat(),
                    ps_worker_settings(config, self.dataset, peer.id),
                    sim_address(peer.id),
                )
            )
            for peer in self.peers
        }

    def _averager(self, peer_id: int | None = None) -> Averager:
        config = self.config  # the idle gossip core's: the lightest there is
        return build_averager("dense", "none", config.seed)

    # ----------------------------------------------------------------- the shards
    def _shard_handler(self, shard: SimShard) -> Callable[[int, list[bytes]], None]:
        def deliver(sender: int, frames: list[bytes]) -> None:
            if shard.stopped_at is not None:  # serve() returned: nobody listens
                return
            try:
                msg = decode(frames, self.max_message_bytes)
                shard.server.handle(msg, self.clock.now)
            except WireError as exc:
                self.network.stats(shard.node).drop(exc.reason)
                log.warning("shard %d: dropped a message from %d: %s", -1 - shard.node, sender, exc)
            self._serve(shard)

        return deliver

    def _serve(self, shard: SimShard) -> None:
        """Tick the shard, send what it owes, and stop it once every worker is gone (as
        ``serve`` does after each message)."""
        server, now = shard.server, self.clock.now
        server.tick(now)
        for address, frames in server.outbox:
            self.network.send(shard.node, self.node_at(address), frames)
        server.outbox.clear()
        if server.finished:
            shard.stopped_at = now

    def _watch_shard(self, shard: SimShard) -> None:
        """``serve``'s tick when no message comes: every ``TICK_S`` until the shard stops."""
        if shard.stopped_at is None:
            self._serve(shard)
            self.clock.after(TICK_S, lambda: self._watch_shard(shard))

    def _write_servers(self) -> None:
        """``servers/<k>.json``: each shard's counters, as ``run_shard`` writes them."""
        for k, shard in enumerate(self.shards):
            path = self.run_dir.server_stats(k)
            path.parent.mkdir(parents=True, exist_ok=True)
            ended = self.clock.now if shard.stopped_at is None else shard.stopped_at
            stats = {**shard.server.stats(), **self.network.stats(shard.node).snapshot()}
            write_json_atomic(path, {**stats, "time": round(ended, 3)})

    # ----------------------------------------------------------------- the workers
    def _handler(self, peer: VirtualPeer) -> Callable[[int, list[bytes]], None]:
        def deliver(sender: int, frames: list[bytes]) -> None:
            if peer.dead or peer.done:  # its sockets are closed
                return
            core = self.workers[peer.id].core
            try:
                core.receive(decode(frames, self.max_message_bytes))
            except WireError as exc:
                self.network.stats(peer.id).drop(exc.reason)
                return
            if core.complete:
                self._adopt(peer)

        return deliver

    def _to_shards(self, peer: VirtualPeer, sends: list[Send]) -> None:
        for send in sends:
            self.network.send(peer.id, shard_node(send.to), send.frames)

    def _exchange(self, peer: VirtualPeer, sends: list[Send], then: Callable[[], None]) -> None:
        """Send, and once every answer is adopted (at once if the core waits for none),
        go on with ``then``."""
        self._to_shards(peer, sends)
        worker = self.workers[peer.id]
        if worker.core.waiting is None:
            then()
            return
        worker.then = then
        self._watch(peer)

    def _watch(self, peer: VirtualPeer) -> None:
        """A timer for the open wait's deadline (replacing the last wait's)."""
        worker = self.workers[peer.id]
        if worker.timer is not None:
            worker.timer.cancel()
        deadline = worker.core.deadline
        late = functools.partial(self._late, peer)
        worker.timer = None if deadline is None else self.clock.at(deadline, late)

    def _late(self, peer: VirtualPeer) -> None:
        """The wait's deadline passed without every answer: the worker stops, as a real one
        does on ``ServerError`` (it tells the shards why)."""
        worker = self.workers[peer.id]
        worker.timer = None
        if peer.dead or worker.core.waiting is None:
            return
        message = worker.core.no_answer([shard_address(k) for k in range(len(self.shards))])
        log.error("%s", message)
        self.failures[peer.id] = message
        self._to_shards(peer, worker.core.leave(f"stopped by ServerError: {message}"))
        peer.dead, peer.finished_at = True, self.clock.now
        self.network.kill(peer.id)

    def _adopt(self, peer: VirtualPeer) -> None:
        """Every shard answered: take the model, then pull on (FedAvg, a round that did not
        pick this worker) or go on."""
        worker = self.workers[peer.id]
        adopted = worker.core.adopt(self.clock.now)
        peer.flat_params.load_(adopted.model)
        peer.steps = worker.core.steps
        if adopted.fresh_round:  # McMahan et al. 2017, Algorithm 1: ClientUpdate
            peer.optimizer.state.clear()
        if worker.core.waiting is not None:
            self._to_shards(peer, adopted.sends)
            self._watch(peer)
            return
        if worker.timer is not None:
            worker.timer.cancel()
        then, worker.then, worker.timer = worker.then, None, None
        assert then is not None
        then()

    def _begin(self, peer: VirtualPeer) -> None:
        """The worker trains from now (under FedAvg once a round picked it): its start line,
        evaluated on drifted labels where it starts past the drift step (as the real runner
        does), then its first step."""
        self._follow_drift(peer)
        self._record(
            peer,
            **self._evaluation(peer),
            start=True,
            swarm=self.swarm_id,
            swarm_start=self.swarm_start,
        )
        self.clock.after(peer.step_time, lambda: self._step(peer))

    def _step(self, peer: VirtualPeer) -> None:
        """One local step's compute ends now: the optimizer step, then a push if one is due."""
        if not self._computed(peer):
            return
        peer.optimizer.step()
        core = self.workers[peer.id].core
        due = core.step(self.clock.now)
        peer.steps = core.steps
        if not due:
            self._after_round(peer)
            return
        flat = peer.flat()
        self._exchange(peer, core.push(self.clock.now, flat), lambda: self._after_round(peer))

    def _tick(self, peer: VirtualPeer) -> None:
        """A heartbeat to every shard every ``HEARTBEAT_S`` while the worker runs."""
        if peer.done or peer.dead:
            return
        self._to_shards(peer, self.workers[peer.id].core.heartbeat())
        self.clock.after(HEARTBEAT_S, lambda: self._tick(peer))

    def _after_round(self, peer: VirtualPeer) -> None:
        """Metrics due at this step, then the next step, or the end (the runner's loop): a
        FedAvg worker ends with the server's last round, the others after ``steps``."""
        config = self.config
        due = config.eval_every and peer.steps % config.eval_every == 0
        if due and peer.steps < config.steps:
            self._record(peer, **self._evaluation(peer))
        elif peer.steps % config.log_every == 0:
            self._record(peer)
        if self.workers[peer.id].core.finished(config.steps):
            self._finish(peer)
        else:
            self.clock.after(peer.step_time, lambda: self._step(peer))

    def _leave(self, peer: VirtualPeer) -> None:
        """``leave`` to every shard (``ServerWorker.close``)."""
        self._to_shards(peer, self.workers[peer.id].core.leave())

    def _record(self, peer: VirtualPeer, **extra: Any) -> None:
        """One metrics line, with a real ps worker's keys."""
        now = self.clock.now
        stats = {**self.network.stats(peer.id).snapshot(), **self.workers[peer.id].core.stats()}
        line = metrics_line(
            peer.id, peer.steps, now, self.swarm_start + now, peer.losses, stats, extra
        )
        peer.metrics.write(json_line(line))
        peer.losses.clear()

    # ----------------------------------------------------------------- the run
    def run(
        self,
        on_progress: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], bool] = lambda: False,
    ) -> float:
        """Run every worker to its end (or until ``should_stop()``), then the shards until
        they saw every worker go; returns the simulated seconds the workers took.
        ``on_progress(steps done by all workers, simulated time)`` is called as it goes."""
        self.run_dir.write_members((p.id, sim_address(p.id)) for p in self.peers)
        for shard in self.shards:
            self.clock.after(TICK_S, functools.partial(self._watch_shard, shard))
        try:
            for peer in self.peers:  # ServerWorker's constructor, then the runner's loop
                peer.metrics = self.run_dir.metrics(peer.id).open("w", buffering=1)
                self.network.start_link(peer.id)
                self.clock.after(HEARTBEAT_S, functools.partial(self._tick, peer))
                start = self.workers[peer.id].core.start(self.clock.now)
                self._exchange(peer, start, functools.partial(self._begin, peer))
            while not self.finished and not should_stop():
                if self.clock.run(max_events=2000) == 0:
                    stuck = [p.id for p in self.peers if not self._over(p)]
                    raise SimulationError(f"workers {stuck} wait for events that never come")
                if on_progress is not None:
                    on_progress(sum(p.steps for p in self.peers), self.clock.now)
            took = self.clock.now
            if self.finished:
                took = max(p.finished_at for p in self.peers)
                self._settle()
        finally:
            for peer in self.peers:
                if peer.metrics is not None:
                    peer.metrics.close()
            self._write_servers()
        return took

    def _settle(self) -> None:
        """Run the shards on until each saw every worker leave or die (a dead one after
        ``round_timeout``, one never heard from after ``startup_timeout``), as the real
        shards run until then."""
        config = self.config
        limit = self.clock.now + config.startup_timeout + config.round_timeout + 1.0
        while any(s.stopped_at is None for s in self.shards):
            if self.clock.run(until=limit, max_events=1000) == 0:
                return
